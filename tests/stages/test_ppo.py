"""PPO end to end on the tiny recipe: it learns, frozen models stay frozen, Ctrl-C checkpoints,
--resume reproduces the uninterrupted run, and two processes log one line per iteration."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch.testing import assert_close
from tracker_stores import TRACKER_PROJECT, assert_trackers_hold

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import load_recipe
from rlhf_cli.resume import ppo_checkpoint_problem
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import MetricsWriter, read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
PPO_SMALL = {
    "iterations": 8,
    "batch_size": 16,
    "mini_batch_size": 8,
    "ppo_epochs": 2,
    "save_freq": 4,
    "log_every": 4,
    "generation": {"max_new_tokens": 16},
}
REQUIRED_KEYS = [
    "env/reward_mean",
    "env/reward_std",
    "objective/kl",
    "objective/kl_coef",
    "objective/entropy",
    "objective/clipfrac",
    "ppo/loss/policy",
    "ppo/loss/value",
    "ppo/loss/total",
    "ppo/policy/approxkl",
    "ppo/val/explained_variance",
    "response/length_mean",
    "time/rollout_s",
    "time/score_s",
    "time/update_s",
    "time/iteration_s",
    "tokens/generated_per_s",
    "rollout/logprob_mismatch",
]


def test_ppo_learns_and_writes_the_contract(ppo_recipe, pipeline, tmp_path, small_recipe):
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(
        pipeline,
        tmp_path,
        small_recipe,
        {
            "iterations": 15,
            "batch_size": 32,
            "mini_batch_size": 8,
            "ppo_epochs": 2,
            "save_freq": 15,
            "log_every": 5,
            "generation": {"top_p": 0.9},  # the guide's nucleus: the loss must see it too
        },
        run={"trackers": ["tensorboard", "trackio"], "project": TRACKER_PROJECT},
    )
    manifest = run_ppo(recipe, QUIET)
    run = RunDir.for_recipe(recipe)
    rows = read_metrics(run.stage_dir("ppo") / "metrics.jsonl")
    assert_trackers_hold(rows, run.stage_dir("ppo"), f"{recipe.run.name}-ppo")

    assert manifest["status"] == "completed"
    assert [r["iteration"] for r in rows] == list(range(1, 16))
    assert all(key in rows[0] for key in REQUIRED_KEYS)
    first = sum(r["env/reward_mean"] for r in rows[:5]) / 5
    last = sum(r["env/reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last, [r["env/reward_mean"] for r in rows])
    assert all(torch.isfinite(torch.tensor(r["objective/kl"])) for r in rows)
    # the ratio and KL are those of the distribution sampled (top-p 0.9), every iteration:
    # float noise typically; a token at the nucleus edge may flip in or out under that noise,
    # moving one token's log-prob by about the edge token's share (seen up to 1e-3 with
    # transformers 5.24, 3.4e-2 with 5.19); a missing top-p renormalisation would be
    # |log 0.9| ~ 0.1 on every token, so the median tells
    mismatch = sorted(r["rollout/logprob_mismatch"] for r in rows)
    assert mismatch[len(mismatch) // 2] < 1e-4 and mismatch[-1] < 5e-2
    # β moves toward the target: down while KL is under it, up while over it
    mean_kl = sum(r["objective/kl"] for r in rows) / len(rows)
    beta_change = manifest["metrics"]["kl_coef_now"] - recipe.ppo.init_kl_coef
    assert beta_change != 0 and (beta_change < 0) == (mean_kl < recipe.ppo.target_kl)
    for name in ("adapter", "value_head", "tokenizer", "samples"):
        assert (run.stage_dir("ppo") / manifest["outputs"][name]).exists()
    assert set(manifest["inputs"]) == {"sft", "rm"}
    samples = read_metrics(run.stage_dir("ppo") / "samples.jsonl")
    assert samples and {"prompt", "response", "score", "kl"} <= set(samples[0])


def test_frozen_models_get_no_gradients(ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch):
    from rlhf_cli.stages import ppo as stage
    from rlhf_cli.stages.ppo import run_ppo

    seen: dict[str, Any] = {}
    real_train = stage.train

    def spying_train(ppo, start):
        actor = ppo.unwrapped
        seen["base"] = {
            n: p.detach().clone() for n, p in actor.policy.named_parameters() if "lora_" not in n
        }
        seen["lora"] = {
            n: p.detach().clone() for n, p in actor.policy.named_parameters() if "lora_" in n
        }
        seen["rm"] = {n: p.detach().clone() for n, p in ppo.models.scorer.model.named_parameters()}
        seen["dropout"] = [
            m.p
            for m in list(actor.modules()) + list(ppo.models.scorer.model.modules())
            if isinstance(m, torch.nn.Dropout)
        ]
        summary = real_train(ppo, start)
        seen["ppo"] = ppo
        return summary

    monkeypatch.setattr(stage, "train", spying_train)
    run_ppo(ppo_recipe(pipeline, tmp_path, small_recipe, {**PPO_SMALL, "iterations": 3}), QUIET)
    actor = seen["ppo"].unwrapped
    assert seen["ppo"].state.optimizer.param_groups[0]["eps"] == 1e-5  # ppo.adam_eps default
    assert seen["dropout"] and all(p == 0.0 for p in seen["dropout"])
    for name, param in actor.policy.named_parameters():
        if "lora_" in name:
            continue
        assert not param.requires_grad and param.grad is None, name
        assert torch.equal(param, seen["base"][name]), name
    assert any(
        not torch.equal(p, seen["lora"][n])
        for n, p in actor.policy.named_parameters()
        if "lora_" in n
    )
    assert torch.count_nonzero(actor.value_head.weight) > 0  # started at zero, trained
    for name, param in seen["ppo"].models.scorer.model.named_parameters():
        assert not param.requires_grad and param.grad is None
        assert torch.equal(param, seen["rm"][name]), name


def _losses(run: RunDir) -> list[float]:
    return [r["ppo/loss/total"] for r in read_metrics(run.stage_dir("ppo") / "metrics.jsonl")]


@pytest.mark.parametrize("score_norm", [False, True])
def test_interrupt_checkpoints_and_resume_reproduces(
    ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch, score_norm
):
    """With `ppo.score_norm` the running score moments are part of the state that resumes."""
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, {**PPO_SMALL, "score_norm": score_norm})
    run = RunDir.for_recipe(recipe)
    run_ppo(recipe, QUIET)
    uninterrupted = _losses(run)
    scores = [r["env/reward_mean"] for r in read_metrics(run.stage_dir("ppo") / "metrics.jsonl")]
    shutil.rmtree(run.stage_dir("ppo"))

    real_log = MetricsWriter.log

    def log_then_ctrl_c(self, metrics, step):  # Ctrl-C arrives during iteration 3
        real_log(self, metrics, step)
        if self.path.name == "metrics.jsonl" and step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(MetricsWriter, "log", log_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(recipe, QUIET)
    monkeypatch.setattr(MetricsWriter, "log", real_log)
    assert run.read_manifest("ppo")["status"] == "interrupted"
    assert (run.stage_dir("ppo") / "checkpoints" / "iter_00003" / "checkpoint.json").is_file()

    manifest = run_ppo(recipe, QUIET, resume=True)
    assert manifest["status"] == "completed"
    rows = read_metrics(run.stage_dir("ppo") / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, 9))
    assert_close(torch.tensor(_losses(run)), torch.tensor(uninterrupted), rtol=1e-4, atol=1e-5)
    resumed = [r["env/reward_mean"] for r in rows]
    assert_close(torch.tensor(resumed), torch.tensor(scores), rtol=1e-4, atol=1e-5)


def test_corrupt_newest_checkpoint_falls_back(ppo_recipe, pipeline, tmp_path, small_recipe):
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, PPO_SMALL)
    run_ppo(recipe, QUIET)
    checkpoints = RunDir.for_recipe(recipe).stage_dir("ppo") / "checkpoints"
    weights = checkpoints / "iter_00008" / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated by a crash
    manifest = run_ppo(recipe, QUIET, resume=True)
    assert manifest["status"] == "completed"
    assert any("iter_00008 is corrupt" in w for w in manifest["warnings"])
    assert manifest["metrics"]["iterations"] == 8

    # every checkpoint damaged: --resume is refused before the finished run's manifest is touched
    for folder in checkpoints.glob("iter_*"):
        (folder / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(StageError, match=r"no usable checkpoint .*\(2 damaged\)"):
        run_ppo(recipe, QUIET, resume=True)
    kept = RunDir.for_recipe(recipe).read_manifest("ppo")
    assert kept["status"] == "completed" and kept["outputs"]["adapter"] == "adapter"


def test_missing_sft_names_the_command(tmp_path, small_recipe):
    from rlhf_cli.stages.ppo import run_ppo

    with pytest.raises(StageError, match="run `rlhf sft` first"):
        run_ppo(load_recipe(small_recipe(tmp_path)), QUIET)


def _rlhf(args: list[str], cwd: Path, **kw: Any) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_cli.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_cli_ctrl_c_exits_130_with_a_checkpoint(
    ppo_recipe, pipeline, tmp_path, small_recipe, signum
):
    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, {**PPO_SMALL, "iterations": 200})
    run = RunDir.for_recipe(recipe)
    metrics = run.stage_dir("ppo") / "metrics.jsonl"
    proc = _rlhf(["ppo", "--recipe", str(tmp_path / "recipe.yaml")], tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(metrics)) < 2 and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    assert run.read_manifest("ppo")["status"] == "interrupted"
    assert list((run.stage_dir("ppo") / "checkpoints").glob("iter_*/checkpoint.json"))


def test_separate_critic_from_the_policy_and_4bit_policy(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(
        pipeline,
        tmp_path,
        small_recipe,
        {**PPO_SMALL, "iterations": 2, "value_model": "separate", "value_init": "policy"},
    )
    recipe = recipe.model_copy(
        update={
            "model": recipe.model.model_copy(
                update={
                    "quantization": recipe.model.quantization.model_copy(
                        update={"load_in_4bit": True, "compute_dtype": "float32"}
                    )
                }
            )
        }
    )
    manifest = run_ppo(recipe, QUIET)
    assert manifest["status"] == "completed"
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["ppo/loss/value"])) for r in rows)


def test_critic_from_a_reward_model_with_another_tokenizer_is_refused(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    from rlhf_cli.errors import ModelLoadError
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(
        pipeline,
        tmp_path,
        small_recipe,
        {**PPO_SMALL, "value_model": "separate", "value_init": "reward_model"},
    )
    with pytest.raises(ModelLoadError, match="shares the policy's tokenizer"):
        run_ppo(recipe, QUIET)


def test_critic_initialised_from_a_same_tokenizer_reward_model(tmp_path, small_recipe):
    """A reward model on the tiny LM itself shares the policy's tokenizer: the critic's head
    starts as the reward head, so its first values are the reward model's per-token scores."""
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft

    recipe = load_recipe(
        small_recipe(
            tmp_path,
            {
                "sft": {"epochs": 1},
                "data": {"preferences": {"max_samples": 60}},
                "reward": {"base_model": "builtin:tiny-lm", "learning_rate": 1e-3},
                "ppo": {
                    **PPO_SMALL,
                    "iterations": 1,
                    "value_model": "separate",
                    "value_init": "reward_model",
                },
            },
        )
    )
    run_sft(recipe, QUIET)
    run_train_rm(recipe, QUIET)
    manifest = run_ppo(recipe, QUIET)
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and rows
    assert rows[0]["ppo/val/mean"] != 0.0  # not a zero head: it starts from the reward head


