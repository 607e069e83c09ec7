"""Plots of stored benchmark results (no measurement): the figures of the benchmarks page whose
scripts do not draw their own.

Usage::

    python benchmarks/plot_results.py --out benchmarks/results --out docs/results

Writes ``durable-3gib.png`` (time until durable per writer) and ``memory-3gib.png`` (peak
resident memory per writer), both from ``results/stall-3gib-2026-12-01.json`` (section 1's
run), and ``sharded.png`` (stall, durable and load per engine and world size) from
``results/sharded-2026-12-01.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
STALL_JSON = os.path.join(HERE, "results", "stall-3gib-2026-12-01.json")
SHARDED_JSON = os.path.join(HERE, "results", "sharded-2026-12-01.json")
#: Rows of the stall run that the plots show (ppe's writers that copy nothing are left out).
WRITERS = ("snapkeep ProcessQueueWriter", "snapkeep ProcessWriter", "snapkeep SimpleWriter",
           "snapkeep ThreadQueueWriter", "snapkeep ThreadWriter", "DCP async_save",
           "torch.save + fsync")


def _color(name: str) -> str:
    return "#4c72b0" if name.startswith("snapkeep") else (
        "#c44e52" if name.startswith("DCP") else "#8c8c8c")


def _barh(ax: Any, rows: list[tuple[str, float]], xlabel: str, title: str, fmt: str) -> None:
    names = [n for n, _ in rows]
    values = [v for _, v in rows]
    ax.barh(range(len(rows)), values, color=[_color(n) for n in names])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, " " + format(v, fmt), va="center", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)


def plot_stall_run(outs: list[str]) -> None:
    import matplotlib.pyplot as plt

    with open(STALL_JSON) as f:
        data = json.load(f)
    by_name = {r["name"]: r for r in data["rows"]}
    gib = data["state_bytes"] / 2**30
    for name, key, xlabel, fmt in (
            ("durable-3gib.png", "durable_s", "seconds from the call until durable", ".2f"),
            ("memory-3gib.png", "peak_rss_gib", "peak resident GiB of the process tree", ".2f")):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        rows = [(w, float(by_name[w][key])) for w in WRITERS if by_name.get(w, {}).get(key)]
        title = (f"Time until durable, {gib:.0f} GiB state" if key == "durable_s" else
                 f"Peak memory while saving a {gib:.0f} GiB state")
        _barh(ax, rows, xlabel, title, fmt)
        if key == "peak_rss_gib":
            ax.axvline(gib, color="black", linestyle="--", linewidth=0.8)
            ax.text(gib, len(rows) - 0.5, " the state", fontsize=7)
        fig.tight_layout()
        for out in outs:
            fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)


def plot_sharded(outs: list[str]) -> None:
    import matplotlib.pyplot as plt

    with open(SHARDED_JSON) as f:
        data = json.load(f)
    runs = data if isinstance(data, list) else data.get("rows", [])
    measures = (("stall", "snapkeep_stall", "dcp_async_stall"),
                ("durable", "snapkeep_durable", "dcp_async_durable"),
                ("load", "snapkeep_load", "dcp_load"),
                ("load resharded", "snapkeep_load_resharded", "dcp_load_resharded"))
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        labels, mine, theirs = [], [], []
        for label, k_mine, k_dcp in measures:
            if run.get(k_mine) is None or run.get(k_dcp) is None:
                continue
            labels.append(label)
            mine.append(run[k_mine])
            theirs.append(run[k_dcp])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], mine, 0.4, label="snapkeep SHARDED", color="#4c72b0")
        ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="DCP (async_save / load)",
               color="#c44e52")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("seconds (median, slowest rank)")
        ax.set_title(f"{run['world']} gloo ranks, {run['state_mib_total']:.0f} MiB in all",
                     fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    for out in outs:
        fig.savefig(os.path.join(out, "sharded.png"), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", action="append", default=[],
                   help="directory for the PNGs (repeatable; default benchmarks/results)")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    outs = args.out or [os.path.join(HERE, "results")]
    plot_stall_run(outs)
    plot_sharded(outs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
