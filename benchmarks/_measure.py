"""Measurement helpers shared by the benchmark scripts: process-tree memory and CPU accounting,
and table formatting. Linux only (reads ``/proc``)."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil

GIB = 1 << 30


def _status_kib(pid: int) -> dict[str, int]:
    """RssAnon/RssFile/RssShmem of one process, in KiB (0 when it is gone)."""
    out = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class TreeMemory:
    """Samples the resident memory of this process and its descendants in a thread.

    Resident bytes = sum over the tree of anonymous RSS, plus the largest file-backed RSS and
    the largest shared-memory RSS of any one process: a worker maps the same torch libraries
    from the page cache as the trainer (about 0.2 GiB of file-backed pages each), and staging
    arenas are mapped by the trainer and its worker; both exist once in physical memory. Each
    sample reads ``/proc/PID/status`` (microseconds); the list of descendants (a scan of
    ``/proc``, milliseconds) is refreshed when a window starts and every ``refresh_s`` within
    it, so sampling disturbs the measured copy as little as possible. A forked child's copy-on-
    write pages are counted in the child too, which overstates fork-based writers (ppe's
    ``ProcessWriter``) while they run.

    Call :meth:`start_window` / :meth:`end_window` around the part to measure;
    :attr:`peak_bytes` is the peak inside windows since the last :meth:`reset`.
    """

    def __init__(self, interval_s: float = 0.02, refresh_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.refresh_s = refresh_s
        self.peak_bytes = 0
        self._active = threading.Event()
        self._stop = threading.Event()
        self._pids: list[int] = []
        self._pids_at = 0.0
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def current_bytes(self, refresh: bool = False) -> int:
        now = time.monotonic()
        if refresh or now - self._pids_at > self.refresh_s:
            try:
                self._pids = [c.pid for c in psutil.Process().children(recursive=True)]
            except psutil.Error:
                self._pids = []
            self._pids_at = now
        anon_kib = file_kib = shmem_kib = 0
        for pid in [os.getpid(), *self._pids]:
            s = _status_kib(pid)
            anon_kib += s["RssAnon"]
            file_kib = max(file_kib, s["RssFile"])
            shmem_kib = max(shmem_kib, s["RssShmem"])
        return (anon_kib + file_kib + shmem_kib) * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._active.wait(0.2):
                self.peak_bytes = max(self.peak_bytes, self.current_bytes())
                self._stop.wait(self.interval_s)

    def reset(self) -> None:
        self.peak_bytes = 0

    def start_window(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes(refresh=True))
        self._active.set()

    def end_window(self) -> None:
        self._active.clear()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes())

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        self._thread.join(2)


class TreeCpu:
    """CPU seconds (user + system) of this process and its children, live or reaped."""

    def __init__(self) -> None:
        self._start_self = 0.0
        self._start_children: dict[int, float] = {}

    @staticmethod
    def _self_s() -> float:
        t = os.times()  # includes children that were waited for (fork-per-save writers)
        return t.user + t.system + t.children_user + t.children_system

    @staticmethod
    def _live() -> dict[int, float]:
        out = {}
        for child in psutil.Process().children(recursive=True):
            try:
                c = child.cpu_times()
                out[child.pid] = c.user + c.system
            except psutil.Error:
                pass
        return out

    def start(self) -> None:
        self._start_self = self._self_s()
        self._start_children = self._live()

    def elapsed_s(self) -> float:
        total = self._self_s() - self._start_self
        for pid, cpu in self._live().items():
            total += cpu - self._start_children.get(pid, 0.0)
        return total


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median (order statistics, binomial):
    ``(lo, hi)`` with at least ``level`` coverage; ``(nan, nan)`` for fewer than 6 values."""
    s = sorted(values)
    n = len(s)
    if n < 6:
        return float("nan"), float("nan")
    alpha = (1 - level) / 2
    # largest k with P(Binomial(n, 1/2) <= k - 1) <= alpha: the interval is s[k-1] .. s[n-k]
    k, tail = 0, 0.0
    while True:
        nxt = tail + math.comb(n, k) / 2**n
        if nxt > alpha:
            break
        tail, k = nxt, k + 1
    k = max(k, 1)
    return s[k - 1], s[n - k]


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Format ``rows`` as a Markdown table; ``columns`` = (key, header, format spec)."""

    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and value != value):
            return "-"
        return format(value, spec) if spec else str(value)

    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [header, rule]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, k, s) for k, _, s in columns) + " |")
    return "\n".join(lines)
