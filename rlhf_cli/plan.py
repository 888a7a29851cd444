"""`rlhf plan`: each stage's peak accelerator memory per process and the time of one PPO
iteration, from the recipe and the models' `config.json` alone (no weights are loaded).

Configs come from the config: the model is built on the meta device (no storage), so parameter
counts, the linear layers bitsandbytes quantises and the LoRA adapter's size are exact for any
architecture transformers knows. Memory is counted the way the stages hold it (docs/plan.md):

- weights in `model.dtype`; 4-bit NF4 linear layers at half a byte a weight plus their block
  scales (one absmax per 64 weights: fp32, or 8-bit with a second fp32 level per 256 blocks
  under double quantisation); the rest in `model.dtype` (`modeling.make_trainable` freezes a
  4-bit base without peft's fp32 upcast);
- what trains in fp32 (LoRA + value head, or every weight), its fp32 gradients and AdamW's two
  fp32 moments;
- activations kept for the backward pass per token and layer, `8h + 4kv + 4I` elements
  (norm inputs and outputs, q/k/v, attention output, a gated MLP's four intermediates, two
  for a plain MLP; SDPA keeps no score matrix), or only each layer's input plus one
  recomputed layer with gradient checkpointing;
- a training step peaks either in its forward/backward pass (activations, logits, AdamW's
  moments; gradients only when they accumulate over micro-batches: they are freed after each
  optimizer step) or in the optimizer step (gradients and moments, the activations freed);
- full-vocabulary logits: PPO's update keeps them in the compute dtype and its entropy makes
  three fp32 copies at once (`ppo/loop.py`); the rollout's old and reference passes hold two
  in the compute dtype; SFT never builds them: TRL's fused LM head projects tiles into one
  buffer (`fused_head_parts`);
- the generation KV cache (`2 · layers · kv` elements per token), or vLLM's fixed share;
- the reward model in `reward.dtype`; the reference is the policy with its adapter disabled
  (nothing extra) or, without LoRA, a frozen copy;
- ZeRO-2 divides gradients and optimizer states by the number of processes, ZeRO-3 and FSDP
  also the weights during the update (the rollout gathers them whole).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rlhf_cli.errors import ModelLoadError, RlhfError
from rlhf_cli.recipe import LoraSection, ModelSection, Recipe, parse_recipe

GIB = 1024**3
MIB = 1024**2
Sharding = Literal["none", "zero2", "zero3", "fsdp"]
SHARDINGS: tuple[str, ...] = ("none", "zero2", "zero3", "fsdp")
CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context + cuBLAS workspace, outside torch's allocator
NF4_BLOCK = 64  # weights per absmax block (bitsandbytes' 4-bit default)
DOUBLE_QUANT_BLOCK = 256  # absmax values per second-level fp32 constant
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# TRL's fused LM head (SFTTrainer): tiles of at most TRL_TOKEN_TILE positions x TRL_VOCAB_TILE
# vocabulary columns (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, trl/trainer/utils.py
# _CHUNKED_LOGPROB_CHUNK_SIZE; tests/unit/test_plan.py checks them against the installed TRL)
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768
# fp32 copies of a tile its torch fallback (no Triton: the CPU) holds at once in the backward,
# `_backward_tile`: scaled logits (2), log p, p, the gradient, the one-hot and target - p
CPU_TILE_FP32_COPIES = 7


@dataclass(frozen=True)
class Gpu:
    """A GPU's figures: memory as `nvidia-smi` reports it, dense bf16 tensor TFLOPS (fp16 on
    the T4, which has no bf16) and memory bandwidth, from the vendors' spec sheets."""

    memory_bytes: int
    tflops: float
    bandwidth_gbs: float
    bf16: bool = True


