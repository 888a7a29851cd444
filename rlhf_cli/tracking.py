"""Where numbers go: metrics.jsonl, optional TensorBoard / wandb, and the rich console."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rlhf_cli.errors import DataError, RlhfError


def make_console(quiet: bool = False, json_mode: bool = False) -> Console:
    """Human output goes to stderr so that `--json` leaves stdout to the JSON alone."""
    return Console(stderr=True, quiet=quiet or json_mode, highlight=False)


def quiet_libraries() -> None:
    """Library chatter (load reports, shard bars) would drown the stage's own progress."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=False,
        disable=console.quiet,
    )


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than an invalid file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object a line and flushes each, so a killed run keeps what it logged."""

    def __init__(
        self,
        path: Path,
        trackers: list[str] | None = None,
        enabled: bool = True,
        resume: bool = False,
    ):
        self.path, self.enabled = path, enabled
        self._tb = self._wandb = None
        if not enabled:
            return
        for tracker in trackers or []:
            try:
                if tracker == "tensorboard":
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(path.parent / "tensorboard"))
                elif tracker == "wandb":
                    import wandb

                    self._wandb = wandb.init(
                        project="rlhf-cli", name=path.parent.parent.name, resume="allow"
                    )
            except ImportError:
                package = "tensorboard" if tracker == "tensorboard" else "wandb"
                raise RlhfError(
                    f"run.trackers lists {tracker} but the {package} package is not "
                    f"installed: pip install {package}"
                ) from None
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a" if resume else "w", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {
            "step": step,
            "time": round(time.time(), 3),
            **{k: _clean(v) for k, v in metrics.items()},
        }
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._handle.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path, through: int | None = None) -> list[dict[str, Any]]:
    """The rows of a JSONL log (none when the file is missing); with `through`, only those of
    iterations 1 to `through`. A last line cut short (a run killed while writing it) is
    dropped; any other line that is not a JSON object is a DataError naming the file and
    line."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number < len(lines):
            raise DataError(f"{path}:{number}: not a JSON object; the log is damaged")
    if through is not None:
        rows = [r for r in rows if 0 < r.get("iteration", 0) <= through]
    return rows
