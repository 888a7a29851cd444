"""Where numbers go: metrics.jsonl, the recipe's experiment trackers (through transformers'
`report_to` and accelerate's `log_with`), and the rich console."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from rlhf_cli.rundir import atomic_write_bytes


def make_console(quiet: bool = False, json_mode: bool = False, stdout: bool = False) -> Console:
    """Human output goes to stderr so that `--json` leaves stdout to the JSON alone (`stdout`:
    a result a command prints there, a report or a table). Text is printed as it is: no
    highlighting, and no emoji codes (a path and line number such as `recipe.yaml:100:` would
    become an emoji)."""
    return Console(stderr=not stdout, quiet=quiet or json_mode, highlight=False, emoji=False)


def quiet_libraries() -> None:
    """Library chatter (load reports, shard bars) would drown the stage's own progress; and
    DeepSpeed, which transformers and accelerate import wherever it is installed, warns on every
    command without CUDA that it "set the accelerator to CPU" unless it is told so."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

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


def fmt_number(value: Any) -> str:
    """Floats to 4 significant digits (a 5.25e-06 difference is not 0.0000), the rest as text."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def metrics_line(metrics: dict[str, Any], keep: Callable[[str], bool] = lambda k: True) -> str:
    """`key value, key value` of a manifest's metrics, for tables and model cards."""
    return ", ".join(f"{k} {fmt_number(v)}" for k, v in metrics.items() if keep(k))


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than an invalid file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object a line and flushes each, so a killed run keeps what it logged."""

    def __init__(self, path: Path, enabled: bool = True, resume: bool = False):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
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

    def close(self) -> None:
        if self.enabled:
            self._handle.close()


@dataclass(frozen=True)
class Trackers:
    """A stage's experiment trackers: the recipe's `run.trackers`, its `run.project`, and the
    tracker run `<run name>-<stage>` grouped under the run name. TRL's stages reach them through
    transformers' `report_to`, PPO through accelerate's trackers; TensorBoard writes
    `<stage>/tensorboard/` either way."""

    names: tuple[str, ...]
    project: str
    run_name: str
    group: str
    tensorboard_dir: Path

    @classmethod
    def for_stage(cls, run: Any, stage: str, stage_dir: Path) -> Trackers:
        """From the recipe's `run` section; a tracker whose package is missing is an RlhfError
        naming the extra to install."""
        require_trackers(run.trackers)
        return cls(
            tuple(run.trackers),
            run.project,
            f"{run.name}-{stage}",
            run.name,
            stage_dir / "tensorboard",
        )

    def trainer_args(self, fields: Any) -> dict[str, Any]:
        """TrainingArguments for transformers' integrations (`fields`: the config class's
        dataclass fields; `project` is new in transformers 5.20)."""
        args: dict[str, Any] = {"report_to": list(self.names) or "none", "run_name": self.run_name}
        if "project" in fields:
            args["project"] = self.project
        return args

    @contextmanager
    def environment(self) -> Iterator[None]:
        """The settings transformers' callbacks read from the environment, for the stage's
        duration: TensorBoard's folder, wandb's project and group, MLflow's experiment (one the
        user set wins, as MLflow's own rule); the earlier values come back afterwards."""
        wanted = {
            "TENSORBOARD_LOGGING_DIR": str(self.tensorboard_dir),
            "WANDB_PROJECT": self.project,
            "WANDB_RUN_GROUP": self.group,
            "MLFLOW_EXPERIMENT_NAME": os.environ.get("MLFLOW_EXPERIMENT_NAME", self.project),
        }
        before = {key: os.environ.get(key) for key in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            try:  # a run reopened by the log of an evaluation after training is finished here
                if "trackio" in self.names:
                    _finish_trackio()
                if "mlflow" in self.names:
                    _end_mlflow_run()
            finally:
                for key, value in before.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

    def for_accelerate(self) -> list[Any]:
        """accelerate's tracker objects for `Accelerator(log_with=...)`, named like the
        transformers ones (started by `accelerator.init_trackers`)."""
        from accelerate import tracking

        made = {
            "tensorboard": lambda: tracking.TensorBoardTracker(
                self.tensorboard_dir.name, self.tensorboard_dir.parent
            ),
            "wandb": lambda: tracking.WandBTracker(
                self.project, name=self.run_name, group=self.group
            ),
            "trackio": lambda: tracking.TrackioTracker(
                self.project, name=self.run_name, resume="allow"
            ),
            "mlflow": lambda: tracking.MLflowTracker(self.project, run_name=self.run_name),
        }
        return [made[name]() for name in self.names]


def finish_trackers(accelerator: Any) -> None:
    """What `accelerator.end_training()` does for the trackers, without ending the process
    group (the stage still saves after). trackio is finished through its module, which also
    forgets the run: accelerate's finish leaves it to an exit hook that would print on stdout
    after a `--json` result."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "trackio":
            _finish_trackio()
        else:
            tracker.finish()


def _finish_trackio() -> None:
    """Finish trackio's open run, if any, so that no exit hook finishes it later (printing on
    stdout after the command's result)."""
    import trackio

    if trackio.context_vars.current_run.get() is not None:
        trackio.finish()


def _end_mlflow_run() -> None:
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.end_run()


def require_trackers(trackers: list[str]) -> None:
    """Each listed tracker's package is importable, else one line naming the extra."""
    for tracker in trackers:
        if importlib.util.find_spec(tracker) is None:  # each is the module and the extra
            raise RlhfError(
                f"run.trackers lists {tracker} but the {tracker} package is not "
                f"installed: pip install 'rlhf-cli[{tracker}]'"
            )


def tracker_config(recipe_dump: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The recipe flattened to `section.field: value` with scalar values, as trackers store
    a run's hyperparameters (lists and nulls as text)."""
    flat: dict[str, Any] = {}
    for key, value in recipe_dump.items():
        if isinstance(value, dict):
            flat.update(tracker_config(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[f"{prefix}{key}"] = value
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


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


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after a checkpoint (and a last line cut short by a kill), so a resumed
    log has one line per step."""
    if not path.is_file():
        return
    keep = [json.dumps(row) for row in read_metrics(path) if row.get("step", 0) <= last_step]
    atomic_write_bytes(path, ("\n".join(keep) + "\n" if keep else "").encode())
