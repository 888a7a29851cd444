"""`rlhf eval` on the tiny run (the session's one-process PPO run, copied): the results, the
manifest and the kept answers; a rerun with another judge generates nothing and loads no model;
the gate exits 4 naming what it missed; labels resolve as audit resolves them; a LoRA policy is
benchmarked as merged weights that give its adapter's logits.

The judge is tests/fake_judge.py's stand-in endpoint, the checks are graded for real
(`contains` and instruction checks); the benchmark harness is replaced where the test is about
the weights it is handed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from fake_judge import FakeJudge
from rich.console import Console
from torch.testing import assert_close
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.errors import StageError
from rlhf_cli.generation import HFGenerator, forward_logits
from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.stages import eval as eval_stage

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
JUDGED = 6  # held-out PPO prompts judged
CHECKS = [  # `contains` graded, and instruction checks
    {"prompt": "How can I keep my flowers fresh for longer?", "solution": "the"},
    {"prompt": "What is a good way to start the day?", "solution": "zebra-in-a-teacup"},
    {"prompt": "Can you help me plan a small garden?",
     "instructions": [{"check": "max_words", "n": 200}]},
    {"prompt": "Tell me how to make a cup of tea please.",
     "instructions": [{"check": "exclude_words", "words": ["zebra"]}]},
]  # fmt: skip


def first(a: str, b: str) -> str:
    """A judge with a position bias and nothing else: it always picks answer A."""
    return "A"


def longer(a: str, b: str) -> str:
    """A judge that likes length: the longer answer in words (A when even)."""
    return "A" if len(a.split()) >= len(b.split()) else "B"


@dataclass
class Evaluated:
    recipe_path: Path
    run: RunDir
    result: dict[str, Any]
    generated: list[int]  # rows each generate call answered, first evaluation
    judge: FakeJudge


class Counter:
    """Counts generate calls (the rows each answered) and model loads while patched in."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        self.loads = 0
        generate, load_policy, load_sft = (
            HFGenerator.generate, eval_stage.load_policy, eval_stage.load_sft_model
        )  # fmt: skip

        def counted_generate(engine: Any, queries: list, *args: Any, **kwargs: Any) -> Any:
            self.rows.append(len(queries))
            return generate(engine, queries, *args, **kwargs)

        def loading(fn: Any) -> Any:
            def load(*args: Any, **kwargs: Any) -> Any:
                self.loads += 1
                return fn(*args, **kwargs)

            return load

        patch.setattr(HFGenerator, "generate", counted_generate)
        patch.setattr(eval_stage, "load_policy", loading(load_policy))
        patch.setattr(eval_stage, "load_sft_model", loading(load_sft))


def eval_recipe(run: RunDir, folder: Path, judge_url: str) -> Path:
    """The PPO run's own recipe, its runs under `folder`, with a judge and checks."""
    data = yaml.safe_load(run.recipe_path().read_text())
    data["run"]["output_dir"] = str(folder / "runs")
    checks = folder / "checks.jsonl"
    checks.write_text("".join(json.dumps(row) + "\n" for row in CHECKS))
    data["eval"] = {
        "generation": {"max_new_tokens": 8, "do_sample": False},
        "judge": {"url": judge_url, "model": "judge", "max_prompts": JUDGED, "bootstrap": 200,
                  "timeout_s": 10.0, "concurrency": 4},
        "checks": {"path": str(checks), "grader": "contains"},
    }  # fmt: skip
    path = folder / "eval.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def evaluated(one_process_run: RunDir, tmp_path_factory) -> Iterator[Evaluated]:
    """The run copied, then `rlhf eval` (ppo against sft) once, a first-position judge."""
    folder = tmp_path_factory.mktemp("eval")
    shutil.copytree(one_process_run.output_dir, folder / "runs")
    judge = FakeJudge(first)
    path = eval_recipe(one_process_run, folder, judge.url)
    with pytest.MonkeyPatch.context() as patch:
        counter = Counter(patch)
        result = eval_stage.run_eval(load_recipe(path), QUIET)
    yield Evaluated(path, RunDir.for_recipe(load_recipe(path)), result, counter.rows, judge)
    judge.stop()


