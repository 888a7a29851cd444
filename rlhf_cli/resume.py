"""Checkpoints and `--resume`: every search for a stage's checkpoints, what makes one whole, and
whether what a checkpoint or result was made from still stands.

```
<stage>/checkpoints/iter_NNNNN/       PPO's (`ppo/checkpoint.py` writes them)
<stage>/checkpoints/checkpoint-N/     the TRL Trainer's (sft, rm)
```
A folder counts by its prefix and number; `newest_whole` picks the newest that a stage's
`problem` check finds whole, skipping damaged ones and the ones a rollback undid (`mark_undone`)
with a note.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_cli.errors import StageError
from rlhf_cli.rundir import InputRecord, Manifest, RunDir, atomic_write_json, file_sha256

RESUMABLE = {"sft", "rm", "ppo"}  # stages whose command takes --resume
PPO_CHECKPOINT, TRAINER_CHECKPOINT = "iter_", "checkpoint-"  # + the iteration / step number
CHECKPOINT_PREFIXES = (PPO_CHECKPOINT, TRAINER_CHECKPOINT)
PPO_INDEX = "checkpoint.json"  # a PPO checkpoint's file list and checksums, written last
UNDONE = "undone.json"  # in a PPO checkpoint a rollback threw away: which rollback, and to what


def checkpoint_folders(root: Path, prefix: str) -> list[Path]:
    """The checkpoint folders `<root>/<prefix><N>`, oldest (smallest N) first; [] without
    `root`."""
    found = [f for f in root.glob(f"{prefix}*") if f.is_dir() and f.name[len(prefix) :].isdigit()]
    return sorted(found, key=lambda f: int(f.name[len(prefix) :]))


def newest_whole(
    root: Path, prefix: str, problem: Callable[[Path], str | None]
) -> tuple[Path | None, list[str]]:
    """The newest checkpoint folder `<root>/<prefix><N>` (by N) that `problem` finds whole
    (None), and a note for each newer one skipped."""
    notes = []
    for folder in reversed(checkpoint_folders(root, prefix)):
        undone = undone_by(folder)
        if undone is not None:
            notes.append(f"checkpoint {folder.name} was {undone}; skipped")
            continue
        why = problem(folder)
        if why is None:
            return folder, notes
        notes.append(f"checkpoint {folder.name} is corrupt ({why}); skipped")
    return None, notes


def mark_undone(folder: Path, iteration: int, restored: int) -> None:
    """Mark checkpoint `folder` as undone by the rollback at iteration `iteration`, which
    restored iteration `restored`'s weights: `--resume` (`newest_whole`), a later rollback and
    `--checkpoint best` never pick it again; `--checkpoint iter_N` still reads it, to look at
    what was undone."""
    atomic_write_json(folder / UNDONE, {"rollback_at": iteration, "restored": restored})


def undone_by(folder: Path) -> str | None:
    """What undid checkpoint `folder` ("undone by the rollback at iteration N"), or None when
    no rollback did."""
    if not (folder / UNDONE).exists():
        return None
    try:
        at = json.loads((folder / UNDONE).read_text())["rollback_at"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return "undone by a rollback"
    return f"undone by the rollback at iteration {at}"


def resume_point(
    root: Path, prefix: str, problem: Callable[[Path], str | None], command: str
) -> tuple[Path, list[str]]:
    """`newest_whole`, or a StageError when there is none: `--resume` cannot continue."""
    folder, notes = newest_whole(root, prefix, problem)
    if folder is None:
        raise StageError(
            f"--resume: no usable checkpoint under {root}"
            + (f" ({len(notes)} damaged)" if notes else "")
            + f"; run `{command}` without --resume to start over"
        )
    return folder, notes


def resumable(run: RunDir, stage: str) -> bool:
    """`stage` of `run` has checkpoints its command's `--resume` can start from: folders named
    as `newest_whole` looks for them (a prefix of `CHECKPOINT_PREFIXES`, then the number)."""
    checkpoints = run.stage_dir(stage) / "checkpoints"
    return stage in RESUMABLE and any(
        checkpoint_folders(checkpoints, p) for p in CHECKPOINT_PREFIXES
    )


def ppo_checkpoint_problem(folder: Path) -> str | None:
    """What is wrong with a PPO checkpoint (None: whole): every file `checkpoint.json` lists
    must be there with its checksum."""
    index = folder / PPO_INDEX
    if not index.is_file():
        return "no checkpoint.json (incomplete write)"
    try:
        expected = json.loads(index.read_text())["sha256"]
        names = list(expected.items())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "checkpoint.json is unreadable"
    if not names:
        return "checkpoint.json lists no files"
    for name, digest in names:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum"
    return None


def trainer_resume_point(stage_dir: Path, command: str) -> tuple[Path, list[str]]:
    """The newest whole Trainer checkpoint under `stage_dir/checkpoints` and a note for each
    newer, damaged one skipped; StageError when there is none. The Trainer writes
    `trainer_state.json` last, so a checkpoint without a readable one was cut short."""
    return resume_point(
        stage_dir / "checkpoints", TRAINER_CHECKPOINT, trainer_checkpoint_problem, command
    )


def trainer_checkpoint_problem(folder: Path) -> str | None:
    """What is missing from a Trainer checkpoint (None: whole). DeepSpeed keeps weights and
    optimizer in `global_step*/`; otherwise the weights (safetensors, or FSDP's files), the
    optimizer and `scheduler.pt` must be there: without the latter transformers would resume
    with a fresh optimizer and schedule, silently."""
    try:
        step = json.loads((folder / "trainer_state.json").read_text())["global_step"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return "no readable trainer_state.json"
    if not isinstance(step, int):
        return "trainer_state.json has no step"
    if any(folder.glob("global_step*")):
        return None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*")):
        return "no weights"
    if not any(
        (folder / name).exists() for name in ("optimizer.pt", "optimizer.bin", "optimizer_0")
    ):
        return "no optimizer state"
    if not (folder / "scheduler.pt").is_file():
        return "no scheduler.pt"
    return None


def check_same_inputs(
    made: Manifest | dict[str, Any],
    now: dict[str, InputRecord],
    stages: tuple[str, ...],
    what: str,
    remedy: str,
) -> None:
    """`made` (a manifest, or a PPO checkpoint's `state.json`, which keeps the same `inputs`)
    records the input stages it was made from; `now` holds their input records as they are
    today. An input stage that finished again since (`rlhf sft` run anew,
    or `run.base` naming another run) is a StageError: what was made on it no longer fits."""
    recorded = made.get("inputs") or {}
    for stage in stages:
        was, current = recorded.get(stage) or {}, now.get(stage) or {}
        if was.get("finished_at") and current.get("finished_at") not in (None, was["finished_at"]):
            raise StageError(
                f"{what} was made from the {stage} stage that finished at {was['finished_at']} "
                f"({was.get('path')}); the one here now finished at {current['finished_at']} "
                f"({current.get('path')}): {remedy}"
            )


BEST_CHECKPOINT = "best.json"  # in PPO's checkpoints folder: the best evaluated iteration's


def named_checkpoint(ppo_dir: Path, name: str) -> Path | None:
    """The PPO checkpoint a command names: `best` (the best held-out evaluation's, which
    `checkpoints/best.json` records), `last` (the final policy: None, the stage's own output)
    or `iter_N` / `N`; StageError naming what exists when there is none."""
    root = ppo_dir / "checkpoints"
    if name == "last":
        return None
    if name == "best":
        try:
            best = json.loads((root / BEST_CHECKPOINT).read_text())
        except OSError:
            raise StageError(
                f"{root} names no best checkpoint: set ppo.eval_every (and "
                "data.prompts.eval_fraction) so that held-out evaluations choose one"
            ) from None
        except ValueError:
            best = None
        named = best.get("checkpoint") if isinstance(best, dict) else None
        if not isinstance(named, str) or not named.startswith(PPO_CHECKPOINT):
            raise StageError(
                f"{root / BEST_CHECKPOINT} is damaged (no checkpoint name in it): name the "
                "checkpoint instead, --checkpoint iter_N (the manifest's `best` says which)"
            )
        folder = root / named
    else:
        number = name.removeprefix(PPO_CHECKPOINT)
        if not number.isdigit():
            raise StageError(f"--checkpoint must be best, last or iter_N, not '{name}'")
        folder = root / ppo_checkpoint_name(int(number))
    if not folder.is_dir():
        saved = ", ".join(f.name for f in checkpoint_folders(root, PPO_CHECKPOINT)) or "none"
        raise StageError(f"{folder} does not exist (checkpoints: {saved})")
    undone = undone_by(folder) if name == "best" else None
    if undone is not None:
        raise StageError(
            f"{root / BEST_CHECKPOINT} names {folder.name}, which was {undone}: name the "
            "checkpoint instead, --checkpoint iter_N"
        )
    return folder


def ppo_checkpoint_name(iteration: int) -> str:
    """The folder name of PPO's checkpoint after `iteration` (`iter_00012`)."""
    return f"{PPO_CHECKPOINT}{iteration:05d}"
