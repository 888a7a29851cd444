"""Stage 2 of the guide: supervised fine-tuning with TRL's SFTTrainer (LoRA, 4-bit when asked)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlhf_cli.data import load_sft, split_eval
from rlhf_cli.errors import StageError
from rlhf_cli.modeling import (
    load_causal_lm,
    load_policy_tokenizer,
    pick_device,
    resolve_dtype,
    upcast_trainable,
)
from rlhf_cli.recipe import Recipe
from rlhf_cli.rundir import RunDir, StageRecord
from rlhf_cli.stages.common import (
    RichProgressCallback,
    drop_printer,
    seed_everything,
    trainer_kwargs,
)
from rlhf_cli.tracking import MetricsWriter, Trackers


def run_sft(recipe: Recipe, console: Console) -> dict[str, Any]:
    """Train the SFT model; write `runs/<name>/sft/`; return its manifest."""
    from accelerate import PartialState

    if not recipe.sft.enabled:
        raise StageError(
            "sft.enabled is false in this recipe: `rlhf ppo` starts from "
            f"model.name_or_path ({recipe.model.name_or_path}) directly"
        )
    run = RunDir.for_recipe(recipe)
    is_main = PartialState().is_main_process
    seed_everything(recipe.run.seed)
    trackers = Trackers.for_stage(recipe.run, "sft", run.stage_dir("sft"))
    with (
        StageRecord(run, "sft", recipe, inputs={}, write=is_main) as record,
        trackers.environment(),
    ):
        # 1. Data, model and trainer.
        trainer, writer, progress, n_rows = setup(recipe, run, record, console, trackers)

        # 2. Train, with the held-out loss measured before and after.
        start_loss = trainer.evaluate()["eval_loss"]
        try:
            result = trainer.train()
            final_loss = trainer.evaluate()["eval_loss"]
        finally:
            progress.progress.stop()
            writer.close()

        # 3. Save: the adapter (LoRA) or the whole model, plus the tokenizer.
        if is_main:
            save(recipe, record, trainer, result, (start_loss, final_loss), n_rows)
    return record.manifest


def setup(
    recipe: Recipe, run: RunDir, record: StageRecord, console: Console, trackers: Trackers
) -> tuple[Any, MetricsWriter, RichProgressCallback, tuple[int, int]]:
    """TRL's SFTTrainer on a seeded train / held-out split, full weights for
    `sft.full_finetune`, else LoRA (on 4-bit weights when asked), trained weights in fp32
    (`modeling.make_trainable`); its metrics writer and bar; the (train, held-out) row counts."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg, device = recipe.sft, pick_device(recipe.run.device)
    chat = recipe.model.prompt_format == "chat"
    rows = load_sft(recipe.data.sft, chat=chat, cache_dir=run.path / ".cache")
    train_rows, eval_rows = split_eval(rows, recipe.data.sft.eval_fraction, recipe.run.seed)
    source = recipe.model.tokenizer or recipe.model.name_or_path
    tokenizer = load_policy_tokenizer(recipe.model, source, "right")
    model_cfg = recipe.model.variant(lora=False) if cfg.full_finetune else recipe.model
    model = load_causal_lm(recipe.model.name_or_path, model_cfg, device)
    dtype = resolve_dtype(recipe.model.dtype, device)
    checkpointing = recipe.model.gradient_checkpointing
    args = SFTConfig(
        **trainer_kwargs(cfg, device, dtype, record.dir, recipe.run.seed, trackers, checkpointing),
        max_length=cfg.max_length,
        warmup_steps=cfg.warmup_ratio,
        lr_scheduler_type="cosine",
    )
    record.replacing()  # the earlier result's logs and weights are written over from here
    writer = MetricsWriter(record.dir / "metrics.jsonl", enabled=record.write)
    progress = RichProgressCallback(console, writer, "sft")
    trainer = SFTTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(eval_rows),
        callbacks=[progress],
    )
    drop_printer(trainer)
    upcast_trainable(trainer.model)  # TRL casts a QLoRA adapter to bf16: keep fp32 masters
    return trainer, writer, progress, (len(train_rows), len(eval_rows))


def save(
    recipe: Recipe,
    record: StageRecord,
    trainer: Any,
    result: Any,
    losses: tuple[float, float],
    n_rows: tuple[int, int],
) -> None:
    """The adapter or whole model, the tokenizer (left padding, as generation needs), and the
    manifest's outputs and metrics."""
    tokenizer = trainer.processing_class
    tokenizer.padding_side = "left"  # what generation needs downstream
    tokenizer.save_pretrained(record.dir / "tokenizer")
    kind = "adapter" if recipe.model.lora.enabled and not recipe.sft.full_finetune else "model"
    trainer.model.save_pretrained(record.dir / kind)
    record.manifest["outputs"] = {kind: kind, "tokenizer": "tokenizer", "metrics": "metrics.jsonl"}
    record.manifest["base_model"] = recipe.model.name_or_path
    record.manifest["metrics"] = {
        "eval_loss_start": losses[0],
        "eval_loss": losses[1],
        "train_loss": result.training_loss,
        "steps": result.global_step,
        "train_rows": n_rows[0],
        "eval_rows": n_rows[1],
        "train_runtime_s": result.metrics.get("train_runtime"),
    }
