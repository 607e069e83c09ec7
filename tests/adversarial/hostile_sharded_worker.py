"""The hostile-file matrix of sharded snapshots, in one process (run by
test_hostile_sharded_files.py): a Checkpointer (sharded, a gloo world of one) commits steps 1
and 2 under ``BASE/good``; for each case, a copy of it has step 2's marker, DCP ``.metadata`` or
shard replaced by a hostile file, and every reader runs on the copy under a 60 s alarm:
``load_latest``, ``Checkpointer(sharded=True).load``, ``snapkeep verify --json``, and the
autoload of a SHARDED snapshot extension (on a copy of the same steps saved by it, damaged
alike).

Usage: ``python hostile_sharded_worker.py BASE``. Prints one JSON line per case:
``{"case", "load_latest", "checkpointer", "verify", "autoload", "warned"}`` where each reader's
value is what it resumed (``"step 1"``...), its error type, or ``"hang"`` when the alarm fired.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import resource
import shutil
import signal
import stat
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from click.testing import CliRunner

import snapkeep
from snapkeep._core.format.checksum import digest_stream
from snapkeep.cli import cli

MARKER = ".snapkeep-commit.json"
TEMPLATE = "ckpt_{step}"
BOUND_S = 60  # a hang (a FIFO read) never returns; 10 s was within reach of a loaded machine


class Hang(BaseException):  # noqa: N818 -- not an error of the code under test: no wrapper
    """The alarm fired: a reader blocked (a BaseException, so no reader's handler eats it)."""


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(BOUND_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _objects() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _train_step(objects: dict[str, Any]) -> None:
    objects["optimizer"].zero_grad()
    objects["model"](torch.ones(2, 4)).sum().backward()
    objects["optimizer"].step()


def _manager(out: Path) -> tuple[Any, Any, dict[str, Any]]:
    from snapkeep import writing
    from snapkeep.training import ExtensionsManager
    from snapkeep.training import extensions as ext

    objects = _objects()
    manager = ExtensionsManager(objects["model"], objects["optimizer"], 1, iters_per_epoch=10,
                                out_dir=str(out), writer=writing.SimpleWriter(out_dir=str(out)))
    snapshot = ext.snapshot(filename="ckpt_{.iteration}", autoload=True, timeout_s=BOUND_S,
                            snapshot_mode=ext.SnapshotMode.SHARDED)
    manager.extend(snapshot, trigger=(1, "iteration"))
    return manager, snapshot, objects


def make_good_for_autoload(out: Path) -> None:
    """The same two steps, saved by the ppe-style SHARDED snapshot extension."""
    manager, snapshot, objects = _manager(out)
    manager.start_extensions()
    while manager.iteration < 2:
        with manager.run_iteration():
            _train_step(objects)
    manager.finalize()


def make_good(out: Path) -> dict[int, list[float]]:
    objects = _objects()
    weights = {}
    with snapkeep.Checkpointer(str(out), sharded=True, template=TEMPLATE) as ckpt:
        for step in (1, 2):
            _train_step(objects)
            ckpt.save(step, objects)
            ckpt.wait()
            weights[step] = objects["model"].weight.flatten().tolist()
    return weights


# -- damages: each takes the snapshot directory of step 2 -----------------------------------------
def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _symlink_to_outside_fifo(path: Path) -> None:
    outside = path.parent.parent.parent / f"fifo-{path.name}"
    if not outside.exists():
        os.mkfifo(outside)
    path.unlink()
    path.symlink_to(outside)


def _symlink_to_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _mknod_zero(path: Path) -> None:
    path.unlink()
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is


def _grown(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 2**20)


def _marker(directory: Path) -> dict[str, Any]:
    return json.loads((directory / MARKER).read_text())


def _rewrite_recorded(directory: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` and record it in the marker (as if the marker were forged
    too): verification passes, only what is in the file can refuse it."""
    (directory / name).write_bytes(data)
    marker = _marker(directory)
    digest, size = digest_stream(io.BytesIO(data))
    marker["files"][name].update(size_bytes=size, checksum=digest)
    (directory / MARKER).write_text(json.dumps(marker))


def _metadata_pointing_at(relative: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        metadata = pickle.loads((directory / ".metadata").read_bytes())  # noqa: S301 (ours)
        for index, info in list(metadata.storage_data.items()):
            metadata.storage_data[index] = type(info)(relative, info.offset, info.length,
                                                      *_rest(info))
        _rewrite_recorded(directory, ".metadata", pickle.dumps(metadata))
    return damage


def _rest(info: Any) -> list[Any]:
    fields = getattr(info, "__dataclass_fields__", {})
    return [getattr(info, f) for f in list(fields)[3:]]


def _marker_bytes(data: bytes) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        (directory / MARKER).write_bytes(data)
    return damage


def _marker_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        marker = _marker(directory)
        edit(marker)
        (directory / MARKER).write_text(json.dumps(marker))
    return damage


def _padded_marker(directory: Path) -> None:
    with open(directory / MARKER, "ab") as f:  # still valid JSON: whitespace, 65 MiB of it
        f.write(b" " * (65 * 2**20))


def _outside_fifo_target(directory: Path) -> None:
    fifo = directory.parent / "fifo-shard"
    os.mkfifo(fifo)
    _metadata_pointing_at("../fifo-shard")(directory)


def _shard(directory: Path) -> Path:
    return next(directory.glob("*.distcp"))


CASES: dict[str, Callable[[Path], None]] = {
    "marker-fifo": lambda d: _fifo(d / MARKER),
    "marker-symlink-to-outside-fifo": lambda d: _symlink_to_outside_fifo(d / MARKER),
    "marker-symlink-to-dev-zero": lambda d: _symlink_to_dev_zero(d / MARKER),
    "marker-device": lambda d: _mknod_zero(d / MARKER),
    "marker-oversized": _padded_marker,
    "marker-list": _marker_bytes(b"[]"),
    "marker-not-utf8": _marker_bytes(b"\xff\xfe{"),
    "marker-deep": _marker_bytes(b"[" * 100_000),
    "marker-files-a-list": _marker_edit(lambda m: m.update(files=[])),
    "marker-record-a-list": _marker_edit(lambda m: m["files"].update({".metadata": [1]})),
    "marker-size-a-string": _marker_edit(
        lambda m: m["files"][".metadata"].update(size_bytes="12")),
    "marker-name-an-int": _marker_edit(lambda m: m.update(name=2)),
    "marker-outside-file": _marker_edit(lambda m: m["files"].update(
        {"../ckpt_1/__0_0.distcp": m["files"][".metadata"]})),
    "metadata-fifo": lambda d: _fifo(d / ".metadata"),
    "metadata-symlink-to-outside-fifo": lambda d: _symlink_to_outside_fifo(d / ".metadata"),
    "metadata-symlink-to-dev-zero": lambda d: _symlink_to_dev_zero(d / ".metadata"),
    "metadata-device": lambda d: _mknod_zero(d / ".metadata"),
    "metadata-oversized": lambda d: _grown(d / ".metadata"),
    "metadata-malformed-recorded": lambda d: _rewrite_recorded(d, ".metadata", b"junk"),
    "metadata-outside-path": _metadata_pointing_at("../ckpt_1/__0_0.distcp"),
    "metadata-outside-fifo": _outside_fifo_target,
    "shard-fifo": lambda d: _fifo(_shard(d)),
    "shard-symlink-to-dev-zero": lambda d: _symlink_to_dev_zero(_shard(d)),
}


def _step_of(state: Any, weights: dict[int, list[float]]) -> str:
    flat: list[float] = []
    for value in _tensors(state):
        flat += value.flatten().tolist()
    found = [f"step {s}" for s, w in weights.items() if all(x in flat for x in w)
             and _contains(flat, w)]
    return found[0] if found else "unknown state"


def _contains(flat: list[float], w: list[float]) -> bool:
    return any(flat[i:i + len(w)] == w for i in range(len(flat) - len(w) + 1))


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def _run(reader: Callable[[], str]) -> str:
    try:
        with bounded():
            return reader()
    except Hang:
        return "hang"
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def run_case(case: str, directory: Path, weights: dict[int, list[float]]) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def latest() -> str:
            state = snapkeep.load_latest(str(directory), template=TEMPLATE)
            return "none" if state is None else _step_of(state, weights)

        def checkpointer() -> str:
            objects = _objects()
            with snapkeep.Checkpointer(str(directory), sharded=True, template=TEMPLATE,
                                       timeout_s=BOUND_S) as ckpt:
                step = ckpt.load(objects)
            loaded = _step_of({"w": objects["model"].weight}, weights)
            return f"step {step}" if loaded == f"step {step}" else f"{step} but {loaded}"

        def verify() -> str:
            result = CliRunner().invoke(cli, ["verify", str(directory), "--template", TEMPLATE,
                                              "--json"])
            if isinstance(result.exception, Hang):
                raise result.exception
            try:
                body = json.loads(result.stdout)
            except ValueError:
                return f"exit {result.exit_code}, not JSON: {result.output[:300]!r}"
            statuses = {s["name"]: s["status"] for s in body["snapshots"]}
            return f"exit {result.exit_code} {json.dumps(statuses, sort_keys=True)}"

        def autoload() -> str:
            manager, snapshot, objects = _manager(directory.parent / "ext")
            manager.start_extensions()
            loaded = snapshot.loaded_entry
            found = _step_of({"w": objects["model"].weight}, weights)
            name = "none" if loaded is None else loaded.name
            return f"step {manager.iteration}" if name == f"ckpt_{manager.iteration}" \
                and found == f"step {manager.iteration}" else f"{name} but {found}"

        outcome = {"case": case, "load_latest": _run(latest), "checkpointer": _run(checkpointer),
                   "verify": _run(verify), "autoload": _run(autoload)}
    outcome["warned"] = sorted({"ckpt_2" in str(w.message) for w in caught})
    return outcome


def main() -> None:
    base = Path(sys.argv[1])
    only = sys.argv[2:]
    # a reader that reads a device to its end grows without bound: fail it, not the machine
    resource.setrlimit(resource.RLIMIT_DATA, (8 * 2**30, 8 * 2**30))
    dist.init_process_group("gloo", init_method=f"file://{base / 'init'}", rank=0,
                            world_size=1)
    weights = make_good(base / "good")
    make_good_for_autoload(base / "good-ext")
    for case, damage in CASES.items():
        if only and case not in only:
            continue
        root = base / case
        root.mkdir()
        directory = root / "out"
        shutil.copytree(base / "good", directory, ignore=shutil.ignore_patterns("*.lock"))
        damage(directory / "ckpt_2")
        shutil.copytree(base / "good-ext", root / "ext", ignore=shutil.ignore_patterns("*.lock"))
        damage(root / "ext" / "ckpt_2")
        print(json.dumps(run_case(case, directory, weights)), flush=True)
        shutil.rmtree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
