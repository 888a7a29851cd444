"""`make bench-learn`: held-out reward gain at one sample budget, ours and TRL's: bench/learn.json.

Methods: our PPO with `advantage_estimator` gae, rloo and grpo (`rlhf_cli.stages.ppo.run_ppo`),
TRL's `RLOOTrainer` and `GRPOTrainer`. Every run gets:
- the same policy: the tiny recipe's SFT model (`rlhf sft` on recipes/tiny.yaml, fully fine-tuned)
  with a fresh LoRA adapter (the recipe's: r 16 on the seven proj modules, dropout 0), reference
  = the adapter disabled;
- the same reward: the MiniLM model `rlhf train-rm` trains on recipes/tiny.yaml, scored by our
  RewardScorer;
- the same training prompts: data/tiny/prompts.jsonl through the recipe's filters, less the
  held-out 20% (`data.split_heldout`, fixed draw), chat template with the generation prompt;
- the same budget of generated completions (`--budget`), in batches of 32 completions sampled at
  temperature 1.0, top-p 0.9, at most 32 new tokens, then 4 passes over each batch in
  mini-batches of 8 (TRL: generation_batch_size 32, per_device_train_batch_size 8,
  num_iterations 4); group methods answer each prompt 4 times (num_generations 4);
- KL: ours gae as the tiny recipe (β 0.05 in the reward, adaptive toward 6 nats); ours rloo and
  TRL RLOO a fixed β 0.05 on the summed k1 KL in the reward; ours grpo and TRL GRPO a fixed
  β 0.05 on k3 in the loss. Everything else at each trainer's defaults (TRL GRPO: loss_type
  "dapo", scale_rewards "group").

Evaluation, the same function for every run, after training: the policy answers every held-out
prompt 4 times (temperature 0.7, top-p 1.0, 32 new tokens, each row from a fixed seed) and so does
the SFT policy (adapter off) from the same seeds (`audit.measure.heldout_eval`); reported: the
held-out reward gain (policy mean − SFT mean), the win rate against the SFT answer to the same
prompt and seed, the KL to the SFT policy (k1, summed per answer) and the wall time of the run.

Each method runs at each learning rate of its search (`--lrs`) and each seed; runs alternate
between methods (seed-major), each in its own process. Per method the learning rate with the best
mean gain over seeds is reported as its best, with every run listed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_ppo import ROOT, recipe_for

MARK = "BENCH-LEARN-RESULT "
METHODS = ("ours-gae", "ours-rloo", "ours-grpo", "trl-rloo", "trl-grpo")
BATCH, MINI, EPOCHS, NEW_TOKENS, GROUP, BETA, HELDOUT = 32, 8, 4, 32, 4, 0.05, 0.2
EVAL_SAMPLES, EVAL_SEED = 4, 1234


def ours_overrides(method: str) -> dict[str, Any]:
    """The `ppo` section's estimator and KL settings of one of our methods."""
    if method == "ours-gae":
        return {"advantage_estimator": "gae"}
    fixed = {"num_generations": GROUP, "adaptive_kl": False, "init_kl_coef": BETA}
    if method == "ours-rloo":
        return {**fixed, "advantage_estimator": "rloo"}
    return {**fixed, "advantage_estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3"}


