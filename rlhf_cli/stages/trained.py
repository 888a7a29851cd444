"""Finding and loading a trained policy for audit, merge and compare.

A policy can be: the run's final PPO output (`runs/<name>/ppo/`), one PPO checkpoint
(`ppo/checkpoints/iter_NNNNN/`), an adapter folder, or a merged model folder. Each comes with its
reference (the SFT model) when the run has one, so KL and reward can be compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_cli.errors import StageError
from rlhf_cli.modeling import (
    freeze,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    lora_config,
    set_dropout,
)
from rlhf_cli.ppo.models import Reference
from rlhf_cli.recipe import ModelSection, Recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.scoring import RewardScorer
from rlhf_cli.stages.ppo import load_sft_model, policy_source, reward_source


@dataclass
class TrainedPolicy:
    model: Any  # a PeftModel (adapter on the SFT model) or a plain causal LM
    reference: Reference | None
    tokenizer: Any
    label: str  # names the audited thing in reports, e.g. "ppo" or "iter_00050"


def _kind(folder: Path) -> str:
    if (folder / "checkpoint.json").is_file():
        return "checkpoint"
    if (folder / "manifest.json").is_file():
        stage = json.loads((folder / "manifest.json").read_text()).get("stage")
        if stage in ("ppo", "merged"):
            return stage
    if (folder / "adapter_config.json").is_file():
        return "adapter"
    if (folder / "config.json").is_file():
        return "model"
    raise StageError(f"{folder} is not a PPO run, checkpoint, adapter or model folder")


def load_trained_policy(recipe: Recipe, run: RunDir, device: torch.device,
                        source: Path | None = None,
                        model_cfg: ModelSection | None = None) -> TrainedPolicy:
    """The policy at `source` (default: the run's final PPO policy), dropout off, frozen."""
    from peft import PeftModel, get_peft_model

    model_cfg = model_cfg or recipe.model
    folder = Path(source) if source is not None else run.stage_dir("ppo")
    if source is None:
        run.require("ppo", "this command")
    if not folder.is_dir():
        raise StageError(f"{folder} does not exist")
    kind = _kind(folder)
    base, sft_adapter, tok_source = policy_source(recipe, run, {})
    if kind == "merged":
        manifest = json.loads((folder / "manifest.json").read_text())
        folder, kind = folder / manifest["outputs"]["model"], "model"
    if kind == "ppo":
        manifest = json.loads((folder / "manifest.json").read_text())
        tok_source = str(folder / manifest["outputs"]["tokenizer"])
        if "adapter" not in manifest["outputs"]:
            folder, kind = folder / manifest["outputs"]["model"], "model"
        else:
            folder, kind = folder / manifest["outputs"]["adapter"], "adapter"
    tokenizer = load_tokenizer(tok_source, model_cfg.trust_remote_code, "left")
    label = folder.name if kind == "checkpoint" else run.name
    if kind == "model":
        model = load_causal_lm(str(folder), model_cfg.variant(lora=False, load_in_4bit=False),
                               device, trainable=False)
        reference_model = load_sft_model(model_cfg, base, sft_adapter, device)
        return TrainedPolicy(model, Reference(model, reference_model), tokenizer, label)
    sft_model = load_sft_model(model_cfg, base, sft_adapter, device)
    if kind == "adapter":
        model = PeftModel.from_pretrained(sft_model, str(folder))
    else:  # a checkpoint: the PPO construction, then its trainable weights
        from safetensors.torch import load_file

        if not model_cfg.lora.enabled:
            raise StageError(f"{folder}: auditing checkpoints of full-weight PPO runs is not "
                             "supported; audit the final policy instead")
        model = get_peft_model(sft_model, lora_config(model_cfg.lora, "CAUSAL_LM", no_dropout=True))
        missing = model.load_state_dict(load_file(folder / "policy.safetensors"), strict=False)
        if missing.unexpected_keys:
            raise StageError(f"{folder} does not match this recipe's LoRA settings")
    set_dropout(model, 0.0)
    return TrainedPolicy(freeze(model), Reference(model), tokenizer, label)


def load_scorer(recipe: Recipe, run: RunDir, device: torch.device) -> RewardScorer | None:
    """The run's reward model as a scorer, or None when it is not at hand."""
    try:
        path, tok = reward_source(recipe, run, {})
    except StageError:
        return None
    model = freeze(load_reward_model(path, device, recipe.reward.dtype,
                                     recipe.reward.trust_remote_code))
    set_dropout(model, 0.0)
    return RewardScorer(model, load_tokenizer(tok, recipe.reward.trust_remote_code,
                                                     "right"),
                        recipe.reward.template, recipe.reward.max_length,
                        recipe.reward.score_batch_size)
