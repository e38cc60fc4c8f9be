"""PNG plots of simulation reports (matplotlib, Agg backend — an optional dependency: the `sim`
extra). Each figure compares every policy of one run side by side."""

from __future__ import annotations

import math
from pathlib import Path

from epp.sim.cluster.report import Report


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


def _ms(v: float | None) -> float:
    return math.nan if v is None else v * 1000.0


def latency_bars(reports: list[Report], path: Path, title: str = "") -> Path:
    """TTFT, per-token ITL and end-to-end percentiles per policy."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("TTFT (ms)", lambda r: [_ms(v) for v in r.overall.ttft]),
              ("inter-token latency (ms)", lambda r: [_ms(v) for v in r.token_itl]),
              ("end-to-end (s)", lambda r: list(r.overall.e2e)))
    width = 0.8 / max(1, len(reports))
    for ax, (label, values) in zip(axes, panels):
        for k, r in enumerate(reports):
            xs = [i + k * width for i in range(3)]
            ax.bar(xs, values(r), width=width, label=r.policy)
        ax.set_xticks([i + width * (len(reports) - 1) / 2 for i in range(3)], ["p50", "p90", "p99"])
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title or reports[0].workload)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def ttft_cdf(reports: list[Report], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in reports:
        q = r.ttft_quantiles
        if q:
            ax.plot([v * 1000 for v in q], [i / (len(q) - 1) for i in range(len(q))], label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or f"{reports[0].workload}: TTFT distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def queues(reports: list[Report], path: Path, title: str = "") -> Path:
    """Requests waiting in the engines and in the EPP's flow-control queue, over time."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.2))
    for r in reports:
        s = r.queue_series
        axes[0].plot(s["time"], s["waiting"], label=r.policy)
        if any(s["router_queued"]):
            axes[1].plot(s["time"], s["router_queued"], label=r.policy)
    axes[0].set_title("waiting in the engines (all pods)")
    axes[1].set_title("queued in the EPP (flow control)")
    for ax in axes:
        ax.set_xlabel("virtual time (s)")
        ax.set_ylabel("requests")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title or reports[0].workload)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def pod_load(reports: list[Report], path: Path, title: str = "") -> Path:
    """Per-pod load (waiting + running) over time, one heat map per policy."""
    plt = _pyplot()
    n = len(reports)
    fig, axes = plt.subplots(n, 1, figsize=(12, 1.2 + 1.6 * n), squeeze=False)
    vmax = max((max(row) for r in reports for row in r.pod_load if row), default=1) or 1
    for ax, r in zip(axes[:, 0], reports):
        if not r.pod_load:
            continue
        grid = [list(col) for col in zip(*r.pod_load)]  # pods x samples
        t = r.queue_series["time"]
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=vmax,
                       extent=(t[0], t[-1] if len(t) > 1 else t[0] + 1, -0.5, len(grid) - 0.5),
                       interpolation="nearest")
        ax.set_ylabel(f"{r.policy}\npod")
    axes[-1, 0].set_xlabel("virtual time (s)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="waiting + running")
    fig.suptitle(title or f"{reports[0].workload}: load per pod")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def class_ttft(reports: list[Report], path: Path, title: str = "") -> Path:
    """p99 TTFT per class, per policy."""
    plt = _pyplot()
    names = [g.name for g in reports[0].by_class]
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.5 * len(names)), 4.2))
    width = 0.8 / max(1, len(reports))
    for k, r in enumerate(reports):
        ax.bar([i + k * width for i in range(len(names))], [_ms(g.ttft[2]) for g in r.by_class], width=width,
               label=r.policy)
    ax.set_xticks([i + width * (len(reports) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_yscale("log")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or f"{reports[0].workload}: TTFT p99 per class")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(reports: list[Report], directory: str | Path, prefix: str = "") -> list[Path]:
    """Every figure for one run's reports, as `<prefix><name>.png` in `directory`."""
    if not reports:
        return []
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return [
        latency_bars(reports, out / f"{prefix}latency.png"),
        ttft_cdf(reports, out / f"{prefix}ttft-cdf.png"),
        queues(reports, out / f"{prefix}queues.png"),
        pod_load(reports, out / f"{prefix}pod-load.png"),
        class_ttft(reports, out / f"{prefix}class-ttft.png"),
    ]