def base_recipe(work: Path, tag: str, seed: int, lr: float, budget: int) -> dict[str, Any]:
    """recipes/tiny.yaml on the bench's SFT model and reward model, with the shared settings."""
    import yaml

    data = yaml.safe_load(recipe_for("tiny", work, budget // BATCH).read_text())
    sft = work / "runs" / "bench-tiny" / "sft"
    data["run"].update(name=tag, seed=seed)
    data["model"].update(name_or_path=str(sft / "model"), tokenizer=str(sft / "tokenizer"))
    data["sft"]["enabled"] = False
    data["reward"] = {
        **data["reward"],
        "base_model": None,
        "pretrained": str(work / "runs" / "bench-tiny" / "rm" / "model"),
    }
    data["data"]["prompts"]["eval_fraction"] = HELDOUT
    data["ppo"].update(
        batch_size=BATCH, mini_batch_size=MINI, gradient_accumulation_steps=1,
        ppo_epochs=EPOCHS, learning_rate=lr,
    )  # fmt: skip
    data["ppo"]["generation"].update(
        max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, do_sample=True
    )
    data["audit"]["generation"].update(
        max_new_tokens=NEW_TOKENS, temperature=0.7, top_p=1.0, do_sample=True
    )
    return data


def evaluate(policy: Any, tokenizer: Any, recipe: Any, work: Path) -> dict[str, float]:
    """The held-out evaluation every run gets (module docstring)."""
    import torch

    from rlhf_cli.audit.measure import heldout_eval
    from rlhf_cli.data import load_prompts, split_heldout
    from rlhf_cli.generation import generator_for, tokenize_prompts
    from rlhf_cli.modeling import Reference
    from rlhf_cli.stages.trained import frozen_scorer

    _, held = split_heldout(load_prompts(recipe.data.prompts, work / ".cache"), HELDOUT)
    asked = [p for p in held for _ in range(EVAL_SAMPLES)]
    queries = tokenize_prompts(tokenizer, asked, True, recipe.data.prompts.max_tokens)
    device = torch.device("cpu")
    scorer = frozen_scorer(
        recipe.reward, recipe.reward.pretrained, recipe.reward.pretrained, device
    )
    policy.eval()
    metrics, _ = heldout_eval(
        policy,
        asked,
        queries,
        recipe.audit.generation,
        seed=EVAL_SEED,
        reference=Reference(policy),
        scorer=scorer,
        generator=generator_for(policy, tokenizer),
    )
    gain = metrics["eval/reward_mean"] - metrics["eval/reward_reference_mean"]
    return {
        "reward_gain": round(gain, 4),
        "reward": round(metrics["eval/reward_mean"], 4),
        "reward_sft": round(metrics["eval/reward_reference_mean"], 4),
        "win_rate": round(metrics["eval/win_rate"], 4),
        "kl": round(metrics["eval/kl"], 4),
        "length": round(metrics["eval/length_mean"], 2),
        "answers": len(asked),
    }


def run_ours(method: str, work: Path, tag: str, seed: int, lr: float, budget: int) -> dict:
    import yaml
    from peft import PeftModel
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import read_metrics

    data = base_recipe(work, tag, seed, lr, budget)
    data["ppo"].update(ours_overrides(method))
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    start = time.perf_counter()
    run_ppo(recipe, Console(stderr=True, quiet=True))
    wall = time.perf_counter() - start
    stage = Path(recipe.run.output_dir) / tag / "ppo"
    rows = read_metrics(stage / "metrics.jsonl")
    sft = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path)
    policy = PeftModel.from_pretrained(sft, str(stage / "adapter"))
    tokenizer = load_tokenizer(recipe.model.tokenizer, padding_side="left")
    completions = sum(1 for _ in rows) * BATCH
    return {"wall_s": round(wall, 1), "completions": completions,
            **evaluate(policy, tokenizer, recipe, work)}  # fmt: skip


def run_trl(method: str, work: Path, tag: str, seed: int, lr: float, budget: int) -> dict:
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from rlhf_cli.data import load_prompts, split_heldout
    from rlhf_cli.modeling import load_tokenizer, lora_config
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.trained import frozen_scorer

    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(base_recipe(work, tag, seed, lr, budget)))
    recipe = load_recipe(path)
    device = torch.device("cpu")
    tokenizer = load_tokenizer(recipe.model.tokenizer, padding_side="left")
    train, _ = split_heldout(load_prompts(recipe.data.prompts, work / ".cache"), HELDOUT)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in train]})
    rm = recipe.reward.pretrained
    scorer = frozen_scorer(recipe.reward, rm, rm, device)

    def reward_model_score(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        """Our scorer: prompt text and stripped completion through the recipe's template."""
        texts = [p[-1]["content"] for p in prompts]
        return scorer.score(texts, [c[-1]["content"].strip() for c in completions])[0].tolist()

    grpo = method == "trl-grpo"
    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if grpo else (RLOOConfig, RLOOTrainer)
    config = config_class(
        output_dir=str(work / tag / "trl"), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=seed,
        max_steps=budget // BATCH * (BATCH // MINI) * EPOCHS,
        per_device_train_batch_size=MINI, gradient_accumulation_steps=1,
        generation_batch_size=BATCH, num_generations=GROUP, max_completion_length=NEW_TOKENS,
        temperature=1.0, top_p=0.9, num_iterations=EPOCHS, beta=BETA,
        epsilon=recipe.ppo.cliprange, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", adam_epsilon=recipe.ppo.adam_eps,
        max_grad_norm=recipe.ppo.max_grad_norm, gradient_checkpointing=False,
        disable_dropout=True, dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, dtype=torch.float32)
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_model_score,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(recipe.model.lora, "CAUSAL_LM", no_dropout=True),
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 1), "completions": budget,
            **evaluate(trainer.model, tokenizer, recipe, work)}  # fmt: skip


