"""The offline methods, `rlhf dpo`, `rlhf kto`, `rlhf orpo` and `rlhf simpo`: preference
optimisation from the SFT policy on `data.preferences`, with no reward model and no rollouts,
each through a TRL trainer (`METHODS`): DPO with the losses it names (`dpo.loss_type`), KTO on
thumbs-up / thumbs-down rows, and from `trl.experimental` ORPO and SimPO (CPOTrainer with its
`simpo` loss and no NLL term), which hold no reference at all. Each writes
`runs/<name>/<method>/` with the same manifest (the method, its inputs, its health).

The reference of DPO and KTO is the SFT model: with LoRA the policy with its adapter disabled
(TRL builds the adapter from our `peft_config` and disables it for the reference: one copy of
the weights), else a frozen copy of the SFT model. On 4-bit weights (QLoRA) the policy's
adapter is stacked over the frozen SFT adapter as PPO's is (`make_trainable`: merging into NF4
would re-quantise the SFT delta away), and the reference is the SFT adapter alone on the base.
Its log-probs of every answer are computed once (TRL's `precompute_ref_log_probs`) and kept in
`<method>/ref_logps/<split>.safetensors` with the hash of what they depend on
(`reference_key`): a rerun or a resume with the same SFT weights, tokenised pairs and length
reads them and runs no reference forward at all (the full-weights copy is not even loaded);
anything else computes them again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from rlhf_cli.data import Pair, hold_out, prompt_text
from rlhf_cli.data.offline import Thumb, read_pairs, read_thumbs
from rlhf_cli.data.rows import StageData
from rlhf_cli.errors import StageError
from rlhf_cli.model_checks import check_context, check_lora_targets, check_vocab
from rlhf_cli.modeling import (
    PPO_ADAPTER,
    load_policy_tokenizer,
    load_sft_model,
    lora_config,
    make_trainable,
    pick_device,
    upcast_trainable,
)
from rlhf_cli.recipe import OfflineSection, Recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.resume import check_same_inputs, trainer_resume_point
from rlhf_cli.rundir import InputRecord, Manifest, RunDir
from rlhf_cli.stages.common import drop_checkpoints, seed_everything
from rlhf_cli.stages.offline_health import report_health
from rlhf_cli.stages.reference_cache import (
    REF_LOGPS,
    SPLITS,
    CachedReferenceDPO,
    CachedReferenceKTO,
    ReferenceCache,
    drop_trl_reference_adapter,
    reference_identity,
)
from rlhf_cli.stages.trained import policy_source
from rlhf_cli.stages.trainers import (
    StageCallback,
    drop_printer,
    policy_trainer_kwargs,
    run_train_loss,
    start_or_resume_trainer,
    train_resumable,
)
from rlhf_cli.tracking import Trackers

T = TypeVar("T")


@dataclass(frozen=True)
class Method:
    """One offline method: its stage (the command, the recipe section and the output folder
    share the name), the rows it reads, whether it holds a reference, and the TRL trainer and
    config behind it with the options taken from its section."""

    name: str
    paired: bool  # chosen and rejected per row (else KTO's one answer with a `label`)
    reference: bool  # a reference model (its log-probs cached), or none
    trl: str  # the TRL classes, `module:Trainer:Config`
    options: Callable[[Any], dict[str, Any]]  # the section -> the TRL config's own fields

    def classes(self) -> tuple[type, type]:
        """(trainer, config): ours around TRL's where the reference's log-probs are cached."""
        module, trainer, config = self.trl.split(":")
        lib = importlib.import_module(module)
        cached = {"DPOTrainer": CachedReferenceDPO, "KTOTrainer": CachedReferenceKTO}
        return cached.get(trainer) or getattr(lib, trainer), getattr(lib, config)


METHODS = {
    m.name: m
    for m in [
        Method(
            "dpo",
            True,
            True,
            "trl:DPOTrainer:DPOConfig",
            lambda c: dict(
                loss_type=list(c.loss_type),
                loss_weights=c.loss_weights,
                beta=c.beta,
                label_smoothing=c.label_smoothing,
            ),
        ),
        Method(
            "kto",
            False,
            True,
            "trl:KTOTrainer:KTOConfig",
            lambda c: dict(
                beta=c.beta,
                desirable_weight=c.desirable_weight,
                undesirable_weight=c.undesirable_weight,
            ),
        ),
        Method(
            "orpo",
            True,
            False,
            "trl.experimental.orpo:ORPOTrainer:ORPOConfig",
            lambda c: dict(beta=c.beta, remove_unused_columns=False),  # else TRL warns and sets it
        ),
        # SimPO is CPO's `simpo` loss without CPO's NLL term (`cpo_alpha=0`), as TRL documents
        Method(
            "simpo",
            True,
            False,
            "trl.experimental.cpo:CPOTrainer:CPOConfig",
            lambda c: dict(
                loss_type="simpo",
                cpo_alpha=0.0,
                beta=c.beta,
                simpo_gamma=c.gamma,
                remove_unused_columns=False,
            ),
        ),
    ]
}


def run_offline(recipe: Recipe, console: Console, method: str, resume: bool = False) -> Manifest:
    """Train the policy by `method` (a key of `METHODS`) from the SFT model (ORPO: or the base);
    write `runs/<name>/<method>/`; return its manifest. With `resume`, continue from the newest
    checkpoint of an interrupted attempt."""
    from accelerate import PartialState

    how, command = METHODS[method], f"rlhf {method}"
    run = RunDir.for_recipe(recipe)
    if recipe.data.preferences is None:
        raise StageError(f"{command} trains on preference data: set data.preferences")
    inputs: dict[str, InputRecord] = {}
    base, sft_adapter, tokenizer_source = start_source(recipe, run, inputs, method)
    is_main = PartialState().is_main_process
    seed_everything(recipe.run.seed)
    trackers = Trackers.for_stage(recipe.run, method, run.stage_dir(method))
    # found before the manifest is touched: a refused --resume leaves the last result intact
    checkpoint = trainer_resume_point(run.stage_dir(method), command) if resume else None
    if checkpoint is not None:
        previous = run.read_manifest(method) or {}
        check_same_inputs(
            previous,
            inputs,
            ("sft",),
            f"the checkpoint {checkpoint[0].name}",
            f"its weights were trained on the earlier one; `{command}` without --resume starts "
            "over on this one",
        )
    with (
        StageRecord(run, method, recipe, inputs=inputs, write=is_main) as record,
        trackers.environment(),
    ):
        # 1. Rows, policy, reference (or its cached log-probs) and trainer.
        sources = (base, sft_adapter, tokenizer_source)
        trainer, stage = setup(how, recipe, run, record, console, trackers, sources)

        # 2. Train, with the held-out rows measured before (the starting policy) and after.
        start = trainer.evaluate()
        stage.writer = start_or_resume_trainer(record, checkpoint, console)
        if checkpoint is None:
            stage.writer.log(start, step=0)
        try:
            folder = checkpoint[0] if checkpoint else None
            result = train_resumable(trainer, stage, folder, console, command)
            final = trainer.evaluate()
        finally:
            stage.progress.stop()
            stage.writer.close()

        # 3. Save: the adapter (LoRA) or the whole model, plus the tokenizer; the health table.
        if is_main:
            save(how, recipe, record, trainer, result, (start, final))
            report_health(record, console, how.reference, getattr(recipe, method).beta)
    return record.manifest


def start_source(
    recipe: Recipe, run: RunDir, inputs: dict[str, InputRecord], method: str
) -> tuple[str, Path | None, str]:
    """(base weights, SFT adapter or None, tokenizer) the policy starts from: the SFT model
    (`policy_source`, recorded in `inputs`), or the base model for `orpo.start: base`."""
    if method == "orpo" and recipe.orpo.start == "base":
        name = recipe.model.name_or_path
        return name, None, recipe.model.tokenizer or name
    return policy_source(recipe, run, inputs, f"rlhf {method}")


def setup(
    how: Method,
    recipe: Recipe,
    run: RunDir,
    record: StageRecord,
    console: Console,
    trackers: Trackers,
    sources: tuple[str, Path | None, str],
) -> tuple[Any, StageCallback]:
    """The rows split as train-rm splits them (`hold_out` with `run.seed`), in TRL's format;
    the starting model as the policy, given a fresh LoRA adapter by TRL (`model.lora`) or
    trained whole in fp32; the reference beside it only when the method holds one, the whole
    weights train and the cache misses; the trainer with its `StageCallback`."""
    cfg, device = getattr(recipe, how.name), pick_device(recipe.run.device)
    base, sft_adapter, tokenizer_source = sources
    chat = recipe.model.prompt_format == "chat"
    if how.paired:
        train, held = paired_data(recipe, run, record, how.name)
        train_rows, eval_rows = ([trl_pair(p, chat) for p in side] for side in (train, held))
    else:
        train_rows, eval_rows = thumbs_data(recipe, run, record, chat)
    tokenizer = load_policy_tokenizer(recipe.model, tokenizer_source, "right")
    model = load_sft_model(recipe.model, base, sft_adapter, device)
    check_context(model, {f"{how.name}.max_length": cfg.max_length}, "the policy")
    check_vocab(model, tokenizer, "model.tokenizer", "the policy")
    identity = reference_identity(recipe, record, cfg.max_length)
    cache = ReferenceCache(record.dir / REF_LOGPS, identity, record.write)
    peft_config, ref_model = None, None
    if recipe.model.lora.enabled and not recipe.model.quantization.load_in_4bit:
        check_lora_targets(model, recipe.model.lora, "model.lora.target_modules")
        peft_config = lora_config(recipe.model.lora, "CAUSAL_LM")
    else:  # whole weights; or a 4-bit base given its adapter here, over the SFT one if any
        model = make_trainable(model, recipe.model, "CAUSAL_LM")
        if how.reference and not recipe.model.lora.enabled and not cache.complete(SPLITS):
            ref_model = load_sft_model(recipe.model, base, sft_adapter, device)  # frozen
    extra = {"cache": cache, "ref_model": ref_model} if how.reference else {}
    trainer_class, config_class = how.classes()
    args = config_class(
        **policy_trainer_kwargs(cfg, recipe, device, record.dir, trackers),
        **how.options(cfg),
        **({"precompute_ref_log_probs": True} if how.reference else {}),
    )
    stage = StageCallback(console, how.name)
    trainer = trainer_class(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=_dataset(train_rows),
        eval_dataset=_dataset(eval_rows),
        peft_config=peft_config,
        callbacks=[stage],
        **extra,
    )
    if how.reference:
        trainer.ref_model = None  # its log-probs are kept: the copy is not needed to train
        drop_trl_reference_adapter(trainer.model)
    record.manifest["reference"] = cache.summary() if how.reference else None
    drop_printer(trainer)
    upcast_trainable(trainer.model)
    kept = (len(trainer.train_dataset), len(trainer.eval_dataset))
    check_dropped(record, (len(train_rows), len(eval_rows)), kept, how.name, cfg.max_length)
    return trainer, stage


def _dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(rows)


def paired_data(
    recipe: Recipe, run: RunDir, record: StageRecord, method: str
) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs) of `data.preferences`, split as `rlhf train-rm` splits
    them."""
    data = read_pairs(recipe.data.preferences, method, run.path / ".cache")
    same = data.dropped.get("identical answers", 0)
    if same:
        record.warn(f"{same} preference pair(s) have the same chosen and rejected answer: skipped")
    return split_and_record(recipe, record, data)


