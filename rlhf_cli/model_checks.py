"""What a loaded model must fit, checked before any text reaches it, each a one-line error
naming the recipe field: the recipe's lengths against its context, its tokenizer against its
embeddings, LoRA target names against its modules."""

from __future__ import annotations

from typing import Any

from torch import nn

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.recipe import LoraSection


def check_lora_targets(model: nn.Module, lora: LoraSection, field: str) -> None:
    """Every name in `lora.target_modules` (the recipe field `field`) matches a module of
    `model`, as peft matches it (the whole name or its last parts): peft refuses a list of which
    none matches with a traceback, and trains fewer layers than asked, silently, when only some
    do (a typo beside `q_proj`)."""
    if lora.target_modules == "all-linear":
        return
    names = [name for name, _ in model.named_modules()]
    missing = [
        target
        for target in lora.target_modules
        if not any(name == target or name.endswith("." + target) for name in names)
    ]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ModelLoadError(
            f"{field}: {', '.join(missing)} names no module of the model; its linear layers are "
            f"{', '.join(linear)} (or write all-linear)"
        )


def model_context(model: Any) -> int | None:
    """The most tokens `model` takes in one sequence: its (text) config's
    `max_position_embeddings` (GPT-2's `n_positions` through its attribute map) less the
    positions its table keeps before the first token's (`reserved_positions`: RoBERTa's 514
    take 512 tokens); None where the config gives none."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return None
    return context - reserved_positions(model)


def reserved_positions(model: Any) -> int:
    """Rows of `model`'s learned position table that no token uses: RoBERTa-style embeddings
    (RoBERTa, XLM-R, CamemBERT, Longformer...) number positions from `padding_idx + 1`, the
    padding index of their `position_embeddings`; 0 for every other model."""
    for module in getattr(model, "modules", list)():
        table = getattr(module, "position_embeddings", None)
        if isinstance(table, nn.Embedding) and table.padding_idx is not None:
            return table.padding_idx + 1
    return 0


def check_context(model: Any, lengths: dict[str, int], whose: str) -> None:
    """The recipe's `lengths` (field -> tokens) together fit `model`'s context (`whose`: the
    policy, the reward model), checked before any text reaches it: a model with learned
    positions (BERT, GPT-2) fails on the first longer sequence (an index error, on CUDA a
    device-side assert), a rotary one runs past what it was trained on, and vLLM refuses."""
    context, need = model_context(model), sum(lengths.values())
    if context is None or need <= context:
        return
    fields = " + ".join(lengths)
    values = " + ".join(str(v) for v in lengths.values())
    shown = f"({values} = {need})" if len(lengths) > 1 else f"({need})"
    what = "it" if len(lengths) == 1 else "their sum"
    raise ModelLoadError(
        f"{fields} {shown} exceeds {whose}'s context of {context} tokens: make {what} at most "
        f"{context}"
    )


def check_vocab(model: Any, tokenizer: Any, field: str, whose: str) -> None:
    """`tokenizer` (the recipe field `field` names it, or the model's own) gives no token id
    past `model`'s embeddings (`whose`: the policy, the reward model): such an id fails the
    forward (an index error, on CUDA a device-side assert) at the first text that has it. A
    model that names no input embeddings has nothing to check against."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is not None and tokenizer is not None and len(tokenizer) > vocab:
        raise ModelLoadError(
            f"{field}: the tokenizer has {len(tokenizer)} tokens but {whose} only {vocab} "
            f"embeddings: set {field} to the model's own tokenizer"
        )
