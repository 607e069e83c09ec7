"""Reporting of observed values, as ppe's ``pytorch_pfn_extras.reporting``.

A :class:`Reporter` collects named values (losses, accuracies, ...) into an *observation*
dictionary. :class:`~snapkeep.training.ExtensionsManager` opens a fresh observation for every
``run_iteration`` and makes its reporter current, so a :func:`report` call anywhere inside the
iteration body lands in ``manager.observation`` where extensions and triggers read it.

The current reporter is tracked per thread; :func:`report` with no current reporter does nothing.
:class:`Summary` and :class:`DictSummary` compute running means of scalar observations (used by
:class:`~snapkeep.training.triggers.BestValueTrigger` and
:class:`~snapkeep.training.triggers.EarlyStoppingTrigger`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy
import torch

from snapkeep._not_shipped import not_shipped_error

__all__ = [
    "DictSummary",
    "Observation",
    "Reporter",
    "Summary",
    "get_current_reporter",
    "report",
    "report_scope",
]

Observation = dict[str, Any]
"""Mapping from a value name (``'main/loss'``) to the reported value."""

_local = threading.local()


def _reporter_stack() -> list[Reporter]:
    stack: list[Reporter] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = []
        _local.stack = stack
    return stack


def _detach(value: Any) -> Any:
    # Reported tensors must not keep the autograd graph of the iteration alive.
    return value.detach() if isinstance(value, torch.Tensor) else value


class Reporter:
    """Collects reported values into its current observation dictionary (as ppe's ``Reporter``).

    Observers are objects (typically modules) registered under a name; values reported *with* an
    observer are stored as ``'<observer name>/<key>'``. Observers are told apart by identity
    (``id(observer)``), not equality.

    Attributes:
        observation: The dictionary that :meth:`report` currently writes to.
    """

    def __init__(self) -> None:
        self._observer_names: dict[int, str] = {}
        self.observation: Observation = {}

    def __enter__(self) -> None:
        """Makes this reporter the current one of this thread."""
        _reporter_stack().append(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        """Restores the previously current reporter."""
        _reporter_stack().pop()

    @contextlib.contextmanager
    def scope(self, observation: Observation) -> Iterator[None]:
        """Makes this reporter current and directs its reports into ``observation``.

        Args:
            observation: Dictionary that receives every value reported inside the ``with`` block.
                The previous observation dictionary is restored on exit, also on error.
        """
        previous = self.observation
        self.observation = observation
        self.__enter__()
        try:
            yield
        finally:
            self.__exit__(None, None, None)
            self.observation = previous

    def add_observer(self, name: str, observer: Any) -> None:
        """Registers ``observer`` so values reported with it are prefixed by ``name + '/'``."""
        self._observer_names[id(observer)] = name

    def add_observers(self, prefix: str, observers: Iterable[tuple[str, Any]]) -> None:
        """Registers several observers; each gets the name ``prefix + name``.

        The names are concatenated without a separator, exactly as ppe does, so that observation
        keys produced for ``module.named_modules()`` match those of a ppe training run.
        """
        for name, observer in observers:
            self._observer_names[id(observer)] = prefix + name

    def report(self, values: Mapping[str, Any], observer: Any = None) -> None:
        """Stores ``values`` into the current observation.

        Tensors are stored detached from the autograd graph (same device and dtype).

        Args:
            values: Names to values.
            observer: Optional registered observer whose name prefixes every key.

        Raises:
            KeyError: ``observer`` was never registered with :meth:`add_observer`.
        """
        detached = {key: _detach(value) for key, value in values.items()}
        if observer is None:
            self.observation.update(detached)
            return
        try:
            prefix = self._observer_names[id(observer)]
        except KeyError:
            raise KeyError(
                f"observer {type(observer).__name__} is not registered with this Reporter; "
                "call add_observer(name, observer) first"
            ) from None
        for key, value in detached.items():
            self.observation[f"{prefix}/{key}"] = value


def get_current_reporter() -> Reporter:
    """Returns the reporter made current last in this thread.

    Raises:
        RuntimeError: No reporter is current (no ``run_iteration`` or ``Reporter.scope`` is open).
    """
    stack = _reporter_stack()
    if not stack:
        raise RuntimeError("no Reporter is current in this thread")
    return stack[-1]


def report(values: Mapping[str, Any], observer: Any = None) -> None:
    """Reports ``values`` to the current reporter, as ppe's ``reporting.report``.

    Inside ``with manager.run_iteration():`` the values land in ``manager.observation``. With no
    current reporter this does nothing (as ppe).

    Args:
        values: Names to values; tensors are stored detached.
        observer: Optional registered observer (for example a model given to the manager) whose
            name prefixes every key, e.g. ``'main/loss'``.

    Raises:
        KeyError: ``observer`` is not registered with the current reporter.
    """
    stack = _reporter_stack()
    if stack:
        stack[-1].report(values, observer)


@contextlib.contextmanager
def report_scope(observation: Observation) -> Iterator[None]:
    """Directs the current reporter's reports into ``observation`` for the ``with`` block.

    Raises:
        RuntimeError: No reporter is current.
    """
    current = get_current_reporter()
    previous = current.observation
    current.observation = observation
    try:
        yield
    finally:
        current.observation = previous


def _is_scalar(value: Any) -> bool:
    return bool(numpy.isscalar(value)) or getattr(value, "ndim", -1) == 0


class Summary:
    """Running weighted mean and standard deviation of scalars, as ppe's ``Summary``.

    Values may be Python/NumPy scalars or zero-dimensional tensors (kept on their device until
    read), or zero-argument callables evaluated lazily when a statistic is requested.
    """

    def __init__(self) -> None:
        self._x: Any = 0.0
        self._x2: Any = 0.0
        self._n: Any = 0
        self._deferred: list[tuple[Callable[[], Any], Any]] = []

    def _flush_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for fn, weight in deferred:
            self.add(fn(), weight)

    def add(self, value: Any, weight: Any = 1) -> None:
        """Adds ``value`` with ``weight`` (default 1); a callable is evaluated later."""
        if callable(value):
            self._deferred.append((value, weight))
            return
        with torch.no_grad():
            self._x = self._x + weight * value
            self._x2 = self._x2 + weight * value * value
            self._n = self._n + weight

    def compute_mean(self) -> Any:
        """Returns the weighted mean (a tensor if tensors were added).

        Raises:
            ZeroDivisionError: Nothing was added (for Python scalars).
        """
        self._flush_deferred()
        return self._x / self._n

    def make_statistics(self) -> tuple[Any, Any]:
        """Returns ``(mean, standard deviation)`` of the added values."""
        self._flush_deferred()
        mean = self._x / self._n
        var = self._x2 / self._n - mean * mean
        # Rounding can make a zero variance slightly negative; clamp it instead of returning NaN.
        if isinstance(var, torch.Tensor):
            return mean, torch.sqrt(torch.clamp(var, min=0))
        return mean, math.sqrt(max(float(var), 0.0))

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{'_x', '_x2', '_n'}`` as Python numbers (ppe's layout; device-free)."""
        self._flush_deferred()
        n = float(self._n)
        return {"_x": float(self._x), "_x2": float(self._x2), "_n": int(n) if n.is_integer() else n}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the sums saved by :meth:`state_dict` (tensors are accepted and converted)."""
        self._deferred = []
        self._x = float(_detach(state["_x"]))
        self._x2 = float(_detach(state["_x2"]))
        n = float(_detach(state["_n"]))
        self._n = int(n) if n.is_integer() else n

    def __add__(self, other: Summary) -> Summary:
        merged = Summary()
        merged._x = self._x + other._x
        merged._x2 = self._x2 + other._x2
        merged._n = self._n + other._n
        merged._deferred = self._deferred + other._deferred
        return merged


class DictSummary:
    """Per-key :class:`Summary` of a stream of dictionaries, as ppe's ``DictSummary``.

    Only scalar entries (Python/NumPy scalars, zero-dimensional tensors or arrays, callables) are
    summarized; other entries are ignored. A ``(value, weight)`` tuple adds a weighted value.
    """

    def __init__(self) -> None:
        self._summaries: dict[str, Summary] = collections.defaultdict(Summary)

    def add(self, d: Mapping[str, Any]) -> None:
        """Adds every scalar entry of ``d``.

        Raises:
            ValueError: A ``(value, weight)`` tuple has a non-scalar weight.
        """
        for key, value in d.items():
            weight: Any = 1
            if isinstance(value, tuple):
                value, weight = value
                if not _is_scalar(weight):
                    raise ValueError(f"weight given for {key!r} must be a scalar, got {weight!r}")
            if callable(value) or _is_scalar(value):
                self._summaries[key].add(value, weight=weight)

    def compute_mean(self) -> dict[str, Any]:
        """Returns ``{key: mean}`` for every key added so far."""
        return {key: summary.compute_mean() for key, summary in self._summaries.items()}

    def make_statistics(self) -> dict[str, Any]:
        """Returns ``{key: mean, key + '.std': standard deviation}`` for every key."""
        stats: dict[str, Any] = {}
        for key, summary in self._summaries.items():
            stats[key], stats[key + ".std"] = summary.make_statistics()
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{key: Summary.state_dict()}`` (ppe's layout)."""
        return {key: summary.state_dict() for key, summary in self._summaries.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replaces all summaries with those saved by :meth:`state_dict`."""
        self._summaries.clear()
        for key, summary_state in state.items():
            self._summaries[key].load_state_dict(summary_state)

    def __add__(self, other: DictSummary) -> DictSummary:
        merged = DictSummary()
        for key in sorted({*self._summaries, *other._summaries}):
            mine, theirs = self._summaries.get(key), other._summaries.get(key)
            if mine is not None and theirs is not None:
                merged._summaries[key] = mine + theirs
            else:
                merged._summaries[key] = mine if mine is not None else theirs  # type: ignore[assignment]
        return merged


def __getattr__(name: str) -> Any:
    # ppe's scalar helpers (divide_scalar, ...) are not shipped
    raise not_shipped_error(__name__, name)