def test_full_disk_while_checkpointing_keeps_the_previous_one(
    ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    import errno

    from rlhf_cli.errors import CheckpointWriteError
    from rlhf_cli.ppo import checkpoint as ckpt
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, PPO_SMALL)
    real_save, calls = ckpt.save_file, []

    def save_until_full(tensors, path):
        calls.append(path)
        if "iter_00008" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", save_until_full)
    with pytest.raises(CheckpointWriteError, match="No space left.*iter_00004.*intact"):
        run_ppo(recipe, QUIET)
    checkpoints = RunDir.for_recipe(recipe).stage_dir("ppo") / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["iter_00004"]  # no half-written folder
    assert ppo_checkpoint_problem(checkpoints / "iter_00004") is None
    manifest = json.loads(RunDir.for_recipe(recipe).manifest_path("ppo").read_text())
    assert manifest["status"] == "failed" and "CheckpointWriteError" in manifest["error"]


def test_non_finite_rewards_skip_updates_then_stop(
    ppo_recipe, pipeline, tmp_path, small_recipe, monkeypatch
):
    from rlhf_cli.errors import NonFiniteError
    from rlhf_cli.scoring import RewardScorer, Scores
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, {**PPO_SMALL, "max_nonfinite": 2})
    real_scored, calls = RewardScorer.scored, []

    def nan_after_first(self, prompts, responses, keywords=None):  # the reward model gives NaN
        scores = real_scored(self, prompts, responses, keywords)
        calls.append(1)
        if len(calls) == 1:
            return scores
        return Scores(torch.full_like(scores.rewards, float("nan")), *scores[1:])

    monkeypatch.setattr(RewardScorer, "scored", nan_after_first)
    with pytest.raises(NonFiniteError, match="2 iterations in a row"):
        run_ppo(recipe, QUIET)
    run = RunDir.for_recipe(recipe)
    rows = read_metrics(run.stage_dir("ppo") / "metrics.jsonl")
    assert len(rows) == 3
    assert rows[0]["ppo/skipped_minibatches"] == 0 and rows[1]["ppo/skipped_minibatches"] > 0
    assert (run.stage_dir("ppo") / "checkpoints" / "iter_00003" / "checkpoint.json").is_file()


