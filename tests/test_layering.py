"""The dependency direction of DESIGN.md: training -> writing -> _core; only _core/storage talks
to fsspec. Checked on the source's import statements, so a violation fails here first."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "snapkeep"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(sub: str) -> list[pathlib.Path]:
    return sorted((SRC / sub).rglob("*.py"))


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("_core", ("snapkeep.writing", "snapkeep.training", "snapkeep.cli", "snapkeep.demo")),
        ("writing", ("snapkeep.training", "snapkeep.cli", "snapkeep.demo")),
    ],
)
def test_dependency_direction(package: str, forbidden: tuple[str, ...]) -> None:
    offenders = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in _files(package)
        for name in _imports(path)
        if name.startswith(forbidden)
    ]
    assert _files(package), f"no sources found under {package}"
    assert offenders == []


def test_only_storage_imports_fsspec() -> None:
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if any(n == "fsspec" or n.startswith("fsspec.") for n in _imports(path))
        and "_core/storage" not in path.as_posix()
    ]
    assert offenders == []


def test_writing_never_imports_the_package_root() -> None:
    """``import snapkeep`` (or ``from snapkeep import x``) from writing runs the root
    ``__init__``, which imports training: the version comes from ``snapkeep._version``."""
    offenders = [
        str(path.relative_to(SRC))
        for path in _files("writing")
        if "snapkeep" in _imports(path)
    ]
    assert offenders == []


#: The public seams: modules that hand the engine's names to the doors by role. Only these (and
#: ``writing``, the ppe writers on the engine) import ``snapkeep._core``.
SEAMS = {"store.py", "session.py", "tiers.py", "errors.py", "retention.py", "layout.py",
         "distributed.py", "staging.py", "wrapping.py", "codecs.py"}


def _layer(rel: str) -> str:
    """The layer of a module (path relative to the package): 'storage', 'core', 'writing', 'seam'
    or 'door'. Everything that is not the engine, a seam or the writers is a door (the ppe
    ``training`` package, the Checkpointer, Lightning, HF, the sharded Checkpointer, load_latest,
    the CLI, the demos, the package root), so a new module is classified without being listed."""
    if rel.startswith("_core/storage/"):
        return "storage"
    if rel.startswith("_core/"):
        return "core"
    if rel.startswith("writing/"):
        return "writing"
    return "seam" if rel in SEAMS else "door"


#: The framework doors: none imports another door (the ppe ``training`` package included).
FRAMEWORK_DOORS = {"checkpointer.py", "lightning.py", "hf.py", "sharded_checkpoint.py",
                   "loading.py", "ray.py"}


def _layering_offenders(src: pathlib.Path) -> list[str]:
    """Every import of every module of ``src`` that breaks DESIGN.md's layering:

    - storage imports nothing of snapkeep but itself and ``_core.errors``;
    - doors never import ``snapkeep._core`` (they use the seams);
    - the framework doors never import ``snapkeep.training`` (the ppe door);
    - nothing imports a private module (``._x``) of another package from outside it.
    """
    offenders = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        layer = _layer(rel)
        package = rel.rpartition("/")[0]
        for name in sorted(_imports(path)):
            if not name.startswith("snapkeep"):
                continue
            parts = name.split(".")
            if layer == "storage" and not name.startswith(
                    ("snapkeep._core.storage", "snapkeep._core.errors")):
                offenders.append(f"{rel} (storage) imports {name}")
            if layer == "door" and (name == "snapkeep._core" or name.startswith("snapkeep._core.")):
                offenders.append(f"{rel} (door) imports {name}")
            if rel in FRAMEWORK_DOORS and (name == "snapkeep.training"
                                           or name.startswith("snapkeep.training.")):
                offenders.append(f"{rel} (framework door) imports {name}")
            private = next((i for i, part in enumerate(parts) if part.startswith("_")
                            and part not in ("_core", "_version")), None)
            if private is not None:
                home = "/".join(parts[1:private])
                if not (package == home or package.startswith(home + "/") or not home):
                    offenders.append(f"{rel} imports the private module "
                                     f"{'.'.join(parts[:private + 1])}")
    return offenders


def test_every_module_keeps_to_its_layer() -> None:
    """Every module of the package (found by walking it, so none is left out) keeps to its
    layer: lightning.py, hf.py, sharded_checkpoint.py and loading.py included."""
    files = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
    assert {"lightning.py", "hf.py", "sharded_checkpoint.py", "loading.py", "checkpointer.py",
            "cli.py", "training/manager.py", "writing/_base.py",
            "_core/session/session.py"} <= files
    assert _layering_offenders(SRC) == []


def test_the_layering_check_sees_each_break(tmp_path: pathlib.Path) -> None:
    """The four breaks found at 971f8e4, rebuilt in a scratch package: each is reported."""
    src = tmp_path / "snapkeep"
    files = {
        "_core/storage/_commit.py": "from snapkeep._core.format.checksum import HashingWriter\n",
        "writing/_ppe_fs.py": "from snapkeep._core.storage._temps import is_temp_name\n",
        "lightning.py": "from snapkeep.training import RngState\n",
        "hf.py": "from snapkeep._core.store.marked_dirs import CheckpointDirs\n",
        "store.py": "from snapkeep._core.store.files import SnapshotStore\n",
        "_core/store/files.py": "from snapkeep._core.storage import Storage\n",
    }
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    assert _layering_offenders(src) == [
        "_core/storage/_commit.py (storage) imports snapkeep._core.format.checksum",
        "hf.py (door) imports snapkeep._core.store.marked_dirs",
        "lightning.py (framework door) imports snapkeep.training",
        "writing/_ppe_fs.py imports the private module snapkeep._core.storage._temps",
    ]


def test_a_violation_is_seen(tmp_path: pathlib.Path) -> None:
    """The walker sees both import forms (so the checks above can fail)."""
    path = tmp_path / "m.py"
    path.write_text("import snapkeep\nfrom snapkeep._core.store.files import SnapshotStore\n"
                    "def f():\n    from snapkeep._core.save import saver\n")
    assert _imports(path) >= {"snapkeep", "snapkeep._core.store.files", "snapkeep._core.save"}


#: Files outside ``_core/storage`` allowed to touch a filesystem object, with why. DCP's own
#: StorageReader/StorageWriter subclasses: ``self.fs`` there is DCP's file-system abstraction
#: inside DCP's reader, which snapkeep extends (its ``.metadata`` read through the allow-list).
_PUBLISH_ALLOWED = {"_core/distributed/dcp_safe.py": {".fs.create_stream"}}


def _publishing_calls(path: pathlib.Path) -> set[str]:
    """``os.replace``/``os.rename``/``os.fsync``/``os.fdatasync`` calls and ``<x>.fs.<y>``
    attribute uses in ``path`` (from the AST: docstrings and comments do not count)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if (isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in {"replace", "rename", "fsync", "fdatasync"}):
            found.add(f"os.{node.attr}")
        if isinstance(node.value, ast.Attribute) and node.value.attr == "fs":
            found.add(f".fs.{node.attr}")
    for node in ast.walk(tree):  # from os import replace, fsync
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found.update(f"os.{a.name}" for a in node.names
                         if a.name in {"replace", "rename", "fsync", "fdatasync"})
    return found


