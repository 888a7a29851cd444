"""`rlhf eval`: policies of a run measured by yardsticks it never trained on, each against a
baseline (the SFT policy by default): a judge head to head (`eval.judge`), verifiable checks
(`eval.checks`) and lm-evaluation-harness benchmarks (`eval.benchmarks`); then the gate.

A policy's answers are generated once per suite, prompt set, generation settings and weights,
and kept in `eval/answers/<label>.<suite>.jsonl` with the hash of everything they depend on: a
rerun with another judge or other checks of the same prompts reuses them, and loads no model
for them. A LoRA policy is benchmarked as its merged weights, merged in memory and checked
against the adapter model's logits as `rlhf merge` checks. Results go to
`eval/<label>.<suite>.json` and the stage's manifest before the gate is applied: a threshold
missed is `EvalGateFailed` (exit 4), with the results attached for the CLI to print.

Long because one stage runs three suites: finding the policies, keeping their answers, each
suite against the baseline and the gate read top to bottom here, each step a short function.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from rlhf_cli.audit.measure import sample_answers
from rlhf_cli.data import Conversation, hold_out, load_prompts, prompt_text
from rlhf_cli.errors import EvalError, EvalGateFailed, MergeMismatch, StageError
from rlhf_cli.generation import require_engine, tokenize_prompts
from rlhf_cli.modeling import (
    check_devices,
    load_policy_tokenizer,
    load_sft_model,
    pick_device,
)
from rlhf_cli.recipe import EvalSection, PromptSource, Recipe
from rlhf_cli.record import StageRecord, require
from rlhf_cli.resume import named_checkpoint
from rlhf_cli.rundir import InputRecord, RunDir, atomic_write_bytes, atomic_write_json
from rlhf_cli.stages.common import seed_everything
from rlhf_cli.stages.trained import (
    PolicyLocation,
    generation_engine,
    load_policy,
    locate_policy,
    merge_and_cast,
    merge_check_inputs,
    policy_source,
)

NEEDED_BY = "rlhf eval"
ANSWERED = ("judge", "checks")  # the suites that read the policies' answers
ANSWER_BATCH = 16  # prompts a generate call, as the audit's
CHECKPOINT = re.compile(r"best|last|iter_\d+")
LENGTH_UNIT = "words"  # the judge's length differences: whitespace-split words of each answer


@dataclass
class Target:
    """A policy to evaluate, worked out before anything loads: its label (a file name), what it
    resolved to, the hash of its weights, the stages they came from, and how to load it as
    (model, tokenizer) on a device."""

    label: str
    source: str
    weights: str
    inputs: dict[str, InputRecord]
    load: Callable[[torch.device], tuple[Any, Any]]
    loaded: tuple[Any, Any] | None = field(default=None, repr=False)
    engine: Any = field(default=None, repr=False)  # its generation engine, built once


def run_eval(
    recipe: Recipe, console: Console, labels: list[str] | None = None, baseline: str | None = None
) -> dict[str, Any]:
    """Measure `labels` (default `eval.policies`) against `baseline` (default `eval.baseline`)
    with the recipe's suites; write the results; return them (`results`: label -> suite ->
    summary, `gate`). EvalGateFailed (its `result` attached) when a policy misses a threshold."""
    cfg = recipe.eval
    baseline = baseline or cfg.baseline
    labels = list(dict.fromkeys(labels or cfg.policies))
    check_suites(cfg)
    run = RunDir.for_recipe(recipe)

    # 1. The judge answers, the prompts read and every policy found before any model loads.
    if cfg.judge is not None:
        from rlhf_cli.evals.judge import check_judge

        check_judge(cfg.judge)
    prompts = suite_prompts(recipe, run)
    targets = {label: resolve_target(recipe, run, label) for label in [*labels, baseline]}
    base = targets[baseline].label
    policies = [targets[label].label for label in labels]
    device = pick_device(recipe.run.device)
    check_devices(recipe)
    if prompts:
        require_engine(cfg.generation, "eval.generation")
    inputs = {k: v for target in targets.values() for k, v in target.inputs.items()}

    with StageRecord(run, "eval", recipe, inputs=inputs) as record:
        earlier = record.previous_manifest()
        # 2. Each policy's answers (kept, or generated once) and benchmarks, one model at a time.
        measured = {}
        for target in targets.values():
            with console.status(f"rlhf eval: {target.label} ({target.source})"):
                measured[target.label] = measure(recipe, target, prompts, record.dir, device)
        # 3. Each policy against the baseline, suite by suite; the results written.
        record.replacing()
        results, files = write_results(recipe, record.dir, targets, base, prompts, measured)
        gate = check_gate(cfg, results, [label for label in policies if label != base])
        record.manifest["outputs"] = {**earlier.get("outputs", {}), **files}
        record.manifest["results"] = {**earlier.get("results", {}), **results}
        record.manifest["baseline"] = base
        record.manifest["last"] = policies
        record.manifest["gate"] = gate
        record.manifest["metrics"] = flat_metrics(results)
    result = {"run": run.name, "dir": str(record.dir), "baseline": base, "policies": policies,
              "results": results, "gate": gate}  # fmt: skip
    if not gate["passed"]:
        failure = EvalGateFailed("eval gate: " + "; ".join(gate["missed"]))
        failure.result = result  # type: ignore[attr-defined]
        raise failure
    return result


def write_results(
    recipe: Recipe,
    folder: Path,
    targets: dict[str, Target],
    base: str,
    prompts: dict[str, Any],
    measured: dict[str, dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """`<label>.<suite>.json` for each policy and suite (the baseline judged against itself
    left out); (label -> suite -> summary, the files written by name)."""
    results: dict[str, dict[str, Any]] = {}
    files = {}
    for target in targets.values():
        label = target.label
        other = None if label == base else measured[base]
        for suite in check_suites(recipe.eval):
            if suite == "judge" and other is None:
                continue  # the baseline against itself says nothing
            full = compare(recipe, suite, prompts, measured[label], other)
            full.update(policy=label, source=target.source, baseline=base, suite=suite)
            path = folder / f"{label}.{suite}.json"
            atomic_write_json(path, full)
            results.setdefault(label, {})[suite] = full["summary"]
            files[f"{label}.{suite}"] = path.name
    return results, files


def check_suites(cfg: EvalSection) -> list[str]:
    """The suites the recipe names (EvalError when none: a recipe need not evaluate, so only
    `rlhf eval` refuses it; the gate's thresholds were checked against them at validation)."""
    suites = [name for name in ("judge", "checks", "benchmarks") if getattr(cfg, name)]
    if not suites:
        raise EvalError("eval: no suite to run: set eval.judge, eval.checks or eval.benchmarks")
    return suites


# ── what each suite asks ──────────────────────────────────────────────────────────────────────


def suite_prompts(recipe: Recipe, run: RunDir) -> dict[str, Any]:
    """The prompts each answered suite asks the policies: `judge` (`prompts_file`, or the run's
    held-out PPO prompts as `rlhf ppo` splits them; at most `max_prompts`), and `checks` (the
    checks file's rows, their prompts within)."""
    cfg, prompts = recipe.eval, {}
    if cfg.judge is not None:
        prompts["judge"] = judge_prompts(recipe, run)[: cfg.judge.max_prompts]
    if cfg.checks is not None:
        from rlhf_cli.evals.checks import read_checks

        prompts["checks"] = read_checks(cfg.checks)
    return prompts


def judge_prompts(recipe: Recipe, run: RunDir) -> list[Conversation]:
    judge, source = recipe.eval.judge, recipe.data.prompts
    assert judge is not None and source is not None  # the recipe's validators see to both
    if judge.prompts_file is not None:
        own = PromptSource(path=judge.prompts_file, min_words=0, max_chars=source.max_chars)
        return load_prompts(own, cache_dir=run.path / ".cache").items
    _, heldout = hold_out(load_prompts(source, cache_dir=run.path / ".cache"), source.eval_fraction)
    if not heldout:
        raise EvalError(
            "eval.judge: no prompts: data.prompts.eval_fraction is 0 (nothing held out of PPO): "
            "set it, or eval.judge.prompts_file"
        )
    return heldout


def prompts_of(suite: str, asked: list[Any]) -> list[str | Conversation]:
    return [row["prompt"] for row in asked] if suite == "checks" else asked


# ── the policies: found, loaded, answering ────────────────────────────────────────────────────


def resolve_target(recipe: Recipe, run: RunDir, label: str) -> Target:
    """`base`, `sft`, `ppo`, an offline stage's policy (`dpo`, any of `OFFLINE_STAGES`),
    `merged`, a PPO checkpoint (`best`, `last`, `iter_N`) or a model folder, found as audit and
    compare find them; nothing loads."""
    from rlhf_cli.rundir import OFFLINE_STAGES

    if label == "base":
        name = recipe.model.name_or_path
        tokenizer = recipe.model.tokenizer or name
        load = _sft_loader(recipe, name, None, tokenizer)
        files = folder_stamp(Path(name)) if Path(name).is_dir() else None
        return Target("base", name, digest({"base": name, "files": files}), {}, load)
    if label == "sft":
        if not recipe.sft.enabled:
            raise StageError(
                "rlhf eval: this recipe trains no SFT policy (sft.enabled is false): compare "
                "with --baseline base"
            )
        inputs: dict[str, InputRecord] = {}
        base, adapter, tokenizer = policy_source(recipe, run, inputs, NEEDED_BY)
        load = _sft_loader(recipe, base, adapter, tokenizer)
        return Target("sft", inputs["sft"]["path"], digest(inputs), inputs, load)
    if label == "ppo" or CHECKPOINT.fullmatch(label):
        folder = None if label == "ppo" else named_checkpoint(run.stage_dir("ppo"), label)
        where = locate_policy(recipe, run, folder, needed_by=NEEDED_BY, stage="ppo")
        return located(recipe, label, where)
    if label in OFFLINE_STAGES:
        return located(recipe, label, locate_policy(recipe, run, needed_by=NEEDED_BY, stage=label))
    if label == "merged":
        require(run, "merged", NEEDED_BY)
        where = locate_policy(recipe, run, run.stage_dir("merged"), needed_by=NEEDED_BY)
        return located(recipe, label, where)
    folder = Path(label)
    if not folder.exists():
        raise StageError(
            f"rlhf eval: '{label}' is not base, sft, ppo, merged, best, last, iter_N or a "
            f"model folder, nor an offline stage ({', '.join(OFFLINE_STAGES)})"
        )
    where = locate_policy(recipe, run, folder, needed_by=NEEDED_BY)
    name = f"{folder.resolve().name}-{digest(str(folder.resolve()))[:8]}"
    return located(recipe, name, where)


def located(recipe: Recipe, label: str, where: PolicyLocation) -> Target:
    """A policy `locate_policy` found; its weights' hash covers the stages it came from and its
    folder's files (names, sizes, times: nothing is read)."""
    weights = digest({"inputs": where.inputs, "files": folder_stamp(where.folder)})

    def load(device: torch.device) -> tuple[Any, Any]:
        policy = load_policy(where, recipe.model, device)
        return policy.model, policy.tokenizer

    return Target(label, str(where.folder), weights, where.inputs, load)


def _sft_loader(
    recipe: Recipe, base: str, adapter: Path | None, tokenizer: str
) -> Callable[[torch.device], tuple[Any, Any]]:
    """The base (no adapter) or the SFT model, as PPO's reference loads it."""

    def load(device: torch.device) -> tuple[Any, Any]:
        model = load_sft_model(recipe.model, base, adapter, device)
        return model, load_policy_tokenizer(recipe.model, tokenizer, "left")

    return load


def loaded(target: Target, device: torch.device) -> tuple[Any, Any]:
    """The target's (model, tokenizer), loaded on first use."""
    if target.loaded is None:
        target.loaded = target.load(device)
    return target.loaded


def folder_stamp(folder: Path) -> list[tuple[str, int, int]]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def measure(
    recipe: Recipe, target: Target, prompts: dict[str, Any], folder: Path, device: torch.device
) -> dict[str, Any]:
    """One policy's answers to each answered suite (kept, or generated) and its benchmarks;
    its model is loaded only if something needs it, and let go after."""
    out: dict[str, Any] = {"answers": {}, "files": {}}
    for suite, asked in prompts.items():
        out["answers"][suite], out["files"][suite] = answers(
            recipe, target, suite, prompts_of(suite, asked), folder, device
        )
    if recipe.eval.benchmarks is not None:
        out["benchmarks"], out["merge_check"] = benchmark(recipe, target, device)
    target.loaded = target.engine = None
    gc.collect()
    return out


def answers_hash(recipe: Recipe, target: Target, suite: str, prompts: list[Any]) -> str:
    """What a suite's answers depend on: the policy's weights, the prompts and how they are
    read and answered."""
    return digest(
        {
            "policy": target.label,
            "suite": suite,
            "weights": target.weights,
            "prompts": prompts,
            "generation": recipe.eval.generation.model_dump(mode="json"),
            "prompt_format": recipe.model.prompt_format,
            "max_tokens": recipe.data.prompts.max_tokens,  # type: ignore[union-attr]
            "seed": recipe.run.seed,
        }
    )


def answers(
    recipe: Recipe,
    target: Target,
    suite: str,
    prompts: list[str | Conversation],
    folder: Path,
    device: torch.device,
) -> tuple[list[str], dict[str, Any]]:
    """The policy's answers to `prompts` and where they are kept (file, hash, reused): the
    kept ones when their hash is this one's, else generated now and kept."""
    key = answers_hash(recipe, target, suite, prompts)
    path = folder / "answers" / f"{target.label}.{suite}.jsonl"
    kept = read_answers(path, key, len(prompts))
    where = {"file": str(path.relative_to(folder)), "hash": key, "reused": kept is not None}
    if kept is not None:
        return kept, where
    texts = generate(recipe, target, prompts, device, folder.parent)
    rows = [{"prompt": p, "answer": a, "hash": key} for p, a in zip(prompts, texts, strict=True)]
    atomic_write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())
    return texts, where