def test_ppo_after_a_lora_sft_uses_the_merged_sft_model_as_reference(
    pipeline, tmp_path, small_recipe
):
    """SFT trained an adapter: PPO merges it into the base (the reference is the SFT model, not
    the raw base) and trains a fresh PPO adapter on top."""
    from rlhf_cli.modeling import load_sft_model
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.sft import run_sft
    from rlhf_cli.stages.trained import policy_source

    shutil.copytree(pipeline / "runs", tmp_path / "runs")
    recipe = load_recipe(
        small_recipe(
            tmp_path,
            {
                "sft": {"full_finetune": False, "epochs": 1, "learning_rate": 5e-3},
                "data": {"sft": {"max_samples": 64}},
                "ppo": {**PPO_SMALL, "iterations": 2},
            },
        )
    )
    run_sft(recipe, QUIET)
    run = RunDir.for_recipe(recipe)
    base, adapter, _ = policy_source(recipe, run, {})
    assert adapter is not None and adapter.name == "adapter"
    merged = load_sft_model(recipe.model, base, adapter, torch.device("cpu"))
    from transformers import AutoModelForCausalLM

    from rlhf_cli.modeling import resolve_model_path

    raw = AutoModelForCausalLM.from_pretrained(resolve_model_path(base))
    assert any(
        not torch.equal(a, b)
        for a, b in zip(merged.state_dict().values(), raw.state_dict().values(), strict=True)
    )
    assert run_ppo(recipe, QUIET)["status"] == "completed"


