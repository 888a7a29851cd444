"""`rlhf merge`: the LoRA adapter merged into its base (the guide's Part 11, Option B): PPO's,
an offline method's (`--stage dpo`, any of `OFFLINE_STAGES`: on the SFT model it was trained
from, as its manifest records it) or SFT's.

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
from typing import Any

import torch
from rich.console import Console

from rlhf_cli.errors import MergeMismatch, StageError
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
from rlhf_cli.stages.trained import (
    POLICY_STAGES,
    PolicyLocation,
    load_policy,
    locate_policy,
    merge_and_cast,
    merge_check_inputs,
)


def merge_model_config(recipe: Recipe, dtype: torch.dtype) -> ModelSection:
    """The model section as merging needs it: weights in `dtype`, no new adapter."""
    return recipe.model.variant(lora=False, load_in_4bit=False, dtype=str(dtype).split(".")[1])


def load_dtype(base: str, dtype: torch.dtype) -> torch.dtype:
    """`dtype` when the base checkpoint is stored in it (loading it there rounds nothing),
    else float32 (an fp32 checkpoint's weights must meet their delta unrounded)."""
    from rlhf_cli.plan import load_config

    stored = str(getattr(load_config(base), "dtype", None) or torch.float32)
    return dtype if stored.removeprefix("torch.") == str(dtype).split(".")[1] else torch.float32


def _adapter_location(
    recipe: Recipe, run: RunDir, stage: str, checkpoint: str = "last"
) -> tuple[Path, str, Path | None, str, dict[str, Any]]:
    """(the adapter to merge, the base it goes on and that base's SFT adapter, the tokenizer,
    the stages it stands on), worked out before anything loads: the PPO or offline policy
    where `locate_policy` finds it (the final one, or PPO's `checkpoint`:
    `resume.named_checkpoint`), or the SFT adapter on `model.name_or_path`."""
    if stage in POLICY_STAGES:
        folder = named_checkpoint(run.stage_dir("ppo"), checkpoint) if stage == "ppo" else None
        where = locate_policy(recipe, run, folder, needed_by="rlhf merge", stage=stage)
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
    recipe: Recipe, console: Console, stage: str = "ppo", checkpoint: str = "last"
) -> Manifest:
    """Merge the PPO adapter (the final one or a checkpoint's: `best`, `iter_N`), an offline
    stage's (`OFFLINE_STAGES`) or SFT's; write `runs/<name>/merged/`; return its manifest."""
    if checkpoint != "last" and stage != "ppo":
        raise StageError(f"--checkpoint {checkpoint} names a PPO checkpoint: merge --stage ppo")
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
        ids, mask = merge_check_inputs(recipe, tokenizer, device)
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
