"""One loader for every model of the pipeline: policy, reference, value and reward.

dtype, device placement, 4-bit NF4 through bitsandbytes, LoRA through peft, and a tokenizer that
pads on the left with a pad token (the EOS when the checkpoint has none). The reference policy is
the policy with its PPO adapter off when LoRA is on, so no second copy of the weights is loaded.

An SFT adapter is merged into full-precision base weights, but kept as a frozen adapter (named
`SFT_ADAPTER`) on a 4-bit base, under the PPO adapter: merging into NF4 re-quantises the weights,
and a delta of a few percent of the weight scale mostly falls between NF4's steps (about 13%
of it survived at 4%).

Long because every way a model of the pipeline loads (dtype, device, 4-bit, LoRA, the SFT
adapter, the reference, the reward model, dropout) is decided here once; what a loaded model
must fit is model_checks.py.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.generation import forward_logits
from rlhf_cli.model_checks import check_lora_targets
from rlhf_cli.recipe import (
    BUILTIN_PREFIX,
    LoraSection,
    ModelSection,
    QuantizationSection,
    Recipe,
)
from rlhf_cli.tiny import BUILTINS, check_builtin, gguf_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SFT_ADAPTER = "sft"  # the frozen SFT adapter on a 4-bit base (`load_sft_model`)
PPO_ADAPTER = "default"  # the trained adapter: peft's default name, saved at a folder's root


def resolve_model_path(name: str, gguf_file: str | None = None) -> str:
    """`builtin:<name>` becomes the folder built or shipped offline, `gguf_file` in the folder
    `name` the float folder it is dequantized into once (`tiny.gguf_folder`); anything else is
    kept."""
    if gguf_file is not None:
        return str(gguf_folder(Path(name) / gguf_file))
    if not name.startswith(BUILTIN_PREFIX):
        return name
    key = name.removeprefix(BUILTIN_PREFIX)
    check_builtin(key)
    return str(BUILTINS[key]())


def model_path(name: str, model_cfg: ModelSection) -> str:
    """`resolve_model_path` for a model or tokenizer source of the recipe's `model`: its
    `gguf_file` applies to `model.name_or_path` (not to an SFT model folder built from it)."""
    gguf = model_cfg.gguf_file if name == model_cfg.name_or_path else None
    return resolve_model_path(name, gguf)


def pick_device(device: str) -> torch.device:
    """`auto`: CUDA when present, else the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("run.device is 'cuda' but no CUDA device is visible")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_devices(recipe: Recipe, *generating: Literal["ppo", "audit"]) -> None:
    """Every GPU that a stage loading the policy uses is one this process sees, checked when
    the stage starts, before any model loads (else transformers fails mid-load, vLLM once the
    policy is loaded): a `model.device_map` of `cuda:N`, and the `tensor_parallel_size` of a
    colocated vLLM engine of the sections the stage generates with, `generating` (on CUDA; on
    the CPU it counts processes). A ModelLoadError names the field and the GPUs seen."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    seen = {0: "no CUDA GPU", 1: "1 GPU (cuda:0)"}.get(
        gpus, f"{gpus} GPUs (cuda:0 to cuda:{gpus - 1})"
    )
    named = re.fullmatch(r"cuda(?::(\d+))?", recipe.model.device_map or "")
    if named and int(named[1] or 0) >= gpus:
        fix = "name one of them, or auto" if gpus else "set it to auto or cpu"
        raise ModelLoadError(
            f"model.device_map is {recipe.model.device_map} but this process sees {seen}: {fix}"
        )
    if recipe.run.device == "cpu" or not gpus:
        return
    for section in generating:
        gen = recipe.ppo.generation if section == "ppo" else recipe.audit.generation
        size = gen.vllm.tensor_parallel_size
        if gen.backend == "vllm" and size > gpus:
            raise ModelLoadError(
                f"{section}.generation.vllm.tensor_parallel_size is {size} but this process "
                f"sees {seen}: make it at most {gpus}"
            )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype a recipe's `dtype` names; `auto` is bfloat16 on a CUDA device that
    computes it natively (Ampere and later: torch's emulated bf16 on older GPUs is slow) and
    float32 everywhere else."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float32


def check_bf16(device: torch.device, field: str, user: str) -> None:
    """bfloat16 (the recipe field `field` asks it) on a CUDA GPU before Ampere, where torch
    only emulates it (slowly; asked for, the model gets it) and `user` refuses it with a
    traceback (vLLM does), is a ModelLoadError naming the field."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ModelLoadError(
            f"{field} is bfloat16, which {user} refuses on this GPU (it computes bfloat16 "
            f"natively from Ampere, compute capability 8.0): set {field} to float16 or auto"
        )


