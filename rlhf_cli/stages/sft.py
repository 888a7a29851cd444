"""Stage 1 of 4 (the guide's stage 2): supervised fine-tuning with TRL's SFTTrainer (LoRA,
4-bit when asked)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlhf_cli.data import Example, hold_out, load_sft, prompt_text
from rlhf_cli.errors import StageError
from rlhf_cli.model_checks import check_context, check_vocab
from rlhf_cli.modeling import (
    check_devices,
    load_causal_lm,
    load_policy_tokenizer,
    pick_device,
    upcast_trainable,
)
from rlhf_cli.recipe import Recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.resume import trainer_resume_point
from rlhf_cli.rundir import Manifest, RunDir
from rlhf_cli.stages.common import drop_checkpoints, seed_everything
from rlhf_cli.stages.data_figures import sft_figures
from rlhf_cli.stages.trainers import (
    StageCallback,
    drop_printer,
    policy_trainer_kwargs,
    run_train_loss,
    start_or_resume_trainer,
    train_resumable,
)
from rlhf_cli.tracking import Trackers


def run_sft(recipe: Recipe, console: Console, resume: bool = False) -> Manifest:
    """Train the SFT model; write `runs/<name>/sft/`; return its manifest. With `resume`,
    continue from the newest checkpoint of an interrupted attempt."""
    from accelerate import PartialState

    if not recipe.sft.enabled:
        raise StageError(
            "sft.enabled is false in this recipe: `rlhf ppo` starts from "
            f"model.name_or_path ({recipe.model.name_or_path}) directly"
        )
    run = RunDir.for_recipe(recipe)
    check_devices(recipe)
    is_main = PartialState().is_main_process
    seed_everything(recipe.run.seed)
    trackers = Trackers.for_stage(recipe.run, "sft", run.stage_dir("sft"))
    # found before the manifest is touched: a refused --resume leaves the last result intact
    checkpoint = trainer_resume_point(run.stage_dir("sft"), "rlhf sft") if resume else None
    with (
        StageRecord(run, "sft", recipe, inputs={}, write=is_main) as record,
        trackers.environment(),
    ):
        # 1. Data, model and trainer.
        trainer, stage, n_rows = setup(recipe, run, record, console, trackers)

        # 2. Train, with the held-out loss measured before (on the fresh weights, also when
        # resuming: logged once, by the first attempt) and after.
        start_loss = trainer.evaluate()["eval_loss"]
        stage.writer = start_or_resume_trainer(record, checkpoint, console)
        if checkpoint is None:
            stage.writer.log({"eval_loss": start_loss}, step=0)
        try:
            folder = checkpoint[0] if checkpoint else None
            result = train_resumable(trainer, stage, folder, console, "rlhf sft")
            final_loss = trainer.evaluate()["eval_loss"]
        finally:
            stage.progress.stop()
            stage.writer.close()

        # 3. Save: the adapter (LoRA) or the whole model, plus the tokenizer.
        if is_main:
            save(recipe, record, trainer, result, (start_loss, final_loss), n_rows)
    return record.manifest


def setup(
    recipe: Recipe, run: RunDir, record: StageRecord, console: Console, trackers: Trackers
) -> tuple[Any, StageCallback, tuple[int, int]]:
    """TRL's SFTTrainer on a seeded train / held-out split, full weights for
    `sft.full_finetune`, else LoRA (on 4-bit weights when asked), trained weights in fp32
    (`modeling.make_trainable`); its `StageCallback` (progress, log, Ctrl-C checkpoint); the
    (train, held-out) row counts."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg, device = recipe.sft, pick_device(recipe.run.device)
    chat = recipe.model.prompt_format == "chat"
    data = load_sft(recipe.data.sft, cache_dir=run.path / ".cache")
    train, held = hold_out(data, recipe.data.sft.eval_fraction, recipe.run.seed)
    train_rows, eval_rows = ([trl_row(e, chat) for e in side] for side in (train, held))
    for warning in data.warnings:  # rows the data holds twice, held out and trained on
        record.warn(warning)
    source = recipe.model.tokenizer or recipe.model.name_or_path
    tokenizer = load_policy_tokenizer(recipe.model, source, "right")
    record.manifest["data"] = {"sft": sft_figures(data, tokenizer, chat, cfg.max_length)}
    model_cfg = recipe.model.variant(lora=False) if cfg.full_finetune else recipe.model
    model = load_causal_lm(recipe.model.name_or_path, model_cfg, device)
    check_context(model, {"sft.max_length": cfg.max_length}, "the policy")
    check_vocab(model, tokenizer, "model.tokenizer", "the policy")
    args = SFTConfig(**policy_trainer_kwargs(cfg, recipe, device, record.dir, trackers))
    stage = StageCallback(console, "sft")
    trainer = SFTTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(eval_rows),
        callbacks=[stage],
    )
    drop_printer(trainer)
    upcast_trainable(trainer.model)  # TRL casts a QLoRA adapter to bf16: keep fp32 masters
    n_rows = (len(trainer.train_dataset), len(trainer.eval_dataset))
    check_truncation(record, (len(train_rows), len(eval_rows)), n_rows, cfg.max_length)
    return trainer, stage, n_rows


def trl_row(example: Example, chat: bool) -> dict[str, Any]:
    """An example in TRL's SFT format: conversational prompt-completion (`chat`: the chat
    template renders the prompt with its generation prompt, as PPO does, and the loss covers the
    answer), standard prompt-completion (the prompt's text, `data.prompt_text`), or `text`."""
    if example.prompt is None:
        return {"text": example.answer}
    if chat:
        answer = [{"role": "assistant", "content": example.answer}]
        return {"prompt": example.prompt, "completion": answer}
    return {"prompt": prompt_text(example.prompt), "completion": example.answer}


def check_truncation(
    record: StageRecord, given: tuple[int, int], kept: tuple[int, int], max_length: int
) -> None:
    """TRL silently drops the rows whose answer cutting at `sft.max_length` removes entirely
    (a long prompt, or a chat template's system prompt, fills the length): a split left empty
    is an error naming the field, fewer rows a manifest warning."""
    for split, before, after in zip(("training", "held-out"), given, kept, strict=True):
        if before and not after:
            raise StageError(
                f"sft.max_length ({max_length}) leaves no answer token in any of the {before} "
                f"{split} rows: their prompts fill it; raise sft.max_length"
            )
        if after < before:
            record.warn(
                f"{before - after} of {before} {split} rows dropped: their prompts fill "
                f"sft.max_length ({max_length}), leaving no answer token to train on"
            )


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
    # an adapter without the base's embeddings, also where a template's end-of-turn token grew
    # them: the new rows are the same on every load of the base (`modeling.grow_embeddings`)
    extra = {"save_embedding_layers": False} if kind == "adapter" else {}
    trainer.model.save_pretrained(record.dir / kind, **extra)
    record.manifest["outputs"] = {kind: kind, "tokenizer": "tokenizer", "metrics": "metrics.jsonl"}
    record.manifest["base_model"] = recipe.model.name_or_path
    record.manifest["metrics"] = {
        "eval_loss_start": losses[0],
        "eval_loss": losses[1],
        "train_loss": run_train_loss(record, result),
        "steps": result.global_step,
        "train_rows": n_rows[0],
        "eval_rows": n_rows[1],
        "train_runtime_s": result.metrics.get("train_runtime"),
    }
    drop_checkpoints(record)  # the result is saved: the resumable state is no longer needed
