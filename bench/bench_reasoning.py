"""`make bench-reasoning`: GRPO on checkable answers, learning shown by accuracy (reasoning.json).

The task is recipes/smollm2-addition.yaml: SmolLM2-135M-Instruct as it comes (no SFT; LoRA r 16
on the seven projections), data/addition ("What is a + b?" with the gold `solution` column),
rewarded by `builtin:math_accuracy` (1 when math-verify finds the answer, the last number, equal
to the gold, else 0). Arms, each from the instruct model, each seed (`--seeds`) in turn, each run
in its own process (its peak RSS its own), alternated within a seed (grpo, trl-grpo, grpo-dapo):
- `grpo`: `rlhf ppo` on the recipe as shipped (4 answers a prompt, 16 an iteration, one pass in
  mini-batches of 8, the k3 KL in the loss at β 0.04, learning rate 2e-4) for `--iterations`
  (12 by default, against the recipe's 40, so that 3 seeds of 3 arms take about an hour here);
- `grpo-dapo`: the same with `ppo.dynamic_sampling: true` (groups whose answers all score alike
  dropped, the batch refilled from fresh prompts);
- `trl-grpo`: TRL's `GRPOTrainer` on the same model, LoRA, training prompts (the recipe's split,
  its chat template), reward (the same function), batch (generation_batch_size 16,
  num_generations 4, per_device_train_batch_size 8: two optimizer steps a generation, as ours
  takes), β, ε, learning rate, temperature, completion length, `loss_type: grpo` (our
  `seq_mean_token_mean`), for `--iterations` × 2 steps: the same sample budget (`grpo-dapo`
  generates more: `sampling_rounds_mean` batches an iteration). TRL's own
  `accuracy_reward` reads LaTeX answers only; what it gives the instruct model's answers is
  recorded beside ours (`trl_accuracy_reward`), which is why the arm uses ours.
Evaluation, the same for every final policy and for the instruct model as it comes (`base`): the
recipe's held-out prompts (never trained on), one greedy answer each (`greedy_accuracy`) and
`--k` sampled answers at temperature 1 (`mean_at_k`, the unbiased `pass_at_1` and `pass_at_k`
of rlhf_cli.audit.measure), graded by the same function. Cost: iteration time (ours: the median
of metrics.jsonl's time/iteration_s over iterations 2..N; TRL: its optimizer steps of one
generation summed, the same median) and each process's peak RSS. Spreads are the standard
deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/smollm2-addition.yaml"
MARK = "BENCH-REASONING-RESULT "
ARMS = ("grpo", "trl-grpo", "grpo-dapo")
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def steady_median(values: list[float]) -> float | None:
    """The median over iterations 2..N (the first warms up)."""
    kept = values[1:] or values
    return round(statistics.median(kept), 3) if kept else None


def recipe(work: Path, seed: int, iterations: int, extra: list[str]) -> Any:
    from rlhf_cli.recipe import load_recipe

    sets = [f"run.output_dir={work}", f"run.seed={seed}", f"ppo.iterations={iterations}",
            "ppo.eval_every=null", f"ppo.save_freq={iterations}", *extra]  # fmt: skip
    return load_recipe(RECIPE, sets)


def splits(rcp: Any, work: Path) -> tuple[list[Any], list[dict], list[Any], list[dict]]:
    """(training prompts, their columns, held-out prompts, their columns) as `rlhf ppo` splits."""
    from dataclasses import replace

    from rlhf_cli.data import hold_out, load_prompts

    data = load_prompts(rcp.data.prompts, cache_dir=work / ".cache")
    rows = replace(data, items=list(zip(data.items, data.columns, strict=True)))
    train, heldout = hold_out(rows, rcp.data.prompts.eval_fraction)
    return (
        [p for p, _ in train],
        [c for _, c in train],
        [p for p, _ in heldout],
        [c for _, c in heldout],
    )


# ── the child processes ────────────────────────────────────────────────────────────────────────


def run_ours(work: Path, seed: int, iterations: int, dapo: bool) -> dict[str, Any]:
    from rich.console import Console

    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import quiet_libraries, read_metrics

    quiet_libraries()
    extra = ["ppo.dynamic_sampling=true"] if dapo else []
    rcp = recipe(work, seed, iterations, extra)
    start = time.perf_counter()
    run_ppo(rcp, Console(stderr=True, quiet=True))
    wall = time.perf_counter() - start
    folder = work / rcp.run.name / "ppo"
    rows = read_metrics(folder / "metrics.jsonl")
    out = {
        "adapter": str(folder / "adapter"),
        "iterations": len(rows),
        "iteration_s_median": steady_median([r["time/iteration_s"] for r in rows]),
        "reward_first": round(rows[0]["env/reward_mean"], 4),
        "reward_last_fifth": round(
            statistics.mean(r["env/reward_mean"] for r in rows[-max(1, len(rows) // 5) :]), 4
        ),
        "wall_s": round(wall, 1),
        "peak_rss_mb": peak_rss_mb(),
    }
    if dapo:
        drops = [r.get("rollout/dropped_groups_rate", 0.0) for r in rows]
        rounds = [r.get("rollout/sampling_rounds", 1.0) for r in rows]
        out["dropped_groups_rate_mean"] = round(statistics.mean(drops), 4)
        out["sampling_rounds_mean"] = round(statistics.mean(rounds), 3)  # batches generated
    return out


def run_trl(work: Path, seed: int, iterations: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the recipe's model, training prompts, reward and batch."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_cli.modeling import load_causal_lm, load_policy_tokenizer, lora_config
    from rlhf_cli.tracking import quiet_libraries
    from rlhf_cli.verifiable import math_accuracy

    quiet_libraries()
    rcp = recipe(work, seed, iterations, [])
    prompts, columns, _, _ = splits(rcp, work)
    dataset = Dataset.from_dict({
        "prompt": prompts,  # conversations (the user's turn), as the recipe's data loads them
        "solution": [c["solution"] for c in columns],
    })  # fmt: skip

    def accuracy(completions: list[Any], solution: list[Any], **_: Any) -> list[float]:
        return list(math_accuracy([], [c[-1]["content"] for c in completions], solution))

    steps: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(time.perf_counter() - self.t0)

    ppo, gen = rcp.ppo, rcp.ppo.generation
    per = ppo.batch_size // ppo.mini_batch_size * ppo.ppo_epochs
    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=seed,
        max_steps=iterations * per, per_device_train_batch_size=ppo.mini_batch_size,
        gradient_accumulation_steps=1, generation_batch_size=ppo.batch_size,
        num_generations=ppo.num_generations, max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature, top_p=gen.top_p, top_k=0, num_iterations=ppo.ppo_epochs,
        beta=ppo.init_kl_coef, epsilon=ppo.cliprange, loss_type="grpo",
        learning_rate=ppo.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_epsilon=ppo.adam_eps, max_grad_norm=ppo.max_grad_norm,
        gradient_checkpointing=False, disable_dropout=True, dataloader_num_workers=0,
    )  # fmt: skip
    name = rcp.model.name_or_path
    tokenizer = load_policy_tokenizer(rcp.model, name, "left")
    model = load_causal_lm(name, rcp.model, torch.device("cpu"), trainable=False)
    trainer = GRPOTrainer(
        model=model, reward_funcs=accuracy, args=config, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[StepTimer()],
        peft_config=lora_config(rcp.model.lora, "CAUSAL_LM", no_dropout=True),
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    cycles = [sum(steps[i * per : (i + 1) * per]) for i in range(len(steps) // per)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    adapter = work / "trl" / "adapter"
    trainer.model.save_pretrained(str(adapter))
    return {
        "adapter": str(adapter),
        "iterations": len(cycles),
        "steps": len(steps),
        "iteration_s_median": steady_median(cycles),
        "reward_first": round(rewards[0], 4) if rewards else None,
        "reward_last_fifth": round(statistics.mean(rewards[-max(1, len(rewards) // 5) :]), 4)
        if rewards
        else None,  # fmt: skip
        "wall_s": round(wall, 1),
        "peak_rss_mb": peak_rss_mb(),
    }


def evaluate(work: Path, adapter: str | None, k: int) -> dict[str, Any]:
    """Greedy accuracy and k samples a prompt (mean@k, unbiased pass@1 and pass@k) on the
    held-out prompts, graded by the reward function; for `base` also TRL's accuracy_reward."""
    import torch

    from rlhf_cli.audit.measure import pass_at_k, repeated, sample_answers
    from rlhf_cli.data.prompts import tokenize_prompts
    from rlhf_cli.generation import generator_for
    from rlhf_cli.modeling import load_causal_lm, load_policy_tokenizer
    from rlhf_cli.tracking import quiet_libraries
    from rlhf_cli.verifiable import math_accuracy

    quiet_libraries()
    rcp = recipe(work, 0, 1, [])
    _, _, prompts, columns = splits(rcp, work)
    solution = [c["solution"] for c in columns]
    name = rcp.model.name_or_path
    tokenizer = load_policy_tokenizer(rcp.model, name, "left")
    model = load_causal_lm(name, rcp.model, torch.device("cpu"), trainable=False)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    queries = tokenize_prompts(tokenizer, prompts, True, rcp.data.prompts.max_tokens)
    generator = generator_for(model, tokenizer)
    policy = generator.sync(model)

    def answers(gen: Any, rows: list[list[int]]) -> list[str]:
        batches = sample_answers(generator, rows, gen, 16, 1000, policy)
        return [t for b in batches for t in b.texts]

    greedy = answers(rcp.eval.generation, queries)
    sampled_gen = rcp.ppo.generation.model_copy(update={"temperature": 1.0, "do_sample": True})
    sampled = answers(sampled_gen, repeated(queries, k))
    greedy_right = math_accuracy([], greedy, solution)
    right = torch.tensor(math_accuracy([], sampled, repeated(solution, k))).view(-1, k)
    counts = right.sum(1).int().tolist()
    out = {
        "prompts": len(prompts),
        "greedy_accuracy": round(statistics.mean(greedy_right), 4),
        "greedy_no_answer_rate": round(greedy_right.metrics["no_answer_rate"], 4),
        "mean_at_k": round(float(right.mean()), 4),
        "pass_at_1": round(statistics.mean(pass_at_k(k, c, 1) for c in counts), 4),
        f"pass_at_{k}": round(statistics.mean(pass_at_k(k, c, k) for c in counts), 4),
        "greedy_examples": greedy[:3],
    }
    if adapter is None:
        from trl.rewards import accuracy_reward

        theirs = accuracy_reward([[{"content": t}] for t in greedy], [str(s) for s in solution])
        out["trl_accuracy_reward"] = round(statistics.mean(r or 0.0 for r in theirs), 4)
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.child == "eval":
        return evaluate(work, args.adapter, args.k)
    if args.child == "trl-grpo":
        return run_trl(work, args.seed, args.iterations)
    return run_ours(work, args.seed, args.iterations, dapo=args.child == "grpo-dapo")