def _from_pretrained(cls: Any, path: str, **kwargs: Any) -> Any:
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ModelLoadError(f"cannot load '{path}': {first}") from None


def load_tokenizer(
    name_or_path: str, trust_remote_code: bool = False, padding_side: str = "left"
) -> Any:
    """A tokenizer with a pad token (EOS when missing) and the padding side enforced."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = _from_pretrained(
        AutoTokenizer, path, trust_remote_code=trust_remote_code, padding_side=padding_side
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"tokenizer of '{name_or_path}' has neither a pad nor an EOS token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    if tokenizer.padding_side != padding_side:
        raise ModelLoadError(f"tokenizer of '{name_or_path}' refuses padding_side={padding_side}")
    return tokenizer


def load_policy_tokenizer(model_cfg: ModelSection, source: str, padding_side: str) -> Any:
    """The policy's tokenizer from `source`, with `model.chat_template` set when the recipe
    names one (a built-in's end of turn made one token: `install_chat_template`); with
    `prompt_format: chat` a tokenizer that still has no chat template is a ModelLoadError (one
    line naming the choices), never a silent fall-back to plain text."""
    from rlhf_cli.chat_templates import install_chat_template

    path = model_path(source, model_cfg)
    tokenizer = load_tokenizer(path, model_cfg.trust_remote_code, padding_side)
    if model_cfg.chat_template is not None:
        install_chat_template(tokenizer, model_cfg.chat_template)
    if model_cfg.prompt_format == "chat" and not tokenizer.chat_template:
        raise ModelLoadError(
            f"model.prompt_format is chat but the tokenizer of '{source}' has no chat "
            "template: set model.chat_template (chatml, llama2, hh or a Jinja file), or "
            "model.prompt_format: plain"
        )
    return tokenizer


def bnb_config(q: QuantizationSection, device: torch.device) -> Any:
    """BitsAndBytesConfig for 4-bit, or None. Fails loudly where bitsandbytes cannot quantise."""
    if not q.load_in_4bit:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # an ImportError or a broken native library
        raise ModelLoadError(
            "model.quantization.load_in_4bit needs a working bitsandbytes "
            f"({exc.__class__.__name__}: {exc}); install it or turn 4-bit off"
        ) from None
    if device.type not in ("cuda", "cpu", "xpu"):
        raise ModelLoadError(
            f"bitsandbytes cannot quantise to 4-bit on '{device.type}'; "
            "set model.quantization.load_in_4bit: false"
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
    )


def keep_4bit_unpacked(model: torch.nn.Module) -> torch.nn.Module:
    """Every 4-bit layer of `model` keeps bitsandbytes' standard weight layout on every CPU (its
    AVX512-BF16 packed layout has no backward and changes the log-probs: docs/ppo.md, "4-bit
    weights on the CPU"). Called on every 4-bit model we load (`_load_weights`)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def assert_quantised(model: torch.nn.Module, name: str) -> None:
    """No silent full-precision fallback: a 4-bit load must contain 4-bit linear layers."""
    import bitsandbytes as bnb

    if not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()):
        raise ModelLoadError(f"'{name}' was asked for in 4-bit but no layer was quantised")


