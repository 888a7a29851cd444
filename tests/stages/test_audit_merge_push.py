"""After one short PPO run on the tiny recipe: audit (saved policy, checkpoint, in training),
merge (logits equal the adapter model's), push (model card, what is sent, the token never
written), report and compare.

One module-scoped run (sft + train-rm + 4 PPO iterations with an audit every 2) serves every test;
tests that would spoil it for the others copy its runs folder first.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console
from torch.testing import assert_close
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
REPO_ID = "tester/tiny-rlhf-test"
COMMIT = "rlhf-cli test upload"
CANARY = "hf_canary_stage_9f8e7d6c5b4a3210QRS"
SMALL: dict[str, Any] = {
    "sft": {"epochs": 1},
    "data": {"sft": {"max_samples": 64}, "preferences": {"max_samples": 48}},
    "ppo": {
        "iterations": 4,
        "batch_size": 8,
        "mini_batch_size": 8,
        "ppo_epochs": 1,
        "save_freq": 4,
        "log_every": 4,
        "generation": {"max_new_tokens": 12},
    },
    "audit": {"samples": 1, "generation": {"max_new_tokens": 12}},
    "push": {"repo_id": REPO_ID, "private": False, "commit_message": COMMIT},
}
# every in-training audit flags: any response of 2+ words is "verbose", and any share is too much
LIVE_AUDIT = {"every": 2, "samples": 1, "verbosity_threshold": 0.0, "verbosity_words": 1}


@dataclass
class Trained:
    folder: Path
    recipe_path: Path  # SMALL with the default audit thresholds: what the tests audit with
    recipe: Recipe
    run: RunDir
    ppo_manifest: dict[str, Any]


@pytest.fixture(scope="module")
def trained(small_recipe: Callable[..., Path], tmp_path_factory) -> Trained:
    """sft + train-rm + PPO (trained with LIVE_AUDIT) once for the module."""
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft

    folder = tmp_path_factory.mktemp("audit_merge_push")
    updates = copy.deepcopy(SMALL)
    updates["audit"].update(LIVE_AUDIT)
    train = load_recipe(small_recipe(folder, updates, name="train.yaml"))
    run_sft(train, QUIET)
    run_train_rm(train, QUIET)
    ppo_manifest = run_ppo(train, QUIET)
    path = small_recipe(folder, copy.deepcopy(SMALL))
    recipe = load_recipe(path)
    return Trained(folder, path, recipe, RunDir.for_recipe(recipe), ppo_manifest)


@pytest.fixture(scope="module")
def merged(trained: Trained) -> dict[str, Any]:
    from rlhf_cli.stages.merge import run_merge

    return run_merge(trained.recipe, QUIET)


def copy_runs(
    trained: Trained, tmp_path: Path, small_recipe: Callable[..., Path], updates: dict[str, Any]
) -> Recipe:
    """The trained run (without its merge or checkpoints) in tmp_path, with a changed recipe."""
    shutil.copytree(
        trained.folder / "runs",
        tmp_path / "runs",
        ignore=shutil.ignore_patterns("merged", "checkpoints"),
    )
    merged_updates = copy.deepcopy(SMALL)
    for section, values in updates.items():
        merged_updates.setdefault(section, {}).update(values)
    return load_recipe(small_recipe(tmp_path, merged_updates))


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ── audit ─────────────────────────────────────────────────────────────────────────────────────


def test_audit_of_the_final_policy_and_of_a_checkpoint(trained: Trained) -> None:
    from rlhf_cli.data import audit_prompts
    from rlhf_cli.stages.audit import run_audit

    n_prompts = len(audit_prompts(trained.recipe.audit))
    final = run_audit(trained.recipe, QUIET)
    for key in ("reward_policy_mean", "reward_reference_mean", "kl_to_reference"):
        assert math.isfinite(final[key]), (key, final[key])
    # the reference answers the same prompts from the same seeds: the length check compares them
    assert final["avg_reference_len"] > 0
    assert final["length_ratio"] == final["avg_response_len"] / final["avg_reference_len"]
    assert ("brevity" in final["flags"]) is (final["length_ratio"] < 0.5)
    assert final["n_responses"] == n_prompts * trained.recipe.audit.samples
    assert Path(final["path"]) == trained.run.stage_dir("audit") / "ppo.json"

    checkpoint = trained.run.stage_dir("ppo") / "checkpoints" / "iter_00004"
    at_4 = run_audit(trained.recipe, QUIET, checkpoint=checkpoint)
    assert math.isfinite(at_4["kl_to_reference"]) and math.isfinite(at_4["reward_policy_mean"])
    assert Path(at_4["path"]) == trained.run.stage_dir("audit") / "iter_00004.json"
    assert at_4["audited"] == str(checkpoint)
    manifest = trained.run.read_manifest("audit")
    assert manifest["status"] == "completed" and manifest["last"] == "iter_00004"
    assert manifest["outputs"] == {"ppo": "ppo.json", "iter_00004": "iter_00004.json"}


def test_in_training_audit_logs_rates_and_raises_beta(trained: Trained) -> None:
    rows = read_metrics(trained.run.stage_dir("ppo") / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    audited = [r["iteration"] for r in rows if "audit/verbosity_score" in r]
    assert audited == [2, 4]
    for row in rows[1], rows[3]:
        assert row["audit/hacking_detected"] == 1.0 and row["audit/verbosity_score"] > 0.0
        assert row["audit/length_ratio"] > 0.0
    # The adaptive controller alone moves β by a factor 1 ± 0.2·8/10000 per iteration;
    # a flagged audit adds audit.kl_coef_step (0.05) on top, before the next iteration.
    step = trained.recipe.audit.kl_coef_step
    beta = [r["objective/kl_coef"] for r in rows] + [trained.ppo_manifest["metrics"]["kl_coef_now"]]
    for before, after in ((0, 1), (2, 3)):  # no audit in between
        assert abs(beta[after] - beta[before]) < 1e-3 * beta[before]
    for before, after in ((1, 2), (3, 4)):  # after the audits of iterations 2 and 4
        assert beta[after] == pytest.approx(beta[before] + step, abs=1e-3 * beta[before])
    assert any(
        "iteration 2: the audit flagged verbosity" in w for w in trained.ppo_manifest["warnings"]
    )


def test_in_training_audit_samples_the_frozen_reference_once(
    trained: Trained, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlhf_cli.audit import measure
    from rlhf_cli.stages.ppo import _live_audit
    from rlhf_cli.stages.trained import (
        generation_engine,
        load_policy,
        load_scorer,
        locate_policy,
    )

    recipe, run, cpu = trained.recipe, trained.run, torch.device("cpu")
    policy = load_policy(locate_policy(recipe, run, needed_by="rlhf audit"), recipe.model, cpu)
    generator = generation_engine(
        recipe.audit.generation, policy.model, policy.tokenizer, recipe, run.path
    )
    sampled = []
    sample_answers = measure.sample_answers
    monkeypatch.setattr(
        measure, "sample_answers", lambda *a: sampled.append(a[1]) or sample_answers(*a)
    )
    scorer = load_scorer(recipe, run, cpu, needed_by="rlhf audit")
    audit = _live_audit(recipe, policy.tokenizer, policy.reference, scorer, generator)
    actor = SimpleNamespace(policy=policy.model)
    first, second = audit(actor, 1), audit(actor, 2)
    assert len(sampled) == 3  # the policy, the reference, the policy again
    # the kept answers are the ones the reference gives from the same seeds: the same report
    assert second == first
    refs = [s["reference"] for s in first["samples"]]
    assert len(refs) == first["n_responses"] and any(refs)
    words = sum(len(r.split()) for r in refs) / len(refs)
    assert first["avg_reference_len"] == pytest.approx(words)


# ── merge ─────────────────────────────────────────────────────────────────────────────────────


def test_merged_model_reproduces_the_adapter_model(trained: Trained, merged) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained.run
    assert merged["status"] == "completed"
    assert merged["metrics"]["max_abs_logit_diff"] <= trained.recipe.merge.atol
    assert run.read_manifest("merged")["status"] == "completed"
    folder = run.stage_dir("merged") / "model"
    assert list(folder.glob("*.safetensors"))

    sft_model = run.resolve_output("sft", run.read_manifest("sft"), "model")
    adapter = run.resolve_output("ppo", trained.ppo_manifest, "adapter")
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(sft_model), str(adapter)
    ).eval()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not any("lora_" in name for name, _ in model.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("How can I keep cut flowers fresh for longer?", return_tensors="pt")
    with torch.inference_mode():
        assert_close(model(**ids).logits, reference(**ids).logits, atol=1e-4, rtol=0)
        # and the adapter is not a no-op: the merge is not trivially the SFT model
        plain = AutoModelForCausalLM.from_pretrained(sft_model).eval()
        assert not torch.allclose(model(**ids).logits, plain(**ids).logits, atol=1e-6)


def test_merge_sft_of_a_full_finetune_has_nothing_to_merge(trained: Trained) -> None:
    from rlhf_cli.stages.merge import run_merge

    with pytest.raises(StageError, match="nothing to merge"):
        run_merge(trained.recipe, QUIET, stage="sft")


@pytest.fixture(scope="module")
def lora_sft(small_recipe: Callable[..., Path], tmp_path_factory) -> Path:
    """A LoRA SFT run (1 epoch on 32 rows) once for the module: its folder."""
    from rlhf_cli.stages.sft import run_sft

    folder = tmp_path_factory.mktemp("lora_sft")
    run_sft(load_recipe(small_recipe(folder, LORA_SFT)), QUIET)
    return folder


LORA_SFT: dict[str, Any] = {
    "sft": {"full_finetune": False, "epochs": 1},
    "data": {"sft": {"max_samples": 32}},
}


def lora_sft_recipe(
    lora_sft: Path, tmp_path: Path, small_recipe: Callable[..., Path], dtype: str
) -> Recipe:
    """The LoRA SFT run (without a merge) in tmp_path, merged in `dtype`."""
    shutil.copytree(lora_sft / "runs", tmp_path / "runs", ignore=shutil.ignore_patterns("merged"))
    return load_recipe(small_recipe(tmp_path, {**LORA_SFT, "merge": {"dtype": dtype}}))


def test_merge_sft_of_a_lora_sft_run(lora_sft: Path, tmp_path: Path, small_recipe) -> None:
    """With `merge.device: cpu` the merge runs on the CPU whatever `run.device` says: here
    `cuda`, which this machine may lack (`rlhf plan` moves a merge too large for the card so)."""
    from transformers import AutoModelForCausalLM

    from rlhf_cli.recipe import parse_recipe
    from rlhf_cli.stages.merge import run_merge

    recipe = lora_sft_recipe(lora_sft, tmp_path, small_recipe, "float32")
    sets = ["run.device=cuda", "merge.device=cpu"]
    recipe = parse_recipe(recipe.to_yaml(), overrides=sets)
    manifest = run_merge(recipe, QUIET, stage="sft")
    assert manifest["status"] == "completed"
    assert manifest["merged_from"]["stage"] == "sft"
    assert manifest["metrics"]["max_abs_logit_diff"] <= recipe.merge.atol
    folder = RunDir.for_recipe(recipe).stage_dir("merged") / "model"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert not any("lora_" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_merge_is_saved_in_its_dtype(
    lora_sft: Path, tmp_path: Path, small_recipe, dtype: str
) -> None:
    """Merged in float32 and cast once: every saved weight is in merge.dtype, and the cast
    model's logits differ from the float32 adapter model's by its rounding alone (a bf16/fp16
    merge checked against merge.atol was always refused)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhf_cli.stages.merge import run_merge

    recipe = lora_sft_recipe(lora_sft, tmp_path, small_recipe, dtype)
    metrics = run_merge(recipe, QUIET, stage="sft")["metrics"]
    assert metrics["dtype"] == f"torch.{dtype}"
    assert metrics["merge_logit_diff_fp32"] <= recipe.merge.atol
    assert 0 < metrics["max_abs_logit_diff"] <= metrics["tolerance"]
    folder = RunDir.for_recipe(recipe).stage_dir("merged") / "model"
    shards = list(folder.glob("*.safetensors"))
    assert shards
    saved = {t.dtype for shard in shards for t in load_file(shard).values()}
    assert saved == {getattr(torch, dtype)}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")  # as the config says
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}