# ── the parent ────────────────────────────────────────────────────────────────────────────────


def spawn(kind: str, work: Path, **options: Any) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--work", str(work)]
    for key, value in options.items():
        if value is not None:
            cmd += [f"--{key}", str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def spread(runs: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {"mean": None, "std": None}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.mean(values), 4), "std": round(std, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/reasoning.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--child", choices=[*ARMS, "eval"])
    parser.add_argument("--work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter")
    args = parser.parse_args()
    if args.child:
        print(MARK + json.dumps(child(args)), flush=True)
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    report: dict[str, Any] = {
        "what": __doc__,
        "commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_start": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"recipe": str(RECIPE.relative_to(ROOT)), "iterations": args.iterations,
                     "k": args.k, "seeds": args.seeds},
        "runs": {arm: [] for arm in args.arms},
    }  # fmt: skip

    def write() -> None:
        report["summary"] = {
            arm: {key: spread([r[section] for r in runs], key)
                  for section, keys in (("eval", ("greedy_accuracy", "mean_at_k", "pass_at_1",
                                                  f"pass_at_{args.k}")),
                                        ("train", ("iteration_s_median", "peak_rss_mb",
                                                   "wall_s")))
                  for key in keys if runs and key in runs[0][section]}
            for arm, runs in report["runs"].items()
        }  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-reasoning-") as tmp:
        report["base"] = spawn("eval", Path(tmp) / "base", k=args.k)
        print(f"base: {report['base']}", file=sys.stderr)
        write()
        for seed in args.seeds:
            for arm in args.arms:
                work = Path(tmp) / f"{arm}-{seed}"
                train = spawn(arm, work, seed=seed, iterations=args.iterations)
                result = spawn("eval", work, adapter=train["adapter"], k=args.k)
                report["runs"][arm].append({"seed": seed, "train": train, "eval": result})
                print(f"{arm} seed {seed}: {train} {result}", file=sys.stderr)
                write()
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write()
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