GPUS: dict[str, Gpu] = {
    "T4": Gpu(15360 * MIB, 65.0, 320.0, bf16=False),
    "A10G": Gpu(23028 * MIB, 70.0, 600.0),
    "L4": Gpu(23034 * MIB, 121.0, 300.0),
    "RTX-4090": Gpu(24564 * MIB, 165.0, 1008.0),
    "A100-40GB": Gpu(40960 * MIB, 312.0, 1555.0),
    "A100-80GB": Gpu(81920 * MIB, 312.0, 2039.0),
    "H100": Gpu(81559 * MIB, 989.0, 3350.0),
    "H200": Gpu(143771 * MIB, 989.0, 4800.0),
}


def find_gpu(name: str) -> Gpu:
    """The table's GPU called `name`, matched without case, spaces or dashes (`a100-40gb`,
    `RTX 4090`, `4090`)."""
    wanted = re.sub(r"[^a-z0-9]", "", name.lower())
    for key, gpu in GPUS.items():
        plain = re.sub(r"[^a-z0-9]", "", key.lower())
        if wanted in (plain, plain.removeprefix("rtx")):
            return gpu
    raise RlhfError(f"unknown GPU '{name}': choose one of {', '.join(GPUS)} or pass --memory")


def parse_bytes(text: str) -> int:
    """`24GiB` or `24G` (powers of 1024), `24GB` (powers of 1000), `512MiB`, or bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([KMGT])(i?)(B?))?\s*", text, re.I)
    if match is None:
        raise RlhfError(f"--memory {text}: write it as a size such as 24GiB, 40GB or 512MiB")
    number, prefix, binary, unit = match.groups()
    power = " KMGT".index((prefix or " ").upper())
    base = 1000 if unit and not binary else 1024
    return int(float(number) * base**power)


@dataclass(frozen=True)
class Target:
    """Where the plan runs: the memory there (None: unknown, nothing to fit), peak compute and
    bandwidth, whether it is a CUDA GPU (the CPU: no CUDA context, float32 for `auto`)."""

    memory_bytes: int | None = None
    tflops: float = GPUS["A100-80GB"].tflops
    bandwidth_gbs: float = GPUS["A100-80GB"].bandwidth_gbs
    cuda: bool = True
    bf16: bool = True
    processes: int = 1
    sharding: Sharding = "none"


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model, read from its config (see `model_shape`)."""

    params: int
    linear_params: int  # in the linear layers bitsandbytes quantises (all but the output head)
    lora_params: int  # a LoRA adapter of the recipe's rank on its target modules
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int  # key (or value) width of one token in one layer
    vocab: int
    gated: bool = True  # a gated MLP (SwiGLU: gate and up projections) or a plain one (GELU)
    stored_bytes: int = 4  # bytes of a weight in its checkpoint (the config's dtype)


def load_config(source: str, trust_remote_code: bool = False, gguf_file: str | None = None) -> Any:
    """The transformers config of `source`: a `config.json` file, a folder (with `gguf_file`:
    read from that GGUF's metadata, nothing dequantized), a `builtin:` model (resolved as the
    stages resolve it) or a hub id already in the local cache; never a download."""
    from transformers import AutoConfig

    from rlhf_cli.modeling import resolve_model_path

    path = Path(source)
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent, trust_remote_code=trust_remote_code)
    if gguf_file is not None:
        from rlhf_cli.tiny import gguf_config

        return gguf_config(path / gguf_file)
    try:
        return AutoConfig.from_pretrained(
            resolve_model_path(source), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError):
        raise ModelLoadError(
            f"cannot read the config of '{source}' offline: pass its config.json with --config "
            "(the policy) or --reward-config (the reward model)"
        ) from None


