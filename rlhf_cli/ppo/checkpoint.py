"""PPO checkpoints: everything needed to continue exactly where a run stopped.

`ppo/checkpoints/iter_NNNNN/` holds the trainable policy weights (`policy.safetensors`: the LoRA
adapter, or all weights without LoRA, gathered whole), the value head or critic
(`value.safetensors`), and the `TrainState`: the optimizer state (`optimizer.pt`, or `engine/` as
DeepSpeed or FSDP2 shard it), scheduler, KL controller, score moments, each process's RNG states
(`rng_<rank>.pt`, the prompt sampler's included), with the iteration counter and the engine and
number of processes that wrote it (`state.json`). It is written into
a temporary folder and renamed into place; its own `checkpoint.json`, written last, lists every
file's sha256, so a truncated or corrupted checkpoint is detected on `--resume` and the previous
good one is used instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from safetensors.torch import save_file

from rlhf_cli.errors import StageError, checkpoint_mismatch, is_shape_error
from rlhf_cli.modeling import trainable_state
from rlhf_cli.ppo import core
from rlhf_cli.ppo.sharding import Engine, load_pt
from rlhf_cli.resume import PPO_INDEX, ppo_checkpoint_name
from rlhf_cli.rundir import atomic_write_json, file_sha256


@dataclass
class TrainState:
    """What the loop trains with besides the weights: one object that `save_checkpoint` writes
    and `load_checkpoint` restores in place (torchtune's checkpoint dict)."""

    optimizer: Any
    scheduler: Any
    kl_ctl: Any  # core.AdaptiveKLController or FixedKLController
    sampler: torch.Generator  # prompt draws and mini-batch shuffles, alike on every process
    score_moments: core.RunningMoments | None  # `ppo.score_norm`; None when it is off


def rng_state(sampler: torch.Generator) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "sampler": sampler.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], sampler: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    sampler.set_state(state["sampler"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    iteration: int,
    engine: Engine,
    actor: Any,
    state: TrainState,
    extra: dict[str, Any],
) -> Path:
    """Write `iter_<iteration>` atomically, `extra` into its `state.json`; return its folder.
    Every process calls it: the trained weights are gathered whole into `policy.safetensors` /
    `value.safetensors` (what `rlhf audit` reads), the optimizer state is written as the engine
    shards it, and each process's RNG state (`rng_<rank>.pt`) is gathered to the main process,
    which writes it: a replicated (DDP) run writes its run directory from the main process
    alone, so the other machines of a multi-machine run need no shared filesystem to write
    it."""
    acc = engine.acc
    final = root / ppo_checkpoint_name(iteration)
    tmp = root / f".{final.name}.tmp"
    try:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        with engine.gathered(actor) as whole:
            if acc.is_main_process:
                save_file(trainable_state(whole.policy), tmp / "policy.safetensors")
                save_file(whole.value_state_dict(), tmp / "value.safetensors")
        engine.save_state(actor, state.optimizer, tmp)
        rngs = gather_object([rng_state(state.sampler)])  # in rank order, whichever machine
        if acc.is_main_process:
            for rank, rng in enumerate(rngs):
                torch.save(rng, tmp / f"rng_{rank}.pt")
            torch.save(state.scheduler.state_dict(), tmp / "scheduler.pt")
            written = {
                "iteration": iteration,
                "kl_controller": state.kl_ctl.state_dict(),
                "engine": engine.name,
                "processes": acc.num_processes,
            }
            if state.score_moments is not None:
                written["score_moments"] = state.score_moments.state_dict()
            atomic_write_json(tmp / "state.json", {**written, **extra})
        acc.wait_for_everyone()
        if acc.is_main_process:
            files = {
                p.relative_to(tmp).as_posix(): file_sha256(p)
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            atomic_write_json(tmp / PPO_INDEX, {"iteration": iteration, "sha256": files})
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except BaseException:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    acc.wait_for_everyone()
    return final


def checkpoint_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's `state.json` (iteration, layout, the input stages it was trained on);
    {} when it has none or cannot be read (`resume.ppo_checkpoint_problem` judges it whole)."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def load_checkpoint(folder: Path, engine: Engine, actor: Any, state: TrainState) -> dict[str, Any]:
    """Restore the trained weights into `actor` and `state` in place, on every process; return
    `state.json`'s contents (the iteration and what `save_checkpoint` was given as `extra`). A
    checkpoint resumes under the engine and number of processes that wrote it."""
    # `resume.ppo_checkpoint_problem` found the checkpoint whole
    saved = json.loads((folder / "state.json").read_text())
    acc = engine.acc
    written = (saved.get("engine", "ddp"), saved.get("processes", 1))
    if written != (engine.name, acc.num_processes):
        raise StageError(
            f"checkpoint {folder.name} was written by {written[0]} on {written[1]} process(es); "
            f"this launch is {engine.name} on {acc.num_processes}: resume with the launch "
            "command that wrote it"
        )
    try:
        engine.load_state(actor, state.optimizer, folder)
    except RuntimeError as exc:  # torch's shape check: the recipe's LoRA rank or modules moved
        if not is_shape_error(exc):
            raise
        raise checkpoint_mismatch(folder, str(exc).splitlines()[0][:200]) from None
    state.scheduler.load_state_dict(load_pt(folder / "scheduler.pt"))
    state.kl_ctl.load_state_dict(saved["kl_controller"])
    if state.score_moments is not None and saved.get("score_moments"):
        state.score_moments.load_state_dict(saved["score_moments"])
    rng_file = folder / f"rng_{acc.process_index}.pt"
    if not rng_file.is_file() and (folder / "rng.pt").is_file():  # one-process, before rng_<rank>
        rng_file = folder / "rng.pt"
    set_rng_state(load_pt(rng_file), state.sampler)
    return saved
