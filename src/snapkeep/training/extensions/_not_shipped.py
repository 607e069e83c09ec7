"""ppe extensions that snapkeep does not ship, and the error that points to the plug-in path."""

from __future__ import annotations

__all__ = ["NOT_SHIPPED", "not_shipped_error"]

NOT_SHIPPED: frozenset[str] = frozenset({
    # public names of pytorch_pfn_extras.training.extensions (0.9.0) that snapkeep lacks
    "AverageAccumulate", "MaxAccumulate", "MinAccumulate", "StandardDeviationAccumulate",
    "UnbiasedStandardDeviationAccumulate", "BestValue", "MaxValue", "MinValue",
    "DistributedEvaluator", "IgniteEvaluator", "MicroAverage", "ParameterStatistics",
    "PlotReport", "PrintReportNotebook", "ProfileReport", "ProgressBarNotebook", "Slack",
    "SlackWebhook", "TimelineTrace", "VariableStatisticsPlot", "snapshot_writers",
})


def not_shipped_error(name: str) -> AttributeError:
    """The error raised when ``snapkeep.training.extensions.<name>`` is one of ppe's extensions
    that snapkeep does not ship: it names the extension and the way to keep using it."""
    return AttributeError(
        f"snapkeep.training.extensions has no {name!r}: snapkeep does not ship ppe's {name}. "
        "Keep pytorch-pfn-extras' ExtensionsManager and its extensions "
        f"(pytorch_pfn_extras.training.extensions.{name}) and plug snapkeep's snapshot "
        "extension into it: manager.extend(snapkeep.training.extensions.snapshot(...)), or "
        "pass a snapkeep writer to ppe's snapshot (writer=snapkeep.writing.ThreadWriter(...))."
    )
