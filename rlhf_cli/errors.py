"""Every user-facing error type, and the exit code the CLI gives it.

The CLI prints each as one line (no traceback) and exits with its `exit_code`:
- 1: `HackingDetected`, the audit found reward hacking (a shell pipeline can gate on it);
- 2: the run cannot go on as asked: a user mistake (recipe, paths, a missing or failed stage,
  a busy run, data, a model that cannot load as asked) or the machine (a full disk while
  checkpointing), or a check that failed before anything was saved (a merge mismatch, a push
  the hub refused);
- 3: `NonFiniteError`, training diverged (a checkpoint of the last state was written);
- 4: `EvalGateFailed`, `rlhf eval` measured a policy below a threshold of `eval.gate`;
- 70 (`INTERNAL_ERROR`, sysexits' EX_SOFTWARE): anything that is not an `RlhfError`, a bug. Its
  traceback goes to a log file (`write_crash_log`: the stage's folder when a stage was open,
  else the run's folder, else the system's temp folder) and stderr gets one line naming the
  error and that file (`internal_error_line`); a CI gate never reads a crash as a result.
Ctrl-C exits 130 after the stage has saved what it can.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import sys
import tempfile
import traceback
from pathlib import Path

INTERNAL_ERROR = 70  # sysexits.h EX_SOFTWARE: an internal software error


class RlhfError(Exception):
    """A user-facing error: bad input, missing stage, unusable hardware. Exit 2."""

    exit_code = 2


class RecipeError(RlhfError):
    """The recipe file cannot be read or does not validate; one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class StageError(RlhfError):
    """A stage cannot start: its input stage is missing, failed, or the run is busy."""


def checkpoint_mismatch(folder: object, why: str) -> StageError:
    """`--resume` from a checkpoint whose trainable weights the recipe no longer builds (the
    LoRA rank or target modules changed)."""
    return StageError(
        f"checkpoint {folder} does not match this recipe's trainable weights ({why}): start a "
        "new run name or drop --resume"
    )


def is_shape_error(exc: BaseException) -> bool:
    """torch's or the optimizer's error for saved weights of other shapes than the model's
    ("size mismatch for ...", "... must match the size of ...", "... shape ..."), not any
    message that happens to say "size" (a batch size, a vocabulary size)."""
    text = str(exc)
    return any(marker in text for marker in ("size mismatch", "match the size", "shape"))


def write_remedy(exc: OSError) -> str:
    """What to do about an OSError from a write, by its cause."""
    if exc.errno == errno.ENOSPC:
        return "free disk space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = os.path.dirname(str(exc.filename)) if exc.filename else "the run folder"
        return f"make {where} writable"
    return "fix that"


class DataError(RlhfError):
    """A dataset is missing, empty, or lacks the columns a stage needs."""


class GenerationServerLost(RlhfError):
    """A rollout server stopped answering (after its retries) or answered out of turn; the PPO
    loop checkpoints first and names the `--resume` line."""


class ModelLoadError(RlhfError):
    """A model cannot be loaded as the recipe asks (e.g. 4-bit where bitsandbytes cannot)."""


class CheckpointWriteError(RlhfError):
    """A checkpoint could not be written (e.g. the disk is full); the previous one is intact."""


class ProcessLostError(RlhfError):
    """Another process of a multi-process (or multi-machine) run stopped answering: its machine
    died, was stopped, or lost the network. The stage stops; it resumes from its newest
    checkpoint."""


class MergeMismatch(RlhfError):
    """The merged model does not reproduce the adapter model; nothing was saved."""


class PushError(RlhfError):
    """The hub refused or could not be reached."""


class HackingDetected(RlhfError):
    """The audit found reward hacking: exit 1 so that a shell pipeline can gate on it."""

    exit_code = 1


class EvalError(RlhfError):
    """`rlhf eval` cannot measure as asked: a judge that does not answer or serve its model, a
    missing key variable, an optional package not installed, a checks file that cannot be read."""


class EvalGateFailed(RlhfError):
    """`rlhf eval`: a policy missed a threshold of `eval.gate` (a CI gate on quality)."""

    exit_code = 4


class NonFiniteError(RlhfError):
    """Too many iterations in a row with non-finite rewards or losses: training diverged."""

    exit_code = 3


class DoesNotFit(RlhfError):
    """`rlhf plan`: the estimated peak exceeds the memory given (a CI gate before a launch)."""


# ── internal errors (bugs): exit 70, the traceback in a log file ─────────────────────────────────


def crash_log_name() -> str:
    """`error.log`, or `error.rank<N>.log` for process N > 0 of a multi-process run (torchrun and
    accelerate set RANK), so that the ranks do not write over each other's log."""
    rank = os.environ.get("RANK", "0")
    return f"error.rank{rank}.log" if rank.isdigit() and int(rank) > 0 else "error.log"


def write_crash_log(exc: BaseException, folder: Path | None, command: str) -> Path | None:
    """Write `exc`'s traceback, after a line naming the time and the command line, to
    `crash_log_name()` in `folder` when it exists and takes it, else to a new file in the
    system's temp folder; None when not even that can be written."""
    text = (
        f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} rlhf {command}: "
        f"{' '.join(sys.argv)}\n\n{''.join(traceback.format_exception(exc))}"
    )
    if folder is not None and folder.is_dir():
        try:
            (folder / crash_log_name()).write_text(text, encoding="utf-8")
            return folder / crash_log_name()
        except OSError:
            pass  # a read-only folder or a full disk: the temp folder
    try:
        fd, name = tempfile.mkstemp(prefix=f"rlhf-{command}-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError:
        return None
    return Path(name)


def internal_error_line(exc: BaseException, log: Path | None) -> str:
    """The one line stderr gets for a bug: its type, the first line of its message, the log."""
    lines = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    where = f"traceback: {log}" if log is not None else "no log could be written"
    return f"internal error {message} ({where})"