def split_and_record(
    recipe: Recipe, record: StageRecord, data: StageData[T]
) -> tuple[list[T], list[T]]:
    """(training rows, held-out rows), split as `rlhf train-rm` splits pairs; the data's summary
    and the hash of its rows in the manifest (what the stage was made from)."""
    source = recipe.data.preferences
    train, held = hold_out(data, source.eval_fraction, recipe.run.seed)
    for warning in data.warnings:
        record.warn(warning)
    record.manifest["data"] = {"preferences": data.summary()}
    rows = json.dumps([vars(item) for item in data.items], sort_keys=True)
    record.manifest["inputs"]["preferences"] = {  # type: ignore[typeddict-item]
        "path": source.where(),
        "sha256": hashlib.sha256(rows.encode()).hexdigest(),
    }
    return train, held


def thumbs_data(
    recipe: Recipe, run: RunDir, record: StageRecord, chat: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) of `data.preferences` in TRL's unpaired format."""
    data = read_thumbs(recipe.data.preferences, run.path / ".cache")
    train, held = split_and_record(recipe, record, data)
    return [[trl_thumb(t, chat) for t in side] for side in (train, held)]  # type: ignore[return-value]


def trl_thumb(thumb: Thumb, chat: bool) -> dict[str, Any]:
    """A KTO row in TRL's unpaired format, conversational or standard as `trl_pair`'s."""
    if chat:
        answer = [{"role": "assistant", "content": thumb.completion}]
        return {"prompt": thumb.prompt, "completion": answer, "label": thumb.label}
    text = prompt_text(thumb.prompt)
    return {"prompt": text, "completion": thumb.completion, "label": thumb.label}