def model_shape(config: Any, causal: bool, lora: LoraSection | None) -> ModelShape:
    """Parameter counts of `config`'s model built on the meta device (a causal LM, or a
    1-logit sequence classifier), and its layer widths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.device("meta"):
        if causal:
            model = AutoModelForCausalLM.from_config(config)
        else:
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
    head = model.get_output_embeddings() if causal else None
    linear = lora_params = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        linear += sum(p.numel() for p in module.parameters(recurse=False))
        if lora is not None and lora.enabled and _targeted(name, lora):
            lora_params += lora.r * (module.in_features + module.out_features)
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    widening = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widening = [m for m in widening if m.out_features == intermediate and m.in_features == hidden]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    stored = getattr(config, "dtype", None)
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        linear_params=linear,
        lora_params=lora_params,
        hidden=hidden,
        layers=config.num_hidden_layers,
        intermediate=intermediate,
        kv_dim=kv_heads * head_dim,
        vocab=config.vocab_size,
        gated=len(widening) >= 2 * config.num_hidden_layers,
        stored_bytes=ELEMENT_BYTES.get(str(stored).removeprefix("torch."), 4),
    )


def _targeted(name: str, lora: LoraSection) -> bool:
    if lora.target_modules == "all-linear":
        return not name.endswith(("score", "classifier"))
    return name.rsplit(".", 1)[-1] in lora.target_modules


# ── the parts ───────────────────────────────────────────────────────────────────────────────────


def element_bytes(dtype: str, target: Target) -> int:
    """Bytes of one element of a recipe dtype; `auto` as `modeling.resolve_dtype` picks it."""
    if dtype == "auto":
        return 2 if target.cuda and target.bf16 else 4
    return ELEMENT_BYTES[dtype]


def nf4_bytes(weights: int, double_quant: bool) -> int:
    """4-bit weights and their block scales: an fp32 absmax per 64 weights, or an 8-bit one
    plus an fp32 constant per 256 blocks with double quantisation."""
    if double_quant:
        scales = weights / NF4_BLOCK + 4 * weights / (NF4_BLOCK * DOUBLE_QUANT_BLOCK)
    else:
        scales = 4 * weights / NF4_BLOCK
    return int(weights / 2 + scales)


def weight_parts(shape: ModelShape, model: ModelSection, target: Target, trains: bool) -> dict:
    """The base weights as loaded: 4-bit (the rest in the dtype, trained or not: a 4-bit base
    is frozen without an fp32 upcast), fp32 when every weight trains, else in `model.dtype`."""
    e = element_bytes(model.dtype, target)
    q = model.quantization
    if q.load_in_4bit:
        rest = shape.params - shape.linear_params
        return {
            "weights 4-bit + scales": nf4_bytes(shape.linear_params, q.double_quant),
            "weights not quantised": rest * e,
        }
    if trains and not model.lora.enabled:
        return {"weights fp32 (trained)": shape.params * 4}
    return {f"weights {_dtype_name(e)}": shape.params * e}


def _dtype_name(e: int) -> str:
    return "fp32" if e == 4 else "16-bit"


def trainable_params(shape: ModelShape, model: ModelSection) -> int:
    return shape.lora_params if model.lora.enabled else shape.params


def mlp_intermediates(shape: ModelShape) -> int:
    """Intermediate-width tensors a training MLP keeps: gate, up, act(gate), their product; or
    the input projection's output and its activation."""
    return 4 if shape.gated else 2