def _adapter_dropped(real_merge: Callable[..., Any]) -> Callable[..., Any]:
    def merge(self, *args, **kwargs):
        return self.unload()  # the LoRA layers removed without adding their weights

    return merge


def _adapter_doubled(real_merge: Callable[..., Any]) -> Callable[..., Any]:
    def merge(self, *args, **kwargs):
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                module.scaling = {name: 2 * value for name, value in module.scaling.items()}
        return real_merge(self, *args, **kwargs)

    return merge


@pytest.mark.parametrize("broken", [_adapter_dropped, _adapter_doubled])
def test_a_wrong_merge_is_refused_in_bf16(
    lora_sft: Path, tmp_path: Path, small_recipe, monkeypatch, broken
) -> None:
    """The bf16 tolerance does not let a wrong merge through: the merge is checked in float32,
    within merge.atol, before the cast."""
    from peft import LoraModel

    from rlhf_cli.errors import MergeMismatch
    from rlhf_cli.stages.merge import run_merge

    recipe = lora_sft_recipe(lora_sft, tmp_path, small_recipe, "bfloat16")
    monkeypatch.setattr(LoraModel, "merge_and_unload", broken(LoraModel.merge_and_unload))
    with pytest.raises(MergeMismatch, match="the float32 merge changes .* nothing saved"):
        run_merge(recipe, QUIET, stage="sft")
    run = RunDir.for_recipe(recipe)
    assert not (run.stage_dir("merged") / "model").exists()
    manifest = run.read_manifest("merged")
    assert manifest["status"] == "failed"
    assert manifest["metrics"]["merge_logit_diff_fp32"] > recipe.merge.atol


