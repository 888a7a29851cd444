"""The names the recipe offers that other layers act on, each declared once with its flags: the
advantage estimators (ppo/estimators.py attaches their functions), the generation backends, the
built-in models' prefix. The schema's `Literal` types are built from these tables."""

from __future__ import annotations

from typing import Literal, NamedTuple


class EstimatorFlags(NamedTuple):
    needs_critic: bool  # a value head or model is built, values computed, a value loss trained
    grouped: bool  # compares the completions of one prompt (`ppo.num_generations` >= 2)


ESTIMATORS: dict[str, EstimatorFlags] = {
    "gae": EstimatorFlags(needs_critic=True, grouped=False),
    "rloo": EstimatorFlags(needs_critic=False, grouped=True),
    "grpo": EstimatorFlags(needs_critic=False, grouped=True),
    "reinforce_pp": EstimatorFlags(needs_critic=False, grouped=False),
}
EstimatorName = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]

GENERATION_BACKENDS = ("hf", "vllm", "vllm_server")
GenerationBackend = Literal[GENERATION_BACKENDS]  # type: ignore[valid-type]
VLLM_BACKENDS = ("vllm", "vllm_server")  # both serve the policy's full-precision weights

BUILTIN_PREFIX = "builtin:"  # `builtin:<name>`: a model built or shipped offline (tiny.py)

# `reward.functions: [{function: builtin:<name>}]`: verifiable rewards (verifiable.py attaches
# their functions)
BUILTIN_REWARDS = ("math_accuracy", "think_format", "overlong")
