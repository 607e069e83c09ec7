"""The matrix's rows may not apply to every scenario: a door's ``skips`` (scenario name ->
reason) skips those cells with the reason (see ``framework_doors.py``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        door = callspec.params.get("door") if callspec is not None else None
        reason = getattr(door, "skips", {}).get(getattr(item, "originalname", item.name))
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"{door.name}: {reason}"))