def lora_config(lora: LoraSection, task_type: str, no_dropout: bool = False) -> Any:
    """peft's LoraConfig from the recipe; `no_dropout` for PPO, whose ratio needs deterministic
    log-probs (the recipe's dropout applies to SFT)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=0.0 if no_dropout else lora.dropout,
        target_modules=lora.target_modules,
        bias=lora.bias,
        task_type=task_type,
    )


def _load_weights(
    cls: Any,
    name_or_path: str,
    model_cfg: ModelSection,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> Any:
    """Base weights in `dtype` (default: the recipe's), 4-bit if asked, on the device (or the
    recipe's device_map)."""
    path = model_path(name_or_path, model_cfg)
    quant = bnb_config(model_cfg.quantization, device)
    kwargs: dict[str, Any] = {
        "dtype": dtype or resolve_dtype(model_cfg.dtype, device),
        "trust_remote_code": model_cfg.trust_remote_code,
    }
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = model_cfg.device_map or {"": str(device)}
    elif model_cfg.device_map:
        kwargs["device_map"] = model_cfg.device_map
    model = _from_pretrained(cls, path, **kwargs)
    if quant is not None:
        assert_quantised(model, name_or_path)
        keep_4bit_unpacked(model)
    elif not model_cfg.device_map:
        model.to(device)
    fit_end_of_turn(model, model_cfg)
    return model


def fit_end_of_turn(model: Any, model_cfg: ModelSection) -> None:
    """`model` fitted to the end-of-turn token that the recipe's built-in chat template adds to
    the policy's tokenizer (`chat_templates.install_chat_template`): an embedding for it where
    the base has none (`grow_embeddings`), and the token among its generation config's EOS ids,
    which every generator stops on (`generation.stop_token_ids`) and saved models carry. Done on
    every load of the policy's weights (SFT, PPO, critic, audit, merge, serve): they all see
    the same token id."""
    from rlhf_cli.chat_templates import END_OF_TURN, end_of_turn_id

    if model_cfg.chat_template not in END_OF_TURN:
        return
    source = model_cfg.tokenizer or model_cfg.name_or_path
    token = end_of_turn_id(
        load_policy_tokenizer(model_cfg, source, "left"), model_cfg.chat_template
    )
    if token is None:
        return
    grow_embeddings(model, token + 1)
    config = getattr(model, "generation_config", None)
    if config is not None:
        eos = config.eos_token_id
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        config.eos_token_id = ids if token in ids else [*ids, token]


def grow_embeddings(model: Any, vocab: int) -> None:
    """At least `vocab` rows in `model`'s input (and output) embeddings; the new rows are the
    mean of the old ones, not random draws (transformers' default): every load of the base then
    gives the same rows, so an SFT adapter trained over them fits any later load of it."""
    old = model.get_input_embeddings().num_embeddings
    if vocab <= old:
        return
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            if layer is not None:
                layer.weight[old:] = layer.weight[:old].mean(dim=0)


def load_causal_lm(
    name_or_path: str, model_cfg: ModelSection, device: torch.device, *, trainable: bool = True
) -> Any:
    """Base weights (4-bit if asked); when `trainable`, made trainable by `make_trainable` (a
    fresh LoRA adapter if `model.lora.enabled`, else every weight, loaded in fp32). Frozen
    otherwise, in the recipe's dtype."""
    from transformers import AutoModelForCausalLM

    if not trainable:
        return freeze(_load_weights(AutoModelForCausalLM, name_or_path, model_cfg, device))
    return _load_trainable(AutoModelForCausalLM, "CAUSAL_LM", name_or_path, model_cfg, device)


def load_backbone(name_or_path: str, model_cfg: ModelSection, device: torch.device) -> Any:
    """A separate critic's transformer (no LM head), trainable under the policy's settings
    (`make_trainable`: 4-bit base + LoRA, LoRA, or every weight in fp32), LoRA dropout off. It
    never generates, so its KV cache is off."""
    from transformers import AutoModel

    backbone = _load_trainable(
        AutoModel, "FEATURE_EXTRACTION", name_or_path, model_cfg, device, no_dropout=True
    )
    backbone.config.use_cache = False
    return backbone


def _load_trainable(
    cls: Any,
    task_type: str,
    name_or_path: str,
    model_cfg: ModelSection,
    device: torch.device,
    no_dropout: bool = False,
) -> Any:
    full = not model_cfg.lora.enabled  # every weight trains: load fp32 master weights
    model = _load_weights(cls, name_or_path, model_cfg, device, torch.float32 if full else None)
    return make_trainable(model, model_cfg, task_type, no_dropout=no_dropout)


def make_trainable(
    model: Any, model_cfg: ModelSection, task_type: str, *, no_dropout: bool = False
) -> Any:
    """`model` made trainable under the recipe's settings, with fp32 master weights for
    whatever trains (compute may still run in half precision, under autocast):

    - 4-bit base: frozen, every weight left in its dtype, and given LoRA (stacked over the
      frozen SFT adapter of a 4-bit SFT model: `add_ppo_adapter`); not peft's
      `prepare_model_for_kbit_training` (docs/ppo.md, "4-bit weights on the CPU");
    - LoRA: a fresh adapter, the base frozen in its dtype (peft upcasts the adapter to fp32,
      `autocast_adapter_dtype`; `upcast_trainable` makes sure of it);
    - neither: every weight trains, in fp32.

    With `model.gradient_checkpointing`, non-reentrant activation checkpointing (it acts only in
    train mode). `no_dropout`: LoRA dropout off (PPO)."""
    quantised = bool(getattr(model, "is_loaded_in_4bit", False))
    if quantised and not model_cfg.lora.enabled:
        raise ModelLoadError(
            "4-bit weights cannot be trained directly: set model.lora.enabled: true, "
            "or model.quantization.load_in_4bit: false"
        )
    if model_cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if quantised:
        model.requires_grad_(False)
    if model_cfg.lora.enabled:
        if task_type == "CAUSAL_LM":  # a critic's backbone lacks the head a target may name
            check_lora_targets(model, model_cfg.lora, "model.lora.target_modules")
        model = add_ppo_adapter(model, lora_config(model_cfg.lora, task_type, no_dropout))
    else:
        model.requires_grad_(True)
    upcast_trainable(model)
    return model


def has_sft_adapter(model: Any) -> bool:
    """Whether `model` holds an unmerged SFT adapter (a 4-bit SFT model: `load_sft_model`)."""
    return SFT_ADAPTER in getattr(model, "peft_config", {})


def add_ppo_adapter(model: Any, config: Any) -> Any:
    """A fresh trainable LoRA adapter on `model`: wrapping a plain model, or stacked over the
    frozen SFT adapter of a 4-bit SFT model, both active (the new one starts at zero, so the
    policy starts as the SFT model). peft's `set_adapter` makes every active adapter trainable:
    the SFT one is frozen again."""
    from peft import get_peft_model

    if not has_sft_adapter(model):
        return get_peft_model(model, config)
    model.add_adapter(PPO_ADAPTER, config)
    stack_adapters(model)
    return model


def stack_adapters(model: Any) -> None:
    """Both adapters of a 4-bit SFT model active, the trained one first and alone trainable.
    First, because transformers' Trainer resumes a PeftModel (the offline methods' --resume)
    into its first active adapter, and then leaves that one alone active: the stage stacks them
    again once the checkpoint has loaded (`StageCallback.on_train_begin`)."""
    model.base_model.set_adapter([PPO_ADAPTER, SFT_ADAPTER])
    model.base_model.set_requires_grad(SFT_ADAPTER, requires_grad=False)


def with_trained_adapter(sft_model: Any, folder: Path) -> Any:
    """The trained (PPO) adapter saved at `folder` on the SFT model it was trained on
    (`load_sft_model`): wrapping it, or stacked over its frozen SFT adapter on a 4-bit base."""
    from peft import PeftModel

    if not has_sft_adapter(sft_model):
        return PeftModel.from_pretrained(sft_model, str(folder))
    sft_model.load_adapter(str(folder), adapter_name=PPO_ADAPTER)
    sft_model.base_model.set_adapter([SFT_ADAPTER, PPO_ADAPTER], inference_mode=True)
    return sft_model


def save_trained(model: Any, folder: Path) -> None:
    """`model`'s trained weights as `from_pretrained` reads them back: its PPO adapter alone at
    the folder's root (never the frozen SFT adapter under it), or its whole weights. An adapter
    goes without embeddings that a template's token grew (`grow_embeddings`: the same on every
    load)."""
    adapter = {"selected_adapters": [PPO_ADAPTER], "save_embedding_layers": False}
    extra = adapter if hasattr(model, "peft_config") else {}
    model.save_pretrained(folder, state_dict=trainable_state(model), **extra)


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation (gradient) checkpointing on a transformers model or its peft
    wrapper: it recomputes each layer in the backward pass, when the model is in train mode.
    (transformers 5 names it `activation_checkpointing_enable`; `gradient_checkpointing_enable`
    is its deprecated alias.)"""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_checkpointing(model: Any) -> bool:
    """Whether activation checkpointing is on (on the model, or the base under its adapter)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())


