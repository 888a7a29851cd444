"""What to change when a plan is over the memory: the recipe's candidate `--set` changes in the
order they cost the least, each re-planned, and ZeRO-3 over more processes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlhf_cli.plan.gpus import Target
from rlhf_cli.plan.memory import plan_recipe
from rlhf_cli.plan.shapes import Configs
from rlhf_cli.recipe import Recipe, parse_recipe
from rlhf_cli.recipe.names import VLLM_BACKENDS


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
    """One change each, in the order they cost the least: checkpointing, 4-bit (not with a vLLM
    engine or server, which serve full-precision weights), halved
    mini-batches (accumulating more steps, so the optimiser step sees as many rollouts),
    halved responses, vLLM's share and sleep, halved SFT / reward batches."""
    model, ppo, gen = recipe.model, recipe.ppo, recipe.ppo.generation
    out: list[list[str]] = []
    if not model.gradient_checkpointing:
        out.append(["model.gradient_checkpointing=true"])
    engines = {gen.backend, recipe.audit.generation.backend}
    if not model.quantization.load_in_4bit and not engines & set(VLLM_BACKENDS):  # full weights
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