def optimizer_parts(trained: int, target: Target) -> dict[str, int]:
    """fp32 gradients and AdamW's two fp32 moments of `trained` parameters, divided by the
    processes under ZeRO and FSDP."""
    share = target.processes if target.sharding != "none" else 1
    return {"gradients fp32": 4 * trained // share, "AdamW m+v fp32": 8 * trained // share}


def activation_bytes(shape: ModelShape, tokens: int, e: int, checkpointing: bool) -> int:
    """Activations kept for the backward pass of `tokens` tokens: `8h + 4kv + 4I` elements per
    token and layer (`2I` for a plain MLP); with checkpointing only each layer's input plus one
    layer recomputed."""
    per_layer = 8 * shape.hidden + 4 * shape.kv_dim + mlp_intermediates(shape) * shape.intermediate
    if checkpointing:
        return tokens * e * (shape.layers * shape.hidden + per_layer)
    return tokens * e * shape.layers * per_layer


def forward_bytes(shape: ModelShape, tokens: int, e: int) -> int:
    """A forward pass without gradients: one layer's working set at a time (the residual and
    the norm's output; act(gate), up and their product, or the two of a plain MLP)."""
    return tokens * e * (2 * shape.hidden + (3 if shape.gated else 2) * shape.intermediate)


def kv_cache_bytes(shape: ModelShape, tokens: int, e: int) -> int:
    return tokens * e * 2 * shape.layers * shape.kv_dim


def fused_head_parts(shape: ModelShape, tokens: int, e: int, target: Target) -> dict[str, int]:
    """TRL's fused LM head (SFTTrainer) scores `tokens` positions without the whole logits:
    one buffer of (min(tokens, 4096), 32768) in the compute dtype, whatever the vocabulary's
    width; on the CPU (no Triton) its torch fallback also holds CPU_TILE_FP32_COPIES fp32
    copies and a bool mask of the (positions, min(vocab, 32768)) tile in the backward."""
    rows = min(tokens, TRL_TOKEN_TILE)
    parts = {"LM head tile buffer (TRL)": rows * TRL_VOCAB_TILE * e}
    if not target.cuda:
        tile = rows * min(shape.vocab, TRL_VOCAB_TILE)
        parts["LM head tile, CPU fallback"] = tile * (4 * CPU_TILE_FP32_COPIES + 1)
    return parts


def training_phases(
    held: dict[str, int], trained: int, target: Target, working: dict[str, int], accumulates: bool
) -> dict[str, dict[str, int]]:
    """A training step's two candidate peaks: the forward/backward pass (what is held, AdamW's
    moments, the micro-batch's `working` set; the gradients too when they accumulate over
    micro-batches) and the optimizer step (gradients and moments; the activations are freed).
    Gradients are set to None after each step, so the first micro-batch's pass has none."""
    optimizer = optimizer_parts(trained, target)
    gradients = {"gradients fp32": optimizer.pop("gradients fp32")}
    during_pass = gradients if accumulates else {}
    return {
        "forward + backward": {**held, **optimizer, **during_pass, **working},
        "optimizer step": {**held, **gradients, **optimizer},
    }


def _sharded(parts: dict[str, int], target: Target) -> dict[str, int]:
    """Weights divided by the processes under ZeRO-3 and FSDP (the update's view)."""
    if target.sharding not in ("zero3", "fsdp") or target.processes == 1:
        return parts
    return {name: size // target.processes for name, size in parts.items()}


# ── the stages ──────────────────────────────────────────────────────────────────────────────────


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
        _sharded(weights, target), trained, target, working, cfg.gradient_accumulation_steps > 1
    )
    return _peak("sft", phases, target)


def plan_train_rm(recipe: Recipe, reward: ModelShape, target: Target) -> StagePlan:
    """TRL's RewardTrainer: chosen and rejected of `reward.batch_size` pairs in one pass."""
    cfg = recipe.reward
    full = not cfg.lora.enabled
    e = 4 if full else element_bytes(cfg.dtype, target)
    trained = reward.params if full else reward.lora_params
    weights = {"weights fp32 (trained)" if full else f"weights {_dtype_name(e)}": reward.params * e}
    if not full:
        weights["LoRA fp32"] = 4 * reward.lora_params
    tokens = 2 * cfg.batch_size * cfg.max_length
    working = {
        "activations": activation_bytes(reward, tokens, e, recipe.model.gradient_checkpointing)
    }
    phases = training_phases(
        _sharded(weights, target), trained, target, working, cfg.gradient_accumulation_steps > 1
    )
    return _peak("train-rm", phases, target)


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
        weights["LoRA + value head fp32"] = 4 * trained
    elif critic:
        weights["value head fp32"] = 4 * (policy.hidden + 1)
    if not model.lora.enabled:  # the reference is a frozen copy
        weights[f"reference {_dtype_name(e)}"] = policy.params * e
    return weights, trained


def plan_ppo(
    recipe: Recipe, policy: ModelShape, reward: ModelShape | None, target: Target
) -> StagePlan:
    """PPO per process: the models (policy, trained weights and AdamW, critic, reference,
    reward model, vLLM's share) held throughout, plus the largest of its phases: generation
    (KV cache), scoring (the reward model's forward), the old / reference log-prob pass (two
    logits tensors) and the update's forward/backward (activations, logits with the entropy's
    fp32 copies) or optimizer step (gradients)."""
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
    held = {"reward model": _reward_weights(recipe, reward, target)}
    rollout = {
        **weights,
        **held,
        "AdamW m+v fp32": optimizer_parts(trained, target)["AdamW m+v fp32"],
        "vLLM share": vllm_share,
    }
    generation = {
        **rollout,
        "KV cache": 0 if vllm else kv_cache_bytes(policy, rows * seq, e),
        "sampling logits fp32": 0 if vllm else 3 * rows * policy.vocab * 4,
    }
    scoring = {**rollout, "reward forward": scoring_bytes(recipe, reward, target, rows)}
    logprobs = {**rollout, "old + reference logits": 2 * mb * (response + 1) * policy.vocab * e}
    update_held = {
        **_sharded(weights, target),
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
    return plan


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
        f"weights {_dtype_name(e)}": policy.params * e,
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


def recipe_stages(recipe: Recipe) -> list[str]:
    """The stages the recipe runs, in order."""
    stages = ["sft"] if recipe.sft.enabled else []
    if recipe.reward.base_model is not None:
        stages.append("train-rm")
    stages += ["ppo", "audit"]
    return stages + (["merge"] if recipe.model.lora.enabled else [])


@dataclass(frozen=True)
class Configs:
    """The transformers configs of the policy and of the reward model (None: no model)."""

    policy: Any
    reward: Any | None


def read_configs(
    recipe: Recipe, config: Path | None = None, reward_config: Path | None = None
) -> Configs:
    """The policy's and the reward model's configs (none without a reward model)."""
    model = recipe.model
    gguf = None if config else model.gguf_file
    policy = load_config(str(config or model.name_or_path), model.trust_remote_code, gguf)
    source = reward_config or recipe.reward.pretrained or recipe.reward.base_model
    reward = None if source is None else load_config(str(source), recipe.reward.trust_remote_code)
    return Configs(policy, reward)


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
    }
    wanted = recipe_stages(recipe) if stages is None else stages
    return Plan({stage: build[stage]() for stage in wanted}, target)


# ── what to change ──────────────────────────────────────────────────────────────────────────────


@dataclass
class Suggestion:
    """Recipe fields (`--set` arguments) and launch settings that change the peak."""

    sets: list[str]
    peak_bytes: int
    fits: bool
    launch: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"set": self.sets, "peak_bytes": self.peak_bytes, "fits": self.fits}
        return out | ({"launch": self.launch} if self.launch else {})