def test_4bit_ppo_on_a_lora_sft_stacks_its_adapter_over_the_sft_one(tmp_path, small_recipe):
    """On a 4-bit base the SFT adapter stays an adapter (a merge into NF4 would erase most of
    it): PPO saves its own adapter alone; audit loads the final adapter and a checkpoint over the
    SFT adapter alike, with the unmerged SFT policy as reference; merge works in full precision."""
    from peft import PeftModel

    from rlhf_cli.modeling import load_causal_lm
    from rlhf_cli.stages.merge import run_merge
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.sft import run_sft
    from rlhf_cli.stages.trained import load_policy, locate_policy, policy_source

    rules = Path(__file__).resolve().parents[2] / "examples" / "rewards.py"
    recipe = load_recipe(
        small_recipe(
            tmp_path,
            {
                "model": {"quantization": {"load_in_4bit": True, "compute_dtype": "float32"}},
                "sft": {"full_finetune": False, "epochs": 1, "learning_rate": 5e-3},
                "data": {"sft": {"max_samples": 32}},
                "reward": {"base_model": None, "functions": [{"function": f"{rules}:politeness"}]},
                "ppo": {**PPO_SMALL, "iterations": 2, "save_freq": 2, "eval_every": None},
            },
        )
    )
    run_sft(recipe, QUIET)
    assert run_ppo(recipe, QUIET)["status"] == "completed"
    run, cpu = RunDir.for_recipe(recipe), torch.device("cpu")
    saved = run.stage_dir("ppo") / "adapter"
    assert sorted(p.name for p in saved.iterdir() if p.suffix != ".md") == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    ids = torch.randint(10, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    final = load_policy(locate_policy(recipe, run, needed_by="rlhf audit"), recipe.model, cpu)
    checkpoint = run.stage_dir("ppo") / "checkpoints" / "iter_00002"
    where = locate_policy(recipe, run, checkpoint, needed_by="rlhf audit")
    at_checkpoint = load_policy(where, recipe.model, cpu)
    base, sft_adapter, _ = policy_source(recipe, run, {})
    frozen = load_causal_lm(base, recipe.model.variant(lora=False), cpu, trainable=False)
    sft = PeftModel.from_pretrained(frozen, str(sft_adapter)).eval()
    with torch.no_grad(), final.reference.model() as reference:
        assert_close(reference(input_ids=ids).logits, sft(input_ids=ids).logits)
    with torch.no_grad():
        trained = final.model(input_ids=ids).logits
        assert_close(at_checkpoint.model(input_ids=ids).logits, trained)
        assert (trained - sft(input_ids=ids).logits).abs().max() > 0  # PPO's adapter acts

    merged = run_merge(recipe, QUIET)
    assert merged["status"] == "completed" and merged["metrics"]["dtype"] == "torch.float32"


def test_reward_truncation_is_reported(ppo_recipe, pipeline, tmp_path, small_recipe):
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, {**PPO_SMALL, "iterations": 1})
    recipe = recipe.model_copy(
        update={"reward": recipe.reward.model_copy(update={"max_length": 12})}
    )
    manifest = run_ppo(recipe, QUIET)
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert rows[0]["reward/truncated_inputs"] > 0
    assert any("longer than reward.max_length" in w for w in manifest["warnings"])


