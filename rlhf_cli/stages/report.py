"""`rlhf report`: a run's metrics.jsonl as pictures (PNG + an HTML page with the summaries), and
the last `rlhf eval` results as bars.

The guide's healthy ranges (Part 9, `ppo/health.py`) are shaded; in-training audits are marked;
with a judge (`audit.judge`), its held-out curves sit beside the proxy's, overoptimization flags
marked.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from rlhf_cli.errors import StageError
from rlhf_cli.ppo.health import RANGES
from rlhf_cli.rundir import RunDir, atomic_write_bytes
from rlhf_cli.tracking import read_metrics

# (title, metric keys); a panel whose first key has a healthy band in `health.RANGES` shades it
PANELS = [
    (
        "Reward: training, and held-out (points)",
        ["env/reward_mean", "eval/reward_mean", "eval/reward_reference_mean"],
    ),
    ("KL to reference (nats)", ["objective/kl"]),
    ("KL coefficient β", ["objective/kl_coef"]),
    ("Policy and value loss", ["ppo/loss/policy", "ppo/loss/value"]),
    ("Entropy (per token)", ["objective/entropy"]),
    ("Clip fraction", ["objective/clipfrac"]),
    ("Response length (tokens)", ["response/length_mean"]),
    (
        "Held-out win rate against the SFT policy: proxy, judge",
        ["eval/win_rate", "eval/judge_win_rate"],
    ),
]
# with a judge: its rewards, and both gains over the SFT policy in one unit (docs/metrics.md)
JUDGE_PANELS = [
    ("Judge reward, held-out", ["eval/judge_reward_mean", "eval/judge_reward_reference_mean"]),
    (
        "Held-out gain over the SFT policy (its scores' std): proxy, judge",
        ["eval/reward_gain", "eval/judge_reward_gain"],
    ),
]


def band_limits(
    values: list[float | None], band: tuple[float | None, float | None]
) -> tuple[float, float]:
    """Y-axis limits that show the data and the healthy band's edges: a closed edge just inside
    the view, an open edge (no bound) a quarter of the span beyond the data, so the band is
    drawn at its true place and size whatever the data do."""
    low, high = band
    points = [v for v in values if v is not None] + [x for x in band if x is not None]
    top, bottom = max(points), min(points)
    span = max(top - bottom, 0.05 * max(abs(top), abs(bottom), 1.0))
    return (
        bottom - 0.25 * span if low is None else bottom - 0.05 * span,
        top + 0.25 * span if high is None else top + 0.05 * span,
    )


def plot_metrics(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """The PPO curves, 2 panels a row, healthy bands shaded and in-training audits marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["iteration"] for r in rows]
    audits = [r["iteration"] for r in rows if "audit/verbosity_score" in r]
    flagged = [r["iteration"] for r in rows if r.get("audit/overoptimization")]
    judged = any("eval/judge_reward_mean" in r for r in rows)
    panels = PANELS + (JUDGE_PANELS if judged else [])
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(12, 13 * len(panels) / 8))
    for ax, (name, keys) in zip(axes.flat, panels, strict=True):
        for key in keys:
            points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
            if not points:
                continue
            x, y = zip(*points, strict=True)
            style = {"marker": "o", "markersize": 3} if len(x) < len(steps) else {}
            ax.plot(x, y, label=key, linewidth=1.4, **style)
        health = RANGES.get(keys[0])
        first = rows[0].get(keys[0]) if rows else None
        band = health.limits(first) if health is not None else None
        if band is not None:
            bottom, top = band_limits([r.get(keys[0]) for r in rows], band)
            ax.set_ylim(bottom, top)
            low, high = band
            ax.axhspan(
                bottom if low is None else low,
                top if high is None else high,
                color="tab:green",
                alpha=0.12,
                label=f"healthy (guide: {health.healthy})",
            )
        for step in audits:
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1)
        for step in flagged if (name, keys) in JUDGE_PANELS else ():
            ax.axvline(step, color="tab:purple", linestyle="--", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("iteration")
        if ax.get_legend_handles_labels()[0]:  # an empty panel gets no legend (nor a warning)
            ax.legend(fontsize=7)
    notes = ["red dotted lines: in-training audits"] if audits else []
    notes += ["purple dashed: overoptimization flagged"] if flagged else []
    fig.suptitle(title + "".join(f"  ({note})" for note in notes))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


EVAL_PANELS = {  # suite -> (title, the measure drawn, its standard error, the y-axis label)
    "judge": ("Judge win rate against the baseline (95% CI)", "win_rate", None, "win rate"),
    "checks": ("Checks accuracy (± se)", "accuracy", "se", "accuracy"),
    "benchmarks": ("Alignment tax: gain on the baseline's score (± se)", "tax", "tax_stderr", "Δ"),
}


def plot_eval(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """The last `rlhf eval` results, a panel per suite, a bar per policy (and per task for the
    benchmarks); the judge's bars carry their bootstrap interval, the others their se."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = [name for name in EVAL_PANELS if any(name in r for r in results.values())]
    fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites, strict=True):
        name, key, se, unit = EVAL_PANELS[suite]
        bars = []  # (label, value, error below, error above)
        for label, summary in ((k, r[suite]) for k, r in results.items() if suite in r):
            if suite == "judge":
                value = summary[key]
                bars.append((label, value, value - summary["ci_low"], summary["ci_high"] - value))
            elif suite == "checks":
                bars.append((label, summary[key], summary[se], summary[se]))
            else:
                bars += [(f"{label}\n{task}", t[key], t[se] or 0.0, t[se] or 0.0)
                         for task, t in summary.items() if key in t]  # fmt: skip
        labels, values, low, high = zip(*bars, strict=True) if bars else ((), (), (), ())
        ax.bar(labels, values, yerr=[low, high], capsize=4, color="tab:blue", alpha=0.8)
        ax.axhline(0.5 if suite == "judge" else 0.0, color="grey", linewidth=1, linestyle=":")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel(unit)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_report(run: RunDir) -> dict[str, str]:
    """Write `ppo/report.png` and `ppo/report.html` (and `eval/report.png`, drawn into the page,
    after `rlhf eval`); return their paths."""
    stage_dir = run.stage_dir("ppo")
    rows = read_metrics(stage_dir / "metrics.jsonl")
    if not rows:
        raise StageError(
            f"run '{run.name}' has no PPO metrics ({stage_dir / 'metrics.jsonl'}): "
            "run `rlhf ppo` first"
        )
    png = stage_dir / "report.png"
    plot_metrics(rows, png, f"rlhf-cli · run {run.name} · {len(rows)} iterations")
    sections = []
    for stage in ("sft", "rm", "ppo", "audit", "merged", "eval"):
        manifest = run.owner(stage).read_manifest(stage)  # sft and rm may be `run.base`'s
        if manifest:
            summary = {"status": manifest["status"], **manifest.get("metrics", {})}
            sections.append(
                f"<h2>{stage}</h2><pre>{html.escape(json.dumps(summary, indent=2))}</pre>"
            )
    images = [("PPO curves", png)]
    paths = {"png": str(png)}
    evaluated = run.read_manifest("eval") or {}
    if evaluated.get("results"):
        paths["eval_png"] = str(run.stage_dir("eval") / "report.png")
        title = f"rlhf eval · run {run.name} · baseline {evaluated.get('baseline')}"
        plot_eval(evaluated["results"], Path(paths["eval_png"]), title)
        images.append(("rlhf eval", Path(paths["eval_png"])))
    pictures = "".join(
        f"<img alt='{alt}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'>"
        for alt, p in images
    )
    page = (
        f"<!doctype html><meta charset='utf-8'><title>rlhf report: {html.escape(run.name)}"
        f"</title><h1>Run {html.escape(run.name)}</h1>" + pictures + "".join(sections)
    )
    out = stage_dir / "report.html"
    atomic_write_bytes(out, page.encode())
    return {**paths, "html": str(out)}
