"""What the training stages share: seeding, and the one fresh-start and --resume path
(`start_or_resume`); what only the TRL-based ones (sft, train-rm) share is in trainers.py."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

from rlhf_cli.record import StageRecord
from rlhf_cli.tracking import (
    MetricsWriter,
    truncate_metrics,
)


def seed_everything(seed: int) -> None:
    """The one place seeds are set: Python, NumPy and torch (all devices)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_or_resume(
    record: StageRecord,
    checkpoint: tuple[Path, list[str]] | None,
    console: Console,
    restore: Callable[[Path], int],
    logs: tuple[str, ...] = ("metrics.jsonl",),
) -> tuple[int, list[MetricsWriter]]:
    """Where a stage starts writing over its earlier result (`record.replacing()`), fresh or
    from `checkpoint` (`resume.resume_point`'s folder and notes); returns the step it starts
    after and a writer for each of its `logs`.

    Fresh (step 0): the earlier attempt's checkpoints are deleted (never to be resumed later)
    and the logs start over. Resume: the notes (damaged checkpoints skipped) go to the console
    and the manifest's warnings, `restore(folder)` restores what the stage keeps and returns the
    checkpoint's step (a checkpoint that does not fit is refused before anything is written),
    and the logs are cut back to that step and appended to."""
    step, resume = 0, checkpoint is not None
    if checkpoint is not None:
        folder, notes = checkpoint
        resume_notes(record, notes, console)
        step = restore(folder)
    record.replacing()
    if not resume:
        drop_checkpoints(record)
    elif record.write:
        for name in logs:
            truncate_metrics(record.dir / name, step)
    return step, [MetricsWriter(record.dir / name, record.write, resume) for name in logs]


def resume_notes(record: StageRecord, notes: list[str], console: Console) -> None:
    """What a resume skipped or found changed: on the console and in the manifest's warnings."""
    for note in notes:
        console.print(f"[yellow]resume[/]: {note}")
        record.warn(note)


def drop_checkpoints(record: StageRecord) -> None:
    """The stage's checkpoints (the Trainer's or PPO's) go once they cannot be wanted: at a
    fresh start, and when the stage has saved its result."""
    if record.write:
        shutil.rmtree(record.dir / "checkpoints", ignore_errors=True)
