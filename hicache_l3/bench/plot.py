"""PNG of bench results: throughput vs page size and vs batch, one line per backend,
raw engine baselines dashed. Needs matplotlib (``pip install 'hicache-l3[plot]'``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from hicache_l3.common.errors import EngineUnavailableError


def row_label(row: dict[str, Any]) -> str:
    """A result row's backend, with its placement when it has one: ``mooncake(local)``."""
    return f"{row['backend']}({row['placement']})" if row.get("placement") else str(row["backend"])


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; EngineUnavailableError without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise EngineUnavailableError("--plot needs matplotlib: pip install 'hicache-l3[plot]'") from exc
    return plt


def plot_results(rows: list[dict[str, Any]], path: Path) -> None:
    """Write a 2x2 figure: GiB/s vs page size (at the largest batch) and vs batch (at the
    largest page size), for set and get; medians with min-max error bars."""
    plt = pyplot()
    data = [r for r in rows if r["op"] in ("set", "get")]
    if not data:
        raise ValueError("no set/get rows to plot")
    if len({r["page_size"] for r in data}) == 1 and len({r["batch"] for r in data}) == 1:
        _bars(plt, data, path)  # one configuration: no curve to draw, compare side by side
        return
    max_batch = max(r["batch"] for r in data)
    max_page = max(r["page_size"] for r in data)
    min_threads = min(r.get("threads", 1) for r in data if not str(r["backend"]).startswith("raw-"))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for col, op in enumerate(("set", "get")):
        for row_i, (xkey, fixed_key, fixed) in enumerate(
            (("page_size", "batch", max_batch), ("batch", "page_size", max_page))
        ):
            ax = axes[row_i][col]
            lines: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in data:
                raw = str(r["backend"]).startswith("raw-")
                if r["op"] == op and r[fixed_key] == fixed and (raw or r.get("threads") == min_threads):
                    lines[row_label(r)].append(r)
            for label, pts in sorted(lines.items()):
                pts.sort(key=lambda r: r[xkey])
                xs = [p[xkey] for p in pts]
                ys = [p["gib_per_s"] for p in pts]
                err = [[y - p["gib_per_s_min"] for y, p in zip(ys, pts)],
                       [p["gib_per_s_max"] - y for y, p in zip(ys, pts)]]
                style = "--" if label.startswith("raw-") else "-"
                ax.errorbar(xs, ys, yerr=err, linestyle=style, marker="o", capsize=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("page size (bytes)" if xkey == "page_size" else "batch (pages)")
            ax.set_ylabel("GiB/s (median, min-max)")
            fixed_text = f"batch {fixed}" if fixed_key == "batch" else f"page {fixed} B"
            ax.set_title(f"{op}: GiB/s vs {xkey.replace('_', ' ')} ({fixed_text})")
            ax.grid(True, alpha=0.3)
            if lines:
                ax.legend(fontsize=8)
    fig.suptitle("hicache-l3 bench: connectors (solid) vs raw engines (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(plt: Any, data: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars per backend: each connector next to its raw engine (hatched)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), squeeze=False)
    for col, op in enumerate(("set", "get")):
        ax = axes[0][col]
        rows = [r for r in data if r["op"] == op]
        if not rows:
            ax.set_axis_off()
            continue
        labels = [row_label(r) for r in rows]
        ys = [r["gib_per_s"] for r in rows]
        err = [[y - r["gib_per_s_min"] for y, r in zip(ys, rows)],
               [r["gib_per_s_max"] - y for y, r in zip(ys, rows)]]
        raw = [lab.startswith("raw-") for lab in labels]
        ax.bar(range(len(rows)), ys, yerr=err, capsize=3,
               color=["#bbbbbb" if r else "#3b75af" for r in raw], edgecolor="black")
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("GiB/s (median, min-max)")
        ax.set_title(f"{op}: page {rows[0]['page_size']} B, batch {rows[0]['batch']}")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("hicache-l3 bench: connectors (blue) next to their raw engines (grey)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
