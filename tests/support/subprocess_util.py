"""Helpers for tests that start real processes."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """``preexec_fn`` for a child that must react to SIGINT as under an interactive shell.

    A test run started in the background (``make test &``, nohup, some CI runners) ignores
    SIGINT, and children inherit that: Python then installs no KeyboardInterrupt handler, and a
    Ctrl-C test would wait in vain. Resetting SIGINT to its default in the child fixes that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