def candidate_sets(recipe: Recipe) -> list[list[str]]:
    """One change each, in the order they cost the least: checkpointing, 4-bit, halved
    mini-batches (accumulating more steps, so the optimiser step sees as many rollouts),
    halved responses, vLLM's share and sleep, halved SFT / reward batches."""
    model, ppo, gen = recipe.model, recipe.ppo, recipe.ppo.generation
    out: list[list[str]] = []
    if not model.gradient_checkpointing:
        out.append(["model.gradient_checkpointing=true"])
    if not model.quantization.load_in_4bit:
        out.append(["model.quantization.load_in_4bit=true", "model.lora.enabled=true"])
    mb, acc = ppo.mini_batch_size, ppo.gradient_accumulation_steps
    while mb % 2 == 0:
        mb, acc = mb // 2, acc * 2
        out.append([f"ppo.mini_batch_size={mb}", f"ppo.gradient_accumulation_steps={acc}"])
    tokens = gen.max_new_tokens
    while tokens >= 64:
        tokens //= 2
        out.append([f"ppo.generation.max_new_tokens={tokens}"])
    if gen.backend == "vllm":
        if not gen.vllm.sleep:
            out.append(["ppo.generation.vllm.sleep=true"])
        for share in (0.2, 0.15, 0.1):
            if share < gen.vllm.gpu_memory_utilization:
                out.append([f"ppo.generation.vllm.gpu_memory_utilization={share}"])
    for section in ("sft", "reward"):
        size, acc = (
            getattr(recipe, section).batch_size,
            getattr(recipe, section).gradient_accumulation_steps,
        )
        while size % 2 == 0 and size > 1:
            size, acc = size // 2, acc * 2
            out.append(
                [f"{section}.batch_size={size}", f"{section}.gradient_accumulation_steps={acc}"]
            )
    return out


