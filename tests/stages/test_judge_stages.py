"""The judge (`audit.judge`) on the tiny model: PPO's held-out evaluations score the policy's and
the reference's answers with it (checked against a direct scoring of the very answers it saw),
`rlhf audit` reports its agreement with the proxy (checked by hand on the saved samples) and exits
1 on overoptimization, `rlhf report` plots it, and `rlhf train-rm` with `reward.judge_fraction`
trains a judge on prompts the reward model never saw."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from rlhf_cli.audit.detectors import overoptimized
from rlhf_cli.cli import app
from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages.trained import load_judge, load_scorer
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
CPU = torch.device("cpu")
PPO = {"iterations": 4, "batch_size": 8, "mini_batch_size": 8, "ppo_epochs": 1, "eval_every": 1,
       "save_freq": 4, "log_every": 4, "generation": {"max_new_tokens": 12}}  # fmt: skip
JUDGE_WEIGHT = 0.5
# A rule judge (answer length in words) that writes down every call: the answers it scored.
RULES = """\
import json

def words(prompts, responses):
    with open({log!r}, "a", encoding="utf-8") as log:
        log.write(json.dumps({{"prompts": prompts, "responses": responses}}) + "\\n")
    return [float(len(r.split())) for r in responses]
"""


@dataclass
class Judged:
    folder: Path
    recipe_path: Path
    recipe: Recipe
    run: RunDir
    manifest: dict[str, Any]
    calls: list[dict[str, list[str]]]  # the judge's calls during PPO, in order


@pytest.fixture(scope="module")
def judged(
    pipeline: Path, small_recipe: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Judged:
    """PPO (4 iterations, a held-out evaluation at each) with the rule judge, on a copy of the
    session's sft + train-rm."""
    from rlhf_cli.stages.ppo import run_ppo

    folder = tmp_path_factory.mktemp("judge")
    shutil.copytree(pipeline / "runs", folder / "runs")
    log = folder / "judged.jsonl"
    rules = folder / "judge_rules.py"
    rules.write_text(RULES.format(log=str(log)), encoding="utf-8")
    judge = {"functions": [{"function": f"{rules}:words", "weight": JUDGE_WEIGHT}]}
    updates = {
        "sft": {"epochs": 6},
        "ppo": PPO,
        "data": {"prompts": {"eval_fraction": 0.05}},  # 10 held-out prompts
        "audit": {"samples": 1, "generation": {"max_new_tokens": 12}, "judge": judge},
    }
    path = small_recipe(folder, updates)
    recipe = load_recipe(path)
    manifest = run_ppo(recipe, QUIET)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return Judged(folder, path, recipe, RunDir.for_recipe(recipe), manifest, calls)


def gain(scores: torch.Tensor, reference: torch.Tensor) -> float:
    return float((scores.mean() - reference.mean()) / reference.std())


