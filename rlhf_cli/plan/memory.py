"""Each stage's peak accelerator memory per process, as the stage holds it, and the time of one
PPO iteration; the whole recipe's plan, and the one stage's peak a manifest records. A stage
peaks in the largest of its phases, each a dict of named parts (`rlhf_cli.plan.parts`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from rlhf_cli.errors import RlhfError
from rlhf_cli.plan.gpus import Target
from rlhf_cli.plan.parts import (
    CUDA_CONTEXT_BYTES,
    activation_bytes,
    dtype_name,
    element_bytes,
    forward_bytes,
    fused_head_parts,
    kv_cache_bytes,
    optimizer_parts,
    sharded,
    trainable_params,
    training_phases,
    weight_parts,
)
from rlhf_cli.plan.shapes import Configs, ModelShape, model_shape, read_configs
from rlhf_cli.recipe import ModelSection, Recipe
from rlhf_cli.rundir import OFFLINE_STAGES

REFERENCE_STAGES = ("dpo", "kto")  # the offline stages that hold a reference (ORPO, SimPO none)


@dataclass
class StagePlan:
    """One stage's estimated peak: the phase it peaks in and that phase's parts."""

    stage: str
    phase: str
    parts: dict[str, int]
    iteration_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    on_host: bool = False  # runs on the CPU while the target is a GPU (`merge.device: cpu`)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_bytes": self.peak_bytes, "phase": self.phase}
        if self.on_host:
            out["device"] = "cpu"
        out["parts"] = dict(self.parts)
        if self.iteration_s is not None:
            out["iteration_s"] = self.iteration_s
        return {**out, **self.detail}


def _peak(stage: str, phases: dict[str, dict[str, int]], target: Target) -> StagePlan:
    if target.cuda:
        phases = {k: {**v, "CUDA context": CUDA_CONTEXT_BYTES} for k, v in phases.items()}
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    parts = {k: int(v) for k, v in phases[phase].items() if v}
    return StagePlan(stage, phase, parts)


def _compute_bytes(model: ModelSection, target: Target) -> int:
    """Bytes of an activation: the 4-bit compute dtype, else the weights' dtype."""
    q = model.quantization
    return element_bytes(q.compute_dtype if q.load_in_4bit else model.dtype, target)


def plan_sft(recipe: Recipe, policy: ModelShape, target: Target) -> StagePlan:
    """TRL's SFTTrainer: one micro-batch of `sft.batch_size` rows of `sft.max_length`, its loss
    through TRL's fused LM head (the labels shifted: one position fewer a row)."""
    cfg = recipe.sft
    model = recipe.model.variant(lora=False) if cfg.full_finetune else recipe.model
    e = _compute_bytes(model, target)
    weights = weight_parts(policy, model, target, trains=True)
    if model.lora.enabled:
        weights["LoRA fp32"] = 4 * policy.lora_params
    working = {
        "activations": activation_bytes(
            policy, cfg.batch_size * cfg.max_length, e, model.gradient_checkpointing
        ),
        **fused_head_parts(policy, cfg.batch_size * (cfg.max_length - 1), e, target),
    }
    trained = trainable_params(policy, model)
    phases = training_phases(
        sharded(weights, target), trained, target, working, cfg.gradient_accumulation_steps > 1
    )
    return _peak("sft", phases, target)


def plan_train_rm(recipe: Recipe, reward: ModelShape, target: Target) -> StagePlan:
    """TRL's RewardTrainer: chosen and rejected of `reward.batch_size` pairs in one pass."""
    cfg = recipe.reward
    full = not cfg.lora.enabled
    e = 4 if full else element_bytes(cfg.dtype, target)
    trained = reward.params if full else reward.lora_params
    weights = {"weights fp32 (trained)" if full else f"weights {dtype_name(e)}": reward.params * e}
    if not full:
        weights["LoRA fp32"] = 4 * reward.lora_params
    tokens = 2 * cfg.batch_size * cfg.max_length
    working = {
        "activations": activation_bytes(reward, tokens, e, recipe.model.gradient_checkpointing)
    }
    phases = training_phases(
        sharded(weights, target), trained, target, working, cfg.gradient_accumulation_steps > 1
    )
    return _peak("train-rm", phases, target)


