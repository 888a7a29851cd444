"""Recipes: one YAML file for the whole pipeline, validated once at load.

Every section is a pydantic model with `extra="forbid"`; every field documents itself so that
`docs/recipes.md` is generated from the schema (`python -m rlhf_cli.recipe`). A stage reads the
shared sections (`run`, `model`, `data`) plus its own.

The package, by job: `names` (the names other layers act on, declared once), `base` (the strict
section, the described field, paths), one module per group of sections (`model`, `data`,
`training`, `ppo`, `dpo` with every offline method, `schema` with the whole `Recipe`), `load`
(YAML and `--set`), `errors` (one line per problem), `docs` (the reference page).
"""

from rlhf_cli.recipe.data import DataSection, DataSource, PromptSource, SourceSpec, StageSource
from rlhf_cli.recipe.docs import DATA_LAYOUTS, schema_markdown
from rlhf_cli.recipe.dpo import (
    DPO_LOSSES,
    DpoSection,
    KtoSection,
    OfflineSection,
    OrpoSection,
    SimpoSection,
)
from rlhf_cli.recipe.eval import (
    BenchmarksSection,
    ChecksSection,
    EvalJudgeSection,
    EvalSection,
    GateSection,
)
from rlhf_cli.recipe.load import default_recipe_path, load_recipe, parse_recipe
from rlhf_cli.recipe.model import LoraSection, ModelSection, QuantizationSection, RunSection
from rlhf_cli.recipe.names import BUILTIN_PREFIX, ESTIMATORS
from rlhf_cli.recipe.ppo import GenerationSection, PpoSection, ServerSection, VllmSection
from rlhf_cli.recipe.schema import AuditSection, MergeSection, PushSection, Recipe
from rlhf_cli.recipe.training import RewardFunctionSpec, RewardSection, SftSection, TrainerSection

__all__ = [
    "BUILTIN_PREFIX",
    "DATA_LAYOUTS",
    "DPO_LOSSES",
    "ESTIMATORS",
    "AuditSection",
    "BenchmarksSection",
    "ChecksSection",
    "DataSection",
    "DataSource",
    "DpoSection",
    "EvalJudgeSection",
    "EvalSection",
    "GateSection",
    "GenerationSection",
    "KtoSection",
    "LoraSection",
    "MergeSection",
    "OfflineSection",
    "OrpoSection",
    "ModelSection",
    "PpoSection",
    "PromptSource",
    "PushSection",
    "QuantizationSection",
    "Recipe",
    "RewardFunctionSpec",
    "RewardSection",
    "RunSection",
    "ServerSection",
    "SftSection",
    "SimpoSection",
    "SourceSpec",
    "StageSource",
    "TrainerSection",
    "VllmSection",
    "default_recipe_path",
    "load_recipe",
    "parse_recipe",
    "schema_markdown",
]