def test_heldout_evaluations_score_both_answers_with_the_judge(judged: Judged) -> None:
    rows = read_metrics(judged.run.stage_dir("ppo") / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    # the reference's answers once, at the first evaluation, then the policy's at each
    assert len(judged.calls) == 1 + len(rows)
    reference, *policy = judged.calls
    prompts = reference["prompts"]
    assert len(prompts) == judged.manifest["prompts"]["heldout"] == 10
    assert all(call["prompts"] == prompts for call in policy)
    proxy = load_scorer(judged.recipe, judged.run, CPU, needed_by="test")

    def scored(call: dict[str, list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        words = torch.tensor([float(len(r.split())) for r in call["responses"]])
        return proxy.score(prompts, call["responses"])[0], JUDGE_WEIGHT * words

    proxy_ref, judge_ref = scored(reference)
    assert judge_ref.std() > 0  # a unit to measure gains in
    series, errors = [], []
    for row, call in zip(rows, policy, strict=True):
        proxy_pol, judge_pol = scored(call)
        wins = (judge_pol > judge_ref).float() + 0.5 * (judge_pol == judge_ref).float()
        reward_gain, judge_gain = gain(proxy_pol, proxy_ref), gain(judge_pol, judge_ref)
        judge_se = float(judge_pol.std()) / len(judge_pol) ** 0.5 / float(judge_ref.std())
        expected = {
            "eval/judge_reward_gain_se": judge_se,
            "eval/reward_mean": float(proxy_pol.mean()),
            "eval/reward_reference_mean": float(proxy_ref.mean()),
            "eval/judge_reward_mean": float(judge_pol.mean()),
            "eval/judge_reward_reference_mean": float(judge_ref.mean()),
            "eval/judge_win_rate": float(wins.mean()),
            "eval/reward_gain": reward_gain,
            "eval/judge_reward_gain": judge_gain,
            "eval/proxy_judge_gap": reward_gain - judge_gain,
        }
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (row["iteration"], key)
        series.append((reward_gain, judge_gain))
        errors.append(judge_se)
        flagged = overoptimized(series, 3, judged.recipe.audit.judge.margin, errors)
        assert row["audit/overoptimization"] == float(flagged)
    summary = judged.manifest["metrics"]
    assert summary["overoptimization_flags"] == sum(r["audit/overoptimization"] for r in rows)
    for key in ("eval/judge_reward_mean", "eval/judge_win_rate", "eval/proxy_judge_gap"):
        assert summary[key] == rows[-1][key]  # the last evaluation's, in the manifest


def test_audit_reports_the_judges_agreement_with_the_proxy(judged: Judged) -> None:
    result = CliRunner().invoke(app, ["audit", "--json", "--recipe", str(judged.recipe_path)])
    report = json.loads(result.stdout)
    saved = json.loads((judged.run.stage_dir("audit") / "ppo.json").read_text())
    samples = saved["samples"]
    prompts = [s["prompt"] for s in samples]
    proxy = load_scorer(judged.recipe, judged.run, CPU, needed_by="test")
    judge = load_judge(judged.recipe, judged.run, CPU, needed_by="test")
    scores = {}
    for name, scorer in (("reward", proxy), ("judge", judge)):
        for side, key in (("", "response"), ("_reference", "reference")):
            texts = [s[key] for s in samples]
            scores[name + side] = scorer.score(prompts, texts)[0].tolist()
            assert [s[name + side] for s in samples] == pytest.approx(scores[name + side])
    agree = against = 0
    for i in range(len(samples)):
        p = scores["reward"][i] - scores["reward_reference"][i]
        j = scores["judge"][i] - scores["judge_reference"][i]
        agree += (p > 0) - (p < 0) == (j > 0) - (j < 0)
        against += p > 0 and j < 0
    assert report["judge_agreement"] == pytest.approx(agree / len(samples))
    assert report["proxy_against_judge"] == pytest.approx(against / len(samples))
    assert report["judge_policy_mean"] == pytest.approx(sum(scores["judge"]) / len(samples))
    assert report["judge_reference_mean"] == pytest.approx(
        sum(scores["judge_reference"]) / len(samples)
    )
    assert ("overoptimization" in report["flags"]) is (against / len(samples) > 0.5)
    assert result.exit_code == (1 if report["flags"] else 0), result.output


# The proxy scores the first answers it is given (the policy's) far above the second (the
# reference's), the judge the other way round: every sample is the proxy's gain alone.
AGAINST = """\
CALLS = {"proxy": 0, "judge": 0}

def _alternate(name, first, second, responses):
    CALLS[name] += 1
    return [first if CALLS[name] % 2 else second] * len(responses)

def proxy(prompts, responses):
    return _alternate("proxy", 1000.0, 0.0, responses)

def judge(prompts, responses):
    return _alternate("judge", 0.0, 1.0, responses)
"""


def test_audit_exits_1_when_the_judge_prefers_the_reference_where_the_proxy_does_not(
    judged: Judged, tmp_path: Path, small_recipe: Callable[..., Path]
) -> None:
    shutil.copytree(judged.folder / "runs", tmp_path / "runs")
    rules = tmp_path / "against.py"
    rules.write_text(AGAINST, encoding="utf-8")
    path = small_recipe(
        tmp_path,
        {
            "sft": {"epochs": 6},
            "ppo": PPO,
            "data": {"prompts": {"eval_fraction": 0.05}},
            "reward": {"functions": [{"function": f"{rules}:proxy"}]},
            "audit": {
                "samples": 1,
                "generation": {"max_new_tokens": 12},
                "judge": {"functions": [{"function": f"{rules}:judge"}]},
                "min_length_ratio": 0,  # no brevity flag: the judge's alone
            },
        },
    )
    result = CliRunner().invoke(app, ["audit", "--recipe", str(path)])
    assert result.exit_code == 1, result.output
    assert "REWARD HACKING DETECTED (overoptimization)" in result.output
    assert "Proxy prefers policy, judge reference" in result.output
    saved = json.loads(
        (RunDir.for_recipe(load_recipe(path)).stage_dir("audit") / "ppo.json").read_text()
    )
    assert saved["judge_agreement"] == 0.0 and saved["proxy_against_judge"] == 1.0
    assert saved["flags"] == ["overoptimization"]


def test_report_plots_the_judge_beside_the_proxy(
    judged: Judged, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    from rlhf_cli.stages.report import run_report

    drawn: list[str] = []
    plot = plt.Axes.plot

    def spy(ax: Any, *args: Any, label: str | None = None, **kwargs: Any) -> Any:
        drawn.append(label)
        return plot(ax, *args, label=label, **kwargs)

    monkeypatch.setattr(plt.Axes, "plot", spy)
    paths = run_report(judged.run)
    assert Path(paths["png"]).stat().st_size > 20_000
    for key in ("eval/judge_reward_mean", "eval/judge_win_rate", "eval/judge_reward_gain"):
        assert key in drawn
    assert "eval/reward_gain" in drawn


def test_train_rm_trains_a_judge_on_prompts_the_reward_model_never_saw(
    tmp_path: Path, small_recipe: Callable[..., Path]
) -> None:
    from safetensors.torch import load_file

    from rlhf_cli.stages.reward import run_train_rm

    updates = {
        "reward": {"judge_fraction": 0.3},
        "data": {"preferences": {"max_samples": 80}},
        "audit": {"judge": {"from_rm": True}},
    }
    recipe = load_recipe(small_recipe(tmp_path, updates))
    manifest = run_train_rm(recipe, QUIET)
    rm = RunDir.for_recipe(recipe).stage_dir("rm")
    outputs = manifest["outputs"]
    assert outputs["judge"] == "judge/model" and (rm / "judge" / "model").is_dir()
    proxy_prompts = set(json.loads((rm / outputs["train_prompts"]).read_text()))
    judge_prompts = set(json.loads((rm / outputs["judge_train_prompts"]).read_text()))
    assert proxy_prompts.isdisjoint(judge_prompts)
    metrics = manifest["metrics"]
    trained = metrics["train_pairs"] + metrics["judge_train_pairs"]
    assert trained == 80 - metrics["eval_pairs"]  # every training pair, to one of the two
    assert len(judge_prompts) == metrics["judge_train_pairs"] == round(0.3 * trained)
    assert 0.0 <= metrics["judge_eval_accuracy"] <= 1.0 and metrics["judge_steps"] > 0
    assert read_metrics(rm / outputs["judge_metrics"])  # its own log
    assert not (rm / "judge" / "checkpoints").exists()
    weights = [load_file(rm / f / "model.safetensors") for f in ("model", "judge/model")]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    judge = load_judge(recipe, RunDir.for_recipe(recipe), CPU, needed_by="test")
    assert judge.functions == [] and judge.input == manifest["input"]
    loaded = judge.model.state_dict()
    shared = [name for name in weights[1] if name in loaded]
    assert len(shared) == len(weights[1])
    assert all(torch.equal(loaded[name], weights[1][name]) for name in shared)


def test_a_judge_from_an_rm_stage_without_one_is_refused(
    pipeline: Path, tmp_path: Path, small_recipe: Callable[..., Path]
) -> None:
    shutil.copytree(pipeline / "runs", tmp_path / "runs")
    recipe = load_recipe(small_recipe(tmp_path, {"audit": {"judge": {"from_rm": True}}}))
    with pytest.raises(StageError, match="trained no judge: set reward.judge_fraction"):
        load_judge(recipe, RunDir.for_recipe(recipe), CPU, needed_by="rlhf audit")
