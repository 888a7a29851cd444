"""`rlhf dpo`: offline preference optimisation from the SFT policy on `data.preferences`, with
TRL's DPOTrainer and the losses it names (`dpo.loss_type`).

The reference is the SFT model: with LoRA the policy with its adapter disabled (TRL builds the
adapter from our `peft_config` and disables it for the reference: one copy of the weights), else
a frozen copy of the SFT model. Its log-probs of every chosen and rejected answer are computed
once (TRL's `precompute_ref_log_probs`) and kept in `dpo/ref_logps/<split>.safetensors` with the
hash of what they depend on (`reference_key`): a rerun or a resume with the same SFT weights,
tokenised pairs and length reads them and runs no reference forward at all (the full-weights
copy is not even loaded); anything else computes them again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from trl import DPOTrainer

from rlhf_cli.data import Pair, hold_out, load_preferences, prompt_text, read_source
from rlhf_cli.data.layouts import layout_of
from rlhf_cli.errors import DataError, StageError
from rlhf_cli.model_checks import check_context, check_lora_targets, check_vocab
from rlhf_cli.modeling import (
    load_policy_tokenizer,
    load_sft_model,
    lora_config,
    make_trainable,
    pick_device,
    resolve_dtype,
    upcast_trainable,
)
from rlhf_cli.recipe import Recipe, StageSource
from rlhf_cli.record import StageRecord
from rlhf_cli.resume import check_same_inputs, trainer_resume_point
from rlhf_cli.rundir import InputRecord, Manifest, RunDir
from rlhf_cli.stages.common import drop_checkpoints, seed_everything
from rlhf_cli.stages.trained import policy_source
from rlhf_cli.stages.trainers import (
    StageCallback,
    drop_printer,
    run_train_loss,
    start_or_resume_trainer,
    train_resumable,
    trainer_kwargs,
)
from rlhf_cli.tracking import Trackers

REF_LOGPS = "ref_logps"  # the reference log-prob cache's folder in dpo/
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's names for them


def run_dpo(recipe: Recipe, console: Console, resume: bool = False) -> Manifest:
    """Train the policy by DPO from the SFT model; write `runs/<name>/dpo/`; return its
    manifest. With `resume`, continue from the newest checkpoint of an interrupted attempt."""
    from accelerate import PartialState

    run = RunDir.for_recipe(recipe)
    if recipe.data.preferences is None:
        raise StageError("rlhf dpo trains on preference pairs: set data.preferences")
    if recipe.model.quantization.load_in_4bit:
        raise StageError(
            "rlhf dpo does not train on 4-bit weights yet: set "
            "model.quantization.load_in_4bit: false"
        )
    inputs: dict[str, InputRecord] = {}
    base, sft_adapter, tokenizer_source = policy_source(recipe, run, inputs, "rlhf dpo")
    is_main = PartialState().is_main_process
    seed_everything(recipe.run.seed)
    trackers = Trackers.for_stage(recipe.run, "dpo", run.stage_dir("dpo"))
    # found before the manifest is touched: a refused --resume leaves the last result intact
    checkpoint = trainer_resume_point(run.stage_dir("dpo"), "rlhf dpo") if resume else None
    if checkpoint is not None:
        previous = run.read_manifest("dpo") or {}
        check_same_inputs(
            previous,
            inputs,
            ("sft",),
            f"the checkpoint {checkpoint[0].name}",
            "its weights were trained on the earlier one; `rlhf dpo` without --resume starts "
            "over on this one",
        )
    with (
        StageRecord(run, "dpo", recipe, inputs=inputs, write=is_main) as record,
        trackers.environment(),
    ):
        # 1. Pairs, policy, reference (or its cached log-probs) and trainer.
        sources = (base, sft_adapter, tokenizer_source)
        trainer, stage = setup(recipe, run, record, console, trackers, sources)

        # 2. Train, with the held-out pairs measured before (the SFT policy) and after.
        start = trainer.evaluate()
        stage.writer = start_or_resume_trainer(record, checkpoint, console)
        if checkpoint is None:
            stage.writer.log(start, step=0)
        try:
            folder = checkpoint[0] if checkpoint else None
            result = train_resumable(trainer, stage, folder, console, "rlhf dpo")
            final = trainer.evaluate()
        finally:
            stage.progress.stop()
            stage.writer.close()

        # 3. Save: the adapter (LoRA) or the whole model, plus the tokenizer.
        if is_main:
            save(recipe, record, trainer, result, (start, final))
    return record.manifest


def setup(
    recipe: Recipe,
    run: RunDir,
    record: StageRecord,
    console: Console,
    trackers: Trackers,
    sources: tuple[str, Path | None, str],
) -> tuple[DPOTrainer, StageCallback]:
    """The pairs split as train-rm splits them (`hold_out` with `run.seed`), in TRL's
    preference format; the SFT model as the policy, given a fresh LoRA adapter by TRL
    (`model.lora`) or trained whole in fp32; the reference beside it only when the whole
    weights train and the cache misses; the trainer with its `StageCallback`."""
    from trl import DPOConfig

    cfg, device = recipe.dpo, pick_device(recipe.run.device)
    base, sft_adapter, tokenizer_source = sources
    chat = recipe.model.prompt_format == "chat"
    train, held = paired_data(recipe, run, record)
    train_rows, eval_rows = ([trl_pair(p, chat) for p in side] for side in (train, held))
    tokenizer = load_policy_tokenizer(recipe.model, tokenizer_source, "right")
    model = load_sft_model(recipe.model, base, sft_adapter, device)
    check_context(model, {"dpo.max_length": cfg.max_length}, "the policy")
    check_vocab(model, tokenizer, "model.tokenizer", "the policy")
    cache = ReferenceCache(record.dir / REF_LOGPS, reference_identity(recipe, record), record.write)
    peft_config, ref_model = None, None
    if recipe.model.lora.enabled:
        check_lora_targets(model, recipe.model.lora, "model.lora.target_modules")
        peft_config = lora_config(recipe.model.lora, "CAUSAL_LM")
    else:
        model = make_trainable(model, recipe.model, "CAUSAL_LM")
        if not cache.complete(("train", "eval")):  # the SFT model, frozen, computes them
            ref_model = load_sft_model(recipe.model, base, sft_adapter, device)
    dtype = resolve_dtype(recipe.model.dtype, device)
    checkpointing = recipe.model.gradient_checkpointing
    args = DPOConfig(
        **trainer_kwargs(cfg, device, dtype, record.dir, recipe.run.seed, trackers, checkpointing),
        max_length=cfg.max_length,
        warmup_steps=cfg.warmup_ratio,
        lr_scheduler_type="cosine",
        loss_type=list(cfg.loss_type),
        loss_weights=cfg.loss_weights,
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        precompute_ref_log_probs=True,
    )
    stage = StageCallback(console, "dpo")
    trainer = CachedReferenceDPO(
        cache,
        model=model,
        ref_model=ref_model,
        args=args,
        processing_class=tokenizer,
        train_dataset=_dataset(train_rows),
        eval_dataset=_dataset(eval_rows),
        peft_config=peft_config,
        callbacks=[stage],
    )
    trainer.ref_model = None  # its log-probs are kept: the copy is not needed to train
    drop_printer(trainer)
    upcast_trainable(trainer.model)
    kept = (len(trainer.train_dataset), len(trainer.eval_dataset))
    check_dropped(record, (len(train_rows), len(eval_rows)), kept, cfg.max_length)
    record.manifest["reference"] = cache.summary()
    return trainer, stage


def _dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(rows)


def paired_data(recipe: Recipe, run: RunDir, record: StageRecord) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs) of `data.preferences`, split as `rlhf train-rm` splits
    them; rows without a chosen and a rejected answer are a DataError naming their layout."""
    source = recipe.data.preferences
    cache_dir = run.path / ".cache"
    try:
        data = load_preferences(source, cache_dir=cache_dir)
    except DataError:
        unpaired = unpaired_layout(source, cache_dir)
        if unpaired is None:
            raise
        raise DataError(
            f"{unpaired[0]}: its rows are unpaired ({unpaired[1]}), one answer each; rlhf dpo "
            "needs a chosen and a rejected answer per row (`prompt`, `chosen`, `rejected`)"
        ) from None
    train, held = hold_out(data, source.eval_fraction, recipe.run.seed)
    for warning in data.warnings:
        record.warn(warning)
    same = data.dropped.get("identical answers", 0)
    if same:
        record.warn(f"{same} preference pair(s) have the same chosen and rejected answer: skipped")
    record.manifest["data"] = {"preferences": data.summary()}
    pairs = json.dumps([vars(pair) for pair in data.items], sort_keys=True)
    record.manifest["inputs"]["preferences"] = {  # type: ignore[typeddict-item]
        "path": source.where(),
        "sha256": hashlib.sha256(pairs.encode()).hexdigest(),
    }
    return train, held