def plan_offline(recipe: Recipe, stage: str, policy: ModelShape, target: Target) -> StagePlan:
    """An offline stage (`rlhf dpo|kto|orpo|simpo`), one micro-batch of its section's
    `batch_size` rows cut to `max_length`. DPO, ORPO and SimPO pass chosen and rejected in one
    batch (twice the rows); KTO one answer a row, after a pass without gradients over the same
    number of mismatched answers (TRL's KL baseline: prompt i with answer i-1), freed before
    the trained pass. DPO and KTO read their log-probs through TRL's fused LM head as SFT's;
    ORPO and SimPO (`trl.experimental`) hold the whole logits, and in the backward three fp32
    tensors of their size (the log-softmax kept, the gradients of the gather and the logsumexp
    and their sum). The reference of DPO and KTO costs nothing under LoRA (the policy with its
    adapter disabled); else it is a frozen copy in `model.dtype`, held by a first run, which
    computes its log-probs (a rerun with the kept ones loads none). ORPO and SimPO hold none."""
    cfg, model = getattr(recipe, stage), recipe.model
    e = _compute_bytes(model, target)
    weights = weight_parts(policy, model, target, trains=True)
    if model.lora.enabled:
        weights["LoRA fp32"] = 4 * policy.lora_params
    elif stage in REFERENCE_STAGES:
        stored = element_bytes(model.dtype, target)
        weights[f"reference {dtype_name(stored)} (first run)"] = policy.params * stored
    rows = cfg.batch_size if stage == "kto" else 2 * cfg.batch_size
    scored = rows * (cfg.max_length - 1)  # the labels shifted: one position fewer a row
    if stage in REFERENCE_STAGES:
        head = fused_head_parts(policy, scored, e, target)
    else:
        head = {
            f"logits {dtype_name(e)}": rows * cfg.max_length * policy.vocab * e,
            "log-softmax + logits' gradients fp32": 3 * scored * policy.vocab * 4,
        }
    working = {
        "activations": activation_bytes(
            policy, rows * cfg.max_length, e, model.gradient_checkpointing
        ),
        **head,
    }
    trained = trainable_params(policy, model)
    phases = training_phases(
        sharded(weights, target), trained, target, working, cfg.gradient_accumulation_steps > 1
    )
    return _peak(stage, phases, target)


def ppo_lengths(recipe: Recipe) -> tuple[int, int]:
    """(prompt, response) tokens at most: `data.prompts.max_tokens`, `max_new_tokens`."""
    assert recipe.data.prompts is not None  # the recipe validator requires it
    return recipe.data.prompts.max_tokens, recipe.ppo.generation.max_new_tokens


def _reward_weights(recipe: Recipe, reward: ModelShape | None, target: Target) -> int:
    if reward is None:
        return 0
    return reward.params * element_bytes(recipe.reward.dtype, target)


def scoring_bytes(recipe: Recipe, reward: ModelShape | None, target: Target, rows: int) -> int:
    """The reward model's forward on `rows` texts (at most `score_batch_size` at once) of
    `reward.max_length` tokens."""
    if reward is None:
        return 0
    tokens = min(rows, recipe.reward.score_batch_size) * recipe.reward.max_length
    return forward_bytes(reward, tokens, element_bytes(recipe.reward.dtype, target))


def _policy_weights(
    policy: ModelShape, model: ModelSection, target: Target, separate: bool, critic: bool
) -> tuple[dict[str, int], int]:
    """The policy's (and a separate critic's) weights as PPO holds them, and how many
    parameters train (LoRA or every weight, and the value head)."""
    e = element_bytes(model.dtype, target)
    weights = weight_parts(policy, model, target, trains=True)
    trained = trainable_params(policy, model) + (policy.hidden + 1 if critic else 0)
    if separate:  # its own backbone, loaded and trained as the policy is
        weights.update({f"critic {k}": v for k, v in weights.items()})
        trained += trainable_params(policy, model)
    if model.lora.enabled:
        weights["LoRA + value head fp32" if critic else "LoRA fp32"] = 4 * trained
    elif critic:
        weights["value head fp32"] = 4 * (policy.hidden + 1)
    if not model.lora.enabled:  # the reference is a frozen copy
        weights[f"reference {dtype_name(e)}"] = policy.params * e
    return weights, trained


