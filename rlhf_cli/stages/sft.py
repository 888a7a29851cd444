"""Stage 2 of the guide: supervised fine-tuning with TRL's SFTTrainer (LoRA, 4-bit when asked)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from rlhf_cli.data import load_sft, split_eval
from rlhf_cli.errors import StageError
from rlhf_cli.modeling import load_causal_lm, load_tokenizer, pick_device, resolve_dtype
from rlhf_cli.recipe import Recipe
from rlhf_cli.rundir import RunDir, StageRecord
from rlhf_cli.stages.common import (
    RichProgressCallback,
    drop_printer,
    seed_everything,
    trainer_kwargs,
)
from rlhf_cli.tracking import MetricsWriter


def run_sft(recipe: Recipe, console: Console) -> dict[str, Any]:
    """Train the SFT model; write `runs/<name>/sft/`; return its manifest."""
    from accelerate import PartialState
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if not recipe.sft.enabled:
        raise StageError("sft.enabled is false in this recipe: `rlhf ppo` starts from "
                         f"model.name_or_path ({recipe.model.name_or_path}) directly")
    cfg, run = recipe.sft, RunDir.for_recipe(recipe)
    is_main = PartialState().is_main_process
    seed_everything(recipe.run.seed)
    device = pick_device(recipe.run.device)
    with StageRecord(run, "sft", recipe, inputs={}, write=is_main) as record:
        # 1. Data: a seeded held-out split for the loss before and after.
        chat = recipe.model.prompt_format == "chat"
        rows = load_sft(recipe.data.sft, chat=chat, cache_dir=run.path / ".cache")
        train_rows, eval_rows = split_eval(rows, recipe.data.sft.eval_fraction, recipe.run.seed)

        # 2. Model: full weights for `full_finetune`, else LoRA (on 4-bit weights when asked).
        tokenizer = load_tokenizer(recipe.model.tokenizer or recipe.model.name_or_path,
                                   recipe.model.trust_remote_code, padding_side="right")
        model_cfg = recipe.model
        if cfg.full_finetune:
            model_cfg = recipe.model.variant(lora=False)
        model = load_causal_lm(recipe.model.name_or_path, model_cfg, device)

        # 3. Trainer.
        dtype = resolve_dtype(recipe.model.dtype, device)
        args = SFTConfig(**trainer_kwargs(cfg, device, dtype, record.dir, recipe.run.seed),
                         max_length=cfg.max_length, warmup_steps=cfg.warmup_ratio,
                         lr_scheduler_type="cosine")
        writer = MetricsWriter(record.dir / "metrics.jsonl", recipe.run.trackers, enabled=is_main)
        progress = RichProgressCallback(console, writer, "sft")
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_list(train_rows),
                             eval_dataset=Dataset.from_list(eval_rows), callbacks=[progress])
        drop_printer(trainer)

        # 4. Train, with the held-out loss measured before and after.
        start_loss = trainer.evaluate()["eval_loss"]
        try:
            result = trainer.train()
            final_loss = trainer.evaluate()["eval_loss"]
        finally:
            progress.progress.stop()
            writer.close()

        # 5. Save: the adapter (LoRA) or the whole model, plus the tokenizer.
        if is_main:
            tokenizer.padding_side = "left"  # what generation needs downstream
            tokenizer.save_pretrained(record.dir / "tokenizer")
            kind = "adapter" if model_cfg.lora.enabled else "model"
            trainer.model.save_pretrained(record.dir / kind)
            record.manifest["outputs"] = {kind: kind, "tokenizer": "tokenizer",
                                          "metrics": "metrics.jsonl"}
            record.manifest["base_model"] = recipe.model.name_or_path
            record.manifest["metrics"] = {
                "eval_loss_start": start_loss, "eval_loss": final_loss,
                "train_loss": result.training_loss, "steps": result.global_step,
                "train_rows": len(train_rows), "eval_rows": len(eval_rows),
                "train_runtime_s": result.metrics.get("train_runtime"),
            }
    return record.manifest
