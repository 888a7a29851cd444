"""Stage 4 of the guide: PPO alignment. Our own, on torch + transformers + peft + accelerate
(TRL 1.x has no PPO trainer).

Four models: the policy (the SFT model with a fresh LoRA adapter), the value head on its backbone
(or a separate critic), the frozen reward model, and the frozen reference (the policy with its
adapter disabled: no second copy of the weights). Dropout is off in all of them: PPO's ratio
compares log-probs of the same tokens at two times, and dropout noise would bias it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from safetensors.torch import save_file

from rlhf_cli.data import load_prompts
from rlhf_cli.errors import DataError, ModelLoadError, StageError
from rlhf_cli.modeling import (
    freeze,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    lora_config,
    pick_device,
    resolve_model_path,
    set_dropout,
)
from rlhf_cli.ppo import core
from rlhf_cli.ppo.checkpoint import load_checkpoint, newest_valid
from rlhf_cli.ppo.health import HealthMonitor
from rlhf_cli.ppo.models import (
    PolicyAndValue,
    Reference,
    ValueModel,
    hidden_size_of,
    zero_value_head,
)
from rlhf_cli.ppo.rollout import stop_token_ids, tokenize_prompts
from rlhf_cli.ppo.trainer import PPOContext, summarize, train
from rlhf_cli.recipe import ModelSection, Recipe
from rlhf_cli.rundir import RunDir, StageRecord, atomic_write_bytes
from rlhf_cli.scoring import RewardScorer
from rlhf_cli.stages.common import seed_everything
from rlhf_cli.tracking import MetricsWriter, read_metrics


def policy_source(recipe: Recipe, run: RunDir, inputs: dict[str, Any]) -> tuple[str, Path | None,
                                                                                 str]:
    """(base weights, SFT adapter to merge or None, tokenizer) the policy starts from."""
    if not recipe.sft.enabled:
        name = recipe.model.name_or_path
        return name, None, recipe.model.tokenizer or name
    manifest = run.require("sft", "rlhf ppo")
    inputs["sft"] = run.input_record("sft")
    tokenizer = str(run.resolve_output("sft", manifest, "tokenizer"))
    if "model" in manifest["outputs"]:
        return str(run.resolve_output("sft", manifest, "model")), None, tokenizer
    return recipe.model.name_or_path, run.resolve_output("sft", manifest, "adapter"), tokenizer


def reward_source(recipe: Recipe, run: RunDir, inputs: dict[str, Any]) -> tuple[str, str]:
    """(reward model, reward tokenizer): the recipe's frozen model or the train-rm output."""
    if recipe.reward.pretrained is not None:
        name = recipe.reward.pretrained
        return name, recipe.reward.tokenizer or name
    manifest = run.require("rm", "rlhf ppo")
    inputs["rm"] = run.input_record("rm")
    path = str(run.resolve_output("rm", manifest, "model"))
    return path, str(run.resolve_output("rm", manifest, "tokenizer"))


def load_sft_model(model_cfg: ModelSection, base: str, sft_adapter: Path | None,
                   device: torch.device) -> Any:
    """The SFT model, frozen: base weights with the SFT adapter (if any) merged in. It is the
    PPO reference, and the base the PPO adapter is trained and merged on."""
    from peft import PeftModel

    model = load_causal_lm(base, model_cfg.variant(lora=False), device, trainable=False)
    if sft_adapter is not None:
        model = PeftModel.from_pretrained(model, str(sft_adapter)).merge_and_unload()
    return model


