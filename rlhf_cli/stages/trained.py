"""What audit, merge, compare, eval and ppo share: where a run's policy and reward model come
from, loading a trained policy, and the check that a merged adapter still gives its logits.

A policy can be: the run's final PPO output (`runs/<name>/ppo/`) or offline method's
(`runs/<name>/dpo/`, any of `OFFLINE_STAGES`), one PPO checkpoint (`ppo/checkpoints/iter_NNNNN/`),
an adapter folder, or a merged model folder. Each comes with its
reference (the SFT model) when the run has one, so KL and reward can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf_cli.data import audit_prompts
from rlhf_cli.errors import StageError
from rlhf_cli.generation import (
    Generator,
    forward_logits,
    generator_for,
    left_pad,
    tokenize_prompts,
)
from rlhf_cli.model_checks import check_context, check_vocab
from rlhf_cli.modeling import (
    Reference,
    check_bf16,
    freeze,
    load_causal_lm,
    load_policy_tokenizer,
    load_reward_model,
    load_sft_model,
    load_tokenizer,
    make_trainable,
    resolve_dtype,
    set_dropout,
    with_trained_adapter,
)
from rlhf_cli.ppo.checkpoint import checkpoint_state
from rlhf_cli.recipe import GenerationSection, ModelSection, Recipe, RewardSection
from rlhf_cli.record import policy_stage, require
from rlhf_cli.resume import PPO_INDEX, check_same_inputs
from rlhf_cli.rundir import OFFLINE_STAGES, STAGE_COMMANDS, InputRecord, Manifest, RunDir
from rlhf_cli.scoring import RewardScorer


def policy_source(
    recipe: Recipe, run: RunDir, inputs: dict[str, InputRecord], needed_by: str = "rlhf ppo"
) -> tuple[str, Path | None, str]:
    """(base weights, SFT adapter to merge or None, tokenizer) the policy starts from; records
    the SFT stage in `inputs` when it is used."""
    if not recipe.sft.enabled:
        name = recipe.model.name_or_path
        return name, None, recipe.model.tokenizer or name
    source = run.owner("sft")  # this run's, or its `run.base`'s
    manifest = require(source, "sft", needed_by)
    inputs["sft"] = source.input_record("sft")
    tokenizer = str(source.resolve_output("sft", manifest, "tokenizer"))
    if "model" in manifest["outputs"]:
        return str(source.resolve_output("sft", manifest, "model")), None, tokenizer
    return recipe.model.name_or_path, source.resolve_output("sft", manifest, "adapter"), tokenizer


def reward_source(
    recipe: Recipe, run: RunDir, inputs: dict[str, InputRecord], needed_by: str = "rlhf ppo"
) -> tuple[str | None, str | None]:
    """(reward model, reward tokenizer): the recipe's frozen model or the train-rm output;
    (None, None) when the reward is `reward.functions` alone."""
    if not recipe.reward.has_model:
        return None, None
    if recipe.reward.pretrained is not None:
        name = recipe.reward.pretrained
        return name, recipe.reward.tokenizer or name
    source = run.owner("rm")  # this run's, or its `run.base`'s
    manifest = require(source, "rm", needed_by)
    inputs["rm"] = source.input_record("rm")
    path = str(source.resolve_output("rm", manifest, "model"))
    return path, str(source.resolve_output("rm", manifest, "tokenizer"))


def check_sft_fits(
    made: Manifest | dict[str, Any],
    sft_now: dict[str, InputRecord],
    what: str,
    kind: str,
    stage: str = "ppo",
) -> None:
    """A policy stands on the SFT model it was made from: an adapter (or LoRA checkpoint) only
    fits it, and whole weights measure their KL against it. `made` (its manifest or checkpoint
    state) must record the sft stage that `sft_now` holds; `stage` trained it (the remedy
    names its command)."""
    if kind == "adapter":
        remedy = (
            "the adapter only fits the SFT model it was trained on; run "
            f"`{STAGE_COMMANDS[stage]}` on this one"
        )
    else:
        remedy = "its KL would be measured against another reference; make one from this SFT"
    check_same_inputs(made, sft_now, ("sft",), what, remedy)


@dataclass
class TrainedPolicy:
    model: Any  # a PeftModel (adapter on, or over, the SFT model) or a plain causal LM
    reference: Reference | None
    tokenizer: Any
    label: str  # names the audited thing in reports, e.g. "ppo" or "iter_00050"


@dataclass(frozen=True)
class PolicyLocation:
    """Where a trained policy is, worked out once before anything loads: what it is (an
    adapter over the SFT model, whole weights, or a PPO checkpoint of LoRA weights), its
    folder, its tokenizer, the SFT model it stands on (base weights and adapter), the stages it
    was made from (`inputs`, for a manifest), and the label reports give it."""

    kind: Literal["adapter", "model", "checkpoint"]
    folder: Path
    tokenizer: str
    base: str
    sft_adapter: Path | None
    inputs: dict[str, InputRecord]
    label: str


def _stage_manifest(folder: Path) -> Manifest | None:
    """The manifest of a stage folder, read through RunDir (its errors name the file)."""
    run, stage = RunDir.of_stage_dir(folder)
    return run.read_manifest(stage)


POLICY_STAGES = ("ppo", *OFFLINE_STAGES)  # the stages that train a policy from the SFT model


def folder_kind(folder: Path) -> str:
    """What a folder holds: a PPO `checkpoint`, a `ppo`, offline (`OFFLINE_STAGES`) or `merged`
    stage, an `adapter` or a `model`; anything else is a StageError."""
    if (folder / PPO_INDEX).is_file():
        return "checkpoint"
    manifest = _stage_manifest(folder)
    if manifest is not None and manifest.get("stage") in (*POLICY_STAGES, "merged"):
        return manifest["stage"]
    if (folder / "adapter_config.json").is_file():
        return "adapter"
    if (folder / "config.json").is_file():
        return "model"
    raise StageError(f"{folder} is not a PPO run, checkpoint, adapter or model folder")


def locate_policy(
    recipe: Recipe,
    run: RunDir,
    source: Path | None = None,
    *,
    needed_by: str,
    stage: str | None = None,
) -> PolicyLocation:
    """The policy at `source` (default: the final policy of `stage`, else of `policy_stage`),
    checked against the SFT model it must stand on; `needed_by` (the command) names who asks in
    the errors of missing stages. Nothing loads."""
    if source is None:
        stage = stage or policy_stage(run)
        require(run, stage, needed_by)
    folder = Path(source) if source is not None else run.stage_dir(stage)
    if not folder.is_dir():
        what = "is a file, not" if folder.exists() else "does not exist: give"
        raise StageError(f"{folder} {what} a PPO run, checkpoint, adapter or model folder")
    kind = folder_kind(folder)
    inputs: dict[str, InputRecord] = {}
    base, sft_adapter, tokenizer = policy_source(recipe, run, inputs, needed_by)
    label = folder.name if kind == "checkpoint" else kind if kind in OFFLINE_STAGES else run.name
    if kind == "checkpoint":
        if not recipe.model.lora.enabled:
            raise StageError(
                f"{folder}: auditing checkpoints of full-weight PPO runs is not supported; "
                "audit the final policy instead"
            )
        check_sft_fits(checkpoint_state(folder), inputs, f"the checkpoint {folder}", "adapter")
    if kind in (*POLICY_STAGES, "merged"):
        owner, stage = RunDir.of_stage_dir(folder)
        manifest = require(owner, stage, needed_by)
        if kind != "merged":
            tokenizer = str(owner.resolve_output(stage, manifest, "tokenizer"))
        kind = "adapter" if "adapter" in manifest["outputs"] else "model"  # merged: a model
        what = f"the {stage} {kind} of run '{owner.name}'"
        check_sft_fits(manifest, inputs, what, kind, stage)
        inputs[stage] = owner.input_record(stage)
        folder = owner.resolve_output(stage, manifest, kind)
    return PolicyLocation(kind, folder, tokenizer, base, sft_adapter, inputs, label)  # type: ignore[arg-type]


def load_policy(
    where: PolicyLocation, model_cfg: ModelSection, device: torch.device
) -> TrainedPolicy:
    """The policy `where` says, dropout off, frozen, with its reference (the SFT model)."""
    tokenizer = load_policy_tokenizer(model_cfg, where.tokenizer, "left")
    sft_model = load_sft_model(model_cfg, where.base, where.sft_adapter, device)
    if where.kind == "model":
        whole = model_cfg.variant(lora=False, load_in_4bit=False)
        model = load_causal_lm(str(where.folder), whole, device, trainable=False)
        return TrainedPolicy(model, Reference(model, sft_model), tokenizer, where.label)
    if where.kind == "adapter":
        model = with_trained_adapter(sft_model, where.folder)
    else:  # a checkpoint: the PPO construction (4-bit bases prepared alike), then its weights
        from safetensors.torch import load_file

        model = make_trainable(sft_model, model_cfg, "CAUSAL_LM", no_dropout=True)
        loaded = load_file(where.folder / "policy.safetensors")
        if model.load_state_dict(loaded, strict=False).unexpected_keys:
            raise StageError(f"{where.folder} does not match this recipe's LoRA settings")
    set_dropout(model, 0.0)
    return TrainedPolicy(freeze(model), Reference(model), tokenizer, where.label)


def load_scorer(
    recipe: Recipe, run: RunDir, device: torch.device, *, needed_by: str
) -> RewardScorer | None:
    """The run's reward (model and functions) as a scorer; None when the run has none (no `rm`
    stage, no `reward.pretrained`, no functions). A failed or damaged `rm` stage is an error,
    not a silent None."""
    cfg = recipe.reward
    no_model = cfg.pretrained is None and run.owner("rm").read_manifest("rm") is None
    if no_model and not (cfg.functions or cfg.url):
        return None
    if no_model:
        return frozen_scorer(cfg, None, None, device)
    path, tok = reward_source(recipe, run, {}, needed_by)
    return frozen_scorer(recipe.reward, path, tok, device)


def load_judge(
    recipe: Recipe, run: RunDir, device: torch.device, *, needed_by: str
) -> RewardScorer | None:
    """`audit.judge` as a scorer (None without one), built as the reward is (`frozen_scorer`,
    `reward`'s template, lengths and dtype): its model (`pretrained`, or with `from_rm` the
    judge that the run's train-rm trained beside the reward model) plus its functions. A
    `from_rm` judge that train-rm did not train is a StageError."""
    judge = recipe.audit.judge
    if judge is None:
        return None
    path, tokenizer = judge.pretrained, judge.tokenizer or judge.pretrained
    if judge.from_rm:
        source = run.owner("rm")  # this run's, or its `run.base`'s
        manifest = require(source, "rm", needed_by)
        if "judge" not in manifest["outputs"]:
            raise StageError(
                f"audit.judge.from_rm: the rm stage of run '{source.name}' trained no judge: "
                "set reward.judge_fraction (e.g. 0.2) and run `rlhf train-rm` again"
            )
        path = tokenizer = str(source.resolve_output("rm", manifest, "judge"))
    reads = recipe.reward.model_copy(
        update={
            "functions": judge.functions,
            "url": None,
            "input": judge.input or recipe.reward.input,
        }
    )
    return frozen_scorer(reads, path, tokenizer, device)


def frozen_scorer(
    cfg: RewardSection, model_path: str | None, tokenizer_path: str | None, device: torch.device
) -> RewardScorer:
    """A frozen reward model (eval mode, dropout off) with its own tokenizer (right padding)
    as a scorer of (prompt, response) encoded as `cfg.input` says, plus `reward.functions` and
    `reward.url`; those alone when `model_path` is None."""
    from rlhf_cli.rewards import RemoteReward

    functions = [(f.function, f.load(), f.weight) for f in cfg.functions]
    if cfg.url is not None:
        remote = RemoteReward(cfg.url, cfg.template, cfg.url_timeout, cfg.url_retries)
        functions.append((cfg.url, remote, 1.0))
    model = tokenizer = None
    if model_path is not None:
        model = freeze(load_reward_model(model_path, device, cfg.dtype, cfg.trust_remote_code))
        set_dropout(model, 0.0)
        tokenizer = load_tokenizer(tokenizer_path or model_path, cfg.trust_remote_code, "right")
    return RewardScorer(
        model, tokenizer, cfg.template, cfg.max_length, cfg.score_batch_size, functions, cfg.input
    )


def generation_engine(
    gen: GenerationSection, model: Any, tokenizer: Any, recipe: Recipe, scratch: Path
) -> Generator:
    """`gen.backend`'s engine answering as `model`: transformers `generate` on the model
    itself, or a colocated vLLM engine built from its whole weights (before any sharding), seeded
    from `run.seed`, computing in `model.dtype` as resolved on `model`'s device, its weights
    written under `scratch` while it loads them. Refused first: a prompt and answer longer than
    the policy's context, a tokenizer with ids past its embeddings, bfloat16 for vLLM on a GPU
    that lacks it."""
    named = {
        id(recipe.ppo.generation): "ppo.generation",
        id(recipe.eval.generation): "eval.generation",
    }
    section = named.get(id(gen), "audit.generation")
    lengths = {"data.prompts.max_tokens": recipe.data.prompts.max_tokens}
    lengths[f"{section}.max_new_tokens"] = gen.max_new_tokens
    check_context(model, lengths, "the policy")
    check_vocab(model, tokenizer, "model.tokenizer", "the policy")
    device = next(model.parameters()).device
    dtype = resolve_dtype(recipe.model.dtype, device)
    if gen.backend == "vllm" and dtype == torch.bfloat16:
        check_bf16(device, "model.dtype", "the vLLM engine")
    return generator_for(
        model,
        tokenizer,
        gen,
        max_len=sum(lengths.values()),
        seed=recipe.run.seed,
        scratch=scratch,
        dtype=dtype,
    )


# ── the merge's logit check: `rlhf merge`, and `rlhf eval` on a LoRA policy's merged weights ──

# A bf16/fp16 copy of a model differs from its float32 original by a few rounding steps
# (machine epsilon x the largest |logit|): measured on Llamas + LoRA of 2 to 24 layers, random
# and SFT-trained, 0.5 to 4.4 steps in both dtypes. 16 leaves room for deeper models; a wrong
# merge is caught before the cast, in float32, within merge.atol.
CAST_ULPS = 16


def cast_tolerance(dtype: torch.dtype, scale: float, atol: float) -> float:
    """The largest |logit difference| allowed between a model cast to `dtype` and its float32
    original whose largest |logit| is `scale`: `merge.atol` for float32, else CAST_ULPS rounding
    steps (machine epsilon) of `dtype` at that scale, never less than `merge.atol`."""
    if dtype == torch.float32:
        return atol
    return max(atol, CAST_ULPS * torch.finfo(dtype).eps * scale)


@torch.inference_mode()
def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return forward_logits(model, ids, mask).float()[mask.bool()]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())  # nan when either has a nan: `not diff <= tol` refuses it


def merge_and_cast(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype, atol: float
) -> tuple[Any, dict[str, Any], str | None]:
    """Merge the adapter model `model` (its adapter in float32) and cast it once to `dtype`,
    checking the merge against the adapter model's logits on `ids`: within `atol` on a float32
    base (then the cast within `cast_tolerance`), within `cast_tolerance` on a base already
    in `dtype`. Returns the merged model, the manifest's metrics (each figure once: the merged
    model's difference and its bound; with a cast, also the float32 merge's and `merge.atol`),
    and why it is refused (None when it passes)."""
    in_fp32 = model.get_base_model().dtype == torch.float32
    before = _logits(model, ids, mask)
    merged = model.merge_and_unload()
    merge_diff = _max_diff(_logits(merged, ids, mask), before)
    diff = merge_diff
    if dtype != torch.float32 and in_fp32:
        merged = merged.to(dtype)
        diff = _max_diff(_logits(merged, ids, mask), before)
    tolerance = cast_tolerance(dtype, float(before.abs().max()), atol)
    cast = in_fp32 and dtype != torch.float32  # a float32 merge, then a cast: two checks
    metrics = {
        "max_abs_logit_diff": diff,
        "tolerance": tolerance,
        **({"merge_logit_diff_fp32": merge_diff, "merge_atol": atol} if cast else {}),
        "dtype": str(next(merged.parameters()).dtype),
        "parameters": sum(p.numel() for p in merged.parameters()),
    }
    problem = None
    if in_fp32 and not merge_diff <= atol:
        problem = (
            f"the float32 merge changes the adapter model's logits by {merge_diff:.3g} > "
            f"merge.atol ({atol})"
        )
    elif not diff <= tolerance:
        problem = (
            f"the merged model in {dtype} differs from the float32 adapter model's logits by "
            f"{diff:.3g} > {tolerance:.3g} ({CAST_ULPS} rounding steps of its largest logit)"
        )
    return merged, metrics, problem


def merge_check_inputs(
    recipe: Recipe, tokenizer: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) that a merge is checked on (`merge_and_cast`): the first four audit prompts,
    64 tokens at most, left-padded, as the policy reads them."""
    chat = recipe.model.prompt_format == "chat"
    queries = tokenize_prompts(tokenizer, audit_prompts(recipe.audit)[:4], chat, 64)
    return left_pad(queries, tokenizer.pad_token_id, device)
