"""The catalog: listing by step, verification against manifests, newest-valid selection."""

from __future__ import annotations

import os

import pytest
import torch

import snapkeep
from snapkeep._core.format.manifest import Manifest, manifest_path
from snapkeep._core.storage import resolve_storage
from snapkeep._core.store.files import SnapshotStore


def _writer_files(directory, template: str, steps) -> SnapshotStore:
    writer = snapkeep.writing.SimpleWriter(out_dir=str(directory))
    for step in steps:
        writer(template.format(step), str(directory), {"step": torch.tensor(step)}, step=step)
    writer.finalize()
    storage, d = resolve_storage(str(directory))
    return SnapshotStore(storage, d, template.replace("{}", "{step}"))


def test_entries_are_ordered_by_step(tmp_path):
    catalog = _writer_files(tmp_path, "snap_{}", [2, 1000, 999, 10])
    assert [e.name for e in catalog.entries()] == ["snap_2", "snap_10", "snap_999", "snap_1000"]
    assert [e.step for e in catalog.entries()] == [2, 10, 999, 1000]


def test_sub_directory_templates_are_listed(tmp_path):
    catalog = _writer_files(tmp_path, "snaps/iter_{}", [3, 20])
    entries = catalog.entries()
    assert [e.name for e in entries] == ["snaps/iter_3", "snaps/iter_20"]
    assert entries[0].path == os.path.join(str(tmp_path), "snaps", "iter_3")
    assert catalog.verify(entries[1]).step == 20


def _fail(reason):
    def loader(entry, data):
        raise reason
    return loader


def test_load_newest_skips_invalid_with_reasons(tmp_path):
    catalog = _writer_files(tmp_path, "snap_{}", [1, 2, 3])

    def loader(entry, data):
        assert data is None  # local files are not prefetched
        if entry.step == 3:
            raise RuntimeError("zip archive: failed finding central directory")
        return entry.step

    with pytest.warns(RuntimeWarning, match="snap_3 .*central directory"):
        entry, state = catalog.load_newest(loader)
    assert (entry.name, state) == ("snap_2", 2)


def test_load_newest_none_when_no_files(tmp_path):
    storage, d = resolve_storage(str(tmp_path))
    store = SnapshotStore(storage, d, "snap_{step}")
    assert store.load_newest(_fail(AssertionError())) is None


@pytest.mark.parametrize("error", [RuntimeError("bad zip"), EOFError(), IndexError("x"),
                                   TypeError("y"), ValueError("z")])
def test_all_invalid_lists_every_reason(tmp_path, error):
    catalog = _writer_files(tmp_path, "snap_{}", [1, 2])
    with pytest.warns(RuntimeWarning), pytest.raises(snapkeep.NoValidSnapshotError) as info:
        catalog.load_newest(_fail(error))
    assert "snap_1" in str(info.value) and "snap_2" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snap_1", "snap_2"]


def test_unsafe_is_never_swallowed(tmp_path):
    catalog = _writer_files(tmp_path, "snap_{}", [1, 2])
    with pytest.raises(snapkeep.UnsafeSnapshotError):
        catalog.load_newest(_fail(snapkeep.UnsafeSnapshotError("needs pickle")))


@pytest.mark.parametrize("content", [b"", b"{not json", b"[]", b'"x"', b'{"format": "other"}',
                                     b'{"format": "snapkeep.manifest/1"}'])
def test_unreadable_manifest_means_unverified(tmp_path, content):
    catalog = _writer_files(tmp_path, "snap_{}", [1])
    entry = catalog.entries()[0]
    with open(manifest_path(catalog.storage, entry.path), "wb") as f:
        f.write(content)
    assert catalog.manifest(entry) is None
    assert catalog.verify(entry) is None


def test_manifest_round_trip():
    manifest = Manifest(name="s", size_bytes=3, checksum="ab" * 16, step=4, run_id="r",
                        metrics={"loss": 0.5})
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest


def test_overwriting_a_name_never_leaves_a_stale_manifest(tmp_path):
    """When the name is reused (a fixed filename), the old manifest never describes the new
    file: while the new one is written, the old file and its manifest stay as they were (both
    temps are written before anything is published); afterwards the new file verifies."""
    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    writer("latest", str(tmp_path), {"v": torch.zeros(10)})
    storage, d = resolve_storage(str(tmp_path))
    catalog = SnapshotStore(storage, d, "latest")
    seen = {}

    def savefun(obj, f):
        seen["old_verifies_during_write"] = catalog.verify(catalog.entries()[0]) is not None
        torch.save(obj, f)

    writer("latest", str(tmp_path), {"v": torch.ones(10)}, savefun=savefun)
    writer.finalize()
    assert seen["old_verifies_during_write"] is True
    assert catalog.verify(catalog.entries()[0]) is not None
    assert torch.equal(torch.load(tmp_path / "latest", weights_only=True)["v"], torch.ones(10))


