"""`make bench-methods`: the guide's Part 12 table (PPO, GRPO, DPO, KTO, ORPO, SimPO) measured
on one task instead of claimed: bench/methods.json (#52 item 5).

For each model (`--model`; `tiny` by default, recipes/tiny.yaml; `smollm2`,
recipes/smollm2-135m.yaml, is supported and not run by default) the SFT model and the reward
model are trained once (`rlhf sft`, `rlhf train-rm`, `run.seed` as shipped) and every method
below starts from them (`run.base`), so the seeds (`--seeds`, 0 1 2) vary the method only. Each
run is the CLI itself in its own process, `rlhf <stage>` with the method's `--set`s (`METHODS`,
short settings recorded in the JSON, not each method's best; on SmolLM2 every stage trains at
the recipe's LoRA rate, 2e-4: `MODEL_SETS`), then on its final policy:
- `rlhf audit` on the held-out prompts PPO never trains on (`data.prompts.eval_fraction`), one
  answer each, every run with the same audit seed (`AUDIT_SEED`), so the SFT policy's answers
  are the same draws for every method: `kl_to_reference` (the policy's KL to the SFT policy on
  its own samples, Σ_t log π − log π_SFT, the same code for every method: the offline methods'
  training never computes a comparable one) and the run's reward model on both answers
  (`reward_policy_mean` − `reward_reference_mean`: the proxy reward gain);
- `rlhf eval <stage> --baseline sft` with the recipe's checks (data/eval/checks.jsonl: 30
  additions no stage teaches and 40 tone rows graded by the data's politeness rule, which no
  method trains on; greedy answers): the checks' `delta` and its paired `delta_se`.
Beside them: the models each holds and its planned peak (`rlhf plan --stage <stage> --json` on
the CPU with the run's settings), the measured peak the stage's manifest records
(`peak_memory_bytes`, `peak_memory_kind`: `cpu_tensors` is the live-tensor count the plan
models, `cpu_rss` the process's resident peak), and the stage's wall time (the process, model
loading included). KTO reads thumbs rows made once from the preference pairs (each chosen
answer a thumbs-up, each rejected one a thumbs-down: `thumbs.jsonl` in the bench's folder).

`summary[model][method]` holds each figure's mean and population std over the seeds, and
`vs_guide` where the measured row disagrees with the guide's Part 12 table (`GUIDE`). The JSON
is written after every run; a run already in `--out` for the same recipe and settings is kept,
not run again (the runs are deterministic), so an interrupted grid goes on where it stopped;
`--fresh` runs everything again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench_hacking import setup  # sft and train-rm once, their held-out figures

ROOT = Path(__file__).resolve().parent.parent
RLHF = str(Path(sys.executable).parent / "rlhf")
MODELS = {"tiny": "tiny.yaml", "smollm2": "smollm2-135m.yaml"}  # --model
# what a model needs beyond the method's sets (`{stage}`: the method's stage): SmolLM2's recipe
# has no eval section (tiny's checks), and its LoRA trains at the recipe's 2e-4, where the grid's
# offline 2e-3 (tiny's, which a 2,202-token vocabulary takes) is ten times that
MODEL_SETS = {
    "tiny": [],
    "smollm2": [
        f"eval.checks={{path: {ROOT / 'data/eval/checks.jsonl'}, grader: math}}",
        "{stage}.learning_rate=2e-4",
    ],
}
AUDIT_SEED = 1000  # a sampling seed no run uses: the same SFT answers for every method
PPO_SHORT = ["ppo.iterations=8", "ppo.eval_every=null", "ppo.save_freq=8"]
OFFLINE_SHORT = ["epochs=1", "batch_size=16", "max_length=128", "learning_rate=2e-3",
                 "logging_steps=5"]  # fmt: skip
GRPO = ["ppo.advantage_estimator=grpo", "ppo.num_generations=4", "ppo.adaptive_kl=false",
        "ppo.kl_in=loss", "ppo.kl_estimator=k3"]  # fmt: skip


def offline(stage: str, *sets: str) -> list[str]:
    return [f"{stage}.{s}" for s in OFFLINE_SHORT] + list(sets)


# method -> (stage, the `--set`s over the recipe); KTO reads `thumbs.jsonl` (`one_run`), one
# answer a row, so its batch holds 32 answers as DPO's 16 pairs do
METHODS: dict[str, tuple[str, list[str]]] = {
    "ppo-gae": ("ppo", [*PPO_SHORT, "ppo.advantage_estimator=gae"]),
    "grpo": ("ppo", [*PPO_SHORT, *GRPO]),
    "dpo-sigmoid": ("dpo", offline("dpo", "dpo.loss_type=[sigmoid]")),
    "dpo-ipo": ("dpo", offline("dpo", "dpo.loss_type=[ipo]")),
    "kto": ("kto", offline("kto", "kto.batch_size=32")),
    "orpo": ("orpo", offline("orpo")),
    "simpo": ("simpo", offline("simpo")),
}
# The guide's Part 12 table (../shared/seeds/000_49ecf41e70d2e497.txt): its columns, the models
# it counts and the memory it claims for a 7B model
GUIDE = {
    "ppo": {"reward_model": True, "value_model": True, "online": True, "models": 4,
            "memory_7b": "~40 GB"},
    "grpo": {"reward_model": True, "value_model": False, "online": True, "models": 3,
             "memory_7b": "~20 GB"},
    "dpo": {"reward_model": False, "value_model": False, "online": False, "models": 2,
            "memory_7b": "~12 GB"},
    "orpo": {"reward_model": False, "value_model": False, "online": False, "models": 1,
             "memory_7b": "~8 GB"},
}  # fmt: skip
GUIDE_ROW = {"ppo-gae": "ppo", "dpo-sigmoid": "dpo", "dpo-ipo": "dpo"}  # method -> its column


def rlhf(*args: str) -> tuple[int, float, str]:
    """One `rlhf` command in its own process: (exit code, wall seconds, stdout)."""
    start = time.perf_counter()
    out = subprocess.run([RLHF, *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode not in (0, 1):  # 1: an audit that flagged; its figures still stand
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(f"bench-methods: rlhf {' '.join(args)} failed (exit {out.returncode})")
    return out.returncode, wall, out.stdout


def flags(sets: list[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def heldout_file(recipe: Path, work: Path) -> Path:
    """The held-out prompts PPO evaluates on (and never trains on), one a line, for the audit."""
    from rlhf_cli.data import load_prompts, prompt_text, split_heldout
    from rlhf_cli.recipe import load_recipe

    source = load_recipe(recipe).data.prompts
    _, held = split_heldout(load_prompts(source).items, source.eval_fraction)
    path = work / "heldout_prompts.txt"
    path.write_text("".join(prompt_text(p).replace("\n", " ") + "\n" for p in held))
    return path


def thumbs_file(recipe: Path, work: Path) -> Path:
    """The recipe's preference pairs as KTO's thumbs rows (module docstring)."""
    from rlhf_cli.recipe import load_recipe

    rows = []
    source = Path(load_recipe(recipe).data.preferences.path)
    for line in source.read_text().splitlines():
        pair = json.loads(line)
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    path = work / "thumbs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def planned(recipe: Path, stage: str, sets: list[str]) -> dict[str, Any]:
    """The plan of `stage` with the run's settings: its peak and the parts it holds."""
    _, _, out = rlhf("plan", "--recipe", str(recipe), *flags(sets), "--stage", stage, "--json")
    plan = json.loads(out)["stages"][stage]
    return {"planned_peak_bytes": plan["peak_bytes"], "planned_parts": sorted(plan["parts"])}


