"""PNG charts for the planner (matplotlib, Agg backend, so no display is needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from pagedserve.planner import queueing, sizing


def _pyplot():  # noqa: ANN202 - matplotlib's module type
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def seats_vs_context(path: Path, free_bytes: float, kv_bytes_by_precision: dict[str, float],
                     contexts: Sequence[int], title: str) -> Path:
    """Worst-case seats a KV budget holds against context length, one line per KV precision."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, bpt in _merge_equal(kv_bytes_by_precision).items():
        seats = [sizing.worst_case_seats(free_bytes, bpt, c) for c in contexts]
        ax.plot(contexts, seats, marker="o", label=f"{label} KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context length reserved per request (tokens)")
    ax.set_ylabel("seats (requests held at once)")
    return _save(plt, fig, ax, path, title)


def _save(plt, fig, ax, path: Path, title: str) -> Path:
    """Title, grid and legend every chart shares; write the PNG and free the figure."""
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kv_vs_context(path: Path, kv_bytes_by_precision: dict[str, float], contexts: Sequence[int], title: str) -> Path:
    """KV bytes one request holds against its context length, one line per KV precision (MiB)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, bpt in _merge_equal(kv_bytes_by_precision).items():
        ax.plot(contexts, [bpt * c / 2**20 for c in contexts], marker="o", label=f"{label} KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV per request (MiB)")
    return _save(plt, fig, ax, path, title)


def wait_vs_utilization(path: Path, service_time: float, servers: int, current_utilization: float | None,
                        percentile: float, title: str) -> Path:
    """Mean and percentile queue wait against utilization for an M/M/c pool, the current point marked."""
    plt = _pyplot()
    utils = np.linspace(0.01, 0.98, 200)
    means, tails = [], []
    for u in utils:
        result = queueing.mmc(u * servers / service_time, service_time, servers, percentile)
        means.append(result.mean_wait * 1e3)
        tails.append(result.percentile_wait * 1e3)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(utils, means, label="mean wait")
    ax.plot(utils, tails, label=f"p{percentile * 100:g} wait")
    if current_utilization is not None and current_utilization < 1:
        now = queueing.mmc(current_utilization * servers / service_time, service_time, servers, percentile)
        ax.plot([current_utilization], [now.mean_wait * 1e3], "o", color="black", label="current (mean)")
        ax.plot([current_utilization], [now.percentile_wait * 1e3], "s", color="black", label="current (tail)")
    elif current_utilization is not None:
        ax.axvline(1.0, color="red", linestyle="--", label=f"current utilization {current_utilization:.2f}: unbounded")
    ax.set_yscale("log")
    ax.set_ylim(bottom=max(1e-3, min(m for m in means if m > 0)))
    ax.set_xlabel("utilization")
    ax.set_ylabel("queue wait (ms)")
    return _save(plt, fig, ax, path, title)


def _merge_equal(kv_bytes_by_precision: dict[str, float]) -> dict[str, float]:
    """One line per distinct size: fp8 and int8 take the same bytes, so they share a label."""
    merged: dict[float, list[str]] = {}
    for precision, bpt in kv_bytes_by_precision.items():
        merged.setdefault(bpt, []).append(precision)
    return {"/".join(names): bpt for bpt, names in merged.items()}
