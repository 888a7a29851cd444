"""PPO checkpoints on a tiny torch module: atomic writes, verification, exact restore."""

from __future__ import annotations

import errno
import functools
import json
import os
import random

import numpy as np
import pytest
import torch

from rlhf_cli.errors import StageError
from rlhf_cli.ppo import checkpoint as ckpt
from rlhf_cli.ppo.core import AdaptiveKLController, FixedKLController
from rlhf_cli.ppo.models import PolicyAndValue
from rlhf_cli.ppo.sharding import Engine
from rlhf_cli.resume import newest_whole, ppo_checkpoint_problem

FILES = [
    "optimizer.pt",
    "policy.safetensors",
    "rng_0.pt",
    "scheduler.pt",
    "state.json",
    "value.safetensors",
]


class Tiny(torch.nn.Module):
    """A frozen `body` (like a LoRA base) under a trainable `head` (like the adapter)."""

    def __init__(self, seed: int, train_body: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(2, 1)
        self.body.requires_grad_(train_body)


@functools.cache
def one_process() -> Engine:
    """The one-process engine (plain files; the sharded ones run in tests/stages)."""
    from accelerate import Accelerator

    return Engine(Accelerator(cpu=True))


class Parts:
    """Everything `save_checkpoint` / `load_checkpoint` take, built from one seed: an actor whose
    policy is `Tiny` and whose value head is a (1, 2) linear layer, and its `TrainState`."""

    def __init__(self, seed: int, kl_ctl=None, lr: float = 0.1):
        self.policy = Tiny(seed)
        self.actor = PolicyAndValue(self.policy, value_head=torch.nn.Linear(2, 1))
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.kl_ctl = kl_ctl if kl_ctl is not None else AdaptiveKLController(0.1, 6.0, 10000)
        self.sampler = torch.Generator().manual_seed(seed)

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            self.optimizer.zero_grad()
            self.policy.head(self.policy.body(torch.ones(4, 3))).pow(2).mean().backward()
            self.optimizer.step()
            self.scheduler.step()

    def state(self) -> ckpt.TrainState:
        """The parts as they are now (a test may swap one), with no score moments."""
        return ckpt.TrainState(self.optimizer, self.scheduler, self.kl_ctl, self.sampler, None)

    def save(self, root, iteration, extra=None):
        return ckpt.save_checkpoint(
            root, iteration, one_process(), self.actor, self.state(), extra or {}
        )

    def load(self, folder):
        return ckpt.load_checkpoint(folder, one_process(), self.actor, self.state())


def draws(sampler: torch.Generator) -> tuple:
    return (
        torch.rand(3).tolist(),
        random.random(),
        np.random.rand(2).tolist(),
        torch.randperm(10, generator=sampler).tolist(),
    )


# ── writing and verifying ───────────────────────────────────────────────────────────────────


def test_save_writes_every_file_and_an_index_that_verifies(tmp_path):
    folder = Parts(0).save(tmp_path, 7, extra={"seen": 12})
    assert folder == tmp_path / "iter_00007"
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES + ["checkpoint.json"])
    index = json.loads((folder / "checkpoint.json").read_text())
    assert index["iteration"] == 7 and sorted(index["sha256"]) == FILES
    assert json.loads((folder / "state.json").read_text()) == {
        "iteration": 7,
        "kl_controller": {"value": 0.1, "target": 6.0, "horizon": 10000},
        "engine": "ddp",
        "processes": 1,
        "seen": 12,
    }
    assert ppo_checkpoint_problem(folder) is None
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00007"]  # no temporary folder left


def test_only_trainable_weights_are_saved(tmp_path):
    parts = Parts(0)
    folder = parts.save(tmp_path, 1)
    from safetensors.torch import load_file

    saved = load_file(folder / "policy.safetensors")
    assert sorted(saved) == ["head.bias", "head.weight"]
    assert torch.equal(saved["head.weight"], parts.policy.head.weight.detach())


@pytest.mark.parametrize(
    "damage, problem",
    [
        ("truncate", "policy.safetensors does not match its checksum"),
        ("delete_file", "rng_0.pt is missing"),
        ("delete_index", "no checkpoint.json (incomplete write)"),
        ("garble_index", "checkpoint.json is unreadable"),
        ("index_without_sha256", "checkpoint.json is unreadable"),
        ("index_not_an_object", "checkpoint.json is unreadable"),
        ("index_not_utf8", "checkpoint.json is unreadable"),
        ("index_lists_nothing", "checkpoint.json lists no files"),
    ],
)
def test_verify_names_what_is_wrong(tmp_path, damage, problem):
    folder = Parts(0).save(tmp_path, 1)
    weights, index = folder / "policy.safetensors", folder / "checkpoint.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "delete_file":
        (folder / "rng_0.pt").unlink()
    elif damage == "delete_index":
        index.unlink()
    elif damage == "garble_index":
        index.write_text('{"iteration": 1, "sha2')
    elif damage == "index_not_an_object":
        index.write_text("[]")
    elif damage == "index_not_utf8":
        index.write_bytes(b"\xff\xfe{")
    elif damage == "index_lists_nothing":
        index.write_text('{"iteration": 1, "sha256": {}}')
    else:
        index.write_text('{"iteration": 1}')
    assert ppo_checkpoint_problem(folder) == problem


