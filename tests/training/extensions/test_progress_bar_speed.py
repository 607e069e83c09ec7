"""ProgressBar's speed as ppe writes it (``'<speed> iters/sec.'``, ppe's test_progress_bar reads
it back): iterations per second since the bar's first call, on a fake clock (no timing)."""

from __future__ import annotations

import io
import re

import snapkeep
from snapkeep.training import extensions


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_speed_counts_iterations_since_the_first_call(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    out = io.StringIO()
    manager = snapkeep.training.ExtensionsManager({}, {}, 2, iters_per_epoch=5)
    manager.extend(extensions.ProgressBar(update_interval=1, bar_length=10, out=out))
    speeds = []
    for _ in range(4):
        with manager.run_iteration():
            clock.now += 0.25  # every iteration takes a quarter of a second
        speeds.append(re.findall(r"(\S+) iters/sec\.", out.getvalue())[-1])
    # the first call opens the bar (nothing timed yet), then 1/0.25 s per iteration
    assert speeds == ["inf", "4", "4", "4"]
    assert "3 iter, 0 epoch / 2 epochs" in out.getvalue()
