"""`rlhf status`: where a run stands, stage by stage, the last `rlhf eval` results, and what to
run next; `--all` lists the runs. It only reads manifests (a damaged one shows as such) and never
takes the run's lock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_cli.errors import StageError
from rlhf_cli.record import policy_stage, stage_state
from rlhf_cli.rundir import OFFLINE_STAGES, STAGE_COMMANDS, RunDir

# the few numbers that say how each stage went (manifest `metrics` keys)
KEY_METRICS = {
    "sft": ("eval_loss",),
    "rm": ("eval_accuracy", "eval_margin"),
    "ppo": ("iterations", "reward_last_fifth", "kl_final", "eval/win_rate"),
    "audit": ("hacking_detected",),
    "merged": ("max_abs_logit_diff",),
    "push": ("files",),
}
# an offline method's (`OFFLINE_STAGES`): its held-out pairs after training, as TRL logs them
OFFLINE_METRICS = ("eval_loss", "eval_rewards/margins", "eval_rewards/accuracies")
# every stage's measured peak beside the plan's estimate (record.StageRecord writes them)
MEMORY_METRICS = (
    "peak_memory_bytes",
    "peak_memory_kind",
    "peak_memory_rss_bytes",
    "planned_peak_bytes",
)
# the stages in pipeline order; `rlhf eval` is a yardstick the recipe may not ask for, shown
# apart (`eval_results`), never the command to type next; an offline method is another path
# than train-rm and ppo, shown after ppo when the run has it (`offline_rows`)
PIPELINE = tuple(s for s in STAGE_COMMANDS if s != "eval" and s not in OFFLINE_STAGES)
# what an offline run (`policy_stage` is an offline one) does not need or advise: the reward
# model, PPO, and the default audit (of PPO's policy)
PPO_ONLY = ("rm", "ppo", "audit")


def stage_row(run: RunDir, stage: str) -> dict[str, Any]:
    """One stage's status, when it finished, its key numbers and the advice for it."""
    try:
        manifest = run.read_manifest(stage)
    except StageError:
        return {"stage": stage, "status": "damaged", "next": STAGE_COMMANDS[stage]}
    if manifest is None:
        return {"stage": stage, "status": "missing"}
    state = stage_state(run, stage, manifest)
    row = {
        "stage": stage,
        "status": state.status,
        "finished_at": manifest.get("finished_at"),
        "metrics": {
            k: manifest.get("metrics", {})[k]
            for k in KEY_METRICS.get(stage, OFFLINE_METRICS) + MEMORY_METRICS
            if k in manifest.get("metrics", {})
        },
    }
    if manifest.get("data"):
        row["data"] = data_line(manifest["data"])
    if "last_attempt" in manifest:
        row["last_attempt"] = manifest["last_attempt"].get("status")
    if state.holder is not None:
        row["pid"] = state.holder["pid"]
    if state.next is not None:
        row["next"] = state.next
    return row


def data_line(data: dict[str, Any]) -> str:
    """What data a stage saw, in one line: rows kept of read, layouts, rows dropped or cut."""
    parts = []
    for figures in data.values():
        layouts = ", ".join(figures["layouts"].values())
        line = f"{figures['kept']}/{figures['rows_read']} rows, {layouts}"
        changed = {
            **figures.get("dropped", {}),
            **figures.get("cut", {}),
            **figures.get("over_limit", {}),
        }
        line += "".join(f"; {n} {why}" for why, n in changed.items() if n)
        parts.append(line)
    return " | ".join(parts)


def run_status(run: RunDir) -> dict[str, Any]:
    """Every stage of `run` (an `sft` / `rm` it takes from its `run.base` shown as that run's;
    its offline stages after ppo, those it has), and the one command to type next (None when
    all is done)."""
    run = RunDir(run.output_dir, run.name, run.snapshot_base())
    rows = []
    for stage in PIPELINE:
        owner = run.owner(stage)
        rows.append(stage_row(owner, stage))
        if owner is not run:
            rows[-1]["from_run"] = owner.name
    after_ppo = PIPELINE.index("ppo") + 1
    rows[after_ppo:after_ppo] = [
        stage_row(run, stage) for stage in OFFLINE_STAGES if run.manifest_path(stage).is_file()
    ]
    advice = next_command(run, rows)
    status = {"run": run.name, "path": str(run.path), "stages": rows, "next": advice}
    evaluated = eval_results(run)
    if evaluated is not None:
        status["eval"] = evaluated
    return status


def next_command(run: RunDir, rows: list[dict[str, Any]]) -> str | None:
    """The one command to type next: a stage's own advice (resume, run again), else the first
    missing stage's command; none while a stage runs. A run whose policy is an offline
    method's (`policy_stage`) skips train-rm, ppo and their audit, and merges that stage."""
    if any("pid" in r for r in rows):
        return None  # something runs: nothing to start now
    trained = policy_stage(run)
    if trained in OFFLINE_STAGES:
        rows = [r for r in rows if r["stage"] not in PPO_ONLY]
    advice = next((r["next"] for r in rows if "next" in r), None)
    if advice is None and all(r["status"] in ("missing", "completed") for r in rows):
        missing = [r["stage"] for r in rows if r["status"] == "missing"]
        advice = STAGE_COMMANDS[missing[0]] if missing else None
        if advice == STAGE_COMMANDS["merged"] and trained in OFFLINE_STAGES:
            advice += f" --stage {trained}"
    return advice


def eval_results(run: RunDir) -> dict[str, Any] | None:
    """The last `rlhf eval` results of each policy (`eval/manifest.json`) and the baseline of
    the last evaluation; None before any (or when the manifest is unreadable: `rlhf eval`
    writes it again)."""
    try:
        manifest = run.read_manifest("eval")
    except StageError:
        return None
    if not manifest or not manifest.get("results"):
        return None
    return {"baseline": manifest.get("baseline"), "policies": manifest["results"]}


def all_runs(output_dir: Path) -> list[dict[str, Any]]:
    """Every run under `output_dir`: its completed stages, whether LATEST names it, and when
    its newest manifest was written."""
    latest = RunDir.latest(output_dir)
    runs = []
    for recipe in sorted(output_dir.glob("*/recipe.yaml")):
        run = RunDir(output_dir, recipe.parent.name)
        stages = PIPELINE + OFFLINE_STAGES
        manifests = [run.manifest_path(s) for s in stages if run.manifest_path(s).is_file()]
        newest = max((m.stat().st_mtime for m in manifests), default=recipe.stat().st_mtime)
        status = run_status(run)  # each manifest read once
        rows = status["stages"]
        runs.append(
            {
                "run": run.name,
                "latest": latest is not None and latest.name == run.name,
                "completed": [
                    r["stage"] for r in rows if r["status"] == "completed" and "from_run" not in r
                ],
                "next": status["next"],
                "modified": newest,
            }
        )
    return runs