def trl_pair(pair: Pair, chat: bool) -> dict[str, Any]:
    """A pair in TRL's preference format: conversational (the chat template renders the prompt
    with its generation prompt, as SFT and PPO see it) or standard (the prompt's text; TRL
    appends EOS to each answer, as SFT's prompt-completion rows end)."""
    if chat:
        answers = {k: [{"role": "assistant", "content": getattr(pair, k)}] for k in SIDES}
        return {"prompt": pair.prompt, **answers}
    return {"prompt": prompt_text(pair.prompt), "chosen": pair.chosen, "rejected": pair.rejected}


SIDES = ("chosen", "rejected")


def check_dropped(
    record: StageRecord, given: tuple[int, int], kept: tuple[int, int], method: str, max_length: int
) -> None:
    """TRL drops the rows whose prompt alone fills `<method>.max_length`: a split left empty is
    an error naming the field, fewer rows a manifest warning."""
    for split, before, after in zip(("training", "held-out"), given, kept, strict=True):
        if before and not after:
            raise StageError(
                f"{method}.max_length ({max_length}) leaves no answer token in any of the "
                f"{before} {split} rows: their prompts fill it; raise {method}.max_length"
            )
        if after < before:
            record.warn(
                f"{before - after} of {before} {split} rows dropped: their prompts fill "
                f"{method}.max_length ({max_length})"
            )


