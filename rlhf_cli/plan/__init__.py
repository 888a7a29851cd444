"""`rlhf plan`: each stage's peak accelerator memory per process and the time of one PPO
iteration, from the recipe and the models' `config.json` alone (no weights are loaded).

- `gpus`: the GPU table, `--memory` sizes and the `Target` a plan runs on;
- `shapes`: the models' configs and their shapes, built on the meta device;
- `parts`: the bytes of each part a stage holds (docs/plan.md, "What is counted");
- `memory`: each stage's peak, one PPO iteration's time, the recipe's plan, and what a
  `vllm_server` backend's server holds beside it;
- `suggest`: the recipe changes that bring a plan under the memory.
"""

from rlhf_cli.plan.gpus import (
    GIB,
    GPUS,
    MIB,
    SHARDINGS,
    Gpu,
    Sharding,
    Target,
    find_gpu,
    parse_bytes,
)
from rlhf_cli.plan.memory import (
    Plan,
    StagePlan,
    offline_stages,
    plan_audit,
    plan_merge,
    plan_merge_on,
    plan_offline,
    plan_ppo,
    plan_recipe,
    plan_sft,
    plan_train_rm,
    plan_vllm_server,
    planned_stage_peak,
    ppo_iteration_seconds,
    ppo_lengths,
    recipe_stages,
    scoring_bytes,
)
from rlhf_cli.plan.parts import (
    CUDA_CONTEXT_BYTES,
    TRL_TOKEN_TILE,
    TRL_VOCAB_TILE,
    activation_bytes,
    element_bytes,
    forward_bytes,
    fused_head_parts,
    kv_cache_bytes,
    nf4_bytes,
    optimizer_parts,
    training_phases,
    weight_parts,
)
from rlhf_cli.plan.shapes import Configs, ModelShape, load_config, model_shape, read_configs
from rlhf_cli.plan.suggest import Suggestion, candidate_sets, suggest, with_sets

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "GIB",
    "GPUS",
    "MIB",
    "SHARDINGS",
    "TRL_TOKEN_TILE",
    "TRL_VOCAB_TILE",
    "Configs",
    "Gpu",
    "ModelShape",
    "Plan",
    "Sharding",
    "StagePlan",
    "Suggestion",
    "Target",
    "activation_bytes",
    "candidate_sets",
    "element_bytes",
    "find_gpu",
    "forward_bytes",
    "fused_head_parts",
    "kv_cache_bytes",
    "load_config",
    "model_shape",
    "nf4_bytes",
    "offline_stages",
    "optimizer_parts",
    "parse_bytes",
    "plan_audit",
    "plan_offline",
    "plan_merge",
    "plan_merge_on",
    "plan_ppo",
    "plan_recipe",
    "plan_sft",
    "plan_train_rm",
    "plan_vllm_server",
    "planned_stage_peak",
    "ppo_iteration_seconds",
    "ppo_lengths",
    "read_configs",
    "recipe_stages",
    "scoring_bytes",
    "suggest",
    "training_phases",
    "weight_parts",
    "with_sets",
]
