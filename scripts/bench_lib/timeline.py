"""The timeline picture: training steps and each save's phases on one time axis, per system."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .train import NONE, OURS, STOCK_ASYNC, Run  # noqa: E402

ROWS = ["training", "snapshot", "flush", "commit"]
COLORS = {
    "fwd+bwd": "#9ecae1",
    "optimizer step": "#3182bd",
    "blocked": "#de2d26",
    "wait previous": "#fd8d3c",
    "snapshot": "#31a354",
    "flush": "#756bb1",
    "commit": "#252525",
}


def _panel(ax: plt.Axes, run: Run, baseline: Run | None) -> None:
    y = {row: len(ROWS) - 1 - i for i, row in enumerate(ROWS)}
    h = 0.6
    ax.broken_barh(
        [(s, m - s) for s, m, _ in run.steps],
        (y["training"] - h / 2, h),
        facecolors=COLORS["fwd+bwd"],
        edgecolor="white",
        linewidth=0.3,
    )
    ax.broken_barh(
        [(m, e - m) for _, m, e in run.steps],
        (y["training"] - h / 2, h),
        facecolors=COLORS["optimizer step"],
        edgecolor="white",
        linewidth=0.3,
    )
    for phase, index, start, end in run.phases:
        if phase in ("blocked", "wait previous"):
            ax.broken_barh(
                [(start, end - start)], (y["training"] - h / 2, h), facecolors=COLORS[phase]
            )
            continue
        ax.broken_barh(
            [(start, max(end - start, 1e-3))],
            (y[phase] - h / 2, h),
            facecolors=COLORS[phase],
            edgecolor="white",
            linewidth=0.3,
        )
        if phase == "snapshot":
            ax.annotate(
                f"ckpt {index}",
                (start, y[phase] + h / 2),
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_yticks([y[r] for r in ROWS], ROWS)
    ax.set_ylim(-0.6, len(ROWS) - 0.2)
    title = f"{run.system}: {len(run.steps)} steps in {run.total_s:.2f} s"
    if baseline is not None:  # one run each: the overhead itself is the paired blocks' figure
        title += f" (no checkpoint: {baseline.total_s:.2f} s)"
    title += f", last save durable {run.drain_s:.2f} s after the last step"
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def plot(runs: dict[str, Run], path: Path) -> Path:
    """Draw ours above stock async on a shared time axis; returns ``path``."""
    shown = [runs[s] for s in (OURS, STOCK_ASYNC) if s in runs]
    fig, axes = plt.subplots(
        len(shown), 1, figsize=(12, 2.2 * len(shown) + 0.9), sharex=True, squeeze=False
    )
    for ax, run in zip(axes[:, 0], shown, strict=True):
        _panel(ax, run, runs.get(NONE))
    axes[-1, 0].set_xlabel("seconds since the first timed step")
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
        loc="lower center",
        ncol=len(COLORS),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle("Checkpointing during training: what overlaps what", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