LAUNCH_CONFIG = {"zero3": "recipes/accelerate/deepspeed_zero3.yaml"}


def suggest(
    recipe: Recipe,
    configs: Configs,
    target: Target,
    limit: int = 6,
    stages: list[str] | None = None,
) -> list[Suggestion]:
    """For a plan of `stages` (default: all) over `target.memory_bytes`: the single changes that
    bring it under, else the changes applied one after another until it fits, and ZeRO-3 over
    more processes; each with the peak it gives. A merge over the memory is moved to the CPU
    (`merge.device=cpu`, first and in every suggestion after it)."""
    memory = target.memory_bytes
    plan = plan_recipe(recipe, configs, target, stages)
    if memory is None or plan.fits:
        return []
    merge = plan.stages.get("merge")
    # a merge over the memory moves to the CPU; every suggestion then carries that change
    base = ["merge.device=cpu"] if merge and not merge.on_host and merge.peak_bytes > memory else []

    def tried(sets: list[str], on: Target = target) -> Suggestion:
        planned = plan_recipe(with_sets(recipe, base + sets), configs, on, stages)
        return Suggestion(base + sets, planned.peak_bytes, planned.fits)

    out = [tried([])] if base else []
    if out and out[0].fits:
        return out
    out += _best_per_field([s for s in map(tried, candidate_sets(recipe)) if s.fits])
    if not any(s.fits for s in out):
        combined: list[str] = []
        for sets in candidate_sets(recipe):
            if not _field_set(combined, sets):
                combined = _merge_sets(combined, sets)
                if (attempt := tried(combined)).fits:
                    out.append(attempt)
                    break
    for processes in (p for p in (2, 4, 8) if p > target.processes):
        sharded = tried([], replace(target, processes=processes, sharding="zero3"))
        if sharded.fits:
            sharded.launch = (
                f"accelerate launch --config_file {LAUNCH_CONFIG['zero3']} --num_processes "
                f"{processes} (rlhf plan --processes {processes} --sharding zero3)"
            )
            out.append(sharded)
            break
    return out[:limit]


def _key(arg: str) -> str:
    return arg.partition("=")[0]


def _field_set(done: list[str], sets: list[str]) -> bool:
    """Whether `done` already sets the first field `sets` sets (a larger halving was taken)."""
    return _key(sets[0]) in {_key(a) for a in done}


def _merge_sets(done: list[str], sets: list[str]) -> list[str]:
    keys = {_key(a) for a in sets}
    return [a for a in done if _key(a) not in keys] + sets


def _best_per_field(fitting: list[Suggestion]) -> list[Suggestion]:
    """Of the fitting changes to one field (the halvings), the mildest: the first one."""
    seen: set[str] = set()
    out = []
    for s in fitting:
        if _key(s.sets[0]) not in seen:
            seen.add(_key(s.sets[0]))
            out.append(s)
    return out


def with_sets(recipe: Recipe, sets: list[str]) -> Recipe:
    """`recipe` with `--set` arguments applied, validated as `rlhf plan --set` would."""
    return parse_recipe(recipe.to_yaml(), "<plan>", None, sets) if sets else recipe


def planned_stage_peak(recipe: Recipe, stage: str | None) -> int | None:
    """The plan's peak for `stage` (a `recipe_stages` name) on the device the stage runs on,
    for its manifest; None for a stage the plan does not count or a config it cannot read.
    Only that stage is planned (a 7B config's meta-device build takes a fraction of a second
    once transformers is imported, as it is by then in every stage)."""
    import os

    import torch

    if stage not in recipe_stages(recipe):
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
