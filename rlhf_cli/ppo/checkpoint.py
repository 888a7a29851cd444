"""PPO checkpoints: everything needed to continue exactly where a run stopped.

`ppo/checkpoints/iter_NNNNN/` holds the trainable policy weights (the LoRA adapter, or all weights
without LoRA), the value head or critic, optimizer, scheduler, KL controller, RNG states and the
iteration counter. It is written into a temporary folder and renamed into place; its own
`checkpoint.json`, written last, lists every file's sha256, so a truncated or corrupted
checkpoint is detected on `--resume` and the previous good one is used instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlhf_cli.errors import StageError
from rlhf_cli.rundir import atomic_write_json, file_sha256

INDEX = "checkpoint.json"


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


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().cpu().contiguous() for n, p in module.named_parameters() if p.requires_grad
    }


def save_checkpoint(
    root: Path,
    iteration: int,
    *,
    policy: torch.nn.Module,
    value_state: dict[str, torch.Tensor],
    optimizer: Any,
    scheduler: Any,
    kl_ctl: Any,
    sampler: torch.Generator,
    extra: dict[str, Any],
) -> Path:
    """Write `iter_<iteration>` atomically; return its folder."""
    final = root / f"iter_{iteration:05d}"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(trainable_state(policy), tmp / "policy.safetensors")
        save_file(value_state, tmp / "value.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(sampler), tmp / "rng.pt")
        atomic_write_json(
            tmp / "state.json",
            {"iteration": iteration, "kl_controller": kl_ctl.state_dict(), **extra},
        )
        files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
        atomic_write_json(tmp / INDEX, {"iteration": iteration, "sha256": files})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify(folder: Path) -> str | None:
    """None when the checkpoint is whole, else what is wrong with it."""
    index = folder / INDEX
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


def newest_valid(root: Path) -> tuple[Path | None, list[str]]:
    """The newest whole checkpoint, and a note for each newer one that was skipped."""
    notes = []
    folders = [f for f in root.glob("iter_*") if f.is_dir() and f.name[5:].isdigit()]
    for folder in sorted(folders, key=lambda f: int(f.name[5:]), reverse=True):
        problem = verify(folder)
        if problem is None:
            return folder, notes
        notes.append(f"checkpoint {folder.name} is corrupt ({problem}); skipped")
    return None, notes


def load_checkpoint(
    folder: Path,
    *,
    policy: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    kl_ctl: Any,
    sampler: torch.Generator,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore state in place; return (state.json contents, value state dict)."""
    weights = load_file(folder / "policy.safetensors")
    expected = set(trainable_state(policy))
    if set(weights) != expected:
        raise StageError(
            f"checkpoint {folder} does not match this recipe's trainable weights "
            f"({len(set(weights) ^ expected)} names differ): start a new run name "
            "or drop --resume"
        )
    device = next(policy.parameters()).device
    with torch.no_grad():
        params = dict(policy.named_parameters())
        for name, tensor in weights.items():
            params[name].copy_(tensor.to(device))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    state = json.loads((folder / "state.json").read_text())
    kl_ctl.load_state_dict(state["kl_controller"])
    set_rng_state(torch.load(folder / "rng.pt", weights_only=False), sampler)
    return state, load_file(folder / "value.safetensors")