def read_answers(path: Path, key: str, count: int) -> list[str] | None:
    """The answers kept in `path` when there are `count` of them, all made under hash `key`."""
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if len(rows) != count or any(
        not isinstance(r, dict) or r.get("hash") != key or not isinstance(r.get("answer"), str)
        for r in rows
    ):
        return None
    return [row["answer"] for row in rows]


def generate(
    recipe: Recipe, target: Target, prompts: list[Any], device: torch.device, scratch: Path
) -> list[str]:
    """The target's answers with `eval.generation` (greedy by default), each row seeded from
    `run.seed`, by its engine (built on first use)."""
    gen = recipe.eval.generation
    model, tokenizer = loaded(target, device)
    if target.engine is None:
        target.engine = generation_engine(gen, model, tokenizer, recipe, scratch)
    seed_everything(recipe.run.seed)
    chat = recipe.model.prompt_format == "chat"
    max_tokens = recipe.data.prompts.max_tokens  # type: ignore[union-attr]
    queries = tokenize_prompts(tokenizer, prompts, chat, max_tokens)
    policy = target.engine.sync(model)
    batches = sample_answers(target.engine, queries, gen, ANSWER_BATCH, recipe.run.seed, policy)
    return [text for batch in batches for text in batch.texts]


def benchmark(
    recipe: Recipe, target: Target, device: torch.device
) -> tuple[dict[str, dict], dict[str, Any] | None]:
    """The policy's benchmark scores on its whole weights: a LoRA policy merged in memory, in
    place (it is the model's last use: no second copy), checked against the adapter model's
    logits as `rlhf merge` checks; the check's figures (None without an adapter). With
    `eval.generation.backend: vllm` the tasks run on a colocated vLLM engine built from those
    merged weights, for the model's whole context (the answers' engine, sized for
    `eval.generation`, is let go first: one engine at a time); otherwise on the HF model."""
    from rlhf_cli.evals.benchmarks import run_benchmarks

    model, tokenizer = loaded(target, device)
    check = None
    if hasattr(model, "merge_and_unload"):
        ids, mask = merge_check_inputs(recipe, tokenizer, device)
        dtype = model.get_base_model().dtype
        model, check, problem = merge_and_cast(model, ids, mask, dtype, recipe.merge.atol)
        if problem is not None:
            raise MergeMismatch(f"rlhf eval: {target.label}: {problem}; no benchmark was run")
        target.loaded = (model, tokenizer)
    target.engine = engine = None  # the answers' engine has answered
    gc.collect()
    gen = recipe.eval.generation
    if gen.backend == "vllm":
        from rlhf_cli.generation import generator_for
        from rlhf_cli.model_checks import model_context
        from rlhf_cli.modeling import resolve_dtype

        context = model_context(model) or tokenizer.model_max_length
        engine = generator_for(model, tokenizer, gen, max_len=context, seed=recipe.run.seed,
                               scratch=RunDir.for_recipe(recipe).path,
                               dtype=resolve_dtype(recipe.model.dtype, device))  # fmt: skip
    chat = recipe.model.prompt_format == "chat"
    cfg = recipe.eval.benchmarks
    return run_benchmarks(cfg, model, tokenizer, chat, engine), check  # type: ignore[arg-type]


