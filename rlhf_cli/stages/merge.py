"""`rlhf merge`: the LoRA adapter merged into its base (the guide's Part 11, Option B).

The base is reloaded in `merge.dtype` (fp16/bf16/fp32, never 4-bit), the adapter applied and
merged with `merge_and_unload`, and the merged model's logits are checked against the adapter
model's on a few prompts before anything is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console

from rlhf_cli.data import audit_prompts
from rlhf_cli.errors import MergeMismatch, StageError
from rlhf_cli.generation import forward_logits, left_pad, tokenize_prompts
from rlhf_cli.modeling import load_policy_tokenizer, load_sft_model, pick_device
from rlhf_cli.recipe import ModelSection, Recipe
from rlhf_cli.record import StageRecord, require
from rlhf_cli.rundir import Manifest, RunDir
from rlhf_cli.stages.trained import check_sft_fits, policy_source


def merge_model_config(recipe: Recipe) -> ModelSection:
    """The model section as merging needs it: full precision weights, no new adapter."""
    return recipe.model.variant(lora=False, load_in_4bit=False, dtype=recipe.merge.dtype)


@torch.inference_mode()
def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return forward_logits(model, ids, mask).float()[mask.bool()]


def run_merge(recipe: Recipe, console: Console, stage: Literal["ppo", "sft"] = "ppo") -> Manifest:
    """Merge the PPO (or SFT) adapter; write `runs/<name>/merged/`; return its manifest."""
    from peft import PeftModel

    run = RunDir.for_recipe(recipe)
    source = run.owner(stage)  # an sft of `run.base` when this run has none
    manifest = require(source, stage, "rlhf merge")
    if "adapter" not in manifest["outputs"]:
        raise StageError(
            f"the {stage} stage of run '{source.name}' trained all weights (no LoRA "
            f"adapter): its model folder is already complete, nothing to merge"
        )
    adapter = source.resolve_output(stage, manifest, "adapter")
    device = pick_device(recipe.run.device)
    model_cfg = merge_model_config(recipe)
    sft_now: dict[str, Any] = {}
    base, sft_adapter, tok_source = policy_source(recipe, run, sft_now, "rlhf merge")
    if stage == "ppo":
        check_sft_fits(manifest, sft_now, f"the ppo adapter of run '{source.name}'", "adapter")
    inputs = {**sft_now, stage: source.input_record(stage)}  # and the SFT it stands on
    with StageRecord(run, "merged", recipe, inputs=inputs) as record:
        # 1. Base in full precision (the SFT model for a PPO adapter), then the adapter.
        with console.status(f"loading the base in {model_cfg.dtype} and the {stage} adapter"):
            if stage == "ppo":
                base_model = load_sft_model(model_cfg, base, sft_adapter, device)
                tok_source = str(run.resolve_output("ppo", manifest, "tokenizer"))
            else:
                base_model = load_sft_model(model_cfg, recipe.model.name_or_path, None, device)
            model = PeftModel.from_pretrained(base_model, str(adapter)).eval()
        tokenizer = load_policy_tokenizer(recipe.model, tok_source, "left")

        # 2. Merge, and check the logits against the adapter model on a few prompts.
        queries = tokenize_prompts(
            tokenizer, audit_prompts(recipe.audit)[:4], recipe.model.prompt_format == "chat", 64
        )
        ids, mask = left_pad(queries, tokenizer.pad_token_id, device)
        before = _logits(model, ids, mask)
        merged = model.merge_and_unload()
        diff = float((_logits(merged, ids, mask) - before).abs().max())
        record.manifest["metrics"] = {
            "max_abs_logit_diff": diff,
            "atol": recipe.merge.atol,
            "dtype": str(next(merged.parameters()).dtype),
            "parameters": sum(p.numel() for p in merged.parameters()),
        }
        if diff > recipe.merge.atol:
            raise MergeMismatch(
                f"the merged model's logits differ from the adapter model's by "
                f"{diff:.3g} > merge.atol ({recipe.merge.atol}); nothing saved"
            )

        # 3. Save safetensors shards and the tokenizer in one folder (from_pretrained-ready).
        out = record.dir / "model"
        record.replacing()
        merged.save_pretrained(out, max_shard_size="2GB")
        tokenizer.save_pretrained(out)
        record.manifest["outputs"] = {"model": "model", "tokenizer": "model"}
        record.manifest["merged_from"] = {"stage": stage, "adapter": str(adapter), "base": base}
    console.print(f"merged {stage} adapter → {Path(out)} (max |Δlogit| {diff:.2e})")
    return record.manifest
