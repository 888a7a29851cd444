"""The bytes of each part a stage holds (weights, 4-bit scales, trained weights, gradients and
AdamW, activations, logits, KV cache) and a training step's two candidate peaks; docs/plan.md,
"What is counted", gives each formula and what it leaves out."""

from __future__ import annotations

from rlhf_cli.plan.gpus import MIB, Target
from rlhf_cli.plan.shapes import ELEMENT_BYTES, ModelShape
from rlhf_cli.recipe import ModelSection

CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context + cuBLAS workspace, outside torch's allocator
NF4_BLOCK = 64  # weights per absmax block (bitsandbytes' 4-bit default)
DOUBLE_QUANT_BLOCK = 256  # absmax values per second-level fp32 constant
# TRL's fused LM head (SFTTrainer): tiles of at most TRL_TOKEN_TILE positions x TRL_VOCAB_TILE
# vocabulary columns (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, trl/trainer/utils.py
# _CHUNKED_LOGPROB_CHUNK_SIZE; tests/unit/test_plan.py checks them against the installed TRL)
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768
# fp32 copies of a tile its torch fallback (no Triton: the CPU) holds at once in the backward,
# `_backward_tile`: scaled logits (2), log p, p, the gradient, the one-hot and target - p
CPU_TILE_FP32_COPIES = 7


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
    return {f"weights {dtype_name(e)}": shape.params * e}


def dtype_name(e: int) -> str:
    """How a part's label names `e`-byte elements."""
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


def sharded(parts: dict[str, int], target: Target) -> dict[str, int]:
    """Weights divided by the processes under ZeRO-3 and FSDP (the update's view)."""
    if target.sharding not in ("zero3", "fsdp") or target.processes == 1:
        return parts
    return {name: size // target.processes for name, size in parts.items()}
