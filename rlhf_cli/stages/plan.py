"""`rlhf plan`: the recipe's plan on the GPU or memory asked for, as one JSON-able dict with
the verdict line and the suggestions (`rlhf_cli/plan/` does the counting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_cli.errors import RlhfError
from rlhf_cli.plan import (
    GIB,
    GPUS,
    SHARDINGS,
    Target,
    find_gpu,
    offline_stages,
    parse_bytes,
    plan_recipe,
    read_configs,
    recipe_stages,
    suggest,
)
from rlhf_cli.recipe import Recipe


def make_target(
    gpu: str | None,
    memory: str | None,
    processes: int = 1,
    sharding: str = "none",
    peaks: tuple[float | None, float | None] = (None, None),
) -> Target:
    """The plan's target from the CLI's options: a table GPU (default A100-80GB's compute
    figures, no memory limit), `--memory` over its memory, `--tflops` / `--bandwidth` over its
    figures."""
    if sharding not in SHARDINGS:
        raise RlhfError(f"--sharding {sharding}: choose one of {', '.join(SHARDINGS)}")
    if sharding != "none" and processes == 1:
        raise RlhfError(f"--sharding {sharding} divides over processes: pass --processes 2 or more")
    card = find_gpu(gpu) if gpu else GPUS["A100-80GB"]
    limit = parse_bytes(memory) if memory else (card.memory_bytes if gpu else None)
    return Target(
        memory_bytes=limit,
        tflops=peaks[0] or card.tflops,
        bandwidth_gbs=peaks[1] or card.bandwidth_gbs,
        bf16=card.bf16,
        processes=processes,
        sharding=sharding,  # type: ignore[arg-type]
    )


def plan_command(
    recipe: Recipe,
    *,
    gpu: str | None = None,
    memory: str | None = None,
    processes: int = 1,
    sharding: str = "none",
    configs: tuple[Path | None, Path | None] = (None, None),
    peaks: tuple[float | None, float | None] = (None, None),
    stages: list[str] | None = None,
) -> dict[str, Any]:
    """`rlhf plan`'s result: `fits`, `memory_bytes`, `stages` (each `peak_bytes`, `parts`,
    PPO's `iteration_s`), `suggestions`, and `verdict`, the one line it ends with. `stages`:
    only these of the recipe's stages (the ones the user will run here)."""
    target = make_target(gpu, memory, processes, sharding, peaks)
    runs = recipe_stages(recipe) + offline_stages(recipe)  # an offline one only when asked
    for stage in stages or []:
        if stage not in runs:
            raise RlhfError(f"--stage {stage}: this recipe runs {', '.join(runs)}")
    wanted = [stage for stage in runs if stage in stages] if stages else None
    read = read_configs(recipe, *configs)
    plan = plan_recipe(recipe, read, target, wanted)
    result = plan.to_json()
    result["suggestions"] = [s.to_json() for s in suggest(recipe, read, target, stages=wanted)]
    result["verdict"] = verdict(plan.stages, target.memory_bytes)
    return result


def verdict(stages: dict[str, Any], memory: int | None) -> str:
    """One line: the peak, and by how much it fits or does not fit `memory` (a stage on the
    host, `merge.device: cpu` on a GPU, is not counted)."""
    counted = {n: s for n, s in stages.items() if not s.on_host} or stages
    name, top = max(counted.items(), key=lambda kv: kv[1].peak_bytes)
    peak = f"peak {top.peak_bytes / GIB:.2f} GiB per process ({name})"
    if memory is None:
        return f"{peak}; pass --gpu or --memory to check that it fits"
    gap = (memory - top.peak_bytes) / GIB
    if gap >= 0:
        return f"fits: {peak}, {gap:.2f} GiB under {memory / GIB:.2f} GiB"
    over = [n for n, s in counted.items() if s.peak_bytes > memory]
    return (
        f"does not fit: {peak} is {-gap:.2f} GiB over {memory / GIB:.2f} GiB "
        f"({', '.join(over)} over); see the suggestions"
    )