def test_merge_mismatch_saves_nothing(
    trained: Trained, tmp_path, small_recipe, monkeypatch
) -> None:
    """A merge that changes the model (here: one weight nudged after the real merge) is caught
    by the logit check; merge.atol is tiny so even float noise alone would be refused."""
    from peft import LoraModel

    from rlhf_cli.errors import MergeMismatch
    from rlhf_cli.stages.merge import run_merge

    recipe = copy_runs(trained, tmp_path, small_recipe, {"merge": {"atol": 1e-12}})
    real_merge = LoraModel.merge_and_unload  # PeftModel.merge_and_unload calls it

    def broken_merge(self, *args, **kwargs):
        model = real_merge(self, *args, **kwargs)
        with torch.no_grad():
            model.get_output_embeddings().weight.add_(1e-3)
        return model

    monkeypatch.setattr(LoraModel, "merge_and_unload", broken_merge)
    with pytest.raises(MergeMismatch, match="nothing saved"):
        run_merge(recipe, QUIET)
    run = RunDir.for_recipe(recipe)
    assert not (run.stage_dir("merged") / "model").exists()
    manifest = run.read_manifest("merged")
    assert manifest["status"] == "failed" and manifest["error"].startswith("MergeMismatch")
    assert manifest["metrics"]["max_abs_logit_diff"] > 1e-12


