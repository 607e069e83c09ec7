"""``LogReport``: mean of the reported values per period, written to a ``log`` file (as ppe's).

The file has ppe's formats and content, so tools that read ppe's ``result/log`` read snapkeep's:
``'json'`` (default) is one JSON list of dictionaries, rewritten whole at every period;
``'json-lines'`` one dictionary per line; ``'yaml'`` a YAML list. Each dictionary holds the mean
of every scalar reported during the period, plus ``epoch``, ``iteration`` and ``elapsed_time``.

The log and the partial summary are part of the extension's ``state_dict`` (ppe's keys
``_trigger``, ``_summary``, ``_log``), so a run resumed from a snapshot writes a ``log`` with
every period exactly once and the same values as an uninterrupted run (``elapsed_time`` aside).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from snapkeep import reporting
from snapkeep.store import RecordError, parse_json
from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import TriggerLike, get_trigger

__all__ = ["LogReport", "LogWriterSaveFunc"]

logger = logging.getLogger(__name__)

FORMATS = ("json", "json-lines", "yaml")
#: Largest saved log restored, in bytes (a long run's log is a few MB).
MAX_LOG_BYTES = 1 << 30


class LogWriterSaveFunc:
    """``savefun(log, file)`` that encodes the list of log entries (as ppe's of that name).

    A module-level class, so it pickles to a process writer's worker.

    Args:
        format: ``'json'``, ``'json-lines'`` or ``'yaml'``.
        append: Whether the writer appends (then ``'json'`` is refused).

    Raises:
        ValueError: ``format`` is not one of the three, or ``'json'`` with ``append``.
    """

    def __init__(self, format: str, append: bool) -> None:
        _check_format(format, append)
        self._format = format
        self._append = append

    def __call__(self, target: list[dict[str, Any]], file_o: IO[bytes]) -> None:
        """Writes ``target`` (a list of dicts of numbers) to the binary file ``file_o``."""
        if self._format == "json":
            text = json.dumps(target, indent=4)
        elif self._format == "json-lines":
            text = "".join(json.dumps(entry) + "\n" for entry in target)
        else:
            import yaml  # optional (PyYAML), as in ppe

            text = yaml.safe_dump([dict(entry) for entry in target])
        file_o.write(text.encode("ascii"))


def _check_format(format: str, append: bool) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} (or None), got {format!r}")
    if format == "json" and append:
        raise ValueError(
            "LogReport cannot append to a 'json' log (a file holds one list); use "
            "format='json-lines' or 'yaml' with append=True, or append=False"
        )


class _LogBuffer:
    """Log entries shared by readers (``LogReport`` itself, ``PrintReport``) that each consume
    them at their own pace: every reader (a *looker*) sees the entries appended since it last
    cleared; entries every reader has cleared are dropped."""

    def __init__(self) -> None:
        self.lookers: dict[int, int] = {}  # looker id -> absolute index of its first entry
        self._log: list[dict[str, Any]] = []
        self._offset = 0  # absolute index of self._log[0]

    def append(self, entry: dict[str, Any]) -> None:
        self._log.append(entry)

    def size(self) -> int:
        """Entries held (not yet cleared by every looker)."""
        return len(self._log)

    def emit_new_looker(self) -> LogLooker:
        """A new reader that starts after the entries held now."""
        looker_id = len(self.lookers)
        self.lookers[looker_id] = self._offset + len(self._log)
        return LogLooker(self, looker_id)

    def replace(self, entries: list[dict[str, Any]]) -> None:
        """Holds ``entries`` instead, unread by every looker (used when a snapshot is loaded)."""
        self._log = list(entries)
        self._offset = 0
        for looker_id in self.lookers:
            self.lookers[looker_id] = 0

    def _get(self, looker_id: int) -> list[dict[str, Any]]:
        return self._log[self.lookers[looker_id] - self._offset:]

    def _clear(self, looker_id: int) -> None:
        self.lookers[looker_id] = self._offset + len(self._log)
        oldest = min(self.lookers.values())
        if oldest > self._offset:
            del self._log[: oldest - self._offset]
            self._offset = oldest


class LogLooker:
    """One reader's view of a :class:`_LogBuffer`."""

    def __init__(self, buffer: _LogBuffer, looker_id: int) -> None:
        self._buffer = buffer
        self._looker_id = looker_id

    def get(self) -> list[dict[str, Any]]:
        """Entries appended since this reader last cleared."""
        return self._buffer._get(self._looker_id)

    def clear(self) -> None:
        """Marks every entry held now as read by this reader."""
        self._buffer._clear(self._looker_id)


class LogReport(extension.Extension):
    """Accumulates the observation every iteration and logs the means per period (as ppe's).

    Called every iteration (its own trigger, ``(1, 'iteration')``), it adds the scalar values of
    ``manager.observation`` to a :class:`~snapkeep.reporting.DictSummary`. When ``trigger``
    fires (and before training, with ``call_before_training``), it appends the means as Python
    floats plus ``'epoch'``, ``'iteration'`` and ``'elapsed_time'`` (seconds, from
    ``manager.elapsed_time``) to the log, writes the log through the writer, and starts a new
    summary.

    The file is written by ``writer`` (default: the manager's writer) as
    ``writer(filename, manager.out, log, savefun=LogWriterSaveFunc(...), append=append)``, so a
    snapkeep writer commits it atomically (temp file, fsync, rename) with a checksum manifest.

    Args:
        keys: Observation keys to accumulate; ``None`` accumulates every scalar.
        trigger: When to emit an entry: a trigger or ``(period, 'iteration' | 'epoch')``;
            default once per epoch.
        postprocess: ``fn(entry)`` called on each entry (a dict it may edit) before it is logged.
        filename: File name under ``manager.out``; a format string filled with the entry
            (``'log_{iteration}'``). Default ``'log'``.
        append: Append each new entry to the file instead of rewriting it (``'json-lines'`` and
            ``'yaml'`` only). A resumed run then keeps lines the killed run wrote after its last
            snapshot (as ppe); the default rewrite keeps each period exactly once.
        format: ``'json'``, ``'json-lines'`` or ``'yaml'``; ``None`` picks ``'json-lines'`` for
            a ``.jsonl`` filename, ``'yaml'`` for ``.yaml`` and ``'json'`` otherwise.
        writer: Writer to use instead of the manager's (``ppe``/snapkeep writer interface); it
            is finalized by this extension's ``finalize``.

    Raises:
        ValueError: ``format`` is unknown, or ``'json'`` with ``append=True`` (ppe raised this
            at the first write; snapkeep at construction).
    """

    def __init__(
        self,
        keys: Iterable[str] | None = None,
        trigger: TriggerLike = (1, "epoch"),
        postprocess: Callable[[dict[str, Any]], None] | None = None,
        filename: str | None = None,
        append: bool = False,
        format: str | None = None,
        *,
        writer: Any = None,
    ) -> None:
        self._keys = None if keys is None else list(keys)
        self._trigger = get_trigger(trigger)
        self._postprocess = postprocess
        self._writer = writer
        filename = "log" if filename is None else filename
        if format is None:
            if filename.endswith(".jsonl"):
                format = "json-lines"
            elif filename.endswith(".yaml"):
                format = "yaml"
            else:
                format = "json"
        _check_format(format, append)
        self._filename = filename
        self._append = append
        self._format = format
        self._log_buffer = _LogBuffer()
        self._log_looker = self._log_buffer.emit_new_looker()
        self._init_summary()

    def _init_summary(self) -> None:
        self._summary = reporting.DictSummary()

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        """Accumulates ``manager.observation``; at the end of a period logs and writes."""
        observation = manager.observation
        if self._keys is None:
            self._summary.add(observation)
        else:
            self._summary.add({k: observation[k] for k in self._keys if k in observation})
        if not (manager.is_before_training or self._trigger(manager)):
            return
        entry: dict[str, Any] = {
            name: float(value) for name, value in self._summary.compute_mean().items()
        }
        entry["epoch"] = manager.epoch
        entry["iteration"] = manager.iteration
        entry["elapsed_time"] = manager.elapsed_time
        if self._postprocess is not None:
            self._postprocess(entry)
        self._log_buffer.append(entry)
        writer: Any = manager.writer if self._writer is None else self._writer
        writer(
            self._filename.format(**entry), manager.out, self._log_looker.get(),
            savefun=LogWriterSaveFunc(self._format, self._append), append=self._append,
        )
        if self._append:
            self._log_looker.clear()
        self._init_summary()

    @property
    def log(self) -> list[dict[str, Any]]:
        """Entries logged so far (with ``append=True``: those not written yet)."""
        return self._log_looker.get()

    def state_dict(self) -> dict[str, Any]:
        """Returns ppe's layout: ``{'_trigger': ..., '_summary': ..., '_log': str}``.

        ``_log`` is the JSON text of the log entries held (ppe's encoding); everything loads with
        ``torch.load(weights_only=True)``.
        """
        return {
            "_trigger": self._trigger.state_dict(),
            "_summary": self._summary.state_dict(),
            "_log": json.dumps(self._log_buffer._log),
        }

    def load_state_dict(self, to_load: Mapping[str, Any]) -> None:
        """Restores the trigger, the partial summary and the log (a state of ppe's too).

        Raises:
            KeyError: ``to_load`` lacks ``'_summary'`` or ``'_log'``.
            ValueError: ``'_log'`` is not a JSON list of objects (bounded: see
                :mod:`snapkeep._core.format.json_records`; NaN values, which ppe writes, are kept).
        """
        if "_trigger" in to_load:
            self._trigger.load_state_dict(to_load["_trigger"])
        self._summary.load_state_dict(to_load["_summary"])
        try:
            entries = parse_json(to_load["_log"], max_bytes=MAX_LOG_BYTES, allow_nan=True)
        except RecordError as e:
            raise ValueError(f"LogReport {self.name!r}: the saved log is not valid: {e}") from None
        if not isinstance(entries, list) or not all(isinstance(x, dict) for x in entries):
            raise ValueError(f"LogReport {self.name!r}: the saved log is not a list of entries")
        self._log_buffer.replace(entries)
        logger.debug("LogReport %r restored %d log entries", self.name, len(entries))

    def to_dataframe(self) -> Any:
        """The log as a ``pandas.DataFrame`` (as ppe's).

        Raises:
            ImportError: pandas is not installed.
        """
        try:
            import pandas
        except ImportError as e:
            raise ImportError("LogReport.to_dataframe needs pandas; pip install pandas") from e
        return pandas.DataFrame(self._log_looker.get())

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        """Finalizes ``writer`` when one was given (the manager finalizes its own)."""
        if self._writer is not None:
            self._writer.finalize()
