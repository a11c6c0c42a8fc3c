"""The simulate scenario's table (Markdown) and picture: growth with the world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .common import Recorder  # noqa: E402

SCENARIO = "simulate"


def _pairs(rec: Recorder) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    stock = {(r["model"], r["world"]): r for r in rec.select(SCENARIO, system="stock")}
    ours = {(r["model"], r["world"]): r for r in rec.select(SCENARIO, system="ours")}
    return [(stock[k], ours[k]) for k in stock if k in ours]


def table(rec: Recorder) -> str:
    """One row per (state, world size): stock | ours for each figure."""
    pairs = _pairs(rec)
    if not pairs:
        return ""
    lines = [
        "### Simulated scale (coordinator and per-rank planning; stock | ours)",
        "",
        "| state | ranks | local items | plan s (1st) | commit s | extra over stock "
        "| repeat plan s | peak MB | .metadata MB | manifest MB | objects "
        "| PUT/s one prefix | load plan s/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, o in pairs:
        fs, fo = s["figures"], o["figures"]
        base = fs["plan_s"] + fs["commit_s"]
        extra = (fo["plan_s"] + fo["commit_s"] - base) / base if base else 0.0
        peak = f"{fs['peak_mb']:.0f} \\| {fo['peak_mb']:.0f}" if fs.get("peak_mb") else "-"
        lines.append(
            f"| {s['model']} | {s['world']} | {s['local_items']} "
            f"| {fs['plan_s']:.3g} \\| {fo['plan_s']:.3g} "
            f"| {fs['commit_s']:.3g} \\| {fo['commit_s']:.3g} | {extra:+.0%} "
            f"| {fs['repeat_plan_s']:.3g} \\| {fo['repeat_plan_s']:.3g} | {peak} "
            f"| {fs['metadata_mb']:.3g} \\| {fo['metadata_mb']:.3g} "
            f"| - \\| {fo['manifest_mb']:.3g} "
            f"| {fs['objects']:.0f} \\| {fo['objects']:.0f} "
            f"| {fs['put_per_s']:.0f} \\| {fo['put_per_s']:.0f} "
            f"| {fs['load_plan_s']:.3g} \\| {fo['load_plan_s']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def plot(rec: Recorder, png: Path) -> Path:
    """Coordinator time (first save, repeat) and ``.metadata`` + manifest size against ranks,
    one line per state and system, log-log."""
    pairs = _pairs(rec)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    models = sorted({s["model"] for s, _ in pairs})
    colors = dict(zip(models, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    panels = [
        ("first save: plan + commit (s)", lambda f: f["plan_s"] + f["commit_s"]),
        ("repeat save: plan (s)", lambda f: f["repeat_plan_s"]),
        ("commit record size (MB)", lambda f: f["metadata_mb"] + f["manifest_mb"]),
    ]
    for ax, (title, value) in zip(axes, panels, strict=True):
        for model in models:
            rows = sorted((p for p in pairs if p[0]["model"] == model), key=lambda p: p[0]["world"])
            worlds = [s["world"] for s, _ in rows]
            for i, style in ((0, "--"), (1, "-")):
                ys = [max(value(p[i]["figures"]), 1e-5) for p in rows]
                ax.plot(
                    worlds,
                    ys,
                    style,
                    marker="o",
                    color=colors[model],
                    label=f"{model} {'stock' if i == 0 else 'ours'}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (simulated)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Coordinator cost as the job grows (dashed: stock DCP, solid: ours)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
