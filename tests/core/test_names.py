"""Names: every snapshot name stays inside out_dir, any name the filesystem accepts works, one it
cannot accept fails before writing, and temp names are short whatever the final name."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import snapkeep
from snapkeep._core.format.naming import FilenameTemplate, ppe_name, ppe_template
from snapkeep._core.storage import TEMP_MARKER, resolve_storage
from snapkeep._core.storage._temps import TEMP_NAME_MAX_BYTES, _temp_owner

ESCAPING_TEMPLATES = [
    "../snapshot_iter_{.iteration}",
    "snaps/../../snapshot_iter_{.iteration}",
    "/tmp/snapshot_iter_{.iteration}",
    "snapshot\0_iter_{.iteration}",
    "snaps//snapshot_iter_{.iteration}",
    "./snapshot_iter_{.iteration}",
    "snapshot_iter_{.iteration}/",
    ".snapkeep/snapshot_iter_{.iteration}",
    "snapshot_iter_{.iteration}.snapkeep-tmp.x",
]


@pytest.mark.parametrize("template", ESCAPING_TEMPLATES)
def test_escaping_templates_are_refused_at_construction(template):
    with pytest.raises(ValueError, match="accepted: a relative path inside out_dir"):
        ppe_template(template)  # ppe's spelling, as the snapshot extension takes it
    with pytest.raises(ValueError, match="accepted: a relative path inside out_dir"):
        FilenameTemplate(template.replace("{.iteration}", "{step}"))  # the store's


@pytest.mark.parametrize("produced", ["../x", "a/../../x", "/etc/x", "x\0y", "a/./b", ""])
def test_escaping_names_from_callables_are_refused(produced):
    template = FilenameTemplate(lambda manager: produced)
    with pytest.raises(ValueError, match="filename"):
        template.format(types.SimpleNamespace(iteration=1))


@pytest.mark.parametrize("template", ["snap_{}", "snap_{0}", "snap_{!r}", "snap_{:>8}",
                                      "snap_{[0]}", "snap_{.a.b}"])
def test_fields_without_an_attribute_are_refused(template):
    with pytest.raises(ValueError, match=r"filename='snapshot_iter_\{\.iteration\}'"):
        ppe_template(template)
    with pytest.raises(ValueError, match=r"a field is a name, e.g. 'snapshot_iter_\{step\}'"):
        FilenameTemplate(template)


@pytest.mark.parametrize(("ppe", "store"), [
    ("snapshot_iter_{.iteration}", "snapshot_iter_{step}"),
    ("s_{0.iteration:06d}", "s_{step:06d}"),
    ("s_{.updater.iteration}", "s_{step}"),
    ("e{0.epoch}_i{0.iteration}_{0.elapsed_time:.1f}", "e{epoch}_i{step}_{elapsed_time:.1f}"),
    ("a{{b}}_{.iteration!s}", "a{{b}}_{step!s}"),
    ("ckpt_{step}", "ckpt_{step}"),  # the store's spelling passes as it is
    ("latest", "latest"),
])
def test_ppe_spelling_is_translated_once_into_the_store_language(ppe, store):
    """The core speaks ``{step}``: ppe's ``{.iteration}`` is translated where ppe's names enter,
    the user's spelling kept for messages, and the names ppe would format are the same."""
    template = ppe_template(ppe)
    assert template.template == store and template.text == ppe
    manager = types.SimpleNamespace(iteration=120, epoch=3, elapsed_time=12.25)
    manager.updater = manager
    name = ppe_name(template, manager)
    assert name == (ppe.format(manager) if "{step}" not in ppe else ppe.format(step=120))
    assert template.step_of(name) == (120 if "{" in store else None)


def test_two_auto_numbered_ppe_fields_name_one_manager():
    """``'e{.epoch}_i{.iteration}'.format(manager)`` fails in ppe (the second field is the
    second positional argument); every field names the manager, so it works here."""
    template = ppe_template("e{.epoch}_i{.iteration}")
    assert ppe_name(template, types.SimpleNamespace(iteration=120, epoch=3)) == "e3_i120"
    assert template.parse("e3_i120") == (120.0, 3.0)  # the step sorts first


def test_the_store_refuses_ppe_spelling_and_a_missing_value():
    with pytest.raises(ValueError, match="ppe's '{.iteration}' spelling is translated"):
        FilenameTemplate("snapshot_iter_{.iteration}")
    template = FilenameTemplate("e{epoch}_s{step}")
    assert template.name_at(7, epoch=2) == "e2_s7"
    with pytest.raises(ValueError, match="names a field that has no value"):
        template.name_at(7)
    with pytest.raises(ValueError, match="has no value"):  # ppe's manager lacks the attribute
        ppe_name(ppe_template("s_{.nonexistent}"), types.SimpleNamespace(iteration=1))


def test_extension_refuses_a_template_with_the_manager_repr():
    with pytest.raises(ValueError, match="manager object itself"):
        snapkeep.training.extensions.snapshot(filename="snap_{}")


