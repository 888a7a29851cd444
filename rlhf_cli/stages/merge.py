"""`rlhf merge`: the LoRA adapter merged into its base (the guide's Part 11, Option B).

The base is reloaded (never 4-bit) in `merge.dtype` when its checkpoint is stored in that
dtype, else in float32, with the adapter in float32, and merged with `merge_and_unload`: peft
adds each layer's float32 delta to its weight in place, `W += B·A·s`, which computes in float32
and rounds once, so a 16-bit base gives the float32 merge's numbers after its cast (the SFT
adapter beneath a PPO adapter is merged first, in its own rounding) while the peak is the model
in its dtype plus one layer's float32 delta, not the float32 model (28 GiB for a 7B).
A float32 merge is checked against the float32 adapter model's logits within `merge.atol` (a
wrong merge fails here) and, for a 16-bit `merge.dtype`, cast once and checked within
`cast_tolerance` (a few rounding steps of its dtype); a merge in 16-bit is checked against its
own adapter model within `cast_tolerance`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console

from rlhf_cli.data import audit_prompts
from rlhf_cli.errors import MergeMismatch, StageError
from rlhf_cli.generation import forward_logits, left_pad, tokenize_prompts
from rlhf_cli.modeling import (
    check_devices,
    load_policy_tokenizer,
    load_sft_model,
    pick_device,
    resolve_dtype,
    save_trained,
)
from rlhf_cli.recipe import ModelSection, Recipe
from rlhf_cli.record import StageRecord, require
from rlhf_cli.resume import named_checkpoint
from rlhf_cli.rundir import Manifest, RunDir
from rlhf_cli.stages.trained import PolicyLocation, load_policy, locate_policy

# A bf16/fp16 copy of a model differs from its float32 original by a few rounding steps
# (machine epsilon x the largest |logit|): measured on Llamas + LoRA of 2 to 24 layers, random
# and SFT-trained, 0.5 to 4.4 steps in both dtypes. 16 leaves room for deeper models; a wrong
# merge is caught before the cast, in float32, within merge.atol.
CAST_ULPS = 16


def merge_model_config(recipe: Recipe, dtype: torch.dtype) -> ModelSection:
    """The model section as merging needs it: weights in `dtype`, no new adapter."""
    return recipe.model.variant(lora=False, load_in_4bit=False, dtype=str(dtype).split(".")[1])


def load_dtype(base: str, dtype: torch.dtype) -> torch.dtype:
    """`dtype` when the base checkpoint is stored in it (loading it there rounds nothing),
    else float32 (an fp32 checkpoint's weights must meet their delta unrounded)."""
    from rlhf_cli.plan import load_config

    stored = str(getattr(load_config(base), "dtype", None) or torch.float32)
    return dtype if stored.removeprefix("torch.") == str(dtype).split(".")[1] else torch.float32


def cast_tolerance(dtype: torch.dtype, scale: float, atol: float) -> float:
    """The largest |logit difference| allowed between a model cast to `dtype` and its float32
    original whose largest |logit| is `scale`: `merge.atol` for float32, else CAST_ULPS rounding
    steps (machine epsilon) of `dtype` at that scale, never less than `merge.atol`."""
    if dtype == torch.float32:
        return atol
    return max(atol, CAST_ULPS * torch.finfo(dtype).eps * scale)


@torch.inference_mode()
def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return forward_logits(model, ids, mask).float()[mask.bool()]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())  # nan when either has a nan: `not diff <= tol` refuses it


def merge_and_cast(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype, atol: float
) -> tuple[Any, dict[str, Any], str | None]:
    """Merge the adapter model `model` (its adapter in float32) and cast it once to `dtype`,
    checking the merge against the adapter model's logits on `ids`: within `atol` on a float32
    base (then the cast within `cast_tolerance`), within `cast_tolerance` on a base already
    in `dtype`. Returns the merged model, the manifest's metrics (each figure once: the merged
    model's difference and its bound; with a cast, also the float32 merge's and `merge.atol`),
    and why it is refused (None when it passes)."""
    in_fp32 = model.get_base_model().dtype == torch.float32
    before = _logits(model, ids, mask)
    merged = model.merge_and_unload()
    merge_diff = _max_diff(_logits(merged, ids, mask), before)
    diff = merge_diff
    if dtype != torch.float32 and in_fp32:
        merged = merged.to(dtype)
        diff = _max_diff(_logits(merged, ids, mask), before)
    tolerance = cast_tolerance(dtype, float(before.abs().max()), atol)
    cast = in_fp32 and dtype != torch.float32  # a float32 merge, then a cast: two checks
    metrics = {
        "max_abs_logit_diff": diff,
        "tolerance": tolerance,
        **({"merge_logit_diff_fp32": merge_diff, "merge_atol": atol} if cast else {}),
        "dtype": str(next(merged.parameters()).dtype),
        "parameters": sum(p.numel() for p in merged.parameters()),
    }
    problem = None
    if in_fp32 and not merge_diff <= atol:
        problem = (
            f"the float32 merge changes the adapter model's logits by {merge_diff:.3g} > "
            f"merge.atol ({atol})"
        )
    elif not diff <= tolerance:
        problem = (
            f"the merged model in {dtype} differs from the float32 adapter model's logits by "
            f"{diff:.3g} > {tolerance:.3g} ({CAST_ULPS} rounding steps of its largest logit)"
        )
    return merged, metrics, problem


