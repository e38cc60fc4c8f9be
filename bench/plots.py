"""PNG plots for the routing reports (matplotlib, Agg backend). Optional: without matplotlib the
reports are written without pictures and say so."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from bench.stats import Point


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_arm(points: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = defaultdict(list)
    for p in points:
        out[p.arm].append(p)
    for series in out.values():
        series.sort(key=lambda p: p.rate)
    return out


def latency_vs_load(points: list[Point], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    arms = _by_arm(points)
    for i, label in enumerate(("TTFT p50", "TTFT p90", "TTFT p99")):
        ax = axes[i]
        for arm, series in arms.items():
            ax.plot([p.rate for p in series], [p.ttft[i] * 1000 for p in series], marker="o", label=arm)
        ax.set_title(label)
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[3]
    for arm, series in arms.items():
        ax.plot([p.rate for p in series], [p.itl[1] * 1000 for p in series], marker="o", label=arm)
    ax.set_title("inter-token latency p99")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def hits_and_throughput(points: list[Point], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, series in _by_arm(points).items():
        rates = [p.rate for p in series]
        axes[0].plot(rates, [p.hit_rate * 100 if not math.isnan(p.hit_rate) else math.nan for p in series],
                     marker="o", label=arm)
        axes[1].plot(rates, [p.out_tps for p in series], marker="o", label=arm)
    axes[0].set_title("prefix-cache hit rate (pods' own counters)")
    axes[0].set_ylim(0, 100)
    axes[0].set_ylabel("% of prompt tokens")
    axes[1].set_title("output tokens/s")
    for ax in axes:
        ax.set_xlabel("offered load (req/s)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def pod_load(points: list[Point], path: Path, title: str) -> Path:
    """Running + waiting requests per pod over time, one panel per arm (the points given)."""
    plt = _pyplot()
    n = len(points)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharey=True)
    for ax, p in zip(axes.flat, points):
        for i, series in enumerate(p.load_series):
            if series:
                ax.plot([t for t, _ in series], [v for _, v in series], label=f"pod {i}", linewidth=1)
        ax.set_title(f"{p.arm} @ {p.rate:g}/s", fontsize=9)
        ax.set_xlabel("s")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel("running + waiting")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
