"""``ProgressBar``: a training progress bar drawn by tqdm, with ppe's arguments.

ppe draws its own multi-line bar with ANSI cursor moves; snapkeep uses tqdm. The line keeps
ppe's status text (``'<iteration> iter, <epoch> epoch / <length> <unit>s'``), the fraction done,
the iteration speed as ppe writes it (``'<speed> iters/sec.'``, counted from the first call) and
the estimated time to finish.
"""

from __future__ import annotations

import numbers
import sys
from typing import IO, Any

import tqdm

from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import check_period, check_unit

__all__ = ["ProgressBar"]

_BAR_CHARS = ".#"  # tqdm's custom "ascii" charset: blank, then full (ppe draws '#' on '.')


class _Bar(tqdm.tqdm):  # type: ignore[type-arg]
    """tqdm without its monitor thread (no thread outlives the bar), with ``speed``: iterations
    per second since the bar was opened (``inf`` before the first timed one, as ppe prints)."""

    monitor_interval = 0

    @property
    def format_dict(self) -> dict[str, Any]:
        fields = dict(super().format_dict)
        done, elapsed_s = self.n - self.initial, fields.get("elapsed") or 0
        fields["speed"] = done / elapsed_s if done > 0 and elapsed_s > 0 else float("inf")
        return fields


def _positive_int(value: object, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{argument} must be an int >= 1, got {value!r}")
    return int(value)


class ProgressBar(extension.Extension):
    """Shows training progress every ``update_interval`` iterations (as ppe's ``ProgressBar``).

    The bar counts iterations up to the training length. A resumed run starts the bar at the
    resumed iteration. ``finalize`` closes the bar.

    Args:
        training_length: ``(length, 'iteration' | 'epoch')``; ``None`` asks the manager's stop
            trigger (``get_training_length()``, which an ``IntervalTrigger`` has).
        update_interval: Redraw every this many iterations (>= 1); default 100.
        bar_length: Width of the bar in characters (>= 1); default 50.
        out: Text stream; ``None`` (default) is ``sys.stdout`` when the bar is first drawn.

    Raises:
        ValueError: ``update_interval`` or ``bar_length`` is not a positive int, or
            ``training_length`` is not a ``(positive number, unit)`` pair; or, at the first
            call, ``training_length`` is ``None`` and the stop trigger has no length.
    """

    def __init__(
        self,
        training_length: tuple[float, str] | None = None,
        update_interval: int = 100,
        bar_length: int = 50,
        out: IO[str] | None = None,
    ) -> None:
        self._training_length = (
            None if training_length is None else _check_length(training_length)
        )
        self._update_interval = _positive_int(update_interval, "update_interval")
        self._bar_length = _positive_int(bar_length, "bar_length")
        self._out = out
        self._bar: tqdm.tqdm[Any] | None = None
        self._status = ""

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        """Redraws the bar when ``manager.iteration`` is a multiple of ``update_interval``."""
        iteration = manager.iteration
        if self._bar is None:  # iterations before the bar opened are not timed
            self._bar = self._open(manager, start=iteration)
        if iteration % self._update_interval == 0:
            length, unit = self._length(manager)
            self._status = f"{iteration} iter, {manager.epoch} epoch / {length} {unit}s"
            self._bar.n = min(iteration, int(self._bar.total))
            self._bar.set_description_str(self._status, refresh=False)
            self._bar.refresh()
            self._bar.delay = 0  # drawn: close() now ends the line

    def _length(self, manager: ExtensionsManagerProtocol) -> tuple[float, str]:
        if self._training_length is None:
            get_length = getattr(manager._stop_trigger, "get_training_length", None)
            if get_length is None:
                raise ValueError(
                    "ProgressBar needs training_length=(length, 'iteration' | 'epoch'): the "
                    f"manager's stop trigger {type(manager._stop_trigger).__name__} has no "
                    "get_training_length()"
                )
            self._training_length = _check_length(get_length())
        return self._training_length

    def _open(self, manager: ExtensionsManagerProtocol, start: int) -> tqdm.tqdm[Any]:
        length, unit = self._length(manager)
        total = length if unit == "iteration" else length * manager._iters_per_epoch
        return _Bar(
            total=total, initial=start, file=self._out if self._out is not None else sys.stdout,
            ascii=_BAR_CHARS, unit="iter", smoothing=0, mininterval=0, dynamic_ncols=False,
            # nothing on screen before the first update_interval (as ppe): a delay stops
            # tqdm's draw at creation, and close() leaves a bar never drawn undrawn
            delay=float("inf"),
            bar_format="{desc} [{bar:" + str(self._bar_length) + "}] {percentage:6.2f}% "
            "{speed:10.5g} iters/sec. ETA {remaining}",  # ppe's speed text
        )

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        """Closes the bar (leaves its last state on screen)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _check_length(training_length: Any) -> tuple[float, str]:
    try:
        length, unit = training_length
    except (TypeError, ValueError):
        raise ValueError(
            "training_length must be (length, 'iteration' | 'epoch'), got "
            f"{training_length!r}"
        ) from None
    unit = check_unit(unit, "training_length unit")
    return check_period(length, unit, "training_length"), unit