def test_resume_after_the_lora_rank_changed_is_refused_and_keeps_the_result(
    ppo_recipe, pipeline, tmp_path, small_recipe
):
    """The docs promise exit 2 (one line), and the completed run stays usable."""
    from rlhf_cli.stages.ppo import run_ppo

    recipe = ppo_recipe(pipeline, tmp_path, small_recipe, {**PPO_SMALL, "iterations": 2})
    run_ppo(recipe, QUIET)
    run = RunDir.for_recipe(recipe)
    changed = recipe.model_copy(
        update={"model": recipe.model.model_copy(
            update={"lora": recipe.model.lora.model_copy(update={"r": 8})}
        )}
    )  # fmt: skip
    with pytest.raises(StageError, match="does not match this recipe's trainable weights"):
        run_ppo(changed, QUIET, resume=True)
    manifest = run.read_manifest("ppo")
    assert manifest["status"] == "completed" and manifest["last_attempt"]["status"] == "failed"
    assert (run.stage_dir("ppo") / manifest["outputs"]["adapter"]).is_dir()


def test_a_variant_run_takes_sft_and_rm_from_its_base(ppo_recipe, pipeline, tmp_path, small_recipe):
    """PPO variants on one SFT and reward model: `run.base` names the run they come from, and
    the manifest records that run's stages as the inputs."""
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.status import run_status

    recipe = ppo_recipe(
        pipeline, tmp_path, small_recipe, {**PPO_SMALL, "iterations": 2},
        run={"name": "variant", "base": "tiny"},
    )  # fmt: skip
    manifest = run_ppo(recipe, QUIET)
    runs = tmp_path / "runs"
    assert manifest["status"] == "completed" and manifest["metrics"]["iterations"] == 2
    assert {k: Path(v["path"]) for k, v in manifest["inputs"].items()} == {
        "sft": runs / "tiny" / "sft",
        "rm": runs / "tiny" / "rm",
    }
    assert sorted(p.name for p in (runs / "variant").iterdir() if p.is_dir()) == ["ppo"]
    rows = {r["stage"]: r for r in run_status(RunDir.for_recipe(recipe))["stages"]}
    assert rows["sft"]["from_run"] == rows["rm"]["from_run"] == "tiny"
    assert rows["ppo"]["status"] == "completed" and "from_run" not in rows["ppo"]