HALF = (torch.bfloat16, torch.float16)


def upcast_trainable(model: nn.Module) -> nn.Module:
    """fp32 master weights for every trainable parameter still in half precision: peft keeps
    LoRA A/B in fp32 on a half-precision base but not a `modules_to_save` head (the reward
    model's score), and TRL's SFTTrainer casts a QLoRA adapter to bf16. A module whose own
    weights are upcast casts its floating inputs to fp32 (its output stays fp32: meant for
    heads), so it also runs outside autocast, e.g. when scoring."""
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and p.dtype in HALF]
        for param in own:
            param.data = param.data.float()
        if own and not getattr(module, "_fp32_inputs", False):
            module.register_forward_pre_hook(_inputs_to_fp32)
            module._fp32_inputs = True
    return model


def _inputs_to_fp32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.float() if isinstance(a, Tensor) and a.dtype in HALF else a for a in args)


def mixed_precision(dtype: torch.dtype, device: torch.device) -> str:
    """accelerate's `mixed_precision` for a compute dtype: autocast to bf16 / fp16 on CUDA over
    fp32 master weights; "no" elsewhere (the CPU computes in each weight's own dtype)."""
    if device.type != "cuda":
        return "no"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")


def load_sft_model(
    model_cfg: ModelSection, base: str, sft_adapter: Path | None, device: torch.device
) -> Any:
    """The SFT model, frozen: base weights with the SFT adapter (if any) merged in, or on a
    4-bit base kept as the adapter `SFT_ADAPTER` (a merge would re-quantise it away). It is the
    PPO reference, and the base the PPO adapter is trained on."""
    from peft import PeftModel

    model = load_causal_lm(base, model_cfg.variant(lora=False), device, trainable=False)
    if sft_adapter is None:
        return model
    if getattr(model, "is_loaded_in_4bit", False):
        # the adapter wraps the base's 4-bit layers, already kept unpacked by `_load_weights`
        return freeze(PeftModel.from_pretrained(model, str(sft_adapter), adapter_name=SFT_ADAPTER))
    return PeftModel.from_pretrained(model, str(sft_adapter)).merge_and_unload()