def build_actor(recipe: Recipe, base: str, sft_adapter: Path | None, device: torch.device,
                reward_path: str, reward_model: Any,
                same_tokenizer: bool) -> tuple[PolicyAndValue, Reference]:
    """Policy (+ fresh LoRA), value head or critic, and the reference, dropout off."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModel

    cfg, lora = recipe.ppo, recipe.model.lora
    model = load_sft_model(recipe.model, base, sft_adapter, device)
    if lora.enabled:
        if recipe.model.quantization.load_in_4bit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        policy = get_peft_model(model, lora_config(lora, "CAUSAL_LM", no_dropout=True))
        reference = Reference(policy)
    else:
        policy = model
        for param in policy.parameters():
            param.requires_grad_(True)
        reference = Reference(policy, frozen_copy=load_sft_model(recipe.model, base, sft_adapter,
                                                                 device))
    set_dropout(policy, 0.0)

    if cfg.value_model == "shared":
        actor = PolicyAndValue(policy, value_head=zero_value_head(hidden_size_of(policy)))
    else:
        if cfg.value_init == "reward_model" and not same_tokenizer:
            raise ModelLoadError("ppo.value_init: reward_model needs a reward model that shares "
                                 "the policy's tokenizer; use value_init: policy")
        source = resolve_model_path(reward_path if cfg.value_init == "reward_model" else base)
        backbone = AutoModel.from_pretrained(source)
        head = zero_value_head(hidden_size_of(backbone))
        if cfg.value_init == "reward_model":
            head.load_state_dict(_reward_head(reward_model, reward_path))
        set_dropout(backbone, 0.0)
        actor = PolicyAndValue(policy, critic=ValueModel(backbone, head))
    return actor.to(device), reference


def _reward_head(reward_model: Any, reward_path: str) -> dict[str, torch.Tensor]:
    """The reward model's scalar head, to start a per-token critic from it."""
    head = getattr(reward_model, "score", None) or getattr(reward_model, "classifier", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ModelLoadError(f"reward model '{reward_path}' has no linear 1-logit head to "
                             "initialise the critic from; use ppo.value_init: policy")
    return {"weight": head.weight.detach().float(), "bias": head.bias.detach().float()
            if head.bias is not None else torch.zeros(1)}


def check_fit(recipe: Recipe, policy: Any, reward_model: Any, reward_tokenizer: Any) -> None:
    """Mismatches that would fail (or silently mis-score) mid-run, caught before training."""
    context = getattr(policy.config, "max_position_embeddings", None)
    need = recipe.data.prompts.max_tokens + recipe.ppo.generation.max_new_tokens
    if context and need > context:
        raise DataError(f"data.prompts.max_tokens ({recipe.data.prompts.max_tokens}) + "
                        f"ppo.generation.max_new_tokens ({recipe.ppo.generation.max_new_tokens})"
                        f" = {need} exceeds the policy's context of {context} tokens")
    rm_context = getattr(reward_model.config, "max_position_embeddings", None)
    if rm_context and recipe.reward.max_length > rm_context:
        raise DataError(f"reward.max_length ({recipe.reward.max_length}) exceeds the reward "
                        f"model's context of {rm_context} tokens")
    vocab = reward_model.get_input_embeddings().num_embeddings
    if len(reward_tokenizer) > vocab:
        raise DataError(f"the reward tokenizer has {len(reward_tokenizer)} tokens but the reward "
                        f"model only {vocab} embeddings: reward.tokenizer does not match "
                        "reward model")


def prompt_overlap(run: RunDir, prompts: list[str]) -> int:
    """PPO prompts the reward model was trained on (the guide's "same data" mistake)."""
    manifest = run.read_manifest("rm")
    if not manifest or "train_prompts" not in manifest.get("outputs", {}):
        return 0
    seen = set(json.loads(run.resolve_output("rm", manifest, "train_prompts").read_text()))
    return sum(p in seen for p in prompts)


def run_ppo(recipe: Recipe, console: Console, resume: bool = False) -> dict[str, Any]:
    """Align the policy with PPO; write `runs/<name>/ppo/`; return its manifest."""
    from accelerate import Accelerator
    from transformers import get_constant_schedule

    cfg, run = recipe.ppo, RunDir.for_recipe(recipe)
    device = pick_device(recipe.run.device)
    accelerator = Accelerator(cpu=device.type == "cpu")
    device = accelerator.device
    is_main = accelerator.is_main_process
    world = accelerator.num_processes
    if cfg.batch_size % world or cfg.mini_batch_size % world:
        raise StageError(f"ppo.batch_size ({cfg.batch_size}) and ppo.mini_batch_size "
                         f"({cfg.mini_batch_size}) must split evenly over {world} processes")
    inputs: dict[str, Any] = {}
    base, sft_adapter, tok_source = policy_source(recipe, run, inputs)
    reward_path, reward_tok = reward_source(recipe, run, inputs)
    seed_everything(recipe.run.seed + accelerator.process_index)
    stage_dir = run.stage_dir("ppo")
    with StageRecord(run, "ppo", recipe, inputs=inputs, write=is_main) as record:
        # 1. Tokenizer, prompts, and the guide's "common mistakes" caught before training.
        tokenizer = load_tokenizer(tok_source, recipe.model.trust_remote_code, "left")
        prompts = load_prompts(recipe.data.prompts, cache_dir=run.path / ".cache")
        if cfg.ppo_epochs > 4:
            record.warn(f"ppo.ppo_epochs is {cfg.ppo_epochs}: beyond 4 the rollout goes "
                        "off-policy (the guide keeps K <= 4; K = 2 is safer)")
        overlap = 0 if cfg.allow_prompt_overlap else prompt_overlap(run, prompts)
        if overlap:
            record.warn(f"{overlap} of {len(prompts)} PPO prompts were in the reward model's "
                        "training pairs: it overestimates scores there; use separate prompts "
                        "(ppo.allow_prompt_overlap: true silences this)")
        for warning in record.manifest["warnings"]:
            console.print(f"[yellow]warning[/]: {escape(warning)}", highlight=False)

        # 2. Models: actor (policy + value), reference, frozen reward model.
        reward_tokenizer = load_tokenizer(reward_tok, recipe.reward.trust_remote_code, "right")
        same_tok = reward_tokenizer.get_vocab() == tokenizer.get_vocab()
        reward_model = freeze(load_reward_model(reward_path, device, recipe.reward.dtype,
                                                recipe.reward.trust_remote_code))
        set_dropout(reward_model, 0.0)
        actor, reference = build_actor(recipe, base, sft_adapter, device, reward_path,
                                       reward_model, same_tok)
        check_fit(recipe, actor.policy, reward_model, reward_tokenizer)
        scorer = RewardScorer(reward_model, reward_tokenizer, recipe.reward.template,
                              recipe.reward.max_length, recipe.reward.score_batch_size)
        chat = recipe.model.prompt_format == "chat"
        queries = tokenize_prompts(tokenizer, prompts, chat, recipe.data.prompts.max_tokens)

        # 3. Optimizer, schedule, KL controller; then resume if asked.
        params = [p for p in actor.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, eps=cfg.adam_eps)
        scheduler = get_constant_schedule(optimizer)
        kl_ctl = (core.AdaptiveKLController(cfg.init_kl_coef, cfg.target_kl, cfg.horizon)
                  if cfg.adaptive_kl else core.FixedKLController(cfg.init_kl_coef))
        sampler = torch.Generator().manual_seed(recipe.run.seed)
        start, seen = 0, []
        if not resume and is_main:  # an earlier run's checkpoints must not be resumed later
            shutil.rmtree(stage_dir / "checkpoints", ignore_errors=True)
        if resume:
            start, seen = _resume(record, stage_dir, actor, optimizer, scheduler, kl_ctl,
                                  sampler, console)
        prepared_actor, optimizer = accelerator.prepare(actor, optimizer)

        # 4. The loop.
        writer = MetricsWriter(stage_dir / "metrics.jsonl", recipe.run.trackers, is_main,
                               resume=start > 0)
        samples = MetricsWriter(stage_dir / "samples.jsonl", None, is_main, resume=start > 0)
        ctx = PPOContext(cfg=cfg, accelerator=accelerator, actor=prepared_actor,
                         reference=reference, scorer=scorer, tokenizer=tokenizer,
                         prompts=prompts, queries=queries,
                         stop_ids=stop_token_ids(tokenizer, actor.policy), optimizer=optimizer,
                         scheduler=scheduler, kl_ctl=kl_ctl, sampler=sampler,
                         stage_dir=stage_dir, writer=writer, samples=samples, console=console,
                         health=HealthMonitor(seen), on_warning=record.warn,
                         audit=_live_audit(recipe, chat), audit_every=recipe.audit.every,
                         audit_kl_step=recipe.audit.kl_coef_step,
                         max_nonfinite=cfg.max_nonfinite)
        ctx.history = [r for r in read_metrics(stage_dir / "metrics.jsonl")
                       if r.get("iteration", 0) <= start] if start else []
        try:
            summary = train(ctx, start)
        finally:
            writer.close()
            samples.close()
            record.manifest["metrics"] = {**summarize(ctx.history), "kl_coef_now": kl_ctl.value}
            record.save()

        # 5. Final artifacts: adapter (or model), value head, tokenizer.
        if is_main:
            unwrapped = accelerator.unwrap_model(prepared_actor)
            kind = "adapter" if recipe.model.lora.enabled else "model"
            unwrapped.policy.save_pretrained(stage_dir / kind)
            tokenizer.save_pretrained(stage_dir / "tokenizer")
            save_file(unwrapped.value_state_dict(), stage_dir / "value_head.safetensors")
            record.manifest["outputs"] = {kind: kind, "tokenizer": "tokenizer",
                                          "value_head": "value_head.safetensors",
                                          "metrics": "metrics.jsonl", "samples": "samples.jsonl",
                                          "checkpoints": "checkpoints"}
            record.manifest["base_model"] = base
            record.manifest["reward_model"] = reward_path
            record.manifest["metrics"] = {**summary, "kl_coef_now": kl_ctl.value}
    return record.manifest


def _live_audit(recipe: Recipe, chat: bool) -> Callable[[PPOContext], dict[str, Any]]:
    """`audit.every`: the same audit as `rlhf audit`, on the live policy."""
    from rlhf_cli.audit.measure import audit_policy
    from rlhf_cli.stages.audit import audit_prompts

    prompts = audit_prompts(recipe.audit)

    def audit(ctx: PPOContext) -> dict[str, Any]:
        return audit_policy(ctx.unwrapped.policy, ctx.tokenizer, prompts, recipe.audit,
                            chat=chat, max_tokens=recipe.data.prompts.max_tokens,
                            stop_ids=ctx.stop_ids, reference=ctx.reference, scorer=ctx.scorer)

    return audit


def _resume(record: StageRecord, stage_dir: Path, actor: PolicyAndValue, optimizer: Any,
            scheduler: Any, kl_ctl: Any, sampler: torch.Generator,
            console: Console) -> tuple[int, list[str]]:
    folder, notes = newest_valid(stage_dir / "checkpoints")
    for note in notes:
        console.print(f"[yellow]resume[/]: {note}")
        record.warn(note)
    if folder is None:
        raise StageError(f"--resume: no usable checkpoint under {stage_dir / 'checkpoints'}; "
                         "run `rlhf ppo` without --resume to start over")
    state, value_state = load_checkpoint(folder, policy=actor.policy, optimizer=optimizer,
                                         scheduler=scheduler, kl_ctl=kl_ctl, sampler=sampler)
    actor.load_value_state_dict(value_state)
    console.print(f"resuming from {folder.name} (iteration {state['iteration']})")
    _truncate_jsonl(stage_dir / "metrics.jsonl", state["iteration"])
    _truncate_jsonl(stage_dir / "samples.jsonl", state["iteration"])
    return int(state["iteration"]), list(state.get("health_seen", []))


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint, so the resumed log has one line per iteration."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    atomic_write_bytes(path, ("\n".join(keep) + "\n" if keep else "").encode())