def answer_rows(run: RunDir, name: str) -> list[dict[str, Any]]:
    text = (run.stage_dir("eval") / "answers" / name).read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_eval_writes_results_manifest_and_the_answers(evaluated: Evaluated) -> None:
    folder = evaluated.run.stage_dir("eval")
    # both policies answered each suite's prompts once: judge 6 + checks 4, each
    assert sorted(evaluated.generated) == [4, 4, 6, 6]
    for name, count in (("ppo.judge.jsonl", JUDGED), ("sft.judge.jsonl", JUDGED),
                        ("ppo.checks.jsonl", 4), ("sft.checks.jsonl", 4)):  # fmt: skip
        rows = answer_rows(evaluated.run, name)
        assert len(rows) == count and len({row["hash"] for row in rows}) == 1

    judged = json.loads((folder / "ppo.judge.json").read_text())
    assert judged["policy"] == "ppo" and judged["baseline"] == "sft"
    assert judged["answers"]["policy"]["file"] == "answers/ppo.judge.jsonl"
    assert (
        judged["answers"]["policy"]["hash"]
        == answer_rows(evaluated.run, "ppo.judge.jsonl")[0]["hash"]
    )
    assert [p["policy"] for p in judged["pairs"]] == [
        r["answer"] for r in answer_rows(evaluated.run, "ppo.judge.jsonl")
    ]
    # a judge that always picks A picks the policy once and the baseline once: every pair a tie
    summary = judged["summary"]
    assert (summary["wins"], summary["ties"], summary["losses"]) == (0, JUDGED, 0)
    assert summary["win_rate"] == 0.5 and summary["length_unit"] == "words"
    assert len(evaluated.judge.requests) == 1 + 2 * JUDGED  # /v1/models, then both orders

    checks = json.loads((folder / "ppo.checks.json").read_text())["summary"]
    answers = [r["answer"] for r in answer_rows(evaluated.run, "ppo.checks.jsonl")]
    hand = [
        "the" in answers[0],
        "zebra-in-a-teacup" in answers[1],
        len(answers[2].split()) <= 200,
        "zebra" not in answers[3].lower(),
    ]
    assert checks["correct"] == sum(hand) and checks["accuracy"] == sum(hand) / 4
    assert (folder / "sft.checks.json").is_file() and not (folder / "sft.judge.json").exists()

    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["stage"] == "eval" and manifest["status"] == "completed"
    assert set(manifest["inputs"]) == {"sft", "ppo"}
    assert set(manifest["outputs"]) == {"ppo.judge", "ppo.checks", "sft.checks"}
    assert manifest["results"]["ppo"]["judge"]["win_rate"] == 0.5
    assert manifest["metrics"]["ppo/checks/accuracy"] == checks["accuracy"]
    assert manifest["gate"] == {"passed": True, "missed": []}
    assert evaluated.result["results"]["ppo"]["checks"]["delta"] == pytest.approx(
        checks["accuracy"] - manifest["results"]["sft"]["checks"]["accuracy"]
    )
    # the gain's error paired by row: the spread of the four per-row differences over root 4
    mine = json.loads((folder / "ppo.checks.json").read_text())["rows"]
    theirs = json.loads((folder / "sft.checks.json").read_text())["rows"]
    diffs = [int(a["correct"]) - int(b["correct"]) for a, b in zip(mine, theirs, strict=True)]
    mean = sum(diffs) / 4
    spread = (sum((d - mean) ** 2 for d in diffs) / 4) ** 0.5
    assert checks["delta_se"] == pytest.approx(spread / 2)