class Reference:
    """The frozen reference policy, the SFT model: the policy with its PPO adapter off (no second
    copy of the weights): only its SFT adapter active on a 4-bit base (`load_sft_model`), else
    every adapter disabled; or a separate frozen model when the policy has no adapter."""

    def __init__(self, policy: nn.Module, frozen_copy: nn.Module | None = None):
        self.policy, self.frozen_copy = policy, frozen_copy

    @contextlib.contextmanager
    def model(self) -> Iterator[nn.Module]:
        if self.frozen_copy is not None:
            yield self.frozen_copy
        elif has_sft_adapter(self.policy):
            with only_adapter(self.policy, SFT_ADAPTER):
                yield self.policy
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @torch.inference_mode()
    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        with self.model() as ref:
            return forward_logits(ref, input_ids, attention_mask)


@contextlib.contextmanager
def only_adapter(model: Any, name: str) -> Iterator[Any]:
    """`model` (a PeftModel) with adapter `name` alone active; afterwards its active adapters,
    and which weights train, as they were (peft's `set_adapter` changes both)."""
    lora = model.base_model
    active = list(lora.active_adapters)
    trains = [p.requires_grad for p in model.parameters()]
    lora.set_adapter(name)
    try:
        yield model
    finally:
        lora.set_adapter(active)
        for param, flag in zip(model.parameters(), trains, strict=True):
            param.requires_grad_(flag)


def load_reward_model(
    name_or_path: str,
    device: torch.device,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    num_labels: int = 1,
) -> Any:
    """A sequence-classification model with one logit (the score). Its pad id is set by the
    `RewardScorer` that uses it, to its tokenizer's."""
    from transformers import AutoModelForSequenceClassification

    path = resolve_model_path(name_or_path)
    model = _from_pretrained(
        AutoModelForSequenceClassification,
        path,
        num_labels=num_labels,
        dtype=resolve_dtype(dtype, device),
        trust_remote_code=trust_remote_code,
    )
    return model.to(device)


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trained weight of `module`, on the CPU."""
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Frozen models (reward, reference) never get gradients and run in eval mode."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


DROPOUT_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Set every dropout probability to `p`, in train mode too (PPO turns dropout off: its ratio
    needs deterministic log-probs, and its update runs in train mode, where gradient
    checkpointing acts). Three places hold a rate: dropout modules (`p`), rates a module copied
    from its config when it was built and reads in forward (Llama attention's
    `attention_dropout`), and the configs themselves (read by code that runs later)."""
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = p
        _set_rates(module, p)
    for config in {id(c): c for c in _configs(model)}.values():
        _set_rates(config, p)


def _is_rate(name: str, value: Any) -> bool:
    """A dropout rate by name (`dropout`, `attention_dropout`, `hidden_dropout_prob`,
    `resid_pdrop`, ...) holding a number (not a flag, a module or None)."""
    named = "dropout" in name or name.endswith("pdrop")
    return named and isinstance(value, (int, float)) and not isinstance(value, bool)


def _set_rates(obj: Any, p: float) -> None:
    for name, value in list(vars(obj).items()):
        if _is_rate(name, value):
            setattr(obj, name, p)


def _configs(model: torch.nn.Module) -> list[Any]:
    return [
        m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")
    ]