def save(
    how: Method,
    recipe: Recipe,
    record: StageRecord,
    trainer: Any,
    result: Any,
    evals: tuple[dict[str, float], dict[str, float]],
) -> None:
    """The adapter or whole model, the tokenizer (left padding, as generation needs), and the
    manifest's method (its section's own fields and the TRL trainer), outputs and metrics."""
    cfg, (start, final) = getattr(recipe, how.name), evals
    tokenizer = trainer.processing_class
    tokenizer.padding_side = "left"  # what generation needs downstream
    tokenizer.save_pretrained(record.dir / "tokenizer")
    kind = "adapter" if recipe.model.lora.enabled else "model"
    # the adapter that trained alone (on a 4-bit base, never the frozen SFT one under it)
    adapter = {"save_embedding_layers": False, "selected_adapters": [PPO_ADAPTER]}
    extra = adapter if kind == "adapter" else {}
    trainer.model.save_pretrained(record.dir / kind, **extra)
    shared = set(OfflineSection.model_fields) - {"beta"}
    record.manifest["method"] = {
        "name": how.name,
        "trainer": how.trl.split(":")[1],
        **cfg.model_dump(mode="json", exclude=shared),
    }
    record.manifest["outputs"] = {
        kind: kind,
        "tokenizer": "tokenizer",
        "metrics": "metrics.jsonl",
        **({"ref_logps": REF_LOGPS} if how.reference else {}),
    }
    record.manifest["base_model"] = recipe.model.name_or_path
    record.manifest["metrics"] = {
        "eval_loss_start": start["eval_loss"],
        **{k: v for k, v in final.items() if k.startswith(("eval_loss", "eval_rewards/"))},
        "train_loss": run_train_loss(record, result),
        "steps": result.global_step,
        "train_rows": len(trainer.train_dataset),
        "eval_rows": len(trainer.eval_dataset),
        "train_runtime_s": result.metrics.get("train_runtime"),
    }
    drop_checkpoints(record)  # the result is saved: the resumable state is no longer needed
