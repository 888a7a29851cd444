"""What the plan needs of a model, from its transformers config alone: the config (never a
download), and the shape built on the meta device (no storage), so parameter counts, the linear
layers bitsandbytes quantises and the LoRA adapter's size are exact for any architecture
transformers knows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.recipe import LoraSection, Recipe

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model, read from its config (see `model_shape`)."""

    params: int
    linear_params: int  # in the linear layers bitsandbytes quantises (all but the output head)
    lora_params: int  # a LoRA adapter of the recipe's rank on its target modules
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int  # key (or value) width of one token in one layer
    vocab: int
    gated: bool = True  # a gated MLP (SwiGLU: gate and up projections) or a plain one (GELU)
    stored_bytes: int = 4  # bytes of a weight in its checkpoint (the config's dtype)


def load_config(source: str, trust_remote_code: bool = False, gguf_file: str | None = None) -> Any:
    """The transformers config of `source`: a `config.json` file, a folder (with `gguf_file`:
    read from that GGUF's metadata, nothing dequantized), a `builtin:` model (resolved as the
    stages resolve it) or a hub id already in the local cache; never a download."""
    from transformers import AutoConfig

    from rlhf_cli.modeling import resolve_model_path

    path = Path(source)
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent, trust_remote_code=trust_remote_code)
    if gguf_file is not None:
        from rlhf_cli.tiny import gguf_config

        return gguf_config(path / gguf_file)
    try:
        return AutoConfig.from_pretrained(
            resolve_model_path(source), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError):
        raise ModelLoadError(
            f"cannot read the config of '{source}' offline: pass its config.json with --config "
            "(the policy) or --reward-config (the reward model)"
        ) from None


def model_shape(config: Any, causal: bool, lora: LoraSection | None) -> ModelShape:
    """Parameter counts of `config`'s model built on the meta device (a causal LM, or a
    1-logit sequence classifier), and its layer widths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.device("meta"):
        if causal:
            model = AutoModelForCausalLM.from_config(config)
        else:
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
    head = model.get_output_embeddings() if causal else None
    linear = lora_params = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        linear += sum(p.numel() for p in module.parameters(recurse=False))
        if lora is not None and lora.enabled and _targeted(name, lora):
            lora_params += lora.r * (module.in_features + module.out_features)
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    widening = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widening = [m for m in widening if m.out_features == intermediate and m.in_features == hidden]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    stored = getattr(config, "dtype", None)
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        linear_params=linear,
        lora_params=lora_params,
        hidden=hidden,
        layers=config.num_hidden_layers,
        intermediate=intermediate,
        kv_dim=kv_heads * head_dim,
        vocab=config.vocab_size,
        gated=len(widening) >= 2 * config.num_hidden_layers,
        stored_bytes=ELEMENT_BYTES.get(str(stored).removeprefix("torch."), 4),
    )


def _targeted(name: str, lora: LoraSection) -> bool:
    if lora.target_modules == "all-linear":
        return not name.endswith(("score", "classifier"))
    return name.rsplit(".", 1)[-1] in lora.target_modules


@dataclass(frozen=True)
class Configs:
    """The transformers configs of the policy and of the reward model (None: no model)."""

    policy: Any
    reward: Any | None


def read_configs(
    recipe: Recipe, config: Path | None = None, reward_config: Path | None = None
) -> Configs:
    """The policy's and the reward model's configs (none without a reward model)."""
    model = recipe.model
    gguf = None if config else model.gguf_file
    policy = load_config(str(config or model.name_or_path), model.trust_remote_code, gguf)
    source = reward_config or recipe.reward.pretrained or recipe.reward.base_model
    reward = None if source is None else load_config(str(source), recipe.reward.trust_remote_code)
    return Configs(policy, reward)
