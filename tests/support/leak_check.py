"""What the suite's leak check (``tests/conftest.py``) must not count as a test's leak."""

from __future__ import annotations

#: pids of helper processes that live longer than one test on purpose (a session-scoped
#: fixture's server); a fixture that starts one adds its pid here.
LONG_LIVED_PIDS: set[int] = set()