def plan_ppo(
    recipe: Recipe, policy: ModelShape, reward: ModelShape | None, target: Target
) -> StagePlan:
    """PPO per process: the models (policy, trained weights and AdamW, critic, reference,
    reward model, a colocated vLLM engine's share) held throughout, plus the largest of its
    phases: generation (KV cache; none here with an engine, whose share holds it, or with
    `vllm_server`, whose servers `plan_vllm_server` sizes apart), scoring (the reward model's
    forward), the old / reference log-prob pass (two logits tensors) and the update's
    forward/backward (activations, logits with the entropy's fp32 copies) or optimizer step
    (gradients)."""
    cfg, model = recipe.ppo, recipe.model
    e = _compute_bytes(model, target)
    prompt, response = ppo_lengths(recipe)
    rows = math.ceil(cfg.batch_size / target.processes)
    seq, mb = prompt + response, min(cfg.mini_batch_size, rows)
    separate = cfg.needs_critic and cfg.value_model == "separate"
    weights, trained = _policy_weights(policy, model, target, separate, cfg.needs_critic)
    gen = cfg.generation
    vllm = gen.backend == "vllm" and target.cuda and target.memory_bytes is not None
    vllm_share = int(gen.vllm.gpu_memory_utilization * target.memory_bytes) if vllm else 0
    samples_here = not vllm and gen.backend != "vllm_server"  # else an engine holds the cache
    held = {"reward model": _reward_weights(recipe, reward, target)}
    rollout = {
        **weights,
        **held,
        "AdamW m+v fp32": optimizer_parts(trained, target)["AdamW m+v fp32"],
        "vLLM share": vllm_share,
    }
    generation = {
        **rollout,
        "KV cache": kv_cache_bytes(policy, rows * seq, e) if samples_here else 0,
        "sampling logits fp32": 3 * rows * policy.vocab * 4 if samples_here else 0,
    }
    scoring = {**rollout, "reward forward": scoring_bytes(recipe, reward, target, rows)}
    logprobs = {**rollout, "old + reference logits": 2 * mb * (response + 1) * policy.vocab * e}
    update_held = {
        **sharded(weights, target),
        **held,
        "vLLM share": 0 if gen.vllm.sleep else vllm_share,
    }
    passes = 2 if separate else 1
    working = {
        "activations": passes * activation_bytes(policy, mb * seq, e, model.gradient_checkpointing),
        "logits + entropy fp32": mb * (response + 1) * policy.vocab * (e + 12),
    }
    update = training_phases(
        update_held, trained, target, working, cfg.gradient_accumulation_steps > 1
    )
    phases = {"generation": generation, "scoring": scoring, "old log-probs": logprobs, **update}
    plan = _peak("ppo", phases, target)
    plan.iteration_s, plan.detail["time_s"] = ppo_iteration_seconds(recipe, policy, reward, target)
    if gen.backend == "vllm_server":
        server = plan_vllm_server(recipe, policy, target)
        plan.detail["server"] = {"peak_bytes": sum(server.values()), "parts": server}
    return plan


def plan_vllm_server(recipe: Recipe, policy: ModelShape, target: Target) -> dict[str, int]:
    """What one vLLM server of `backend: vllm_server` holds, outside the training processes'
    plan: the policy's weights in `model.dtype` (`auto` resolved for a GPU like the target's)
    and the KV cache of the whole `ppo.batch_size` (every process's prompts reach it) at
    `data.prompts.max_tokens + max_new_tokens` tokens; `async_steps` N >= 1 may have N batches
    in flight at once, so N times that."""
    e = element_bytes(recipe.model.dtype, replace(target, cuda=True))
    batches = max(1, recipe.ppo.generation.async_steps)
    kv = kv_cache_bytes(policy, recipe.ppo.batch_size * sum(ppo_lengths(recipe)), e)
    cache = "KV cache of a batch" if batches == 1 else f"KV cache of {batches} batches (async)"
    return {f"weights {dtype_name(e)}": policy.params * e, cache: batches * kv}


