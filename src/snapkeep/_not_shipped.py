"""ppe names snapkeep does not ship, and the error that points to the plug-in path.

``import snapkeep as ppe`` keeps ppe's training loop, snapshot extension, writers and reporter
working. The rest of ppe's public surface (its ``nn``, ``cuda``, ``runtime``, ``handler``,
``Trainer``, the TensorBoard writer, most extensions, ...) is not part of snapkeep: asking for
one of those names raises an :class:`AttributeError` that says so and shows how to keep it
(pytorch-pfn-extras itself, with snapkeep's snapshot extension or writers plugged into it).
The lists are ppe 0.9.0's public names, per module (checked against the installed ppe by
``tests/test_ppe_names_not_shipped.py``); any other missing name gets Python's ordinary error.
"""

from __future__ import annotations

__all__ = ["NOT_SHIPPED", "not_shipped_error"]

#: Per snapkeep module: the public names of the same ppe module that snapkeep lacks.
NOT_SHIPPED: dict[str, frozenset[str]] = {
    "snapkeep": frozenset({
        "as_ndarray", "as_numpy_dtype", "compile", "config", "cuda", "dataloaders", "dataset",
        "engine", "from_ndarray", "from_numpy_dtype", "get_xp", "handler", "logging", "map",
        "nn", "ops", "profiler", "requires", "runtime", "to", "utils",
    }),
    "snapkeep.writing": frozenset({"TensorBoardWriter"}),
    "snapkeep.reporting": frozenset({"divide_scalar", "multiply_scalar", "subtract_scalar"}),
    "snapkeep.training": frozenset({
        "AccuracyMetric", "DistributedEvaluator", "Evaluator", "IgniteExtensionsManager",
        "Trainer", "metrics",
    }),
    "snapkeep.training.extensions": frozenset({
        "AverageAccumulate", "MaxAccumulate", "MinAccumulate", "StandardDeviationAccumulate",
        "UnbiasedStandardDeviationAccumulate", "BestValue", "MaxValue", "MinValue",
        "DistributedEvaluator", "IgniteEvaluator", "MicroAverage", "ParameterStatistics",
        "PlotReport", "PrintReportNotebook", "ProfileReport", "ProgressBarNotebook", "Slack",
        "SlackWebhook", "TimelineTrace", "VariableStatisticsPlot", "snapshot_writers",
    }),
}


def not_shipped_error(module: str, name: str) -> AttributeError:
    """The ``AttributeError`` for ``module.name``: the not-shipped explanation when ppe has that
    name (see :data:`NOT_SHIPPED`), else Python's ordinary message.

    Args:
        module: the snapkeep module asked, e.g. ``'snapkeep.writing'``.
        name: the attribute asked for.
    """
    if name not in NOT_SHIPPED.get(module, frozenset()):
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    ppe_name = "pytorch_pfn_extras" + module[len("snapkeep"):] + f".{name}"
    return AttributeError(
        f"{module} has no {name!r}: snapkeep does not ship ppe's {name} ({ppe_name}). "
        f"Keep pytorch-pfn-extras for it (import pytorch_pfn_extras; {ppe_name}) and plug "
        "snapkeep into ppe's ExtensionsManager: manager.extend("
        "snapkeep.training.extensions.snapshot(...)), or pass a snapkeep writer to ppe's "
        "snapshot (writer=snapkeep.writing.ThreadWriter(...)). See docs/migration.md."
    )