def unpaired_layout(source: StageSource, cache_dir: Path) -> tuple[str, str] | None:
    """(the source, its layout) of the first source whose rows hold one answer each (a
    prompt-completion row, KTO's with a `label`), or None."""
    for spec in source.parts():
        rows, _ = read_source(spec, cache_dir, limit=1)
        values = rows[0].values
        if layout_of(values, "preferences"):
            continue
        layout = layout_of(values, "sft")
        if not layout:
            return None
        if values.get("label") is not None:
            layout += " with `label`: KTO's thumbs-up/down layout"
        return spec.where(), layout
    return None


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
    record: StageRecord, given: tuple[int, int], kept: tuple[int, int], max_length: int
) -> None:
    """TRL drops the pairs whose prompt alone fills `dpo.max_length`: a split left empty is an
    error naming the field, fewer pairs a manifest warning."""
    for split, before, after in zip(("training", "held-out"), given, kept, strict=True):
        if before and not after:
            raise StageError(
                f"dpo.max_length ({max_length}) leaves no answer token in any of the {before} "
                f"{split} pairs: their prompts fill it; raise dpo.max_length"
            )
        if after < before:
            record.warn(
                f"{before - after} of {before} {split} pairs dropped: their prompts fill "
                f"dpo.max_length ({max_length})"
            )