def method_sets(model: str, method: str) -> tuple[str, list[str]]:
    """(the method's stage, its `--set`s on `model`: the method's, then the model's)."""
    stage, sets = METHODS[method]
    return stage, [*sets, *(s.replace("{stage}", stage) for s in MODEL_SETS[model])]


def one_run(recipe: Path, work: Path, base: str, method: str, seed: int) -> dict[str, Any]:
    """`rlhf <stage>`, then `rlhf audit` and `rlhf eval` on its final policy; the run's figures."""
    stage, sets = method_sets(work.name, method)
    if stage == "kto":
        sets = [*sets, f"data.preferences.path={work / 'thumbs.jsonl'}"]
    tag = f"{method}-s{seed}"
    where = [f"run.output_dir={work / 'runs'}", f"run.name={tag}", f"run.base={base}"]
    common = ["--recipe", str(recipe), "--quiet"]
    _, wall, _ = rlhf(stage, *common, *flags([*where, f"run.seed={seed}", *sets]))
    manifest = json.loads((work / "runs" / tag / stage / "manifest.json").read_text())
    metrics = manifest["metrics"]
    prompts = f"audit.prompts_file={work / 'heldout_prompts.txt'}"
    audit_sets = [*where, f"run.seed={AUDIT_SEED}", prompts, "audit.samples=1", *sets]
    audit_dir = str(work / "runs" / tag / stage)
    _, audit_wall, out = rlhf("audit", audit_dir, *common, *flags(audit_sets), "--json")
    audit = json.loads(out)
    eval_sets = [*where, "eval.benchmarks=null", "eval.judge=null", *sets]
    _, eval_wall, _ = rlhf("eval", stage, "--baseline", "sft", *common, *flags(eval_sets))
    graded = json.loads((work / "runs" / tag / "eval" / "manifest.json").read_text())["metrics"]
    result = {
        "seed": seed,
        "wall_s": round(wall, 1),
        "peak_memory_bytes": metrics.get("peak_memory_bytes"),
        "peak_memory_kind": metrics.get("peak_memory_kind"),
        "manifest_planned_peak_bytes": metrics.get("planned_peak_bytes"),
        "kl_to_sft": round(audit["kl_to_reference"], 4),
        "reward_policy": round(audit["reward_policy_mean"], 4),
        "reward_sft": round(audit["reward_reference_mean"], 4),
        "reward_gain": round(audit["reward_policy_mean"] - audit["reward_reference_mean"], 4),
        "checks_accuracy": round(graded[f"{stage}/checks/accuracy"], 4),
        "checks_delta": round(graded[f"{stage}/checks/delta"], 4),
        "checks_delta_se": round(graded.get(f"{stage}/checks/delta_se", float("nan")), 4),
        "audit_wall_s": round(audit_wall, 1),
        "eval_wall_s": round(eval_wall, 1),
    }
    print(f"{tag}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


FIGURES = ("wall_s", "peak_memory_bytes", "kl_to_sft", "reward_gain", "checks_delta",
           "checks_delta_se")  # fmt: skip


def summarise(method: str, runs: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    """Mean and population std over the seeds of each figure; the models held; `vs_guide`."""
    row: dict[str, Any] = {"seeds": [r["seed"] for r in runs], **plan}
    for key in FIGURES:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            row[key] = round(statistics.fmean(values), 4)
            row[f"{key}_std"] = round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0
    row["peak_memory_kind"] = sorted({str(r.get("peak_memory_kind")) for r in runs})
    row["holds"] = holds(method, plan["planned_parts"])
    row["vs_guide"] = vs_guide(method, row)
    return row


def holds(method: str, parts: list[str]) -> dict[str, Any]:
    """What the method holds, from its plan's parts (`parts`) and its stage: the weight copies
    (`models`: the policy, a frozen reference copy, a separate critic, the reward model; under
    LoRA the reference is the policy with its adapter disabled and the value model a head on
    the policy, neither a copy), the reward model, the value model, and whether it samples."""
    stage = METHODS[method][0]
    reward = "reward model" in parts
    copies = 1 + reward + any(p.startswith(("reference", "critic")) for p in parts)
    return {
        "models": copies,
        "reference": "adapter disabled" if stage in ("ppo", "dpo", "kto") else None,
        "reward_model": reward,
        "value_model": any("value head" in p or p.startswith("critic") for p in parts),
        "online": stage == "ppo",
    }


def vs_guide(method: str, row: dict[str, Any]) -> list[str]:
    """Where the measured row disagrees with the guide's Part 12 table."""
    key = GUIDE_ROW.get(method, method)
    if key not in GUIDE:
        return [f"the guide's table has no {method} row"]
    claim, held = GUIDE[key], row["holds"]
    notes = [
        f"{field}: the guide says {claim[field]}, measured {held[field]}"
        for field in ("reward_model", "value_model", "online", "models")
        if held[field] != claim[field]
    ]
    return notes


def memory_order(summary: dict[str, Any]) -> dict[str, Any]:
    """The guide's memory order (PPO > GRPO > DPO > ORPO, ~40/20/12/8 GB at 7B) against the
    planned and measured peaks of the same columns here."""
    columns = {GUIDE_ROW.get(m, m): row for m, row in summary.items()}
    columns = {k: columns[k] for k in GUIDE if k in columns}
    guide = sorted(columns, key=lambda k: -float(GUIDE[k]["memory_7b"].strip("~ GB")))
    planned = sorted(columns, key=lambda k: -columns[k]["planned_peak_bytes"])
    counted = [k for k in columns if columns[k]["peak_memory_kind"] == ["cpu_tensors"]]
    measured = sorted(counted, key=lambda k: -columns[k]["peak_memory_bytes"])
    agrees = guide == planned and measured == [k for k in guide if k in counted]
    return {"guide": guide, "planned": planned, "measured (live tensors)": measured,
            "agrees": agrees}  # fmt: skip


def summarised(runs: dict[str, list], plans: dict[str, Any]) -> dict[str, Any]:
    summary = {m: summarise(m, rs, plans[m]) for m, rs in runs.items() if rs and m in plans}
    return {"summary": summary, "memory_order": memory_order(summary), "runs": runs}


def recorded(out: Path, model: str, record: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The runs `out` holds for `model` when its recipe and settings are `record`'s."""
    earlier = json.loads(out.read_text()).get("models", {}).get(model, {}) if out.is_file() else {}
    same = all(earlier.get(k) == v for k, v in record.items())
    return {m: list(earlier.get("runs", {}).get(m, []) if same else []) for m in METHODS}


def write(out: Path, results: dict[str, Any]) -> None:
    """bench/methods.json with `results`; a model not run now keeps its earlier record."""
    previous = json.loads(out.read_text()) if out.is_file() else {}
    models = {**previous.get("models", {}), **results}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    out.write_text(json.dumps({
        "what": __doc__.split("\n\n")[0],
        "how": __doc__.split("\n\n", 1)[1].split("\n\n`summary")[0],
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "load_average": [round(x, 1) for x in os.getloadavg()],
                    "torch": version("torch"), "transformers": version("transformers"),
                    "trl": version("trl"), "commit": commit},
        "guide": GUIDE,
        "models_run": sorted(models),
        "models_not_run": {m: "not run (--model)" for m in MODELS if m not in models},
        "models": models,
    }, indent=1) + "\n")  # fmt: skip


def mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.0f}"


def pm(row: dict[str, Any], key: str, digits: int) -> str:
    """A figure's mean ± its spread over the seeds (one seed: the mean alone)."""
    if key not in row:
        return "–"
    spread = f" ± {row[f'{key}_std']:.{digits}f}" if len(row["seeds"]) > 1 else ""
    return f"{row[key]:+.{digits}f}{spread}"


def table(out: Path, model: str) -> str:
    """The markdown table of docs/methods.md from `out`'s summary for `model`."""
    summary = json.loads(out.read_text())["models"][model]["summary"]
    lines = [
        "| method | models held | reward model | value model | online | peak MiB, plan / "
        "measured | wall s | KL to SFT | proxy reward gain | checks Δ (± se) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, row in summary.items():
        held, kind = row["holds"], row["peak_memory_kind"]
        measured = mib(row.get("peak_memory_bytes")) + ("" if kind == ["cpu_tensors"] else " RSS")
        lines.append(
            f"| {method} | {held['models']} | {'yes' if held['reward_model'] else 'no'} | "
            f"{'yes' if held['value_model'] else 'no'} | {'yes' if held['online'] else 'no'} | "
            f"{mib(row['planned_peak_bytes'])} / {measured} | {row['wall_s']:.0f} | "
            f"{pm(row, 'kl_to_sft', 3)} | {pm(row, 'reward_gain', 3)} | "
            f"{pm(row, 'checks_delta', 3)} (± {row.get('checks_delta_se', 0):.3f}) | "
            f"{len(row['seeds'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["tiny"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-methods")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "methods.json")
    parser.add_argument("--fresh", action="store_true", help="run again the runs --out has")
    parser.add_argument("--table", action="store_true", help="print --out's table and stop")
    args = parser.parse_args()
    if args.table:
        print("\n\n".join(table(args.out, m) for m in args.model))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict[str, Any] = {}
    for model in args.model:
        recipe = ROOT / "recipes" / MODELS[model]
        work, base = args.work / model, f"{model}-setup"
        work.mkdir(parents=True, exist_ok=True)
        record = {"recipe": f"recipes/{recipe.name}", "audit_seed": AUDIT_SEED,
                  "sets": {m: method_sets(model, m)[1] for m in METHODS}}  # fmt: skip
        runs = {m: [] for m in METHODS} if args.fresh else recorded(args.out, model, record)
        record["setup"] = setup(recipe, work, base)
        heldout_file(recipe, work)
        thumbs_file(recipe, work)
        plans = {m: planned(recipe, *method_sets(model, m)) for m in args.methods}
        for seed in args.seeds:
            for method in args.methods:
                if any(r["seed"] == seed for r in runs[method]):
                    continue
                runs[method].append(one_run(recipe, work, base, method, seed))
                runs[method].sort(key=lambda r: r["seed"])
                results[model] = record | summarised(runs, plans)
                write(args.out, results)  # an interrupted grid keeps the runs it made
        results[model] = record | summarised(runs, plans)
        write(args.out, results)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