def test_only_storage_publishes() -> None:
    """Issue 17: nothing above storage renames, fsyncs or calls fsspec; publishing is one step
    of the storage layer (``Storage.publish_with_companion``)."""
    offenders = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("_core/storage/"):
            continue
        calls = _publishing_calls(path) - _PUBLISH_ALLOWED.get(rel, set())
        if calls:
            offenders[rel] = sorted(calls)
    assert offenders == {}


def test_publishing_scan_sees_a_violation(tmp_path: pathlib.Path) -> None:
    """The scan above is not blind: it reports each form it forbids."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom os import fsync\n\n\ndef f(storage, a, b):\n"
                   "    os.replace(a, b)\n    storage.fs.info(a)\n")
    assert _publishing_calls(bad) == {"os.replace", "os.fsync", ".fs.info"}


def _structure_report():
    """tools/structure_report.py, whose figures tests/test_structure_report.py checks on a known
    package (so a violation is seen there)."""
    import importlib.util

    tool = SRC.parents[1] / "tools" / "structure_report.py"
    spec = importlib.util.spec_from_file_location("structure_report_tool", tool)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_private_module_re_exports_a_name() -> None:
    """Issue 17: every import comes from the name's home. Only public facades (snapkeep.store,
    snapkeep.errors, ...) and package ``__init__`` files re-export; ppe's private paths live in
    training/extensions/_snapshot.py as assignments, not re-exports."""
    tool = _structure_report()
    report = tool.re_exports(tool.load_modules(SRC.parent))
    offenders = {r["module"]: r["examples"] for r in report["modules"] if r["kind"] == "private"}
    assert offenders == {}


def test_no_private_name_is_imported_across_modules() -> None:
    tool = _structure_report()
    assert tool.private_imports(tool.load_modules(SRC.parent))["names"] == []


def test_no_import_cycles() -> None:
    tool = _structure_report()
    strict = tool.cycles(tool.load_modules(SRC.parent))["strict"]
    assert strict["component_members"] == []


# -- one run control (issue 31 item 3) -----------------------------------------------------------
#: The one place that installs signal handlers: the run control's signal flags
#: (``SignalWatch``, held by ``RunControl``). The process writer's child ignores SIGINT there
#: (a worker process, not a run: Ctrl-C reaches the trainer, which drains it).
_SIGNAL_HANDLERS = {"_core/distributed/signals.py", "_core/save/worker.py"}
#: What only the run control builds: the doors get it from their session
#: (``session.run_control(...)``) and never hold these parts themselves.
_RUN_CONTROL_PARTS = {"SignalWatch", "StatusLog", "write_status", "write_run_status",
                      "StatusRecorder"}
_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "broadcast",
                "broadcast_object_list", "all_gather_into_tensor", "reduce", "gather",
                "scatter"}


def _run_control_offenders(src: pathlib.Path) -> list[str]:
    """Calls of ``signal.signal`` outside :data:`_SIGNAL_HANDLERS`; a door naming one of
    :data:`_RUN_CONTROL_PARTS`; a door calling a torch.distributed collective itself
    (``dist.all_reduce``: a hand-written cross-rank outcome exchange; the run control and
    ``_core/distributed`` exchange them)."""
    offenders = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                func = node.func
                owner = ast.unparse(func.value)
                if func.attr == "signal" and owner == "signal" and rel not in _SIGNAL_HANDLERS:
                    offenders.append(f"{rel}:{node.lineno} installs a signal handler")
                if func.attr in _COLLECTIVES and owner in ("dist", "torch.distributed") \
                        and _layer(rel) == "door" and not rel.startswith("_core/"):
                    offenders.append(f"{rel}:{node.lineno} calls {owner}.{func.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "RunControl" and _layer(rel) == "door":
                offenders.append(f"{rel}:{node.lineno} builds a RunControl")
            if _layer(rel) == "door" and isinstance(node, (ast.Name, ast.alias)):
                name = node.id if isinstance(node, ast.Name) else node.name
                if name in _RUN_CONTROL_PARTS:
                    offenders.append(f"{rel}:{getattr(node, 'lineno', 0)} uses {name}")
    return offenders


#: Known, outside the run control: the ppe distributed snapshot's resume listing, broadcast
#: from the saver rank on the world group (not a preemption or status exchange).
_KNOWN_COLLECTIVES = {"training/extensions/_distributed.py"}


def test_the_doors_hold_no_signal_handling_status_writing_or_collectives_of_their_own() -> None:
    """Every door's preemption and run status is the one run control's: no door installs a
    signal handler, builds a run control, a signal watch or a status log, or all-reduces a flag
    itself (at 2c657db the ppe preemption extension did all three, HF built a SignalWatch +
    StatusLog, Lightning a RunControl of its own)."""
    offenders = [o for o in _run_control_offenders(SRC)
                 if o.split(":")[0] not in _KNOWN_COLLECTIVES or "calls" not in o]
    assert offenders == []


def test_the_run_control_check_sees_each_kind(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "snapkeep"
    (src / "training").mkdir(parents=True)
    (src / "training" / "door.py").write_text(
        "import signal\nimport torch.distributed as dist\n"
        "from snapkeep.distributed import SignalWatch\n"
        "signal.signal(signal.SIGTERM, print)\ndist.all_reduce(flag)\nRunControl(s, d)\n")
    assert sorted(_run_control_offenders(src)) == [
        "training/door.py:3 uses SignalWatch",
        "training/door.py:4 installs a signal handler",
        "training/door.py:5 calls dist.all_reduce",
        "training/door.py:6 builds a RunControl",
    ]