AUDIT_BATCH = 16  # rows the audit generates at once (audit/measure.py)


def plan_audit(
    recipe: Recipe, policy: ModelShape, reward: ModelShape | None, target: Target
) -> StagePlan:
    """The audited policy (adapter on its frozen base) generating batches of AUDIT_BATCH rows,
    then the reward model scoring them."""
    model = recipe.model
    e = element_bytes(model.dtype, target)
    prompt = ppo_lengths(recipe)[0] + recipe.audit.generation.max_new_tokens
    rows = min(AUDIT_BATCH, len(recipe.audit.prompts) * recipe.audit.samples)
    held = {
        **weight_parts(policy, model, target, trains=False),
        "LoRA fp32": 4 * policy.lora_params,
        "reward model": _reward_weights(recipe, reward, target),
    }
    generation = {
        **held,
        "KV cache": kv_cache_bytes(policy, rows * prompt, e),
        "sampling logits fp32": 3 * rows * policy.vocab * 4,
    }
    scoring = {**held, "reward forward": scoring_bytes(recipe, reward, target, rows)}
    return _peak("audit", {"generation": generation, "scoring": scoring}, target)


MERGE_CHECK_PROMPTS, MERGE_CHECK_TOKENS = 4, 64  # the logit check's prompts (stages/merge.py)


def plan_merge(recipe: Recipe, policy: ModelShape, target: Target) -> StagePlan:
    """The base in `merge.dtype` (fp32 when its checkpoint is wider) with the adapter in fp32,
    merged one layer at a time (its fp32 delta added in place), and the logit checks on
    a few prompts: the model's full logits, the adapter model's and the merged model's kept
    rows, their difference and its absolute value."""
    e = element_bytes(recipe.merge.dtype, target)
    e = 4 if policy.stored_bytes > e else e
    tokens = min(MERGE_CHECK_PROMPTS, len(recipe.audit.prompts)) * MERGE_CHECK_TOKENS
    layer = policy.hidden * policy.intermediate  # the largest layer an adapter targets
    parts = {
        f"weights {dtype_name(e)}": policy.params * e,
        "LoRA fp32": 4 * policy.lora_params,
        "one layer's fp32 delta": 4 * layer,
        "logits fp32 (check)": 4 * tokens * policy.vocab * 4,
        "forward": forward_bytes(policy, tokens, e),
    }
    return _peak("merge", {"merge": parts}, target)


# ── time ────────────────────────────────────────────────────────────────────────────────────────


