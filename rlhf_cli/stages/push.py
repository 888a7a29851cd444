"""`rlhf push`: publish the merged model (or the adapter, the guide's Option A) with a model card
that names how the policy was trained: PPO, or an offline method (`OFFLINE_STAGES`) with its
settings and inputs as its manifest records them.

The token comes from `HF_TOKEN` or the user's saved login, never from the recipe or the command
line, and it is never written: not to logs, manifests, the card, or error messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rlhf_cli.errors import PushError, StageError
from rlhf_cli.recipe import Recipe
from rlhf_cli.record import StageRecord, policy_stage, require
from rlhf_cli.resume import check_same_inputs
from rlhf_cli.rundir import OFFLINE_STAGES, STAGE_COMMANDS, Manifest, RunDir, atomic_write_bytes
from rlhf_cli.tracking import metrics_line, read_metrics


def hub_token() -> str | None:
    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()


def redact(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _metrics(manifest: Manifest, keep: Callable[[str], bool] = lambda k: True) -> str:
    return metrics_line(manifest.get("metrics", {}), keep)


def _how_it_was_made(recipe: Recipe, run: RunDir) -> list[str]:
    """The card's table: each stage's settings and results (from its manifest)."""
    sft, rm, ppo, audits = (  # sft and rm may be those of `run.base`
        run.owner(s).read_manifest(s) or {} for s in ("sft", "rm", "ppo", "audit")
    )
    # the audit of the final PPO policy, whatever was audited after it (checkpoints, files)
    audit: Manifest = {"metrics": audits.get("reports", {}).get("ppo", {})}
    if not audit["metrics"] and audits.get("last") == "ppo":  # written before `reports` was
        audit = audits
    p, a = recipe.ppo, recipe.audit
    sft_settings = _sft_settings(recipe)
    kl_mode = f"adaptive, target {p.target_kl}" if p.adaptive_kl else "fixed"
    reward = recipe.reward
    return [
        "## How it was made",
        "",
        "| stage | settings | result |",
        "|---|---|---|",
        f"| SFT | {sft_settings} | {_metrics(sft, lambda k: k.startswith('eval_loss'))} |",
        f"| Reward model | {reward.pretrained or reward.base_model or 'none'}"
        f"{' + ' + ', '.join(f.function for f in reward.functions) if reward.functions else ''}"
        f", input {reward.input}, template "
        f"`{reward.template!r}`, max length {reward.max_length} | "
        f"{_metrics(rm, lambda k: k in ('eval_accuracy', 'eval_margin'))} |",
        f"| PPO | {p.iterations} iterations, batch {p.batch_size}, lr {p.learning_rate}, "
        f"β₀ {p.init_kl_coef} ({kl_mode}), γ {p.gamma}, λ {p.lam}, clip {p.cliprange}, "
        f"vf_coef {p.vf_coef}, LoRA r {recipe.model.lora.r} | {_metrics(ppo)} |",
        f"| Audit | verbosity > {a.verbosity_threshold}, sycophancy > "
        f"{a.sycophancy_threshold}, repetition > {a.repetition_threshold}, length vs reference "
        f"< {a.min_length_ratio} | {_metrics(audit)} |",
        "",
    ]


def _sft_settings(recipe: Recipe) -> str:
    if not recipe.sft.enabled:
        return "skipped (instruction-tuned base)"
    return f"lr {recipe.sft.learning_rate}, {recipe.sft.epochs} epochs"


FINAL_METRICS = (
    "env/reward_mean",
    "objective/kl",
    "objective/kl_coef",
    "objective/entropy",
    "objective/clipfrac",
    "ppo/loss/value",
)


def _final_metrics(run: RunDir) -> list[str]:
    rows = read_metrics(run.stage_dir("ppo") / "metrics.jsonl")
    last = rows[-1] if rows else {}
    return ["## Final PPO metrics", ""] + [
        f"- `{key}`: {last[key]:.4g}" for key in FINAL_METRICS if last.get(key) is not None
    ]


def _offline_made(recipe: Recipe, run: RunDir, stage: str) -> list[str]:
    """The card's table for an offline method: SFT, then the method's settings (its manifest's
    `method`), the inputs it trained on and its results."""
    made = run.read_manifest(stage) or {}
    sft = run.owner("sft").read_manifest("sft") or {}
    method = made.get("method", {})
    settings = ", ".join(f"{k} {v}" for k, v in method.items() if k != "name")
    inputs = "; ".join(
        f"{name} `{record['path']}`"
        + (f" (sha256 {record['sha256'][:12]})" if "sha256" in record else "")
        for name, record in made.get("inputs", {}).items()
    )
    memory = ("peak_memory", "planned_peak")
    return [
        "## How it was made",
        "",
        "| stage | settings | result |",
        "|---|---|---|",
        f"| SFT | {_sft_settings(recipe)} | {_metrics(sft, lambda k: k.startswith('eval_loss'))} |",
        f"| {method.get('name', stage).upper()} | {settings}; inputs: {inputs} | "
        f"{_metrics(made, lambda k: not k.startswith(memory))} |",
        "",
    ]


def _offline_final_metrics(run: RunDir, stage: str) -> list[str]:
    rows = [r for r in read_metrics(run.stage_dir(stage) / "metrics.jsonl") if "loss" in r]
    last = rows[-1] if rows else {}
    keys = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")
    return [f"## Final {stage.upper()} training metrics", ""] + [
        f"- `{key}`: {last[key]:.4g}" for key in keys if last.get(key) is not None
    ]


def _how_to_load(repo: str, base: str, adapter_only: bool) -> list[str]:
    if adapter_only:
        code = [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            "",
            f"base = AutoModelForCausalLM.from_pretrained({base!r})",
            f"model = PeftModel.from_pretrained(base, {repo!r})",
        ]
    else:
        code = [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"model = AutoModelForCausalLM.from_pretrained({repo!r})",
            f"tokenizer = AutoTokenizer.from_pretrained({repo!r})",
        ]
    return ["## How to load", "", "```python", *code, "```", ""]


def pushed_stage(run: RunDir, adapter_only: bool) -> str:
    """The stage that trained what is pushed: the run's policy stage (`policy_stage`) for its
    adapter, else the stage `rlhf merge` took (`merged_from`: ppo, sft, an offline one)."""
    if adapter_only:
        return policy_stage(run)
    return (run.read_manifest("merged") or {}).get("merged_from", {}).get("stage", "ppo")


def model_card(recipe: Recipe, run: RunDir, adapter_only: bool) -> str:
    """README.md of the pushed folder: what it is, how it was made, how to load it."""
    repo = recipe.push.repo_id
    stage = pushed_stage(run, adapter_only)
    offline = stage in OFFLINE_STAGES
    trained = stage if offline else "ppo"
    base = (run.read_manifest(trained) or {}).get("base_model", recipe.model.name_or_path)
    how = (
        f"{stage.upper()} from preference pairs, without a reward model,"
        if offline
        else "PPO from human-preference rewards"
    )
    header = [
        "---",
        "library_name: " + ("peft" if adapter_only else "transformers"),
        f"tags: [rlhf, {trained}, rlhf-cli]",
        "---",
        "",
        f"# {repo}",
        "",
        f"A policy aligned with {how} by rlhf-cli (run `{run.name}`), starting from "
        f"`{recipe.model.name_or_path}`.",
        "",
    ]
    intended_use = [
        "",
        "## Intended use",
        "",
        "Research and evaluation of RLHF-aligned assistants. "
        + (
            "Its preference is the one of the pairs it was trained on, "
            if offline
            else "Reward is relative to this run's reward model and reference: "
        )
        + "check quality with an external benchmark (MT-Bench, AlpacaEval, head-to-head win "
        "rates) before relying on it.",
        "",
    ]
    sections = [
        header,
        _offline_made(recipe, run, stage) if offline else _how_it_was_made(recipe, run),
        _offline_final_metrics(run, stage) if offline else _final_metrics(run),
        intended_use,
        _how_to_load(repo, base, adapter_only),
    ]
    return "\n".join(line for section in sections for line in section)


def push_folder(recipe: Recipe, run: RunDir, adapter_only: bool) -> Path:
    """The folder to upload: the policy stage's adapter (PPO's, or the offline method's) or the
    merged model, made from the SFT stage the model card describes."""
    trained = pushed_stage(run, adapter_only)
    stage, kind = (trained, "adapter") if adapter_only else ("merged", "model")
    manifest = require(run, stage, "rlhf push --adapter-only" if adapter_only else "rlhf push")
    sft = run.owner("sft")
    if (sft.read_manifest("sft") or {}).get("status") == "completed":
        sft_now = {"sft": sft.input_record("sft")}
        offline = trained in OFFLINE_STAGES
        command = STAGE_COMMANDS[trained if offline else "ppo"]
        remedy = f"the model card would describe another SFT; run `{command}` on this one"
        if not adapter_only:
            remedy += f" and `rlhf merge{f' --stage {trained}' if offline else ''}`"
        check_same_inputs(
            manifest, sft_now, ("sft",), f"the {stage} {kind} of run '{run.name}'", remedy
        )
    return run.resolve_output(stage, manifest, kind)


def run_push(
    recipe: Recipe, console: Console, adapter_only: bool = False, dry_run: bool = False
) -> dict[str, Any]:
    """Write the model card, then upload the folder (unless `dry_run`); return what was sent."""
    run = RunDir.for_recipe(recipe)
    repo_id = recipe.push.repo_id
    if not repo_id:
        raise StageError("push.repo_id is not set in the recipe (e.g. your-username/my-model)")
    folder = push_folder(recipe, run, adapter_only)
    atomic_write_bytes(folder / "README.md", model_card(recipe, run, adapter_only).encode())
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    result: dict[str, Any] = {
        "repo_id": repo_id,
        "folder": str(folder),
        "files": files,
        "bytes": sum((folder / f).stat().st_size for f in files),
        "commit_message": recipe.push.commit_message,
        "private": recipe.push.private,
        "dry_run": dry_run,
    }
    if dry_run:
        console.print(
            f"dry run: would upload {len(files)} files ({result['bytes'] / 1e6:.1f} MB)"
            f" from {folder} to {repo_id}"
        )
        return result
    token = hub_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    pushed = pushed_stage(run, adapter_only) if adapter_only else "merged"
    inputs = {pushed: run.input_record(pushed)}
    with StageRecord(run, "push", recipe, inputs=inputs) as record:
        url = upload(
            folder, repo_id, recipe.push.private, recipe.push.commit_message, token, console
        )
        record.manifest["outputs"] = {"repo": url}
        record.manifest["metrics"] = {"files": len(files), "bytes": result["bytes"]}
    return {**result, "url": url}


def upload(
    folder: Path, repo_id: str, private: bool, message: str, token: str, console: Console
) -> str:
    """create_repo (if needed) + upload_folder; hub errors become one redacted line."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        with console.status(f"uploading {folder} to {repo_id}"):
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            commit = api.upload_folder(
                folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message
            )
    except Exception as exc:  # HTTP errors, refused connections, timeouts: all mean "not sent"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PushError(f"push to {repo_id} failed: {redact(first, token)}") from None
    return str(getattr(commit, "commit_url", None) or repo_id)
