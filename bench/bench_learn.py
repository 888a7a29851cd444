"""`make bench-learn`: held-out reward gain against KL to the SFT policy, ours and TRL's, over a
grid of learning rates, KL coefficients and seeds at one sample budget: bench/learn.json.

Methods (the keys): our PPO (`rlhf_cli.stages.ppo.run_ppo`) with `advantage_estimator`
`ours-gae`, `ours-rloo`, `ours-grpo` and `ours-reinforce_pp` (the sampled log-prob support but
for reinforce_pp), the first three again with `logprob_support: full` (`ours-gae-full`,
`ours-rloo-full`, `ours-grpo-full`), grpo with Dr. GRPO's aggregation as well
(`ours-grpo-dr`), with DAPO's clip-higher (`ours-grpo-full-ch`: `cliprange_high` 0.28) and with
the KL loss weighted by π/π_old (`ours-grpo-full-ukl`: `kl_importance_weight`, the schema's
default since; every other grpo method runs the plain k3 term, `kl_importance_weight: false`),
plus variants screened at one point only (`OURS`, last block); TRL's
`RLOOTrainer` (`trl-rloo`) and `GRPOTrainer` with its default `loss_type` (`trl-grpo`: "dapo" in
TRL 1.x, the loss_type used is recorded with each run), with "dr_grpo" (`trl-grpo-dr_grpo`) and
with "grpo" (`trl-grpo-grpo`), all with TRL's default `use_bias_correction_kl` (the same weighting),
and one check off the default grid: "grpo" without it (`trl-grpo-grpo-plainkl`, tiny, β 0.1:
TRL with our old plain k3 term). Two policies (`--policy`), each with its default grid
(`POLICIES`):
- `tiny` (default): the tiny recipe's SFT model (`rlhf sft` on recipes/tiny.yaml, fully
  fine-tuned), prompts of at most 64 tokens; default budget 1024 completions; every method but
  the screened ones and the check (`GRID`) at lr 1e-4, 3e-4 and 1e-3 and β 0.02 and 0.1;
- `smollm2-135m`: SmolLM2-135M-Instruct (`builtin:smollm2-135m`, dequantized once into a float
  folder), no SFT (it is instruction-tuned already), prompts of at most 96 tokens (its chat
  template's default system prompt takes about 30; recipes/smollm2-135m.yaml's data settings);
  a smaller grid, as a run takes 10 to 13 min on a 2-core CPU (the tiny grid's 252 runs would be
  about two days): default budget 256 completions, four methods (our grpo and GAE with the full
  support, grpo with the weighted KL loss, TRL's best on the tiny task, GRPO `dr_grpo`) at lr
  1e-4, 3e-4 and 1e-3 and β 0.02 and 0.1.

Every run of a policy gets:
- the same policy with a fresh LoRA adapter (r 16, alpha 32, on the seven proj modules, dropout
  0), reference = the adapter disabled; float32 on the CPU;
- the same reward: the MiniLM model `rlhf train-rm` trains on recipes/tiny.yaml, scored by our
  RewardScorer (no missing-EOS penalty, no score normalisation for anyone);
- the same training prompts: data/tiny/prompts.jsonl through the recipe's filters, less the
  held-out 20% (`data.split_heldout`, fixed draw), chat template with the generation prompt;
- the same budget of generated completions (`--budget`), in batches of 32 completions sampled at
  temperature 1.0, top-p 0.9, at most 32 new tokens, then 4 passes over each batch in
  mini-batches of 8 (TRL: generation_batch_size 32, per_device_train_batch_size 8,
  num_iterations 4), a constant learning rate; rloo and grpo (ours and TRL's) answer each prompt
  4 times (num_generations 4), ours-reinforce_pp once (32 prompts a batch);
- the KL coefficient β of the grid (`--kls`), each method with its own placement of the KL:
  ours-gae in the reward, k1, adaptive toward 6 nats with β as the starting value, as the tiny
  recipe (its horizon of 10000 moves β by at most 0.2·32/10000 a batch: within ±2% over 1024
  completions); ours-rloo and TRL RLOO a fixed β on the summed k1 KL in the reward; ours-grpo and
  TRL GRPO (all three loss types) a fixed β on k3 in the loss; ours-reinforce_pp a fixed β on k2
  in the reward, with Dr. GRPO's constant length normalisation (`loss_aggregation:
  seq_mean_token_sum_norm`) and the temperature-only log-prob support (`logprob_support: full`),
  as tests/stages/test_estimators.py runs it. Everything else at each trainer's defaults (ours:
  token-mean loss, clip 0.2; TRL GRPO: scale_rewards "group").

Evaluation, the same function for every run, after training: the policy answers every held-out
prompt 4 times (temperature 0.7, top-p 1.0, 32 new tokens, each row from a fixed seed) and so does
the SFT policy (adapter off) from the same seeds (`audit.measure.heldout_eval`); recorded: the
held-out reward gain (policy mean − SFT mean), the win rate against the SFT answer to the same
prompt and seed, the KL to the SFT policy (k1, summed per answer) and the wall time of the
training (ours: `run_ppo`, which includes its own end-of-run held-out pass; TRL: `train()`).

Grid: every method at every learning rate (`--lrs`), KL coefficient (`--kls`) and seed
(`--seeds`), point by point (KL coefficient, then learning rate, then seed, then method), each
run in its own process. Every finished run is appended at once to the runs file (`--runs`,
bench/learn_runs.jsonl: one JSON line keyed by policy, method, lr, kl_coef, seed and budget, with
its results and the setup it ran on: the SFT and reward model's held-out figures and a digest of
their weights); an invocation skips the runs already there, so the grid fills over several
sessions. The SFT and reward models are trained once per work folder (`--work`). Off the
default grid, the runs file also holds `ours-gae-full` at β 0.005 (lr 1e-3, 3 seeds: `--methods
ours-gae-full --lrs 1e-3 --kls 0.005`): at β 0.02 its k1 reward penalty holds it to half the KL
grpo reaches, and this point compares them at the same KL; on SmolLM2 the same at lr 3e-4
(`--policy smollm2-135m --methods ours-gae-full --lrs 3e-4 --kls 0.005`).

This file is rebuilt from the runs file at the end of every invocation (alone with
`--summarise-only`), from the runs at each policy's budget (`--budget` for `--policy`, the
default for the other) and the seeds of `--seeds`:
- `frontier[policy][method]`: one point per (learning rate, KL coefficient) whose runs cover
  every seed: means over seeds of the measured KL (`kl`), the gain (`gain`), the win rate and the
  wall time, with the seed spread (population std, `kl_spread`, `gain_spread`);
- `pareto[policy][method]`: the points no other point of that method dominates (at least the
  gain at no more KL, better in one), by KL;
- `comparison[policy]`: TRL GRPO's best point (highest mean gain over its `trl-grpo*` methods),
  our best point (any of our methods) at no more mean KL, the difference of their mean gains,
  whether it is within the larger of their seed spreads, and whether ours reaches TRL's gain;
  under `gae` the same for the best point of our GAE methods against our best point at any KL;
- `progress[policy]`: runs recorded, complete points and points still missing seeds;
- `setup[policy]`: the distinct setups the summarised runs ran on (more than one: the runs come
  from SFT or reward models trained apart).

`--judge` (tiny policy): the frontier that does not saturate, gold reward against KL as Gao et
al. (2022) measure over-optimisation. `rlhf train-rm` trains the proxy reward on half the
preference prompts and a judge on the other half (`reward.judge_fraction` 0.5: no prompt
shared); every method trains against the proxy, and the held-out evaluation scores the same
answers with the judge too (`judge_gain`: judge mean minus the SFT answers' judge mean;
`judge_win_rate`). The frontier, Pareto set and comparison then rank by `judge_gain`
(`comparison.by`); the proxy's `gain` stays beside it. Its own files (`bench/learn_judge.json`,
`bench/learn_judge_runs.jsonl`) and work folder: its proxy saw half the data, so its runs are
not comparable with the default grid's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

from bench_ppo import ROOT, recipe_for

MARK = "BENCH-LEARN-RESULT "
BATCH, MINI, EPOCHS, NEW_TOKENS, GROUP, HELDOUT = 32, 8, 4, 32, 4, 0.2
EVAL_SAMPLES, EVAL_SEED = 4, 1234
JUDGE_FRACTION = 0.5  # `--judge`: the preference prompts kept from the proxy for the judge
_GROUPED = {"num_generations": GROUP, "adaptive_kl": False}
_KL_LOSS = {"kl_in": "loss", "kl_estimator": "k3"}
_GRPO = {"advantage_estimator": "grpo", **_GROUPED, **_KL_LOSS, "kl_importance_weight": False}
FULL = {"logprob_support": "full"}
CLIP_HIGH = {"cliprange_high": 0.28}  # DAPO's clip-higher
OURS = {  # the four estimators as first measured: the sampled support, except reinforce_pp
    "ours-gae": {"advantage_estimator": "gae", "logprob_support": "sampled"},
    "ours-rloo": {"advantage_estimator": "rloo", **_GROUPED, "logprob_support": "sampled"},
    "ours-grpo": {**_GRPO, "logprob_support": "sampled"},
    "ours-reinforce_pp": {"advantage_estimator": "reinforce_pp", "adaptive_kl": False,
                          "kl_estimator": "k2", "loss_aggregation": "seq_mean_token_sum_norm",
                          **FULL},
}  # fmt: skip
OURS |= {  # the same with the temperature-only support, and Dr. GRPO's aggregation on grpo
    "ours-gae-full": {**OURS["ours-gae"], **FULL},
    "ours-rloo-full": {**OURS["ours-rloo"], **FULL},
    "ours-grpo-full": {**_GRPO, **FULL},
    "ours-grpo-dr": {**_GRPO, **FULL, "loss_aggregation": "seq_mean_token_sum_norm"},
    "ours-grpo-full-ch": {**_GRPO, **FULL, **CLIP_HIGH},
    "ours-grpo-full-ukl": {**_GRPO, **FULL, "kl_importance_weight": True},  # TRL's KL gradient
}
SCREENED = {  # tried at one point only (lr 1e-3, β 0.02, seed 0), not carried further
    "ours-gae-full-k3loss": {**OURS["ours-gae-full"], **_KL_LOSS, "kl_importance_weight": False},
    "ours-gae-lam1": {**OURS["ours-gae"], "lam": 1.0},
    "ours-gae-full-lam1": {**OURS["ours-gae-full"], "lam": 1.0},
    "ours-gae-full-vf05": {**OURS["ours-gae-full"], "vf_coef": 0.5},
    "ours-gae-full-sep": {**OURS["ours-gae-full"], "value_model": "separate"},
    "ours-gae-full-wr": {**OURS["ours-gae-full"], "whiten_rewards": True},
    "ours-gae-full-ch": {**OURS["ours-gae-full"], **CLIP_HIGH},
    "ours-gae-full-g4": {**OURS["ours-gae-full"], "num_generations": GROUP},
}
OURS |= SCREENED
TRL = {  # GRPOConfig / RLOOConfig settings of each TRL method beyond the shared ones
    "trl-rloo": {},
    "trl-grpo": {},
    "trl-grpo-dr_grpo": {"loss_type": "dr_grpo"},
    "trl-grpo-grpo": {"loss_type": "grpo"},
}
CHECKS = {"trl-grpo-grpo-plainkl": {"loss_type": "grpo", "use_bias_correction_kl": False}}
TRL |= CHECKS
METHODS = (*OURS, *TRL)
GRID = tuple(m for m in METHODS if m not in SCREENED and m not in CHECKS)


class Grid(NamedTuple):
    """A policy's default grid: completions a run, methods, learning rates, KL coefficients."""

    budget: int
    methods: tuple[str, ...]
    lrs: tuple[float, ...]
    kls: tuple[float, ...]