def test_a_rerun_with_another_judge_generates_nothing(
    evaluated: Evaluated, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = {p: p.read_bytes() for p in (evaluated.run.stage_dir("eval") / "answers").iterdir()}
    judge = FakeJudge(longer)
    counter = Counter(monkeypatch)
    try:
        recipe = load_recipe(evaluated.recipe_path, [f"eval.judge.url={judge.url}"])
        result = eval_stage.run_eval(recipe, QUIET)
    finally:
        judge.stop()
    assert counter.rows == [] and counter.loads == 0  # no answer generated, no model loaded
    assert {p: p.read_bytes() for p in kept} == kept
    # the longer answer wins in both orders; even lengths: each order picks A, a tie
    policy = [r["answer"] for r in answer_rows(evaluated.run, "ppo.judge.jsonl")]
    sft = [r["answer"] for r in answer_rows(evaluated.run, "sft.judge.jsonl")]
    wins = sum(len(a.split()) > len(b.split()) for a, b in zip(policy, sft, strict=True))
    ties = sum(len(a.split()) == len(b.split()) for a, b in zip(policy, sft, strict=True))
    summary = result["results"]["ppo"]["judge"]
    assert (summary["wins"], summary["ties"]) == (wins, ties)
    assert summary["win_rate"] == pytest.approx((wins + ties / 2) / JUDGED)


def test_the_gate_exits_4_naming_each_missed_threshold(evaluated: Evaluated) -> None:
    result = CliRunner().invoke(
        app,
        ["eval", "--recipe", str(evaluated.recipe_path), "--json",
         "--set", f"eval.judge.url={evaluated.judge.url}",
         "--set", "eval.gate.min_win_rate=0.55", "--set", "eval.gate.min_accuracy=1.0"],
    )  # fmt: skip
    assert result.exit_code == 4, result.output
    error = result.output.strip().splitlines()[-1]
    accuracy = json.loads((evaluated.run.stage_dir("eval") / "ppo.checks.json").read_text())
    assert error == (
        "error: eval gate: ppo: judge win rate 0.5000 < 0.55 (eval.gate.min_win_rate); ppo: "
        f"checks accuracy {accuracy['summary']['accuracy']:.4f} < 1.0 (eval.gate.min_accuracy)"
    )
    printed = json.loads(result.stdout[: result.stdout.rindex("}") + 1])  # results first
    assert printed["gate"]["passed"] is False and printed["results"]["ppo"]["judge"]["ties"] == 6
    manifest = json.loads(evaluated.run.manifest_path("eval").read_text())
    assert manifest["status"] == "completed" and len(manifest["gate"]["missed"]) == 2


def test_labels_resolve_as_audit_resolves_them(evaluated: Evaluated) -> None:
    recipe, run = load_recipe(evaluated.recipe_path), evaluated.run
    ppo = run.stage_dir("ppo")
    sft = eval_stage.resolve_target(recipe, run, "sft")
    assert sft.source == str(run.stage_dir("sft")) and set(sft.inputs) == {"sft"}
    final = eval_stage.resolve_target(recipe, run, "ppo")
    assert final.source == str(ppo / "adapter") and set(final.inputs) == {"sft", "ppo"}
    assert eval_stage.resolve_target(recipe, run, "last").weights == final.weights
    checkpoint = eval_stage.resolve_target(recipe, run, "iter_2")
    assert checkpoint.source == str(ppo / "checkpoints" / "iter_00002")
    best = json.loads((ppo / "checkpoints" / "best.json").read_text())["checkpoint"]
    assert eval_stage.resolve_target(recipe, run, "best").source == str(ppo / "checkpoints" / best)
    folder = eval_stage.resolve_target(recipe, run, str(ppo / "checkpoints" / "iter_00002"))
    assert folder.label.startswith("iter_00002-") and folder.weights == checkpoint.weights
    assert len({sft.weights, final.weights, checkpoint.weights}) == 3
    with pytest.raises(StageError, match="'nonsense' is not base, sft, ppo"):
        eval_stage.resolve_target(recipe, run, "nonsense")


def test_a_lora_policy_is_benchmarked_as_merged_weights_giving_its_logits(
    evaluated: Evaluated, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlhf_cli.evals import benchmarks

    seen = {}

    def harness(
        cfg: Any, model: Any, tokenizer: Any, chat: bool, engine: Any = None
    ) -> dict[str, dict]:
        seen["model"], seen["chat"], seen["engine"] = model, chat, engine
        return {"tiny_arith": {"metric": "acc", "score": 0.25, "stderr": 0.1, "n": 4,
                               "higher_is_better": True, "chat_template": chat,
                               "backend": "hf"}}  # fmt: skip

    monkeypatch.setattr(benchmarks, "run_benchmarks", harness)
    sets = ["eval.benchmarks.tasks=[tiny_arith]"]
    recipe: Recipe = load_recipe(evaluated.recipe_path, sets)
    target = eval_stage.resolve_target(recipe, evaluated.run, "ppo")
    device = torch.device("cpu")
    scores, check = eval_stage.benchmark(recipe, target, device)
    merged = seen["model"]
    assert not hasattr(merged, "peft_config") and seen["chat"] is True
    assert seen["engine"] is None  # the HF backend: eval.generation.backend is hf
    assert check is not None and check["tolerance"] == recipe.merge.atol
    assert check["max_abs_logit_diff"] <= recipe.merge.atol
    adapter, tokenizer = target.load(device)  # a fresh adapter model, unmerged
    ids, mask = eval_stage.merge_check_inputs(recipe, tokenizer, device)
    with torch.no_grad():
        want = forward_logits(adapter, ids, mask)[mask.bool()]
        got = forward_logits(merged, ids, mask)[mask.bool()]
    assert_close(got, want, atol=1e-5, rtol=0)
    assert scores["tiny_arith"]["score"] == 0.25


def test_status_shows_and_report_draws_the_last_results(evaluated: Evaluated) -> None:
    from rlhf_cli.stages.status import run_status

    manifest = json.loads(evaluated.run.manifest_path("eval").read_text())
    judge = manifest["results"]["ppo"]["judge"]
    checks = manifest["results"]["ppo"]["checks"]
    status = run_status(evaluated.run)["eval"]
    assert status == {"baseline": "sft", "policies": manifest["results"]}
    runs = str(evaluated.run.output_dir)
    shown = CliRunner().invoke(app, ["status", evaluated.run.name, "--runs-dir", runs])
    assert shown.exit_code == 0, shown.output
    assert "last rlhf eval (baseline sft):" in shown.output
    line = (
        f"  ppo: judge {judge['win_rate']:.3f} [{judge['ci_low']:.3f}, {judge['ci_high']:.3f}] "
        f"(LC {judge['lc_win_rate']:.3f}); checks {checks['accuracy']:.3f} ± {checks['se']:.3f}"
    )
    assert line in shown.output.splitlines()
    drawn = CliRunner().invoke(app, ["report", evaluated.run.name, "--runs-dir", runs, "--json"])
    assert drawn.exit_code == 0, drawn.output
    paths = json.loads(drawn.output)
    assert paths["eval_png"] == str(evaluated.run.stage_dir("eval") / "report.png")
    assert Path(paths["eval_png"]).stat().st_size > 1000
    assert Path(paths["html"]).read_text().count("<img") == 2


def test_benchmarks_through_the_harness_give_the_alignment_tax(
    evaluated: Evaluated, repo_root: Path
) -> None:
    pytest.importorskip("lm_eval")
    tasks = repo_root / "data" / "eval" / "tasks"
    sets = [
        "eval.judge=null", "eval.checks=null", "eval.benchmarks.tasks=[tiny_polite]",
        f"eval.benchmarks.include_path={tasks}", "eval.benchmarks.limit=8",
    ]  # fmt: skip
    result = eval_stage.run_eval(load_recipe(evaluated.recipe_path, sets), QUIET)
    folder = evaluated.run.stage_dir("eval")
    ppo = json.loads((folder / "ppo.benchmarks.json").read_text())
    sft = json.loads((folder / "sft.benchmarks.json").read_text())
    ours, theirs = ppo["summary"]["tiny_polite"], sft["summary"]["tiny_polite"]
    assert ours["n"] == theirs["n"] == 8 and ours["chat_template"] is True
    assert ours["tax"] == pytest.approx(ours["score"] - theirs["score"])
    assert ppo["merge_check"]["max_abs_logit_diff"] <= ppo["merge_check"]["tolerance"]
    assert sft["merge_check"] is None  # the SFT model of the tiny run is whole weights
    assert result["results"]["ppo"]["benchmarks"]["tiny_polite"]["tax"] == ours["tax"]