# ── a policy against the baseline ─────────────────────────────────────────────────────────────


def compare(
    recipe: Recipe,
    suite: str,
    prompts: dict[str, Any],
    policy: dict[str, Any],
    baseline: dict[str, Any] | None,
) -> dict[str, Any]:
    """One suite's result file for a policy (`baseline` None: the baseline's own): `summary`
    (its numbers), the settings, the answers' files and hashes, and the details."""
    cfg = recipe.eval
    out: dict[str, Any] = {"settings": getattr(cfg, suite).model_dump(mode="json")}
    if suite in ANSWERED:
        out["generation"] = cfg.generation.model_dump(mode="json")
        out["answers"] = {"policy": policy["files"][suite]}
        if baseline is not None:
            out["answers"]["baseline"] = baseline["files"][suite]
    if suite == "judge":
        assert baseline is not None and cfg.judge is not None
        out.update(judged(cfg, prompts["judge"], policy["answers"]["judge"],
                          baseline["answers"]["judge"], recipe.run.seed))  # fmt: skip
    elif suite == "checks":
        out.update(checked(cfg, prompts["checks"], policy, baseline))
    else:
        out.update(benchmarked(policy, baseline))
    return out


def judged(
    cfg: EvalSection, prompts: list[Any], policy: list[str], baseline: list[str], seed: int
) -> dict[str, Any]:
    """Each pair judged in both orders; the win rate with its interval, and the win rate
    length-controlled on the answers' difference in words (policy minus baseline)."""
    from rlhf_cli.evals.judge import judge_pairs, win_rates

    assert cfg.judge is not None
    texts = [prompt_text(p) for p in prompts]
    pairs = judge_pairs(cfg.judge, texts, policy, baseline)
    diffs = [float(len(a.split()) - len(b.split())) for a, b in zip(policy, baseline, strict=True)]
    rates = win_rates([p["outcome"] for p in pairs], diffs, cfg.judge.bootstrap, seed)
    summary = {**rates, "n": len(pairs), "unreadable": sum(p["unreadable"] for p in pairs),
               "length_unit": LENGTH_UNIT}  # fmt: skip
    rows = [
        {"prompt": t, "policy": a, "baseline": b, "length_diff": d, **p}
        for t, a, b, d, p in zip(texts, policy, baseline, diffs, pairs, strict=True)
    ]
    return {"summary": summary, "pairs": rows}