def _adapter_location(
    recipe: Recipe, run: RunDir, stage: Literal["ppo", "sft"], checkpoint: str = "last"
) -> tuple[Path, str, Path | None, str, dict[str, Any]]:
    """(the adapter to merge, the base it goes on and that base's SFT adapter, the tokenizer,
    the stages it stands on), worked out before anything loads: the PPO policy where
    `locate_policy` finds it (the final one, or `checkpoint`: `resume.named_checkpoint`), or
    the SFT adapter on `model.name_or_path`."""
    if stage == "ppo":
        folder = named_checkpoint(run.stage_dir("ppo"), checkpoint)
        where = locate_policy(recipe, run, folder, needed_by="rlhf merge")
        if where.kind == "checkpoint":
            return (_checkpoint_adapter(recipe, run, where), where.base, where.sft_adapter,
                    where.tokenizer, where.inputs)  # fmt: skip
        if where.kind == "adapter":
            return where.folder, where.base, where.sft_adapter, where.tokenizer, where.inputs
    source = run.owner(stage)  # an sft of `run.base` when this run has none
    manifest = require(source, stage, "rlhf merge")
    if "adapter" not in manifest["outputs"]:
        raise StageError(
            f"the {stage} stage of run '{source.name}' trained all weights (no LoRA "
            f"adapter): its model folder is already complete, nothing to merge"
        )
    adapter = source.resolve_output(stage, manifest, "adapter")
    tokenizer = str(source.resolve_output(stage, manifest, "tokenizer"))
    return adapter, recipe.model.name_or_path, None, tokenizer, {stage: source.input_record(stage)}


def _checkpoint_adapter(recipe: Recipe, run: RunDir, where: PolicyLocation) -> Path:
    """A PPO checkpoint's trained weights as an adapter folder (`merged/.checkpoint-adapter`),
    through the loader `rlhf audit` uses on checkpoints."""
    policy = load_policy(where, recipe.model, torch.device("cpu"))
    folder = run.stage_dir("merged") / ".checkpoint-adapter"
    shutil.rmtree(folder, ignore_errors=True)
    save_trained(policy.model, folder)
    return folder


def run_merge(
    recipe: Recipe,
    console: Console,
    stage: Literal["ppo", "sft"] = "ppo",
    checkpoint: str = "last",
) -> Manifest:
    """Merge the PPO (or SFT) adapter, the final one or a checkpoint's (`best`, `iter_N`);
    write `runs/<name>/merged/`; return its manifest."""
    from peft import PeftModel

    run = RunDir.for_recipe(recipe)
    adapter, base, sft_adapter, tok_source, inputs = _adapter_location(
        recipe, run, stage, checkpoint
    )
    device = pick_device("cpu" if recipe.merge.device == "cpu" else recipe.run.device)
    check_devices(recipe)
    dtype = resolve_dtype(recipe.merge.dtype, device)
    model_cfg = merge_model_config(recipe, load_dtype(base, dtype))
    with StageRecord(run, "merged", recipe, inputs=inputs) as record:
        # 1. Base in merge.dtype or float32 (the SFT model for a PPO adapter), then the adapter.
        with console.status(f"loading the base in {model_cfg.dtype} and the {stage} adapter"):
            base_model = load_sft_model(model_cfg, base, sft_adapter, device)
            model = PeftModel.from_pretrained(base_model, str(adapter)).eval()
        tokenizer = load_policy_tokenizer(recipe.model, tok_source, "left")

        # 2. Merge (each layer's delta in float32), cast to merge.dtype, check the logits.
        queries = tokenize_prompts(
            tokenizer, audit_prompts(recipe.audit)[:4], recipe.model.prompt_format == "chat", 64
        )
        ids, mask = left_pad(queries, tokenizer.pad_token_id, device)
        merged, record.manifest["metrics"], problem = merge_and_cast(
            model, ids, mask, dtype, recipe.merge.atol
        )
        if problem is not None:
            raise MergeMismatch(f"{problem}; nothing saved")
        diff = record.manifest["metrics"]["max_abs_logit_diff"]

        # 3. Save safetensors shards and the tokenizer in one folder (from_pretrained-ready).
        out = record.dir / "model"
        record.replacing()
        merged.save_pretrained(out, max_shard_size="2GB")
        tokenizer.save_pretrained(out)
        record.manifest["outputs"] = {"model": "model", "tokenizer": "model"}
        record.manifest["merged_from"] = {
            "stage": stage, "adapter": str(adapter), "base": base, "checkpoint": checkpoint,
        }  # fmt: skip
    console.print(f"merged {stage} adapter → {Path(out)} (max |Δlogit| {diff:.2e})")
    return record.manifest