# ── push ──────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def hub(monkeypatch) -> dict[str, list[dict[str, Any]]]:
    """No hub is reachable here: HfApi.create_repo and HfApi.upload_folder are replaced by
    recorders (everything else, the token lookup included, is the real code)."""
    import huggingface_hub

    calls: dict[str, list[dict[str, Any]]] = {"create_repo": [], "upload_folder": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append({"repo_id": repo_id, "token": self.token, **kwargs})
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        calls["upload_folder"].append(
            {**kwargs, "token": self.token, "readme": (folder / "README.md").read_text()}
        )
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/1")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return calls


def test_push_dry_run_lists_files_and_uploads_nothing(
    trained: Trained, merged, hub, monkeypatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)  # a dry run needs no token
    pushed_before = trained.run.read_manifest("push")
    result = invoke("push", "--dry-run", "--json", "--recipe", str(trained.recipe_path))
    assert result.exit_code == 0, result.output
    sent = json.loads(result.stdout)
    assert sent["dry_run"] is True and sent["repo_id"] == REPO_ID
    assert Path(sent["folder"]) == trained.run.stage_dir("merged") / "model"
    assert "README.md" in sent["files"] and "config.json" in sent["files"]
    assert any(f.endswith(".safetensors") for f in sent["files"])
    assert hub == {"create_repo": [], "upload_folder": []}
    assert trained.run.read_manifest("push") == pushed_before


def test_push_uploads_the_merged_folder_and_never_writes_the_token(
    trained: Trained, merged, hub, monkeypatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", CANARY)
    result = invoke("push", "--recipe", str(trained.recipe_path))
    assert result.exit_code == 0, result.output
    folder = trained.run.stage_dir("merged") / "model"

    [create] = hub["create_repo"]
    assert create["repo_id"] == REPO_ID and create["exist_ok"] is True
    assert create["private"] is False  # the recipe's, not the default True
    [upload] = hub["upload_folder"]
    assert Path(upload["folder_path"]) == folder and upload["repo_id"] == REPO_ID
    assert upload["commit_message"] == COMMIT
    assert create["token"] == upload["token"] == CANARY  # it came from HF_TOKEN

    card = upload["readme"]
    assert card == (folder / "README.md").read_text()
    assert "builtin:tiny-lm" in card and "library_name: transformers" in card
    for stage in ("| SFT |", "| Reward model |", "| PPO |", "| Audit |"):
        assert stage in card, stage
    last = read_metrics(trained.run.stage_dir("ppo") / "metrics.jsonl")[-1]
    assert f"- `env/reward_mean`: {last['env/reward_mean']:.4g}" in card
    assert f"- `objective/kl`: {last['objective/kl']:.4g}" in card
    assert f"AutoModelForCausalLM.from_pretrained('{REPO_ID}')" in card
    assert trained.run.read_manifest("push")["status"] == "completed"

    assert CANARY not in result.output
    files = [f for f in trained.run.path.rglob("*") if f.is_file()]
    assert len(files) > 10
    for file in files:
        assert CANARY.encode() not in file.read_bytes(), file


def test_push_adapter_only_sends_the_ppo_adapter(
    trained: Trained, merged, hub, monkeypatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", CANARY)
    result = invoke("push", "--adapter-only", "--json", "--recipe", str(trained.recipe_path))
    assert result.exit_code == 0, result.output
    adapter = trained.run.resolve_output("ppo", trained.ppo_manifest, "adapter")
    [upload] = hub["upload_folder"]
    assert Path(upload["folder_path"]) == adapter
    assert "adapter_config.json" in json.loads(result.stdout)["files"]
    assert "library_name: peft" in upload["readme"]
    assert f"PeftModel.from_pretrained(base, '{REPO_ID}')" in upload["readme"]
    assert CANARY not in result.output


# ── report and compare ────────────────────────────────────────────────────────────────────────


def test_report_of_the_latest_run_writes_a_png_and_html(trained: Trained, monkeypatch) -> None:
    import base64

    monkeypatch.chdir(trained.folder)  # runs/LATEST is found from here, no argument given
    result = invoke("report")
    assert result.exit_code == 0, result.output
    png = trained.run.stage_dir("ppo") / "report.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    page = (trained.run.stage_dir("ppo") / "report.html").read_text()
    assert f"data:image/png;base64,{base64.b64encode(data).decode()}" in page
    assert "<h2>ppo</h2>" in page


def test_compare_json_rows(trained: Trained) -> None:
    prompts = ["How do I keep bread from going stale?", "What is a good way to water plants?"]
    result = invoke(
        "compare",
        "--json",
        "--recipe",
        str(trained.recipe_path),
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["prompt"] for r in rows] == prompts
    for row in rows:
        assert {"prompt", "sft", "ppo", "sft_score", "ppo_score"} <= set(row)
        assert isinstance(row["sft"], str) and isinstance(row["ppo"], str)
        assert math.isfinite(row["sft_score"]) and math.isfinite(row["ppo_score"])


def test_compare_twice_prints_identical_json(trained: Trained) -> None:
    """Seeded from run.seed like the audit: sampled answers repeat call after call, whatever
    the process's RNG did before."""
    args = ("compare", "--json", "--recipe", str(trained.recipe_path))
    first = invoke(*args)
    torch.manual_seed(12345)  # another draw in between must not matter
    torch.rand(7)
    second = invoke(*args)
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    assert first.stdout == second.stdout
