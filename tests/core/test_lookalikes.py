"""Names that look like snapshots of another template, and the template that would match."""

from __future__ import annotations

import pytest

from snapkeep._core.store.lookalikes import suggest_template
from snapkeep.store import lookalike_message, ppe_template


@pytest.mark.parametrize(("name", "field", "suggested"), [
    ("100.pt", "{step}", "{step}.pt"),
    ("ckpt_e3_i100.pt", "{step}", "ckpt_e3_i{step}.pt"),
    ("snap{1}_7", "{.iteration}", "snap{{1}}_{.iteration}"),
    ("model.pt", "{step}", None),
])
def test_suggested_template(name: str, field: str, suggested: str | None) -> None:
    assert suggest_template(name, field) == suggested
    if suggested is not None and field == "{.iteration}":
        assert ppe_template(suggested).parse(name) is not None  # it does match


def test_message_names_files_by_template_and_skips_hidden_and_own_files() -> None:
    names = ["100.pt", "200.pt", ".hidden1", "x.snapkeep-tmp.3", "notes.txt", "run_7"]
    message = lookalike_message(names, "snapshot_iter_{.iteration}", "{.iteration}", "out")
    assert message is not None
    assert "['100.pt', '200.pt'] would match the template '{.iteration}.pt'" in message
    assert "['run_7'] would match the template 'run_{.iteration}'" in message
    assert ".hidden1" not in message and "snapkeep-tmp" not in message
    assert lookalike_message(["notes.txt"], "t_{.iteration}", "{.iteration}", "out") is None
