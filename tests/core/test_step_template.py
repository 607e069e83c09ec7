"""One translation of a ``{step}`` name into the store's template, for every door that takes
one (the Checkpointer's ``template``, Lightning's names with only a step): before, Lightning's
copy refused the format specs the Checkpointer's accepted."""

from __future__ import annotations

import re

import pytest

from snapkeep.store import step_template


@pytest.mark.parametrize(("template", "step", "name"), [
    ("ckpt_{step}", 7, "ckpt_7"),
    ("{step:08d}.pt", 42, "00000042.pt"),
    ("run/{step}", 3, "run/3"),
    ("step={step}.ckpt", 12, "step=12.ckpt"),
    ("a{{b}}_{step:04d}", 5, "a{b}_0005"),
])
def test_a_name_formats_and_parses_back_to_its_step(template: str, step: int, name: str) -> None:
    made = step_template(template)
    assert made.name_at(step) == name
    assert made.step_of(name) == step


@pytest.mark.parametrize(("template", "error", "says"), [
    ("ckpt", ValueError, "exactly one {step}"),
    ("{step}_{step}", ValueError, "exactly one {step}"),
    ("{epoch}_{step}", ValueError, "{epoch}"),
    ("{step!r}", ValueError, "{step}"),
    ("ckpt_{step", ValueError, "malformed"),
    (b"ckpt_{step}", TypeError, "must be a str"),
])
def test_a_bad_template_names_what_is_accepted(template, error, says) -> None:
    with pytest.raises(error, match=re.escape(says)):
        step_template(template)


def test_lightning_takes_the_same_templates(tmp_path) -> None:
    pytest.importorskip("lightning")
    from snapkeep.lightning import SnapkeepCheckpointIO

    io = SnapkeepCheckpointIO()
    try:
        io.open(str(tmp_path / "ckpts"), template="step={step:04d}.ckpt")  # refused before
        assert io.newest(str(tmp_path / "ckpts"), template="step={step:04d}.ckpt") is None
    finally:
        io.close()
