"""docs/index.md's install commands are true: snapkeep is not on an index, and the wheel built
from a checkout as the page says installs an importable snapkeep (issue 19 item 5)."""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "index.md"


def test_the_page_installs_from_a_checkout_not_from_an_index():
    text = INDEX.read_text()
    assert "pip install snapkeep " not in text and "pip install snapkeep\n" not in text
    for command in ("pip install /path/to/snapkeep ",
                    'pip install "/path/to/snapkeep[s3,safetensors]"',
                    "pip wheel --no-deps -w dist /path/to/snapkeep ",
                    "pip install dist/snapkeep-*.whl"):
        assert command in text


def test_the_documented_wheel_builds_and_installs(tmp_path):
    checkout = tmp_path / "snapkeep"  # a copy: the build writes build/ and *.egg-info into it
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, checkout / name)
    shutil.copytree(ROOT / "src", checkout / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # as documented, plus --no-build-isolation: the tests run offline, with setuptools installed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", "dist", str(checkout)], cwd=tmp_path, check=True, timeout=300)
    wheels = glob.glob(str(tmp_path / "dist" / "snapkeep-*.whl"))
    assert len(wheels) == 1 and wheels[0].endswith("-py3-none-any.whl")
    assert "snapkeep/py.typed" in zipfile.ZipFile(wheels[0]).namelist()
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(site), wheels[0]], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", "import snapkeep; print(snapkeep.__file__, snapkeep.__version__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=120)
    where, version = out.stdout.split()
    assert where == str(site / "snapkeep" / "__init__.py")
    assert f"snapkeep-{version}-py3-none-any.whl" == os.path.basename(wheels[0])