def child(method: str, work: Path, tag: str, seed: int, lr: float, budget: int) -> dict:
    from rlhf_cli.tracking import quiet_libraries

    quiet_libraries()
    if method == "setup":
        return setup(work)
    run = run_trl if method.startswith("trl") else run_ours
    return {"method": method, "seed": seed, "lr": lr,
            **run(method, work, tag, seed, lr, budget)}  # fmt: skip


def setup(work: Path) -> dict[str, Any]:
    """`rlhf sft` and `rlhf train-rm` on recipes/tiny.yaml: the shared policy and reward."""
    from rich.console import Console

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft

    recipe = load_recipe(recipe_for("tiny", work, 1))
    quiet = Console(stderr=True, quiet=True)
    sft, rm = run_sft(recipe, quiet), run_train_rm(recipe, quiet)
    return {"sft_eval_loss": sft["metrics"].get("eval_loss"),
            "rm_eval_accuracy": rm["metrics"].get("eval_accuracy")}  # fmt: skip


def spawn(method: str, work: Path, tag: str, seed: int = 0, lr: float = 0.0, budget: int = 0):
    cmd = [sys.executable, __file__, "--child", method, "--tag", tag, "--work", str(work),
           "--seed", str(seed), "--lr", str(lr), "--budget", str(budget)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"bench-learn: {tag} failed (exit {out.returncode})")
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith(MARK))
    result = json.loads(line.removeprefix(MARK))
    print(f"{tag}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def summarise(runs: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Per method and learning rate: mean and spread (population std) over seeds; the best
    learning rate by mean held-out gain."""
    out: dict[str, Any] = {}
    for method in methods:
        by_lr: dict[str, Any] = {}
        for lr in sorted({r["lr"] for r in runs if r["method"] == method}):
            mine = [r for r in runs if r["method"] == method and r["lr"] == lr]
            by_lr[str(lr)] = {
                key: {
                    "mean": round(statistics.fmean(r[key] for r in mine), 4),
                    "spread": round(statistics.pstdev(r[key] for r in mine), 4),
                }
                for key in ("reward_gain", "win_rate", "kl", "wall_s")
            }
        best = max(by_lr, key=lambda lr: by_lr[lr]["reward_gain"]["mean"])
        out[method] = {"best_lr": float(best), "best": by_lr[best], "by_lr": by_lr}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "learn.json")
    ap.add_argument("--budget", type=int, default=1024, help="completions per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlhf-bench-learn"))
    ap.add_argument("--child")
    ap.add_argument("--tag")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0)
    args = ap.parse_args()
    if args.child:
        result = child(args.child, args.work, args.tag, args.seed, args.lr, args.budget)
        print(MARK + json.dumps(result), flush=True)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prepared = spawn("setup", args.work, "setup")
    runs = [
        spawn(method, args.work, f"{method}-s{seed}-lr{lr:g}", seed, lr, args.budget)
        for seed in args.seeds
        for lr in args.lrs
        for method in args.methods
    ]
    report = {
        "what": __doc__,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "budget_completions": args.budget,
        "seeds": args.seeds,
        "learning_rates": args.lrs,
        "setup": prepared,
        "summary": summarise(runs, args.methods),
        "runs": runs,
        "bench_wall_s": round(time.time() - started, 1),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