POLICIES = {
    "tiny": Grid(1024, GRID, (1e-4, 3e-4, 1e-3), (0.02, 0.1)),
    "smollm2-135m": Grid(
        256, ("ours-grpo-full", "ours-grpo-full-ukl", "ours-gae-full", "trl-grpo-dr_grpo"),
        (1e-4, 3e-4, 1e-3), (0.02, 0.1),
    ),
}  # fmt: skip
KEY = ("policy", "method", "lr", "kl_coef", "seed", "budget")


def base_recipe(policy: str, work: Path, tag: str, seed: int, lr: float, budget: int) -> dict:
    """The policy's shipped recipe on the bench's policy and reward model, with the shared
    settings."""
    import yaml

    from rlhf_cli.modeling import resolve_model_path

    data = yaml.safe_load(recipe_for(policy, work, budget // BATCH).read_text())
    if policy == "tiny":
        sft = work / "runs" / "bench-tiny" / "sft"
        model, tokenizer = str(sft / "model"), str(sft / "tokenizer")
    else:
        model = tokenizer = resolve_model_path(data["model"]["name_or_path"])
    data["run"].update(name=tag, seed=seed, device="cpu")
    data["model"].update(name_or_path=model, tokenizer=tokenizer, dtype="float32")
    data["sft"]["enabled"] = False
    data["reward"] = {
        **data["reward"],
        "base_model": None,
        "pretrained": str(work / "runs" / "bench-tiny" / "rm" / "model"),
    }
    data["data"]["prompts"]["eval_fraction"] = HELDOUT
    data["ppo"].update(
        batch_size=BATCH, mini_batch_size=MINI, gradient_accumulation_steps=1,
        ppo_epochs=EPOCHS, learning_rate=lr, missing_eos_penalty=None,
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
    from rlhf_cli.data import load_prompts, prompt_text, split_heldout
    from rlhf_cli.generation import generator_for, tokenize_prompts
    from rlhf_cli.modeling import Reference
    from rlhf_cli.stages.trained import frozen_scorer

    _, held = split_heldout(load_prompts(recipe.data.prompts, work / ".cache").items, HELDOUT)
    asked = [prompt_text(p) for p in held for _ in range(EVAL_SAMPLES)]
    queries = tokenize_prompts(tokenizer, asked, True, recipe.data.prompts.max_tokens)
    device = torch.device("cpu")
    scorer = frozen_scorer(
        recipe.reward, recipe.reward.pretrained, recipe.reward.pretrained, device
    )
    folder = work / "runs" / "bench-tiny" / "rm" / "judge" / "model"
    judge = (
        frozen_scorer(recipe.reward, str(folder), str(folder), device) if folder.is_dir() else None
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
        judge=judge,
    )
    gain = metrics["eval/reward_mean"] - metrics["eval/reward_reference_mean"]
    judged = {}
    if judge is not None:
        judge_gain = metrics["eval/judge_reward_mean"] - metrics["eval/judge_reward_reference_mean"]
        judged = {"judge_gain": round(judge_gain, 4),
                  "judge_win_rate": round(metrics["eval/judge_win_rate"], 4)}  # fmt: skip
    return {
        **judged,
        "reward_gain": round(gain, 4),
        "reward": round(metrics["eval/reward_mean"], 4),
        "reward_sft": round(metrics["eval/reward_reference_mean"], 4),
        "win_rate": round(metrics["eval/win_rate"], 4),
        "kl": round(metrics["eval/kl"], 4),
        "length": round(metrics["eval/length_mean"], 2),
        "answers": len(asked),
    }


def run_ours(
    method: str, policy: str, work: Path, tag: str, seed: int, lr: float, kl: float, budget: int
) -> dict[str, Any]:
    import yaml
    from peft import PeftModel
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import read_metrics

    data = base_recipe(policy, work, tag, seed, lr, budget)
    data["ppo"].update(OURS[method], init_kl_coef=kl)
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    start = time.perf_counter()
    run_ppo(recipe, Console(stderr=True, quiet=True))
    wall = time.perf_counter() - start
    stage = Path(recipe.run.output_dir) / tag / "ppo"
    rows = read_metrics(stage / "metrics.jsonl")
    sft = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path)
    policy_model = PeftModel.from_pretrained(sft, str(stage / "adapter"))
    tokenizer = load_tokenizer(recipe.model.tokenizer, padding_side="left")
    completions = sum(1 for _ in rows) * BATCH
    return {"wall_s": round(wall, 1), "completions": completions,
            **evaluate(policy_model, tokenizer, recipe, work)}  # fmt: skip


def run_trl(
    method: str, policy: str, work: Path, tag: str, seed: int, lr: float, kl: float, budget: int
) -> dict[str, Any]:
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from rlhf_cli.data import load_prompts, prompt_text, split_heldout
    from rlhf_cli.modeling import load_tokenizer, lora_config
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.trained import frozen_scorer

    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(base_recipe(policy, work, tag, seed, lr, budget)))
    recipe = load_recipe(path)
    device = torch.device("cpu")
    tokenizer = load_tokenizer(recipe.model.tokenizer, padding_side="left")
    train, _ = split_heldout(load_prompts(recipe.data.prompts, work / ".cache").items, HELDOUT)
    dataset = Dataset.from_dict({"prompt": train})
    rm = recipe.reward.pretrained
    scorer = frozen_scorer(recipe.reward, rm, rm, device)

    def reward_model_score(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        """Our scorer: prompt text and stripped completion through the recipe's template."""
        texts = [prompt_text(p) for p in prompts]
        return scorer.score(texts, [c[-1]["content"].strip() for c in completions])[0].tolist()

    grpo = method.startswith("trl-grpo")
    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if grpo else (RLOOConfig, RLOOTrainer)
    config = config_class(
        output_dir=str(work / tag / "trl"), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=seed,
        max_steps=budget // BATCH * (BATCH // MINI) * EPOCHS,
        per_device_train_batch_size=MINI, gradient_accumulation_steps=1,
        generation_batch_size=BATCH, num_generations=GROUP, max_completion_length=NEW_TOKENS,
        temperature=1.0, top_p=0.9, num_iterations=EPOCHS, beta=kl,
        epsilon=recipe.ppo.cliprange, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", adam_epsilon=recipe.ppo.adam_eps,
        max_grad_norm=recipe.ppo.max_grad_norm, gradient_checkpointing=False,
        disable_dropout=True, dataloader_num_workers=0, **TRL[method],
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
    loss_type = {"loss_type": config.loss_type} if grpo else {}
    return {"wall_s": round(wall, 1), "completions": budget, **loss_type,
            **evaluate(trainer.model, tokenizer, recipe, work)}  # fmt: skip


def setup(work: Path, judge: bool) -> dict[str, Any]:
    """`rlhf sft` and `rlhf train-rm` on recipes/tiny.yaml: the tiny policy and the shared
    reward (with `judge`, the reward on half the preference prompts and the judge on the other
    half, `reward.judge_fraction`); their held-out figures and a digest of their weights."""
    import yaml
    from rich.console import Console

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.stages.sft import run_sft

    path = recipe_for("tiny", work, 1)
    if judge:
        data = yaml.safe_load(path.read_text())
        data["reward"]["judge_fraction"] = JUDGE_FRACTION
        path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    quiet = Console(stderr=True, quiet=True)
    sft, rm = run_sft(recipe, quiet), run_train_rm(recipe, quiet)
    digest = hashlib.sha256()
    for folder in ("sft/model", "rm/model", *(["rm/judge/model"] if judge else [])):
        for weights in sorted((work / "runs" / "bench-tiny" / folder).glob("*.safetensors")):
            digest.update(weights.read_bytes())
    judged = {"judge_eval_accuracy": rm["metrics"].get("judge_eval_accuracy")} if judge else {}
    return {"sft_eval_loss": sft["metrics"].get("eval_loss"),
            "rm_eval_accuracy": rm["metrics"].get("eval_accuracy"), **judged,
            "weights_sha256": digest.hexdigest()[:16]}  # fmt: skip


def child(args: argparse.Namespace) -> dict[str, Any]:
    from rlhf_cli.tracking import quiet_libraries

    quiet_libraries()
    if args.child == "setup":
        return setup(args.work, args.judge)
    run = run_trl if args.child in TRL else run_ours
    return run(args.child, args.policy, args.work, args.tag, args.seed, args.lr, args.kl,
               args.budget)  # fmt: skip


def spawn(work: Path, tag: str, method: str, *flags: str) -> dict[str, Any]:
    """`child` in its own process: its result."""
    cmd = [sys.executable, __file__, "--child", method, "--tag", tag, "--work", str(work), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"bench-learn: {tag} failed (exit {out.returncode})")
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith(MARK))
    result = json.loads(line.removeprefix(MARK))
    print(f"{tag}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def prepared(work: Path, judge: bool) -> dict[str, Any]:
    """The setup of this work folder, run the first time only (work/setup.json)."""
    path = work / "setup.json"
    if not path.is_file():
        path.write_text(json.dumps(spawn(work, "setup", "setup", *(["--judge"] if judge else []))))
    return json.loads(path.read_text())


def read_runs(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def point(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (learning rate, KL coefficient) of a method: means and spreads over its seeds."""

    def mean(key: str) -> float:
        return round(statistics.fmean(r[key] for r in runs), 4)

    def spread(key: str) -> float:
        return round(statistics.pstdev(r[key] for r in runs), 4)

    judged = {}
    if all("judge_gain" in r for r in runs):
        judged = {"judge_gain": mean("judge_gain"), "judge_gain_spread": spread("judge_gain"),
                  "judge_win_rate": mean("judge_win_rate")}  # fmt: skip
    return {"lr": runs[0]["lr"], "kl_coef": runs[0]["kl_coef"], "kl": mean("kl"),
            "kl_spread": spread("kl"), "gain": mean("reward_gain"),
            "gain_spread": spread("reward_gain"), "win_rate": mean("win_rate"), **judged,
            "wall_s": mean("wall_s"), "seeds": sorted(r["seed"] for r in runs)}  # fmt: skip


def pareto(points: list[dict[str, Any]], y: str) -> list[dict[str, Any]]:
    """The points no other dominates (at least the gain `y` at no more KL, better in one), by
    KL."""

    def dominates(q: dict[str, Any], p: dict[str, Any]) -> bool:
        better = q[y] > p[y] or q["kl"] < p["kl"]
        return better and q[y] >= p[y] and q["kl"] <= p["kl"]

    kept = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(kept, key=lambda p: p["kl"])


def comparison(frontier: dict[str, list[dict[str, Any]]], y: str) -> dict[str, Any] | None:
    """TRL GRPO's best point against our best point at no more KL, and our best GAE point
    against our best point at any KL (`versus`), by the gain `y`."""
    trl = [{"method": m, **p} for m, ps in frontier.items() if m.startswith("trl-grpo") for p in ps]
    if not trl:
        return None
    best = max(trl, key=lambda p: p[y])
    ours = [{"method": m, **p} for m, ps in frontier.items() if m in OURS for p in ps]
    mine = max((p for p in ours if p["kl"] <= best["kl"]), key=lambda p: p[y], default=None)
    out = {"by": y, "trl_grpo_best": best, "ours_best_at_no_more_kl": mine,
           **versus(mine, best, y)}  # fmt: skip
    gae = [p for p in ours if p["method"].startswith("ours-gae")]
    if gae:
        top, top_gae = (max(ps, key=lambda p: p[y]) for ps in (ours, gae))
        out["gae"] = {"ours_best": top, "gae_best": top_gae, **versus(top_gae, top, y)}
    return out


def versus(mine: dict[str, Any] | None, other: dict[str, Any], y: str) -> dict[str, Any]:
    """Gain `y` of `mine` minus that of `other`, and whether that is within the larger seed
    spread."""
    if mine is None:
        return {"gain_difference": None, "within_one_spread": None, "reaches_it": False}
    gap = round(mine[y] - other[y], 4)
    spread = max(mine[f"{y}_spread"], other[f"{y}_spread"])
    return {"gain_difference": gap, "within_one_spread": abs(gap) <= spread, "reaches_it": gap >= 0}


def summarise(
    runs: list[dict[str, Any]], budgets: dict[str, int], seeds: list[int], y: str = "gain"
) -> dict:
    """The frontier, Pareto, comparison, progress and setup blocks (module docstring) of the
    runs at each policy's budget and of `seeds`, the gain `y` on the frontier's y-axis."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r["budget"] == budgets[r["policy"]] and r["seed"] in seeds:
            groups[r["policy"], METHODS.index(r["method"]), r["kl_coef"], r["lr"]].append(r)
    out: dict[str, dict[str, Any]] = {
        k: {} for k in ("frontier", "pareto", "comparison", "progress", "setup")
    }
    for (policy, index, *_), mine in sorted(groups.items()):
        complete = {r["seed"] for r in mine} == set(seeds)
        progress = out["progress"].setdefault(policy, {"runs": 0, "points": 0, "incomplete": 0})
        progress["runs"] += len(mine)
        progress["points" if complete else "incomplete"] += 1
        setups = out["setup"].setdefault(policy, [])
        for r in mine:
            if r["setup"] not in setups:
                setups.append(r["setup"])
        if complete:
            out["frontier"].setdefault(policy, {}).setdefault(METHODS[index], []).append(
                point(mine)
            )
    for policy, methods in out["frontier"].items():
        out["pareto"][policy] = {m: pareto(ps, y) for m, ps in methods.items()}
        out["comparison"][policy] = comparison(methods, y)
    return out


def run_grid(args: argparse.Namespace, budget: int) -> None:
    """The grid's runs not in the runs file yet, each appended to it when done."""
    done = {tuple(r[k] for k in KEY) for r in read_runs(args.runs)}
    todo = [
        (method, lr, kl, seed)
        for kl in args.kls
        for lr in args.lrs
        for seed in args.seeds
        for method in args.methods
        if (args.policy, method, lr, kl, seed, budget) not in done
    ]
    print(f"bench-learn: {len(todo)} runs to do, {len(done)} recorded", file=sys.stderr)
    if not todo:
        return
    args.work.mkdir(parents=True, exist_ok=True)
    prepared_on = prepared(args.work, args.judge)
    for method, lr, kl, seed in todo:
        tag = f"{args.policy}-{method}-s{seed}-lr{lr:g}-kl{kl:g}-b{budget}"
        flags = ["--policy", args.policy, "--seed", str(seed), "--lr", str(lr), "--kl", str(kl),
                 "--budget", str(budget)]  # fmt: skip
        result = spawn(args.work, tag, method, *flags)
        key = dict(zip(KEY, (args.policy, method, lr, kl, seed, budget), strict=True))
        with args.runs.open("a") as runs:
            runs.write(json.dumps({**key, **result, "setup": prepared_on}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", action="store_true", help="the judge's gain on the y-axis")
    ap.add_argument("--out", type=Path, help="default: bench/learn.json (learn_judge.json)")
    ap.add_argument("--runs", type=Path, help="default: bench/learn_runs.jsonl (learn_judge_…)")
    ap.add_argument("--policy", default="tiny", choices=POLICIES)
    ap.add_argument("--budget", type=int, help="completions a run (default: the policy's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", help="default: the policy's")
    ap.add_argument("--kls", type=float, nargs="+", help="KL coefficients β (default: policy's)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, help="default: the policy's")
    ap.add_argument("--work", type=Path, help="default: /tmp/rlhf-bench-learn(-judge)")
    ap.add_argument("--summarise-only", action="store_true", help="rebuild --out from --runs")
    ap.add_argument("--child")
    ap.add_argument("--tag")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0)
    ap.add_argument("--kl", type=float, default=0.0)
    args = ap.parse_args()
    name = "learn_judge" if args.judge else "learn"
    args.out = args.out or ROOT / "bench" / f"{name}.json"
    args.runs = args.runs or ROOT / "bench" / f"{name}_runs.jsonl"
    args.work = args.work or Path("/tmp/rlhf-bench-" + name.replace("_", "-"))
    if args.child:
        print(MARK + json.dumps(child(args)), flush=True)
        return
    grid = POLICIES[args.policy]
    args.methods = args.methods or list(grid.methods)
    args.lrs, args.kls = args.lrs or list(grid.lrs), args.kls or list(grid.kls)
    budget = args.budget or grid.budget
    budgets = {**{p: g.budget for p, g in POLICIES.items()}, args.policy: budget}
    runs = args.runs.resolve()
    interrupted = False
    try:
        if not args.summarise_only:
            run_grid(args, budget)
    except KeyboardInterrupt:  # the finished runs are in the runs file; the summary still follows
        interrupted = True
    finally:
        report = {
            "what": __doc__,
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                **{name: version(name) for name in ("torch", "transformers", "peft", "trl")},
            },
            "budget_completions": budgets,
            "seeds": args.seeds,
            "runs_file": str(runs.relative_to(ROOT) if runs.is_relative_to(ROOT) else runs),
            **summarise(
                read_runs(args.runs), budgets, args.seeds, "judge_gain" if args.judge else "gain"
            ),
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: report[k] for k in ("progress", "comparison")}, indent=2))
    if interrupted:
        raise SystemExit("bench-learn: interrupted; rerun the command to resume the grid")


if __name__ == "__main__":
    main()
