"""Run pytorch-pfn-extras 0.9.0's own tests against snapkeep, changing only their imports.

    python tools/ppe_tests.py [--source DIR] [--json] [-- PYTEST_ARGS...]

The tests are fetched at run time into the git-ignored ``.ppe_tests/`` (nothing of ppe is kept in
the repository):

1. ``pip download --no-deps --no-binary :all: pytorch-pfn-extras==0.9.0`` -- ppe's source
   distribution. (0.9.0's sdist ships no tests; the step is kept in case a later one does.)
2. otherwise the source archive of the ``v0.9.0`` tag from the project's GitHub repository.
3. ``--source DIR``: a ppe checkout or unpacked archive you already have (no network), such as
   ``../shared/ppe-tests`` beside the clone (ppe 0.9.0's test files, unmodified). The test suite
   runs ``--source ../shared/ppe-tests --patch-targets`` and expects 135 passed, 0 failed
   (``tests/interop/test_ppe_tests_tool.py``).

From ``tests/pytorch_pfn_extras_tests`` it takes the manager, extension, trigger, snapshot and
writer tests (:data:`SELECTED`), rewrites the imports only (``import pytorch_pfn_extras as ppe``
-> ``import snapkeep as ppe``, ``from pytorch_pfn_extras[.x] import y`` -> ``from snapkeep[.x]
import y``, ``import pytorch_pfn_extras`` -> ``import snapkeep as pytorch_pfn_extras``), and
runs them with pytest with ``src/`` first on the path. ``--patch-targets`` also rewrites the
module paths in ``mock.patch("pytorch_pfn_extras.writing....")`` strings (without it, those
writer tests patch ppe's classes and exercise snapkeep's unpatched). Tests of ppe's private
helpers and of features outside snapkeep's scope are deselected, each with its reason
(:data:`OUT_OF_SCOPE`).
``--baseline`` runs the same files unchanged against the installed ppe; ``--compare`` runs both
and lists each snapkeep failure as "ONLY under snapkeep" (a gap) or "also under ppe" (the
fetched test does not match ppe 0.9.0 either). Each run prints its passed/failed/skipped
counts. Exit status: pytest's (of the last run).

Where GitHub cannot be reached, the files were taken from stored copies of
pfnet/pytorch-pfn-extras (one version per file, most older than v0.9.0) into
``.ppe_tests/tests/pytorch_pfn_extras_tests/``; the commits used, by path under it:

- ``training_tests/``: test_manager.py f6008e4a13ec8c98eaa7f7a65cbb5b7c19ca0f15,
  test_extension.py 0e9f943941664ef674748892899a3273ffcf4f7d, test_extension_entry.py
  13a2ef234034f4d382bcc647e0aacceedda8518d, test_trigger_util.py
  2fe56baaf5eec851d0c079ff4c6661997c013d40; ``test_writing.py``
  5083250f3c2b43188945df9c6ad53f5ac245cd4c
- ``training_tests/triggers_tests/``: early_stopping b4438ea4ae787be3eaaa7b74e0977c2b92a33a13,
  function 014e825a0230c04eaf0ff7d92f97a7f03e7faa0d, interval
  be5b592bfcfe67fa0663d3fd9bbcae052e29ac6b, minmax_value
  174ad5475fd6ae01f3fbd2dc73de6a92e5430c87, once 25b742dbdeba9891523cf1742344acea2f2db3e1,
  schedule 2fe56baaf5eec851d0c079ff4c6661997c013d40, time
  fff3d4858d8fa39924b901167c4c8db74ca6f4da
- ``training_tests/extensions_tests/``: snapshot 5bedae44976c943aecdaf366a9de7f151bc33c2c,
  snapshot_writers 318d4f66fc9f1b7286499c92ca6060cc3acb7b03, distributed_snapshot
  d61e94c83a2d7f6d1da687a3052c1c2914fba182, log_report
  6af15f79fe141fbe59709845ff339b7c920f26a9, print_report
  5b5fdabbcc170f5aa659a5297996c5d36cedac53, progress_bar
  25b742dbdeba9891523cf1742344acea2f2db3e1, lr_scheduler
  91f51ace9e78fec6d8c142d60c5dc1a86553193a, fail_on_non_number
  25b742dbdeba9891523cf1742344acea2f2db3e1, value_observation
  8deac719ba2f52bf49e0c506bae036983ae806f9, evaluator 6c91cfb218db4f2ab888c14615adc610860b5517

Result on 2026-12-01 (``--compare``): ppe 0.9.0 itself 138 passed, 7 failed, 1 skipped of 146;
snapkeep 137 passed, 8 failed, 1 skipped -- 7 of the 8 fail under ppe 0.9.0 too (the stored
files predate it), the other patches ppe's QueueWriter by name (passes with --patch-targets).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from xml.etree import ElementTree

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".ppe_tests"
VERSION = "0.9.0"
ARCHIVE_URL = f"https://github.com/pfnet/pytorch-pfn-extras/archive/refs/tags/v{VERSION}.tar.gz"
TESTS_PREFIX = "tests/pytorch_pfn_extras_tests"

#: Test files taken from ppe's test tree (relative to ``tests/pytorch_pfn_extras_tests``).
SELECTED = [
    "training_tests/test_manager.py",
    "training_tests/test_extension.py",
    "training_tests/test_extension_entry.py",
    "training_tests/test_trigger_util.py",
    "training_tests/triggers_tests",
    "training_tests/extensions_tests/test_snapshot.py",
    "training_tests/extensions_tests/test_snapshot_writers.py",
    "training_tests/extensions_tests/test_distributed_snapshot.py",
    "training_tests/extensions_tests/test_log_report.py",
    "training_tests/extensions_tests/test_print_report.py",
    "training_tests/extensions_tests/test_progress_bar.py",
    "training_tests/extensions_tests/test_lr_scheduler.py",
    "training_tests/extensions_tests/test_fail_on_non_number.py",
    "training_tests/extensions_tests/test_value_observation.py",
    "training_tests/extensions_tests/test_evaluator.py",
    "test_writing.py",
]

#: ``node id substring -> reason`` for tests outside snapkeep's scope (deselected, listed).
OUT_OF_SCOPE = {
    "test_ignite": "ppe's IgniteExtensionsManager is not provided",
    "test_trainer": "ppe's Trainer is not provided",
    "test_sharded_snapshot": ("ppe's SHARDED file layout (a torch.save file per rank); "
                              "snapkeep's SHARDED writes DCP checkpoints"),
    "test_find_snapshot_files": "ppe's private helper (mtime order; snapkeep orders by step)",
    "test_find_latest_snapshot": "ppe's private helper (mtime order; snapkeep orders by step)",
    "test_find_stale_snapshot": "ppe's private helper (mtime order; snapkeep orders by step)",
    "test_tensorboard": "ppe's TensorBoard writer is not provided",
    "test_timeline": "ppe's timeline tracing (enable_trace) is not provided",
}

_IMPORT_RULES = [
    (re.compile(r"^(\s*)import pytorch_pfn_extras as (\w+)", re.M), r"\1import snapkeep as \2"),
    (re.compile(r"^(\s*)from pytorch_pfn_extras(\.[\w.]+)? import", re.M),
     r"\1from snapkeep\2 import"),
    (re.compile(r"^(\s*)import pytorch_pfn_extras(\.[\w.]+)?\s*$", re.M),
     r"\1import snapkeep as pytorch_pfn_extras"),
]


_PATCH_TARGET = re.compile(r"""(["'])pytorch_pfn_extras(\.[\w.]*)?(["'])""")


def rewrite_imports(source: str, *, patch_targets: bool = False) -> str:
    """``source`` with ppe's imports pointing at snapkeep; nothing else changes, unless
    ``patch_targets``: then dotted module paths in string literals (``mock.patch(
    "pytorch_pfn_extras.writing.X")`` targets) point at snapkeep too."""
    for pattern, replacement in _IMPORT_RULES:
        source = pattern.sub(replacement, source)
    if patch_targets:
        source = _PATCH_TARGET.sub(r"\1snapkeep\2\3", source)
    return source


def _log(message: str) -> None:
    print(f"[ppe_tests] {message}", file=sys.stderr, flush=True)


def _tests_root(tree: pathlib.Path) -> pathlib.Path | None:
    for candidate in [tree, *tree.iterdir()] if tree.is_dir() else []:
        root = candidate / TESTS_PREFIX
        if root.is_dir():
            return root
    return None


def _unpack(archive: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def fetch() -> pathlib.Path:
    """The unpacked ppe tree holding ``tests/pytorch_pfn_extras_tests`` (cached).

    Raises:
        SystemExit: neither the sdist nor the tag archive provides the tests.
    """
    cached = CACHE / "source"
    if cached.is_dir() and _tests_root(cached) is not None:
        return cached
    CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"pytorch-pfn-extras=={VERSION}", "-d", tmp], capture_output=True, text=True,
            timeout=300, check=False)
        sdists = sorted(pathlib.Path(tmp).glob("*.tar.gz"))
        if download.returncode == 0 and sdists:
            tree = _unpack(sdists[0], pathlib.Path(tmp) / "sdist")
            if _tests_root(tree) is not None:
                shutil.rmtree(cached, ignore_errors=True)
                shutil.move(str(tree), cached)
                return cached
            _log(f"the sdist of pytorch-pfn-extras {VERSION} ships no tests; trying the "
                 f"v{VERSION} source archive")
        else:
            _log(f"pip download failed: {download.stderr.strip()[-300:]}")
        archive = pathlib.Path(tmp) / "source.tar.gz"
        try:
            with urllib.request.urlopen(ARCHIVE_URL, timeout=60) as response, \
                    archive.open("wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as e:
            raise SystemExit(
                f"cannot fetch ppe {VERSION}'s tests: the sdist has none and {ARCHIVE_URL} is "
                f"unreachable ({e}). Pass --source DIR with a ppe {VERSION} checkout.") from e
        tree = _unpack(archive, pathlib.Path(tmp) / "archive")
        if _tests_root(tree) is None:
            raise SystemExit(f"{ARCHIVE_URL} holds no {TESTS_PREFIX}")
        shutil.rmtree(cached, ignore_errors=True)
        shutil.move(str(tree), cached)
        return cached


def prepare(tests_root: pathlib.Path, into: pathlib.Path, *, patch_targets: bool = False,
            rewrite: bool = True) -> list[pathlib.Path]:
    """Copy the selected tests (and conftest files on their way), with rewritten imports
    unless not ``rewrite`` (the baseline run against ppe itself)."""
    shutil.rmtree(into, ignore_errors=True)
    written = []
    for relative in SELECTED:
        source = tests_root / relative
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for path in files:
            if not path.is_file():
                _log(f"not in this ppe version: {path.relative_to(tests_root)}")
                continue
            written.append(_copy(tests_root, path, into, patch_targets, rewrite))
    for conftest in tests_root.rglob("conftest.py"):
        target = into / conftest.relative_to(tests_root)
        if target.parent.is_dir() and not target.exists():
            _copy(tests_root, conftest, into, patch_targets, rewrite)
    return written


def _copy(tests_root: pathlib.Path, path: pathlib.Path, into: pathlib.Path,
          patch_targets: bool, rewrite: bool) -> pathlib.Path:
    target = into / path.relative_to(tests_root)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text()
    target.write_text(rewrite_imports(text, patch_targets=patch_targets) if rewrite else text)
    return target


def outcomes(report: pathlib.Path) -> dict[str, str]:
    """``{test id: 'passed' | 'failed' | 'skipped'}`` from pytest's junit XML ``report`` (an
    error in a fixture counts as failed)."""
    result = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("failed" if tags & {"failure", "error"} else
                   "skipped" if "skipped" in tags else "passed")
        result[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return result


def summarize(report: pathlib.Path) -> dict[str, int]:
    """``{'passed', 'failed', 'skipped', 'total'}`` counted from pytest's junit XML ``report``."""
    found = list(outcomes(report).values())
    counts = {key: found.count(key) for key in ("passed", "failed", "skipped")}
    counts["total"] = len(found)
    return counts


def run(tests_root: pathlib.Path, *, baseline: bool, patch_targets: bool,
        pytest_args: list[str], work: pathlib.Path = CACHE) -> tuple[int, pathlib.Path]:
    """Run the selected tests (rewritten for snapkeep, or unchanged against ppe when
    ``baseline``), copied under ``work``; prints the counts. Returns pytest's exit status and
    its junit report."""
    run_dir = work / ("baseline" if baseline else "rewritten")
    files = prepare(tests_root, run_dir, patch_targets=patch_targets, rewrite=not baseline)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not baseline:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    report = run_dir / "report.xml"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
               "--rootdir", str(run_dir), f"--junitxml={report}",
               "-k", " and ".join(f"not {key}" for key in OUT_OF_SCOPE),
               *map(str, files), *pytest_args]
    with tempfile.TemporaryDirectory(prefix="ppe-tests-") as cwd:
        # ppe's snapshot tests write into the working directory; keep that out of the repo.
        result = subprocess.run(command, cwd=cwd, env=env, check=False)
    if report.exists():
        counts = summarize(report)
        against = "ppe (baseline)" if baseline else "snapkeep"
        print(f"[ppe_tests] against {against}: {counts['passed']} passed, {counts['failed']} "
              f"failed, {counts['skipped']} skipped of {counts['total']} "
              f"({len(OUT_OF_SCOPE)} out-of-scope patterns deselected)", flush=True)
    return result.returncode, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=pathlib.Path,
                        help="a ppe checkout or unpacked archive (skips the download)")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON last")
    parser.add_argument("--baseline", action="store_true",
                        help="run the same tests unchanged against the installed ppe (what "
                             "passes under ppe itself), for comparison")
    parser.add_argument("--compare", action="store_true",
                        help="run under ppe, then under snapkeep, and list the tests that fail "
                             "only under snapkeep (the gaps) and those that fail under both")
    parser.add_argument("--patch-targets", action="store_true",
                        help="also point mock.patch('pytorch_pfn_extras.x.Y') targets at snapkeep "
                             "(ppe's writer tests patch StandardWriter/QueueWriter by name)")
    parser.add_argument("--work", type=pathlib.Path, default=CACHE,
                        help="where the rewritten copies and pytest's report go (default: the "
                             "git-ignored .ppe_tests/ of the repository)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    tree = args.source if args.source is not None else fetch()
    tests_root = _tests_root(tree)
    if tests_root is None:
        raise SystemExit(f"{tree} holds no {TESTS_PREFIX}")
    for key, reason in OUT_OF_SCOPE.items():
        _log(f"deselected *{key}*: {reason}")
    under_ppe: dict[str, str] = {}
    if args.compare or args.baseline:
        status, report = run(tests_root, baseline=True, patch_targets=False,
                             pytest_args=args.pytest_args, work=args.work)
        under_ppe = outcomes(report) if report.exists() else {}
    if not args.baseline:
        status, report = run(tests_root, baseline=False, patch_targets=args.patch_targets,
                             pytest_args=args.pytest_args, work=args.work)
    if args.compare and report.exists():
        failed = sorted(t for t, outcome in outcomes(report).items() if outcome == "failed")
        for test in failed:
            where = ("also under ppe" if under_ppe.get(test) == "failed"
                     else "ONLY under snapkeep")
            print(f"[ppe_tests] failed {where}: {test}", flush=True)
    if args.json and report.exists():
        print(json.dumps(summarize(report)))
    return status


if __name__ == "__main__":
    sys.exit(main())