def test_counter_fields_match_whole_numbers_only():
    from snapkeep._core.format.naming import FilenameTemplate

    template = FilenameTemplate("snap_e{epoch}_i{step}_acc{observation}")
    assert template.parse("snap_e2_i300_acc0.75") == (300.0, 2.0, 0.75)
    assert template.parse("snap_e2_i300.5_acc0.75") is None  # a stray name is not a snapshot
    assert template.parse("snap_e2.0_i300_acc0.75") is None
    assert FilenameTemplate("it_{step:06d}").step_of("it_000120") == 120


# -- the store's own operations --------------------------------------------------------------------
def _store_with(tmp_path, steps, run_id="run-a"):
    from snapkeep._core.save.job import SaveJob

    storage, d = resolve_storage(str(tmp_path))
    store = SnapshotStore(storage, d, "s_{step}")
    for step in steps:
        store.commit(SaveJob(storage=storage, path=os.path.join(d, f"s_{step}"),
                             savefun=torch.save, step=step, run_id=run_id),
                     {"step": torch.tensor(step)})
    return store


@pytest.mark.parametrize(("lineage", "protect", "kept"), [
    ({"run-a"}, [], ["s_3", "s_4"]),
    ({"run-a"}, ["s_1"], ["s_1", "s_3", "s_4"]),
    ({"run-b"}, [], ["s_3", "s_4"]),  # committed by this store object: its own files
])
def test_retain_keeps_policy_protect_and_newest(tmp_path, lineage, protect, kept):
    from snapkeep.retention import KeepLatest

    store = _store_with(tmp_path, [1, 2, 3, 4])
    protected = [os.path.join(store.directory, n) for n in protect]
    store.retain(KeepLatest(2), frozenset(lineage), protect=protected)
    assert [e.name for e in store.entries()] == kept
    assert sorted(os.listdir(tmp_path / ".snapkeep")) == sorted(f"{n}.json" for n in kept)


def test_retain_leaves_other_runs_files_alone(tmp_path):
    from snapkeep.retention import KeepLatest

    _store_with(tmp_path, [1, 2, 3], run_id="other")
    store = SnapshotStore(*resolve_storage(str(tmp_path)), "s_{step}")  # a new process
    assert store.retain(KeepLatest(1), frozenset({"mine"})) == []
    assert [e.name for e in store.entries()] == ["s_1", "s_2", "s_3"]


def test_delete_and_sweep_orphan_manifests(tmp_path):
    store = _store_with(tmp_path, [1, 2])
    store.delete(store.entries()[0])
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "s_2"]
    os.remove(tmp_path / "s_2")  # as a kill between the two deletes leaves it
    assert store.orphan_manifests() == [str(tmp_path / ".snapkeep" / "s_2.json")]
    assert store.sweep() == [str(tmp_path / ".snapkeep" / "s_2.json")]
    assert os.listdir(tmp_path / ".snapkeep") == []


def test_on_error_snapshots_are_never_entries(tmp_path):
    from snapkeep._core.store.files import ON_ERROR_SUFFIX

    store = _store_with(tmp_path, [1])
    (tmp_path / f"s_2{ON_ERROR_SUFFIX}").write_bytes(b"x")
    assert [e.name for e in store.entries()] == ["s_1"]


def test_a_held_listing_is_listed_once_and_kept_up_to_date(tmp_path, monkeypatch):
    """Held (the trainer's store), kind check, sweep, orphan check and entries share one
    listing of the directory and one of its manifest directory; the store's own commits and
    deletes update them; released, it lists afresh (what something else wrote is seen)."""
    from snapkeep._core.save.job import SaveJob

    store = _writer_files(tmp_path, "snap_{}", [1, 2])
    store.hold_listing()
    listed: list[str] = []
    ls = store.storage.fs.ls
    monkeypatch.setattr(store.storage.fs, "ls",
                        lambda path, *a, **kw: listed.append(path) or ls(path, *a, **kw))
    store.check_kind()
    assert store.sweep() == []
    assert store.orphan_manifests() == []
    assert [e.step for e in store.entries()] == [1, 2]
    assert sorted(listed) == sorted([str(tmp_path), str(tmp_path / ".snapkeep")])
    listed.clear()
    path = os.path.join(str(tmp_path), "snap_3")
    store.commit(SaveJob(storage=store.storage, path=path, savefun=torch.save, step=3),
                 {"step": torch.tensor(3)})
    assert store.delete(store.entries()[0])
    assert [e.step for e in store.entries()] == [2, 3]
    assert store.orphan_manifests() == []
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snap_2", "snap_3"]
    assert listed == []
    (tmp_path / "snap_4").write_bytes(b"written behind the store's back")
    assert [e.step for e in store.entries()] == [2, 3]
    store.release_listing()
    assert [e.step for e in store.entries()] == [2, 3, 4] and listed == [str(tmp_path)]
    (tmp_path / "snap_5").write_bytes(b"not held: seen at once")
    assert [e.step for e in store.entries()] == [2, 3, 4, 5]