def checked(
    cfg: EvalSection, rows: list[dict], policy: dict[str, Any], baseline: dict[str, Any] | None
) -> dict[str, Any]:
    """The policy's answers graded; beside the baseline's accuracy, the difference (`delta`) and
    its standard error paired by row (`delta_se`: the spread of the per-row differences, over
    root n), smaller than the two accuracies' errors combined when both get the same rows
    right."""
    from rlhf_cli.evals.checks import grade

    assert cfg.checks is not None
    graded = grade(cfg.checks, rows, policy["answers"]["checks"])
    summary = {k: v for k, v in graded.items() if k != "rows"}
    if baseline is not None:
        theirs = grade(cfg.checks, rows, baseline["answers"]["checks"])
        summary["baseline_accuracy"] = theirs["accuracy"]
        summary["baseline_se"] = theirs["se"]
        summary["delta"] = graded["accuracy"] - theirs["accuracy"]
        diffs = [float(a["correct"]) - float(b["correct"])
                 for a, b in zip(graded["rows"], theirs["rows"], strict=True)]  # fmt: skip
        summary["delta_se"] = statistics.pstdev(diffs) / math.sqrt(len(diffs))
    return {"summary": summary, "rows": graded["rows"]}


def benchmarked(policy: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Each task's score (and its metric's direction, `higher_is_better`); with a baseline, the
    alignment tax (the gain on the baseline's score, negative a loss whichever way the metric
    points; its standard error from both)."""
    from rlhf_cli.evals.benchmarks import alignment_tax

    tasks = {name: dict(task) for name, task in policy["benchmarks"].items()}
    if baseline is not None:
        for name, tax in alignment_tax(policy["benchmarks"], baseline["benchmarks"]).items():
            tasks[name].update(tax=tax["tax"], tax_stderr=tax["stderr"])
    return {"summary": tasks, "merge_check": policy["merge_check"]}


# ── the gate ───────────────────────────────────────────────────────────────────────────────────


def check_gate(
    cfg: EvalSection, results: dict[str, dict[str, Any]], policies: list[str]
) -> dict[str, Any]:
    """Each policy's results against `eval.gate`: `passed`, and a line for each threshold
    missed, naming the policy, the measure, its value and the threshold."""
    gate, missed = cfg.gate, []
    for label in policies:
        got = results[label]
        minimums = (
            ("judge", "win_rate", gate.min_win_rate, "judge win rate", "min_win_rate"),
            ("judge", "lc_win_rate", gate.min_lc_win_rate, "length-controlled win rate",
             "min_lc_win_rate"),
            ("checks", "accuracy", gate.min_accuracy, "checks accuracy", "min_accuracy"),
        )  # fmt: skip
        for suite, key, threshold, what, name in minimums:
            value = got.get(suite, {}).get(key)
            if threshold is not None and not (value is not None and value >= threshold):
                missed.append(f"{label}: {what} {_shown(value)} < {threshold} (eval.gate.{name})")
        for task, threshold in gate.max_alignment_tax.items():
            tax = got.get("benchmarks", {}).get(task, {}).get("tax")
            if not (tax is not None and tax >= threshold):
                missed.append(
                    f"{label}: {task} alignment tax {_shown(tax)} < {threshold} "
                    f"(eval.gate.max_alignment_tax)"
                )
    return {"passed": not missed, "missed": missed}


def _shown(value: float | None) -> str:
    return "none" if value is None else f"{value:+.4f}" if value < 0 else f"{value:.4f}"


def flat_metrics(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's summary numbers: `<label>/<suite>/<measure>` (a benchmark's per task)."""
    flat = {}
    for label, suites in results.items():
        for suite, summary in suites.items():
            for key, value in summary.items():
                if isinstance(value, dict):  # a benchmark task
                    for name in ("score", "tax"):
                        if value.get(name) is not None:
                            flat[f"{label}/{suite}/{key}/{name}"] = value[name]
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    flat[f"{label}/{suite}/{key}"] = value
    return flat