WRITERS = {
    "simple": lambda: snapkeep.writing.SimpleWriter(),
    "thread": lambda: snapkeep.writing.ThreadWriter(),
    "process": lambda: snapkeep.writing.ProcessWriter(),
}


@pytest.mark.parametrize("writer_kind", sorted(WRITERS))
@pytest.mark.parametrize("name", ["../escaped", "/{tmp}/escaped_abs", "sub/../../escaped"])
def test_writers_never_write_outside_out_dir(tmp_path, writer_kind, name):
    out = tmp_path / "out"
    out.mkdir()
    name = name.format(tmp=str(tmp_path).lstrip("/"))
    writer = WRITERS[writer_kind]()
    try:
        with pytest.raises(ValueError, match="accepted: a relative path"):
            writer(name, str(out), {"x": torch.ones(2)})
    finally:
        writer.finalize()
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert [n for n in os.listdir(out) if n != ".snapkeep"] == []


@pytest.mark.parametrize("path_of", [
    lambda d: os.path.join(d, "..", "victim"),
    lambda d: os.path.join(d, "sub", "..", "..", "victim"),
    lambda d: os.path.join(d, "vic\0tim"),
])
def test_storage_refuses_escaping_deletes_and_writes_whatever_the_caller(tmp_path, path_of):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    storage, d = resolve_storage(str(out))
    with pytest.raises(ValueError, match="NUL|'\\.\\.'"):
        storage.remove(path_of(d))
    with pytest.raises(ValueError, match="NUL|'\\.\\.'"):
        storage.write_bytes(path_of(d), b"overwritten")
    assert victim.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["out", "victim"]


def _name_max(directory) -> int:
    return os.pathconf(str(directory), "PC_NAME_MAX")


@pytest.mark.parametrize("writer_kind", sorted(WRITERS))
@pytest.mark.parametrize("char", ["a", "é"])
def test_longest_name_the_filesystem_accepts_with_its_manifest_works(tmp_path, writer_kind, char):
    limit = _name_max(tmp_path) - len(".json")
    name = char * (limit // len(char.encode()))
    writer = WRITERS[writer_kind]()
    state = {"x": torch.arange(5.0)}
    try:
        writer(name, str(tmp_path), state)
    finally:
        writer.finalize()
    assert torch.equal(torch.load(tmp_path / name)["x"], state["x"])
    assert os.listdir(tmp_path / ".snapkeep") == [name + ".json"]
    assert not [n for n in os.listdir(tmp_path) if TEMP_MARKER in n]


@pytest.mark.parametrize("extra", [1, len(".json")])
def test_a_name_without_room_for_itself_or_its_manifest_fails_before_writing(tmp_path, extra):
    name = "n" * (_name_max(tmp_path) - len(".json") + extra)
    writer = snapkeep.writing.ThreadWriter()
    try:
        with pytest.raises(ValueError, match=f"NAME_MAX of {_name_max(tmp_path)} bytes"):
            writer(name, str(tmp_path), {"x": torch.ones(1)})
    finally:
        writer.finalize()
    assert [n for n in os.listdir(tmp_path) if n != ".snapkeep"] == []


def test_storage_write_refuses_a_name_over_name_max_before_writing(tmp_path):
    storage, d = resolve_storage(str(tmp_path))
    with pytest.raises(ValueError, match=f"NAME_MAX of {_name_max(tmp_path)} bytes"):
        storage.write_bytes(os.path.join(d, "x" * (_name_max(tmp_path) + 1)), b"data")
    assert os.listdir(tmp_path) == []


def test_temp_names_are_bounded_and_still_identify_a_dead_writer(tmp_path):
    """A writer process that died mid-write leaves a temp of a long name; the next run's sweep
    recognises it by the pid/token in its (short) name and removes it; its own stay."""
    long_name = "L" * (_name_max(tmp_path) - len(".json"))
    code = (
        "import sys; from snapkeep._core.storage import resolve_storage\n"
        "s, d = resolve_storage(sys.argv[1])\n"
        "t = s.temp_name_for(s.join(d, sys.argv[2]))\n"
        "open(t, 'wb').write(b'partial'); print(t)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path), long_name],
                          capture_output=True, text=True, check=True, env=env, timeout=120)
    dead_temp = dead.stdout.strip()
    storage, d = resolve_storage(str(tmp_path))
    mine = storage.temp_name_for(storage.join(d, long_name))
    for temp in (dead_temp, mine):
        assert len(os.path.basename(temp).encode()) <= TEMP_NAME_MAX_BYTES < 100
    with open(mine, "wb") as f:
        f.write(b"in use")
    assert _temp_owner(os.path.basename(mine))[1] == os.getpid()
    assert storage.remove_stale_temps(d) == [dead_temp]
    assert os.listdir(tmp_path) == [os.path.basename(mine)]
    os.unlink(mine)