def ppo_iteration_seconds(
    recipe: Recipe, policy: ModelShape, reward: ModelShape | None, target: Target
) -> tuple[float, dict[str, float]]:
    """Seconds of one PPO iteration on one process at the target's peak figures (a lower
    bound): generation reads the weights (and the KV cache) once per decoded token, bandwidth
    bound; the prefill, the reward, old and reference passes are forwards (2·N FLOPs a token);
    each epoch's update costs 6·N a token (4·N with LoRA: no weight gradients of the frozen
    base), plus 2·N recomputed with gradient checkpointing."""
    cfg, model = recipe.ppo, recipe.model
    prompt, response = ppo_lengths(recipe)
    rows = math.ceil(cfg.batch_size / target.processes)
    n = policy.params
    flops = target.tflops * 1e12
    stored = sum(weight_parts(policy, model, target, trains=False).values())
    e = element_bytes(model.dtype, target)
    kv_read = kv_cache_bytes(policy, rows * (prompt + response // 2), e)
    decode = response * (stored + kv_read) / (target.bandwidth_gbs * 1e9)
    tokens = rows * (prompt + response)
    train_per_token = (4 if model.lora.enabled else 6) + (2 if model.gradient_checkpointing else 0)
    reward_n = reward.params if reward is not None else 0
    parts = {
        "generation": decode + 2 * n * rows * prompt / flops,
        "reward": 2 * reward_n * rows * min(prompt + response, recipe.reward.max_length) / flops,
        "old + reference log-probs": 2 * 2 * n * tokens / flops,
        "update": cfg.ppo_epochs * train_per_token * n * tokens / flops,
    }
    return sum(parts.values()), parts


# ── the plan ────────────────────────────────────────────────────────────────────────────────────


@dataclass
class Plan:
    """The planned stages, in the order they run, on one target."""

    stages: dict[str, StagePlan]
    target: Target

    @property
    def peak_bytes(self) -> int:
        """The largest peak on the target's memory (a stage on the host does not count)."""
        return max((s.peak_bytes for s in self.stages.values() if not s.on_host), default=0)

    @property
    def fits(self) -> bool:
        return self.target.memory_bytes is None or self.peak_bytes <= self.target.memory_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "memory_bytes": self.target.memory_bytes,
            "peak_bytes": self.peak_bytes,
            "processes": self.target.processes,
            "sharding": self.target.sharding,
            "stages": {name: s.to_json() for name, s in self.stages.items()},
        }


def offline_stages(recipe: Recipe) -> list[str]:
    """The offline stages the plan sizes when asked (`--stage dpo`): another path than
    train-rm and ppo, so never in the recipe's whole plan; only with `data.preferences`."""
    return list(OFFLINE_STAGES) if recipe.data.preferences is not None else []


def recipe_stages(recipe: Recipe) -> list[str]:
    """The stages the recipe runs, in order."""
    stages = ["sft"] if recipe.sft.enabled else []
    if recipe.reward.base_model is not None:
        stages.append("train-rm")
    stages += ["ppo", "audit"]
    return stages + (["merge"] if recipe.model.lora.enabled else [])


def plan_merge_on(recipe: Recipe, policy: ModelShape, target: Target) -> StagePlan:
    """`plan_merge` on the device the merge runs on: the CPU's memory, outside the fit, with
    `merge.device: cpu` on a GPU target."""
    if recipe.merge.device == "cpu" and target.cuda:
        return replace(plan_merge(recipe, policy, replace(target, cuda=False)), on_host=True)
    return plan_merge(recipe, policy, target)


def plan_recipe(
    recipe: Recipe, configs: Configs, target: Target, stages: list[str] | None = None
) -> Plan:
    """The `stages` of `recipe` (default: every stage it runs) planned on `target` (the CPU's
    memory with `run.device: cpu`); each model's shape is read only when a stage needs it."""
    if recipe.run.device == "cpu":
        target = replace(target, cuda=False)
    policy = functools.cache(lambda: model_shape(configs.policy, True, recipe.model.lora))

    @functools.cache
    def reward() -> ModelShape | None:
        if configs.reward is None:
            return None
        return model_shape(configs.reward, False, recipe.reward.lora)

    build = {
        "sft": lambda: plan_sft(recipe, policy(), target),
        "train-rm": lambda: plan_train_rm(recipe, reward(), target),
        "ppo": lambda: plan_ppo(recipe, policy(), reward(), target),
        "audit": lambda: plan_audit(recipe, policy(), reward(), target),
        "merge": lambda: plan_merge_on(recipe, policy(), target),
        **{
            stage: functools.partial(plan_offline, recipe, stage, policy(), target)
            for stage in OFFLINE_STAGES
        },
    }
    wanted = recipe_stages(recipe) if stages is None else stages
    return Plan({stage: build[stage]() for stage in wanted}, target)


def planned_stage_peak(recipe: Recipe, stage: str | None) -> int | None:
    """The plan's peak for `stage` (a `recipe_stages` name) on the device the stage runs on,
    for its manifest; None for a stage the plan does not count or a config it cannot read.
    Only that stage is planned (a 7B config's meta-device build takes a fraction of a second
    once transformers is imported, as it is by then in every stage)."""
    import os

    import torch

    if stage not in recipe_stages(recipe) + offline_stages(recipe):
        return None
    from rlhf_cli.modeling import resolve_dtype

    cuda = recipe.run.device != "cpu" and torch.cuda.is_available()
    bf16 = cuda and resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    target = Target(cuda=cuda, bf16=bf16, processes=int(os.environ.get("WORLD_SIZE", "1")))
    try:
        configs = read_configs(recipe)
    except RlhfError:
        return None
    return plan_recipe(recipe, configs, target, [stage]).stages[stage].peak_bytes
