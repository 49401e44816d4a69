"""PNG of bench results: throughput vs page size and vs batch, one line per backend,
raw engine baselines dashed. Needs matplotlib (``pip install 'hicache-l3[plot]'``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from hicache_l3.common.errors import EngineUnavailableError


def _label(row: dict[str, Any]) -> str:
    return f"{row['backend']}({row['placement']})" if row.get("placement") else str(row["backend"])


def plot_results(rows: list[dict[str, Any]], path: Path) -> None:
    """Write a 2x2 figure: GiB/s vs page size (at the largest batch) and vs batch (at the
    largest page size), for set and get; medians with min-max error bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise EngineUnavailableError("--plot needs matplotlib: pip install 'hicache-l3[plot]'") from exc
    data = [r for r in rows if r["op"] in ("set", "get")]
    if not data:
        raise ValueError("no set/get rows to plot")
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
                    lines[_label(r)].append(r)
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
