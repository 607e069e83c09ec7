"""``Evaluator``: runs a validation loop and reports the means (as ppe's ``Evaluator``).

ppe's ``DistributedEvaluator`` and ``IgniteEvaluator`` are not shipped (see the package's
``__getattr__``); subclasses may override :meth:`Evaluator._gather_summaries` to combine
summaries across processes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import tqdm

from snapkeep import reporting
from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol

__all__ = ["Evaluator"]

Metric = Callable[[Any, Any, bool], None]
"""``metric(batch, output, last_batch)``; reports values with ``snapkeep.report``."""


class _Bar(tqdm.tqdm):  # type: ignore[type-arg]
    """tqdm without its monitor thread (no thread outlives the bar)."""

    monitor_interval = 0


class _EvalBar(_Bar):
    """Adds ``speed`` (batches per second; ``inf`` before the first batch, as ppe prints) to
    the fields a ``bar_format`` may use."""

    @property
    def format_dict(self) -> dict[str, Any]:
        fields = dict(super().format_dict)
        done, elapsed_s = self.n - self.initial, fields.get("elapsed") or 0
        fields["speed"] = done / elapsed_s if done > 0 and elapsed_s > 0 else float("inf")
        return fields


def _bar_format(name: str) -> str:
    # ppe's three lines of text on one line (tqdm redraws one line): the same substrings
    width = len(name)
    return ("{desc} [{bar:50}] {percentage:6.2f}% {n:>" + str(width) + "} iterations {speed:>"
            + str(width) + ".5g} iters/sec. ETA {remaining}")


@contextlib.contextmanager
def _eval_mode(targets: Iterable[torch.nn.Module]) -> Iterator[None]:
    modules = list(targets)
    was_training = [m.training for m in modules]
    try:
        for m in modules:
            m.eval()
        yield
    finally:
        for m, training in zip(modules, was_training):
            m.train(training)


class Evaluator(extension.Extension):
    """Evaluates models on a validation set and reports the mean of what was reported.

    As ppe's ``Evaluator``: by default once per epoch, priority ``PRIORITY_WRITER``, default
    name ``'validation'``. Each call makes a fresh :class:`~snapkeep.reporting.Reporter` current
    (targets registered as observers named ``'<extension name>/<target name>'``), puts the
    targets in eval mode and runs under ``torch.no_grad()``; for every batch of the ``'main'``
    iterator it calls ``eval_func`` (default: the ``'main'`` target) with the batch unpacked --
    a tuple or list as positional arguments, a dict as keyword arguments, anything else (and a
    named tuple) as one argument -- then every metric. The means over batches of the values
    reported in each batch (a :class:`~snapkeep.reporting.DictSummary`) are reported to the
    reporter that is current at the call (the manager's) and returned. Keys reported without an
    observer keep their names (ppe's example reports ``'val/loss'``).

    Args:
        iterator: A data loader (any sized iterable of batches), registered as ``'main'``, or a
            mapping of names to them.
        target: A module, registered as ``'main'``, or a mapping of names to modules.
        eval_hook: ``fn(evaluator)`` called at the start of each evaluation.
        eval_func: Called for each batch instead of the ``'main'`` target.
        progress_bar: Show a tqdm bar over the batches on ``sys.stdout``, redrawn after every
            batch and removed when done; one line with ppe's text (``'validation [##...]'``,
            ``'<n> iterations'``, ``'<speed> iters/sec.'``).
        metrics: ``metric(batch, output, last_batch)`` callables run after each batch.

    Raises:
        TypeError: ``target`` is neither a module nor a mapping of modules.
    """

    trigger = (1, "epoch")
    priority = extension.PRIORITY_WRITER

    def __init__(
        self,
        iterator: Any,
        target: torch.nn.Module | Mapping[str, torch.nn.Module],
        eval_hook: Callable[[Evaluator], None] | None = None,
        eval_func: Callable[..., Any] | None = None,
        *,
        progress_bar: bool = False,
        metrics: Sequence[Metric] | None = None,
    ) -> None:
        if isinstance(target, torch.nn.Module):
            target = {"main": target}
        if not isinstance(target, Mapping) or not all(
            isinstance(t, torch.nn.Module) for t in target.values()
        ):
            raise TypeError(
                "target must be a torch.nn.Module or a mapping of names to modules, got "
                f"{type(target).__name__}"
            )
        self._iterators: dict[str, Any] = (
            dict(iterator) if isinstance(iterator, Mapping) else {"main": iterator}
        )
        self._targets: dict[str, torch.nn.Module] = dict(target)
        self.name = None
        self.eval_hook = eval_hook
        self._eval_func = eval_func
        self._progress_bar = bool(progress_bar)
        self._metrics: list[Metric] = list(metrics or [])

    @property
    def default_name(self) -> str:
        """``'validation'`` (as ppe)."""
        return "validation"

    def eval_func(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluates one batch: ``eval_func`` if given, else the ``'main'`` target.

        Raises:
            KeyError: No ``eval_func`` and no target named ``'main'``.
        """
        func = self._eval_func if self._eval_func is not None else self._targets["main"]
        return func(*args, **kwargs)

    def get_iterator(self, name: str) -> Any:
        """The iterator registered as ``name``."""
        return self._iterators[name]

    def get_all_iterators(self) -> dict[str, Any]:
        """All iterators by name (a copy of the mapping)."""
        return dict(self._iterators)

    def get_target(self, name: str) -> torch.nn.Module:
        """The target registered as ``name``."""
        return self._targets[name]

    def get_all_targets(self) -> dict[str, torch.nn.Module]:
        """All targets by name (a copy of the mapping)."""
        return dict(self._targets)

    def add_metric(self, metric_fn: Metric) -> None:
        """Adds ``metric_fn(batch, output, last_batch)``, run after every batch."""
        self._metrics.append(metric_fn)

    def __call__(self, manager: ExtensionsManagerProtocol | None = None) -> dict[str, Any]:
        """Evaluates, reports the means to the current reporter and returns them.

        Works without a manager (``evaluator()``), as ppe's.
        """
        reporter = reporting.Reporter()
        prefix = "" if self.name is None else self.name + "/"
        for name, target in self._targets.items():
            reporter.add_observer(prefix + name, target)
            reporter.add_observers(prefix + name, target.named_modules())
        with reporter, torch.no_grad():
            result = self.evaluate()
        reporting.report(result)
        return result

    def _gather_summaries(self, summary: reporting.DictSummary) -> reporting.DictSummary:
        """Hook for subclasses that combine summaries across processes (identity here)."""
        return summary

    def evaluate(self) -> dict[str, Any]:
        """Runs the evaluation loop over the ``'main'`` iterator; returns ``{key: mean}``.

        Must run with a reporter current (``__call__`` provides one). Means of tensors stay
        tensors (0-dim, on their device); of Python numbers, Python floats.

        Raises:
            RuntimeError: No reporter is current.
        """
        iterator = self._iterators["main"]
        if self.eval_hook is not None:
            self.eval_hook(self)
        summary = reporting.DictSummary()
        total = len(iterator) if hasattr(iterator, "__len__") else None
        bar = None
        if self._progress_bar:
            name = self.name or self.default_name
            bar = _EvalBar(total=total, desc=name, file=sys.stdout, leave=False, unit="batch",
                           ascii=".#", mininterval=0,
                           bar_format=None if total is None else _bar_format(name))
        try:
            with _eval_mode(self._targets.values()):
                for index, batch in enumerate(iterator):
                    observation: dict[str, Any] = {}
                    with reporting.report_scope(observation):
                        output = self._evaluate_batch(batch)
                        last = total is not None and index == total - 1
                        for metric in self._metrics:
                            metric(batch, output, last)
                    summary.add(observation)
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return self._gather_summaries(summary).compute_mean()

    def _evaluate_batch(self, batch: Any) -> Any:
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple: one value
            return self.eval_func(batch)
        if isinstance(batch, (tuple, list)):
            return self.eval_func(*batch)
        if isinstance(batch, dict):
            return self.eval_func(**batch)
        return self.eval_func(batch)