def test_a_flipped_byte_of_the_same_length_is_caught(tmp_path):
    folder = Parts(0).save(tmp_path, 1)
    state = folder / "state.json"
    text = state.read_text()
    state.write_text(text.replace('"iteration": 1', '"iteration": 2'))
    assert len(state.read_text()) == len(text)
    assert ppo_checkpoint_problem(folder) == "state.json does not match its checksum"


def test_newest_valid_picks_the_newest_whole_checkpoint(tmp_path):
    parts = Parts(0)
    for iteration in (2, 4, 10):
        parts.save(tmp_path, iteration)
    folder, notes = newest_whole(tmp_path, "iter_", ppo_checkpoint_problem)
    assert folder == tmp_path / "iter_00010" and notes == []


def test_newest_valid_orders_by_iteration_number_not_by_name(tmp_path):
    parts = Parts(0)
    for iteration in (99999, 100000):
        parts.save(tmp_path, iteration)
    (tmp_path / "iter_notes.txt").write_text("not a checkpoint")
    folder, notes = newest_whole(tmp_path, "iter_", ppo_checkpoint_problem)
    assert folder == tmp_path / "iter_100000" and notes == []


def test_newest_valid_skips_corrupt_ones_with_a_note_each(tmp_path):
    parts = Parts(0)
    for iteration in (2, 4, 6, 8):
        parts.save(tmp_path, iteration)
    weights = tmp_path / "iter_00008" / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (tmp_path / "iter_00006" / "checkpoint.json").unlink()
    (tmp_path / "iter_00004" / "checkpoint.json").write_text("not json")
    folder, notes = newest_whole(tmp_path, "iter_", ppo_checkpoint_problem)
    assert folder == tmp_path / "iter_00002"
    assert notes == [
        "checkpoint iter_00008 is corrupt (policy.safetensors does not match its checksum); "
        "skipped",
        "checkpoint iter_00006 is corrupt (no checkpoint.json (incomplete write)); skipped",
        "checkpoint iter_00004 is corrupt (checkpoint.json is unreadable); skipped",
    ]


def test_newest_valid_with_nothing_usable(tmp_path):
    assert newest_whole(tmp_path / "absent", "iter_", ppo_checkpoint_problem) == (None, [])
    Parts(0).save(tmp_path, 3)
    (tmp_path / "iter_00003" / "checkpoint.json").unlink()
    folder, notes = newest_whole(tmp_path, "iter_", ppo_checkpoint_problem)
    assert folder is None and len(notes) == 1 and "iter_00003" in notes[0]


def test_a_leftover_temporary_folder_is_never_picked(tmp_path):
    parts = Parts(0)
    parts.save(tmp_path, 1)
    whole = parts.save(tmp_path / "elsewhere", 9)  # a complete, verifying folder ...
    whole.rename(tmp_path / ".iter_00009.tmp4242")  # ... left under its temporary name
    assert ppo_checkpoint_problem(tmp_path / ".iter_00009.tmp4242") is None
    assert newest_whole(tmp_path, "iter_", ppo_checkpoint_problem) == (tmp_path / "iter_00001", [])


def test_failed_write_leaves_no_folder_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    parts = Parts(0)
    previous = parts.save(tmp_path, 1)
    digest = ckpt.file_sha256(previous / "policy.safetensors")
    real_save, written = torch.save, []

    def save_until_full(obj, path, *args, **kwargs):
        if path.name == "rng_0.pt":  # policy, value and optimizer are already written
            raise OSError(28, "No space left on device")
        written.append(path.name)
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save_until_full)
    parts.train_steps(1)
    with pytest.raises(OSError, match="No space left"):
        parts.save(tmp_path, 2)
    assert written == ["optimizer.pt"]  # it did fail midway
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00001"]
    assert ppo_checkpoint_problem(previous) is None
    assert ckpt.file_sha256(previous / "policy.safetensors") == digest