# ── the reference's log-probs, computed once ───────────────────────────────────────────────────


def reference_identity(recipe: Recipe, record: StageRecord) -> dict[str, Any]:
    """What the reference's log-probs depend on besides the tokenised pairs: the SFT weights
    (the sft stage's folder and the attempt that made them, as the manifest's inputs record
    it; the base model's name without SFT), the dtype they compute in, and the cut to
    `dpo.max_length` (TRL cuts in its collator, after tokenising)."""
    sft = record.manifest["inputs"].get("sft")
    weights = (
        {"sft": sft["path"], "finished_at": sft["finished_at"]}
        if sft
        else {"base": recipe.model.name_or_path}
    )
    return {"weights": weights, "dtype": recipe.model.dtype, "max_length": recipe.dpo.max_length}


class ReferenceCache:
    """`<dpo>/ref_logps/<split>.safetensors`: the reference's log-probs of each pair's chosen
    and rejected answer, with the hash (`key`) of the identity and the split's token ids, chat
    template included (what TRL's tokenising made of it)."""

    def __init__(self, folder: Path, identity: dict[str, Any], write: bool):
        self.folder, self.identity, self.write = folder, identity, write
        self.status: dict[str, str] = {}  # split -> reused | computed

    def key(self, dataset: Any, template: str | None) -> str:
        ids = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_dict()
        text = json.dumps({**self.identity, "ids": ids, "template": template}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, split: str) -> Path:
        return self.folder / f"{split}.safetensors"

    def complete(self, splits: tuple[str, ...]) -> bool:
        """Whether every split has a kept file (its key is checked when it is read)."""
        return all(self.path(split).is_file() for split in splits)

    def load(self, split: str, key: str, rows: int) -> dict[str, torch.Tensor] | None:
        """The split's kept log-probs when they were made under `key` for `rows` pairs."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path(split)), "pt") as kept:
                if (kept.metadata() or {}).get("key") != key:
                    return None
                columns = {name: kept.get_tensor(name) for name in REF_COLUMNS}
        except (OSError, SafetensorError):
            return None
        return columns if all(len(c) == rows for c in columns.values()) else None

    def save(self, split: str, key: str, columns: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if not self.write:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.path(split).with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in columns.items()}, str(partial), {"key": key})
        partial.replace(self.path(split))

    def summary(self) -> dict[str, Any]:
        return {"log_probs": REF_LOGPS, "splits": dict(self.status)}


class CachedReferenceDPO(DPOTrainer):
    """TRL's DPOTrainer whose reference log-probs go through `ReferenceCache`. With
    `precompute_ref_log_probs` TRL calls `_precompute_ref_logps` for each split at its
    construction, whatever columns the data holds, and keys its own cache on a hash of every
    weight in a temporary folder (for data held in memory): the split's kept columns are
    attached here instead, with no reference forward; only a miss runs TRL's."""

    def __init__(self, cache: ReferenceCache, *args: Any, **kwargs: Any):
        self.ref_cache = cache
        super().__init__(*args, **kwargs)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        cache = self.ref_cache
        key = cache.key(dataset, self._tokenizer.chat_template)
        kept = cache.load(name, key, len(dataset))
        if kept is not None:
            cache.status[name] = "reused"
            for column, values in kept.items():
                dataset = dataset.add_column(column, values.tolist())
            return dataset
        dataset = super()._precompute_ref_logps(dataset, name, batch_size)
        cache.save(name, key, {c: torch.tensor(dataset[c]) for c in REF_COLUMNS})
        cache.status[name] = "computed"
        return dataset


