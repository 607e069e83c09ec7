"""``PrintReport``: prints the entries of a ``LogReport`` as a table (as ppe's).

Same text as ppe's command-line ``PrintReport``: a header of the entry names, each in a column
``max(10, len(name))`` characters wide plus two spaces, then one row per log entry with every
value formatted ``'{:<Wg}'`` (blank when the entry lacks the key). Each row is preceded by the
ANSI "erase below" sequence, as ppe does to overwrite a progress bar; live tqdm bars on the
same stream (``ProgressBar``'s) are cleared before and redrawn after the rows.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

import tqdm

from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training.extensions.log_report import LogLooker, LogReport

__all__ = ["PrintReport", "create_header_and_templates", "filter_and_sort_entries"]

_ERASE_BELOW = "\033[J"


def create_header_and_templates(
    entries: Sequence[str],
) -> tuple[str, list[tuple[str, str, str]]]:
    """Returns the header line and ``(entry, value template, blank cell)`` per column."""
    widths = [max(10, len(entry)) for entry in entries]
    header = "  ".join(entry.ljust(width) for entry, width in zip(entries, widths)) + "\n"
    templates = [
        (entry, "{:<" + str(width) + "g}  ", " " * (width + 2))
        for entry, width in zip(entries, widths)
    ]
    return header, templates


def filter_and_sort_entries(all_entries: Sequence[str], unit: str = "epoch") -> list[str]:
    """Orders inferred entries as ppe does: ``'epoch'`` (or ``'iteration'``, by ``unit``)
    first, the other counter dropped, ``'elapsed_time'`` last, the rest in first-seen order."""
    entries = [e for e in all_entries if e not in ("epoch", "iteration", "elapsed_time")]
    if unit in all_entries and unit in ("epoch", "iteration"):
        entries.insert(0, unit)
    if "elapsed_time" in all_entries:
        entries.append("elapsed_time")
    return entries


class PrintReport(extension.Extension):
    """Prints the log of a :class:`LogReport` in a human-readable table (as ppe's).

    Each call prints the entries logged since the previous call (the header before the first
    row). Register it with the same trigger as the ``LogReport`` or every iteration (default).
    On a resumed run the restored log is printed again at the first call, as ppe does with
    ``append=False``.

    Args:
        entries: Keys to print, in order; ``None`` infers them from the logged entries (the
            time unit of the ``LogReport``'s trigger first, ``elapsed_time`` last).
        log_report: Name of a ``LogReport`` registered with the manager, or a ``LogReport``
            instance that this extension calls itself (then its state is saved in this
            extension's ``state_dict``). Default ``'LogReport'``.
        out: Text stream to print to; ``None`` (default) is ``sys.stdout`` at print time.

    Raises:
        TypeError: ``log_report`` is neither a str nor a ``LogReport`` (at construction), or the
            extension it names is not a ``LogReport`` (at the first call).
    """

    def __init__(
        self,
        entries: Sequence[str] | None = None,
        log_report: str | LogReport = "LogReport",
        out: IO[str] | None = None,
    ) -> None:
        if not isinstance(log_report, (str, LogReport)):
            raise TypeError(
                "log_report must be the name of a registered LogReport or a LogReport, got "
                f"{type(log_report).__name__}"
            )
        self._infer_entries = entries is None
        self._entries: list[str] = [] if entries is None else list(entries)
        self._log_report = log_report
        self._out = out
        self._looker: LogLooker | None = None
        header, self._templates = create_header_and_templates(self._entries)
        self._header: str | None = header  # printed at the first call
        self._all_entries: list[str] = []

    def get_log_report(self, manager: ExtensionsManagerProtocol) -> LogReport:
        """The ``LogReport`` read by this extension (looked up by name in ``manager``).

        Raises:
            TypeError: The named extension is not a ``LogReport``.
        """
        if isinstance(self._log_report, LogReport):
            return self._log_report
        found = manager.get_extension(self._log_report)
        if not isinstance(found, LogReport):
            raise TypeError(
                f"log_report {self._log_report!r} names a {type(found).__name__}, not a LogReport"
            )
        return found

    def initialize(self, manager: ExtensionsManagerProtocol) -> None:
        """Starts reading the log report's entries from the current end of its log."""
        self._looker = self.get_log_report(manager)._log_buffer.emit_new_looker()

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        """Prints the entries logged since the previous call."""
        log_report = self.get_log_report(manager)
        if isinstance(self._log_report, LogReport):
            log_report(manager)  # an instance of our own: it accumulates through us
        if self._looker is None:
            self.initialize(manager)
        looker = self._looker
        if looker is None:  # set by initialize() above
            raise RuntimeError("PrintReport could not attach to its LogReport")
        if self._infer_entries:
            self._update_entries(log_report, looker.get())
        rows = looker.get()
        if not rows and not self._header:
            return
        out = self._out if self._out is not None else sys.stdout
        # tqdm clears its live bars on `out` (a ProgressBar's) and redraws them afterwards
        with tqdm.tqdm.external_write_mode(file=out):
            if self._header:
                out.write(self._header)
                self._header = None
            for entry in rows:
                out.write(_ERASE_BELOW)
                self._print(out, entry)
        looker.clear()

    def _update_entries(self, log_report: LogReport, logged: list[dict[str, Any]]) -> None:
        new = [key for entry in logged for key in entry if key not in self._all_entries]
        if not new:
            return
        for key in new:
            if key not in self._all_entries:
                self._all_entries.append(key)
        unit = getattr(log_report._trigger, "unit", "epoch")
        self._entries = filter_and_sort_entries(self._all_entries, unit=unit)
        self._header, self._templates = create_header_and_templates(self._entries)

    def _print(self, out: IO[str], entry: Mapping[str, Any]) -> None:
        for key, template, blank in self._templates:
            out.write(template.format(entry[key]) if key in entry else blank)
        out.write("\n")
        flush = getattr(out, "flush", None)
        if callable(flush):
            flush()

    def state_dict(self) -> dict[str, Any]:
        """``{'_log_report': ...}`` when this extension owns its ``LogReport``, else ``{}``."""
        if isinstance(self._log_report, LogReport):
            return {"_log_report": self._log_report.state_dict()}
        return {}

    def load_state_dict(self, to_load: Mapping[str, Any]) -> None:
        """Restores the owned ``LogReport`` (see :meth:`state_dict`)."""
        if isinstance(self._log_report, LogReport) and "_log_report" in to_load:
            self._log_report.load_state_dict(to_load["_log_report"])