def test_failed_rewrite_of_the_same_iteration_keeps_the_old_one(tmp_path, monkeypatch):
    parts = Parts(0)
    folder = parts.save(tmp_path, 5)
    before = json.loads((folder / "checkpoint.json").read_text())
    parts.train_steps(1)

    def broken(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(ckpt.torch, "save", broken)
    with pytest.raises(OSError):
        parts.save(tmp_path, 5)
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00005"]
    assert json.loads((folder / "checkpoint.json").read_text()) == before
    assert ppo_checkpoint_problem(folder) is None


def test_saving_the_same_iteration_again_replaces_it(tmp_path):
    parts = Parts(0)
    parts.save(tmp_path, 5, extra={"seen": 1})
    folder = parts.save(tmp_path, 5, extra={"seen": 2})
    assert json.loads((folder / "state.json").read_text())["seen"] == 2
    assert ppo_checkpoint_problem(folder) is None
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00005"]


# ── restoring ───────────────────────────────────────────────────────────────────────────────


def test_load_restores_weights_optimizer_scheduler_and_kl(tmp_path):
    saved = Parts(0)
    saved.train_steps(2)
    saved.kl_ctl.update(current_kl=12.0, n_steps=1000)  # 0.1 * (1 + 0.2 * 1000 / 10000)
    value = {"weight": torch.tensor([[1.5, -2.0]]), "bias": torch.tensor([0.25])}
    saved.actor.value_head.load_state_dict(value)
    folder = saved.save(tmp_path, 2, extra={"seen": 16})

    fresh = Parts(1, kl_ctl=AdaptiveKLController(0.5, 1.0, 1), lr=0.1)
    frozen_before = {n: p.detach().clone() for n, p in fresh.policy.body.named_parameters()}
    assert not torch.equal(frozen_before["weight"], saved.policy.body.weight)
    state = fresh.load(folder)

    assert state == {
        "iteration": 2,
        "seen": 16,
        "engine": "ddp",
        "processes": 1,
        "kl_controller": {"value": pytest.approx(0.102), "target": 6.0, "horizon": 10000},
    }
    assert all(torch.equal(fresh.actor.value_state_dict()[k], value[k]) for k in value)
    for name in ("weight", "bias"):
        assert torch.equal(getattr(fresh.policy.head, name), getattr(saved.policy.head, name))
        assert torch.equal(getattr(fresh.policy.body, name), frozen_before[name])  # untouched
    param = fresh.policy.head.weight
    assert fresh.optimizer.state[param]["step"].item() == 2
    assert torch.equal(
        fresh.optimizer.state[param]["exp_avg"],
        saved.optimizer.state[saved.policy.head.weight]["exp_avg"],
    )
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # 0.1 * 0.5 * 0.5
    assert fresh.scheduler.last_epoch == 2
    assert fresh.kl_ctl.value == pytest.approx(0.102)
    assert (fresh.kl_ctl.target, fresh.kl_ctl.horizon) == (6.0, 10000)


def test_every_file_torch_loads_on_resume_comes_onto_the_cpu(tmp_path, monkeypatch):
    # without a map_location a file lands where it was saved from: every process would fill the
    # GPU of the process that wrote it (cuda:0)
    folder = Parts(0).save(tmp_path, 1)
    loaded, real_load = {}, torch.load

    def recording_load(path, *args, **kwargs):
        loaded[os.path.basename(path)] = kwargs.get("map_location", args[0] if args else None)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    Parts(1).load(folder)
    assert loaded == dict.fromkeys(["optimizer.pt", "scheduler.pt", "rng_0.pt"], "cpu")


def test_load_restores_a_fixed_kl_controller_after_a_raise(tmp_path):
    saved = Parts(0, kl_ctl=FixedKLController(0.2))
    saved.kl_ctl.raise_by(0.05)
    folder = saved.save(tmp_path, 1)
    fresh = Parts(0, kl_ctl=FixedKLController(0.9))
    state = fresh.load(folder)
    assert state["kl_controller"] == {"value": pytest.approx(0.25)}
    assert fresh.kl_ctl.value == pytest.approx(0.25)


def test_training_on_after_load_matches_training_on_without_stopping(tmp_path):
    saved = Parts(0)
    saved.train_steps(2)
    folder = saved.save(tmp_path, 2)
    saved.train_steps(3)
    fresh = Parts(0)  # the same frozen body; the head at its initial, untrained values
    assert not torch.equal(fresh.policy.head.weight, saved.policy.head.weight)
    fresh.load(folder)
    fresh.train_steps(3)
    assert torch.equal(fresh.policy.head.weight, saved.policy.head.weight)
    assert torch.equal(fresh.policy.head.bias, saved.policy.head.bias)


def test_load_restores_every_random_number_generator(tmp_path):
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    parts = Parts(3)
    torch.randperm(10, generator=parts.sampler)  # the sampler is mid-stream, not at its seed
    folder = parts.save(tmp_path, 1)
    expected = draws(parts.sampler)

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    sampler = torch.Generator().manual_seed(99)
    assert draws(sampler) != expected
    parts.sampler = sampler
    parts.load(folder)
    assert draws(sampler) == expected


def test_different_trainable_weights_are_refused_before_anything_changes(tmp_path):
    folder = Parts(0).save(tmp_path, 1)
    other = Parts(1)
    other.policy.body.requires_grad_(True)  # trainable: body.weight, body.bias, head.*
    weights_before = [p.detach().clone() for p in other.policy.parameters()]
    kl_before = other.kl_ctl.state_dict()
    with pytest.raises(StageError, match=r"does not match .*\(2 names differ\)"):
        other.load(folder)
    assert all(
        torch.equal(a, b) for a, b in zip(weights_before, other.policy.parameters(), strict=True)
    )
    assert other.kl_ctl.state_dict() == kl_before
    assert other.scheduler.last_epoch == 0


def test_weights_of_another_shape_are_refused_even_where_they_would_broadcast(tmp_path):
    """A rank-1 LoRA matrix would broadcast into any rank: the shapes are compared first."""
    folder = Parts(0).save(tmp_path, 1)  # head.weight (1, 2), head.bias (1,)
    other = Parts(1)
    other.policy.head = torch.nn.Linear(2, 3)  # (3, 2) and (3,): copy_ would broadcast
    other.optimizer = torch.optim.AdamW(other.policy.head.parameters(), lr=0.1)
    before = [p.detach().clone() for p in other.policy.head.parameters()]
    with pytest.raises(StageError, match=r"does not match .*\(2 shapes differ, e.g. head\."):
        other.load(folder)
    assert all(
        torch.equal(a, b) for a, b in zip(before, other.policy.head.parameters(), strict=True)
    )


def test_a_checkpoint_written_before_per_process_rng_files_still_resumes(tmp_path):
    saved = Parts(0)
    saved.train_steps(1)
    folder = saved.save(tmp_path, 1)
    (folder / "rng_0.pt").rename(folder / "rng.pt")  # the one-process layout of earlier versions
    state = json.loads((folder / "state.json").read_text())
    for key in ("engine", "processes"):
        del state[key]
    (folder / "state.json").write_text(json.dumps(state))
    expected = draws(saved.sampler)
    fresh = Parts(0)
    fresh.load(folder)
    assert draws(fresh.sampler) == expected
    assert torch.equal(fresh.policy.head.weight, saved.policy.head.weight)


@pytest.mark.parametrize(
    "code, remedy",
    [
        (errno.ENOSPC, "free disk space"),
        (errno.EACCES, "make /runs/x/ppo/checkpoints writable"),
        (errno.EROFS, "make /runs/x/ppo/checkpoints writable"),
        (errno.EIO, "fix that"),
    ],
)
def test_a_failed_write_says_what_to_do_by_its_cause(code, remedy):
    from rlhf_cli.errors import write_remedy

    exc = OSError(code, os.strerror(code), "/runs/x/ppo/checkpoints/.iter_00008.tmp1")
    assert write_remedy(exc) == remedy


@pytest.mark.parametrize(
    "files, problem",
    [
        (["model.safetensors", "optimizer.pt", "scheduler.pt"], None),
        (["adapter_model.safetensors", "optimizer.pt", "scheduler.pt"], None),
        (["global_step4/mp_rank_00_model_states.pt"], None),  # DeepSpeed's layout
        (["pytorch_model_fsdp_0/x.distcp", "optimizer_0/y.distcp", "scheduler.pt"], None),
        (["optimizer.pt", "scheduler.pt"], "no weights"),
        (["model.safetensors", "scheduler.pt"], "no optimizer state"),
        (["model.safetensors", "optimizer.pt"], "no scheduler.pt"),  # transformers would skip both
    ],
)
def test_a_trainer_checkpoint_is_whole_only_with_what_resume_loads(tmp_path, files, problem):
    from rlhf_cli.resume import trainer_resume_point

    def write(folder, names, step):
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(b"x")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    older = tmp_path / "checkpoints" / "checkpoint-2"
    write(older, ["model.safetensors", "optimizer.pt", "scheduler.pt"], 2)
    folder = tmp_path / "checkpoints" / "checkpoint-4"
    write(folder, files, 4)
    if problem is None:
        assert trainer_resume_point(tmp_path, "rlhf sft") == (folder, [])
    else:
        note = f"checkpoint checkpoint-4 is corrupt ({problem}); skipped"
        assert trainer_resume_point(tmp_path, "rlhf sft") == (older, [note])