def save(
    recipe: Recipe,
    record: StageRecord,
    trainer: Any,
    result: Any,
    evals: tuple[dict[str, float], dict[str, float]],
) -> None:
    """The adapter or whole model, the tokenizer (left padding, as generation needs), and the
    manifest's method, outputs and metrics."""
    cfg, (start, final) = recipe.dpo, evals
    tokenizer = trainer.processing_class
    tokenizer.padding_side = "left"  # what generation needs downstream
    tokenizer.save_pretrained(record.dir / "tokenizer")
    kind = "adapter" if recipe.model.lora.enabled else "model"
    extra = {"save_embedding_layers": False} if kind == "adapter" else {}
    trainer.model.save_pretrained(record.dir / kind, **extra)
    record.manifest["method"] = {
        "name": "dpo",
        "loss_type": list(cfg.loss_type),
        "loss_weights": cfg.loss_weights,
        "beta": cfg.beta,
        "label_smoothing": cfg.label_smoothing,
    }
    record.manifest["outputs"] = {
        kind: kind,
        "tokenizer": "tokenizer",
        "metrics": "metrics.jsonl",
        "ref_logps": REF_LOGPS,
    }
    record.manifest["base_model"] = recipe.model.name_or_path
    record.manifest["metrics"] = {
        "eval_loss_start": start["eval_loss"],
        **{k: v for k, v in final.items() if k.startswith(("eval_loss", "eval_rewards/"))},
        "train_loss": run_train_loss(record, result),
        "steps": result.global_step,
        "train_pairs": len(trainer.train_dataset),
        "eval_pairs": len(trainer.eval_dataset),
        "train_runtime_s": result.metrics.get("train_runtime"),
    }
    drop_checkpoints(record)  # the result is saved: the resumable state is no longer needed
