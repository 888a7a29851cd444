"""`make bench-peer`: our PPO beside TRL's RLOOTrainer on one model and one batch → bench/peer.json.

What is compared, per iteration (one batch of completions and its updates):
- ours: `rlhf_cli.stages.ppo.run_ppo` (policy + shared value head, GAE, clipped policy and value
  losses, adaptive KL; reference = the policy with its LoRA adapter disabled);
- theirs: TRL's `RLOOTrainer` (no critic: a leave-one-out baseline over `num_generations`
  completions of each prompt, KL as a reward penalty; reference = the adapter disabled too).
Both get the same policy (a locally built ~55M-parameter Llama, `rlhf_cli.tiny.build_local_55m`:
random weights, the tiny tokenizer and its chat template; float32 on the CPU; a fresh LoRA r=16 on
the seven proj modules), the same prompts (data/tiny/prompts.jsonl through the recipe's filters,
chat template with the generation prompt), the same reward (the MiniLM model `rlhf train-rm` trains
on recipes/tiny.yaml, scoring "Human: {prompt}\\n\\nAssistant: {response}" with our RewardScorer),
`batch` completions per iteration (ours: `batch` prompts; TRL: batch / num_generations prompts ×
num_generations) sampled at temperature 1.0, top_p 1.0, at most `max_new_tokens` new tokens, then
`ppo_epochs` passes over them in mini-batches of `mini_batch` with one optimizer step each (TRL:
per_device_train_batch_size = mini_batch, generation_batch_size = batch, num_iterations =
ppo_epochs, gradient checkpointing off like ours): one of our iterations is (batch / mini_batch) ×
ppo_epochs TRL optimizer steps.

`--policy smollm2-135m` runs the same comparison on the real instruct model SmolLM2-135M-Instruct
(`builtin:smollm2-135m`, its chat template and default system prompt) and writes it under the
`smollm2-135m` key of the output, next to the 55M report at the top level.

How: runs alternate ours, TRL, ours, TRL, ... (`--rounds` of each), each in its own subprocess,
so its peak RSS (getrusage ru_maxrss) is its own. Ours: the median of time/iteration_s from
metrics.jsonl over iterations 2..N. TRL: the wall time of each optimizer step (a TrainerCallback,
on_step_begin → on_step_end, which encloses generation, scoring and the log-prob passes); the
steps of one generation cycle are summed into an iteration and the median is over iterations
2..N (the per-step median, skipping step 1, is reported too). Tokens per second, for both, =
completion tokens (the EOS included) / generation time (ours: time/generate_s around `generate`;
TRL: the time around its `_generate_single_turn`). The ratio is ours / theirs per round (> 1: ours
is slower), and its median.

Memory: our PPO with LoRA (reference = adapter disabled: one copy of the weights, only the adapter
and the value head trained) against `model.lora.enabled: false` (all weights trained, AdamW state
for all of them, reference = a separate frozen copy), each in its own subprocess.

`--smoke` runs the same on the shipped tiny model (0.5M parameters) for 2 iterations.
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
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_ppo import ROOT, recipe_for

from rlhf_cli.tiny import LOCAL_55M_CONFIG, build_local_55m

MARK = "BENCH-PEER-RESULT "
POLICIES = ("local-55m", "smollm2-135m")
REWARD_TEMPLATE = "Human: {prompt}\n\nAssistant: {response}"
MEMORY_KEYS = ("peak_rss_mb", "peak_rss_train_mb", "rss_before_run_ppo_mb", "iteration_s_median")


@dataclass(frozen=True)
class Settings:
    """What both trainers get; serialised to each child process."""

    model: str
    reward_model: str
    iterations: int
    batch_size: int
    mini_batch_size: int
    ppo_epochs: int
    max_new_tokens: int
    num_generations: int
    lora_r: int
    threads: int | None
    seed: int = 0

    @property
    def steps_per_iteration(self) -> int:
        """TRL optimizer steps that make one of our iterations (one generation batch)."""
        return self.batch_size // self.mini_batch_size * self.ppo_epochs


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def median(values: list[float], digits: int = 4) -> float | None:
    return round(statistics.median(values), digits) if values else None


# ── the child processes ────────────────────────────────────────────────────────────────────────


def write_recipe(s: Settings, work: Path, tag: str, lora: bool) -> Path:
    """recipes/tiny.yaml (paths fixed by bench_ppo.recipe_for) with the bench settings: SFT off,
    the local policy, the trained reward model frozen, the shared batch and generation."""
    import yaml

    data = yaml.safe_load(recipe_for("tiny", work, s.iterations).read_text())
    data["run"].update(name=tag, seed=s.seed, device="cpu")
    data["model"].update(name_or_path=s.model, dtype="float32")
    data["model"]["lora"].update(enabled=lora, r=s.lora_r, alpha=2 * s.lora_r, dropout=0.0)
    data["sft"]["enabled"] = False
    data["reward"] = {
        **data["reward"],
        "base_model": None,
        "pretrained": s.reward_model,
        "template": REWARD_TEMPLATE,
    }
    data["ppo"].update(
        batch_size=s.batch_size,
        mini_batch_size=s.mini_batch_size,
        gradient_accumulation_steps=1,
        ppo_epochs=s.ppo_epochs,
    )
    data["ppo"]["generation"].update(
        max_new_tokens=s.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, do_sample=True
    )
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def child_setup(s: Settings) -> None:
    """Quiet libraries; pin the thread count when asked."""
    import torch

    from rlhf_cli.tracking import quiet_libraries

    quiet_libraries()
    if s.threads:
        torch.set_num_threads(s.threads)


def train_reward_model(work: Path) -> dict[str, Any]:
    """`rlhf train-rm` on recipes/tiny.yaml (the MiniLM reward model), as bench_ppo's tiny step."""
    from rich.console import Console

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.reward import run_train_rm
    from rlhf_cli.tracking import quiet_libraries

    quiet_libraries()
    start = time.perf_counter()
    manifest = run_train_rm(
        load_recipe(recipe_for("tiny", work, 1)), Console(stderr=True, quiet=True)
    )
    return {
        "path": str(work / "runs" / "bench-tiny" / "rm" / "model"),
        "eval_accuracy": manifest["metrics"].get("eval_accuracy"),
        "train_s": round(time.perf_counter() - start, 1),
    }


def run_ours(s: Settings, work: Path, tag: str, lora: bool) -> dict[str, Any]:
    """Our PPO through run_ppo; figures from its metrics.jsonl."""
    child_setup(s)
    import torch
    from rich.console import Console

    import rlhf_cli.ppo.loop as loop
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import read_metrics

    recipe = load_recipe(write_recipe(s, work, tag, lora))
    # The loop checkpoints only after the last iteration (save_freq is huge): the peak up to
    # that call is the training peak, without the final checkpoint and adapter writes.
    before_save: list[float] = []
    original_checkpoint = loop.checkpoint

    def checkpoint(ppo: Any, iteration: int) -> Any:
        before_save.append(peak_rss_mb())
        return original_checkpoint(ppo, iteration)

    loop.checkpoint = checkpoint
    rss_start = peak_rss_mb()
    start = time.perf_counter()
    run_ppo(recipe, Console(stderr=True, quiet=True))
    wall = time.perf_counter() - start
    rows = read_metrics(Path(recipe.run.output_dir) / tag / "ppo" / "metrics.jsonl")
    steady = rows[1:] or rows
    tokens = [r["tokens/generated_per_s"] * r["time/generate_s"] for r in steady]
    return {
        "impl": "ours",
        "tag": tag,
        "lora": lora,
        "iterations": len(rows),
        "iteration_s": [round(r["time/iteration_s"], 4) for r in rows],
        "iteration_s_median": median([r["time/iteration_s"] for r in steady]),
        "generation_s_median": median([r["time/generate_s"] for r in steady]),
        "tokens_generated_per_s": median([r["tokens/generated_per_s"] for r in steady], 1),
        "completion_tokens_per_iteration": median(tokens, 1),
        "completion_length_mean": median([r["response/length_mean"] for r in steady], 2),
        "throughput_tokens_per_s": median(
            [t / r["time/iteration_s"] for t, r in zip(tokens, steady, strict=True)], 1
        ),
        "reward_mean_last": round(rows[-1]["env/reward_mean"], 4),
        "kl_last": round(rows[-1]["objective/kl"], 4),
        "wall_s": round(wall, 1),
        "threads": torch.get_num_threads(),
        "rss_before_run_ppo_mb": rss_start,
        "peak_rss_train_mb": before_save[0] if before_save else None,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_theirs(s: Settings, work: Path, tag: str) -> dict[str, Any]:
    """TRL's RLOOTrainer on the same model, prompts, reward model, batch and passes."""
    child_setup(s)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    from rlhf_cli.data import load_prompts, prompt_text
    from rlhf_cli.modeling import load_tokenizer, lora_config
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.trained import frozen_scorer

    recipe = load_recipe(write_recipe(s, work, tag, lora=True))
    device = torch.device("cpu")
    tokenizer = load_tokenizer(s.model, padding_side="left")
    prompts = load_prompts(recipe.data.prompts, cache_dir=work / ".cache").items
    dataset = Dataset.from_dict({"prompt": prompts})
    scorer = frozen_scorer(recipe.reward, s.reward_model, s.reward_model, device)

    def reward_model_score(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        """The same scorer as ours: prompt text and stripped completion through the template."""
        texts = [prompt_text(p) for p in prompts]
        replies = [c[-1]["content"].strip() for c in completions]
        return scorer.score(texts, replies)[0].tolist()

    steps: list[float] = []
    generations: list[tuple[float, int]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(time.perf_counter() - self.t0)

    class TimedRLOO(RLOOTrainer):
        """Times the generation call only (left-padding, `generate`, EOS masking)."""

        def _generate_single_turn(
            self, prompt_ids: Any, images: Any, multimodal_fields: Any
        ) -> Any:
            t0 = time.perf_counter()
            completion_ids = super()._generate_single_turn(prompt_ids, images, multimodal_fields)
            generations.append((time.perf_counter() - t0, sum(map(len, completion_ids))))
            return completion_ids

    ppo = recipe.ppo
    config = RLOOConfig(
        output_dir=str(work / tag / "trl"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=s.seed,
        max_steps=s.iterations * s.steps_per_iteration,
        per_device_train_batch_size=s.mini_batch_size,
        gradient_accumulation_steps=1,
        generation_batch_size=s.batch_size,
        num_generations=s.num_generations,
        max_completion_length=s.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=s.ppo_epochs,
        beta=ppo.init_kl_coef,
        epsilon=ppo.cliprange,
        learning_rate=ppo.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_epsilon=ppo.adam_eps,
        max_grad_norm=ppo.max_grad_norm,
        gradient_checkpointing=False,
        disable_dropout=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
    trainer = TimedRLOO(
        model=model,
        reward_funcs=reward_model_score,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
        peft_config=lora_config(recipe.model.lora, "CAUSAL_LM", no_dropout=True),
    )
    rss_start = peak_rss_mb()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    per = s.steps_per_iteration
    if len(steps) != s.iterations * per or len(generations) != s.iterations:
        raise RuntimeError(
            f"expected {s.iterations} generations and {s.iterations * per} "
            f"steps, saw {len(generations)} and {len(steps)}"
        )
    cycles = [sum(steps[i * per : (i + 1) * per]) for i in range(s.iterations)]
    steady = range(1, s.iterations)  # iteration 1 is warm-up
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "impl": "trl",
        "tag": tag,
        "iterations": len(cycles),
        "steps": len(steps),
        "steps_per_iteration": per,
        "iteration_s": [round(c, 4) for c in cycles],
        "iteration_s_median": median([cycles[i] for i in steady]),
        "step_s_median": median(steps[1:] or steps),
        "generation_s_median": median([generations[i][0] for i in steady]),
        "tokens_generated_per_s": median(
            [generations[i][1] / generations[i][0] for i in steady], 1
        ),
        "completion_tokens_per_iteration": median([generations[i][1] for i in steady], 1),
        "completion_length_mean": median([generations[i][1] / s.batch_size for i in steady], 2),
        "throughput_tokens_per_s": median([generations[i][1] / cycles[i] for i in steady], 1),
        "reward_mean_last": round(logs[-1]["reward"], 4) if logs else None,
        "kl_last": round(logs[-1]["kl"], 4) if logs and "kl" in logs[-1] else None,
        "wall_s": round(wall, 1),
        "threads": torch.get_num_threads(),
        "rss_before_train_mb": rss_start,
        "peak_rss_mb": peak_rss_mb(),
    }


def child(kind: str, s: Settings, work: Path, tag: str) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    if kind == "train-rm":
        return train_reward_model(work)
    if kind == "trl":
        return run_theirs(s, work, tag)
    return run_ours(s, work, tag, lora=kind != "ours-full")


# ── the parent: A B A B, then the memory pair ─────────────────────────────────────────────────


def spawn(kind: str, s: Settings, work: Path, tag: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--tag",
        tag,
        "--work",
        str(work),
        "--settings",
        json.dumps(asdict(s)),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"bench-peer: {kind} run '{tag}' failed (exit {out.returncode})")
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith(MARK))
    result = json.loads(line.removeprefix(MARK))
    shown = {
        k: result.get(k)
        for k in (
            "iteration_s_median",
            "tokens_generated_per_s",
            "peak_rss_mb",
            "wall_s",
            "path",
            "train_s",
        )
    }
    print(
        f"{tag}: {json.dumps({k: v for k, v in shown.items() if v is not None})}", file=sys.stderr
    )
    return result


def model_facts(s: Settings) -> dict[str, Any]:
    """Parameter counts of the policy and of the LoRA adapter both trainers put on it."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_cli.modeling import lora_config
    from rlhf_cli.recipe import LoraSection

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(s.model))
    total = sum(p.numel() for p in model.parameters())
    lora = LoraSection(r=s.lora_r, alpha=2 * s.lora_r, dropout=0.0)
    with warnings.catch_warnings():  # peft asks a deprecated transformers property
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, lora_config(lora, "CAUSAL_LM", no_dropout=True))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return {
        "parameters": total,
        "lora_trainable_parameters": trainable,
        "lora": {
            "r": lora.r,
            "alpha": lora.alpha,
            "dropout": 0.0,
            "target_modules": lora.target_modules,
        },
    }


def recipe_facts(s: Settings, work: Path) -> dict[str, Any]:
    """The prompts that pass the recipe's filters (and their token lengths under the chat
    template), and the optimisation settings both trainers take from the recipe."""
    from rlhf_cli.data import load_prompts
    from rlhf_cli.generation import tokenize_prompts
    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.recipe import load_recipe

    (work / "facts").mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(write_recipe(s, work / "facts", "facts", lora=True))
    prompts = load_prompts(recipe.data.prompts, cache_dir=work / "facts" / ".cache").items
    lengths = [len(q) for q in tokenize_prompts(load_tokenizer(s.model), prompts, True, 10**6)]
    ppo = recipe.ppo
    return {
        "prompts": {
            "path": "data/tiny/prompts.jsonl",
            "count": len(prompts),
            "template": "the tokenizer's chat template, add_generation_prompt=True",
            "tokens_max": max(lengths),
            "tokens_mean": round(statistics.mean(lengths), 1),
            "ours_truncates_to_tokens": recipe.data.prompts.max_tokens,
        },
        "optimisation": {
            "learning_rate": ppo.learning_rate,
            "adam_eps": ppo.adam_eps,
            "max_grad_norm": ppo.max_grad_norm,
            "clip_epsilon": ppo.cliprange,
            "lr_schedule": "constant",
            "kl": {
                "ours": f"per-token penalty, adaptive, init_kl_coef {ppo.init_kl_coef}",
                "trl": f"beta {ppo.init_kl_coef}: sequence KL subtracted from the reward",
            },
        },
    }


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {
        name: version(name)
        for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets")
    }


def summarize(runs: list[dict[str, Any]], key: str) -> float | None:
    return median([r[key] for r in runs if r.get(key) is not None])


def memory_reference(memory: dict[str, dict[str, Any]], iterations: int) -> dict[str, Any]:
    """Our LoRA run (reference = the adapter disabled) beside our full-weights run (a frozen
    copy as the reference)."""
    lora_mem, full_mem = memory["ours"], memory["ours-full"]
    return {
        "lora_adapter_disabled_reference": {
            "config": "model.lora.enabled: true (r as above): the reference is the policy "
            "with its adapter disabled (one copy of the weights); trained: the "
            "adapter and the value head",
            **{k: lora_mem[k] for k in MEMORY_KEYS},
        },
        "full_weights_frozen_copy_reference": {
            "config": "model.lora.enabled: false: all weights trained (gradients and AdamW "
            "state for all), the reference is a separate frozen copy",
            **{k: full_mem[k] for k in MEMORY_KEYS},
        },
        "extra_peak_rss_mb": round(full_mem["peak_rss_mb"] - lora_mem["peak_rss_mb"], 1),
        "extra_peak_rss_train_mb": round(
            full_mem["peak_rss_train_mb"] - lora_mem["peak_rss_train_mb"], 1
        )
        if full_mem["peak_rss_train_mb"] and lora_mem["peak_rss_train_mb"]
        else None,
        "note": "full weights change what is trained, so these runs are not comparable "
        f"with TRL's LoRA runs above; iterations per run: {iterations}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "peer.json"))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the shipped tiny model, 2 iterations (a check that it all runs)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="local-55m",
        help="local-55m: the random ~55M Llama (the top level of --out); smollm2-135m: the real "
        "instruct model (builtin:smollm2-135m), written under its own key of --out",
    )
    parser.add_argument("--iterations", type=int, help="iterations per run (default 4; smoke 2)")
    parser.add_argument("--rounds", type=int, default=2, help="A-B rounds (at least 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="completions per iteration")
    parser.add_argument("--mini-batch-size", type=int, default=8)
    parser.add_argument(
        "--ppo-epochs", type=int, default=2, help="passes over each batch (TRL: num_iterations)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--num-generations",
        type=int,
        default=4,
        help="TRL completions per prompt (batch / this = prompts per step)",
    )
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument(
        "--memory-iterations",
        type=int,
        default=2,
        help="iterations of each run of the LoRA vs full-weights memory pair (0: no pair)",
    )
    parser.add_argument("--threads", type=int, help="torch threads per run (default: torch's)")
    parser.add_argument(
        "--reward-model",
        help="a reward model folder already trained by "
        "`rlhf train-rm` on the tiny recipe (skips training one)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, Settings(**json.loads(args.settings)), Path(args.work), args.tag)
        print(MARK + json.dumps(result))
        return
    iterations = args.iterations or (2 if args.smoke else 4)
    if args.rounds < 2 or iterations < 2:
        parser.error("--rounds and --iterations must be at least 2 (iteration 1 is warm-up)")
    if args.memory_iterations < 0:
        parser.error("--memory-iterations must be 0 (no memory pair) or more")
    if args.batch_size % args.mini_batch_size or args.batch_size % args.num_generations:
        parser.error("--mini-batch-size and --num-generations must divide --batch-size")
    if args.num_generations < 2:
        parser.error("--num-generations must be at least 2 (RLOO's leave-one-out baseline)")
    for key, value in {
        "RLHF_CLI_CACHE": str(ROOT / ".cache" / "rlhf-cli"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)

    from rlhf_cli.tracking import quiet_libraries

    quiet_libraries()
    load_at_start = os.getloadavg()
    if load_at_start[0] > 0.5:
        print(
            f"bench-peer: load average {load_at_start[0]:.2f}: other processes are running, "
            "and with all cores in use by torch the timings will be noisy",
            file=sys.stderr,
        )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-peer-") as tmp:
        work = Path(tmp)
        if args.smoke:
            from rlhf_cli.tiny import tiny_lm_path

            model, model_name = str(tiny_lm_path()), "builtin:tiny-lm (shipped, random weights)"
        elif args.policy == "smollm2-135m":
            from rlhf_cli.tiny import smollm2_path

            model = str(smollm2_path())
            model_name = "SmolLM2-135M-Instruct (builtin:smollm2-135m: the Q4_1 GGUF, dequantized)"
        else:
            model = str(build_local_55m(work / "local-55m"))
            model_name = f"local Llama {LOCAL_55M_CONFIG}, random weights (seed 0)"
        base = Settings(
            model=model,
            reward_model="",
            iterations=iterations,
            batch_size=args.batch_size,
            mini_batch_size=args.mini_batch_size,
            ppo_epochs=args.ppo_epochs,
            max_new_tokens=args.max_new_tokens,
            num_generations=args.num_generations,
            lora_r=args.lora_r,
            threads=args.threads,
        )
        if args.reward_model:
            rm = {"path": str(Path(args.reward_model).resolve()), "trained_here": False}
        else:
            rm = {**spawn("train-rm", base, work / "rm", "train-rm"), "trained_here": True}
        s = Settings(**{**asdict(base), "reward_model": rm["path"]})

        runs: list[dict[str, Any]] = []
        for n in range(1, args.rounds + 1):
            for kind in ("ours", "trl"):
                runs.append({"round": n, **spawn(kind, s, work / f"{kind}-{n}", f"{kind}-{n}")})
        mem_s = Settings(**{**asdict(s), "iterations": args.memory_iterations})
        memory = {
            kind: spawn(kind, mem_s, work / f"mem-{kind}", f"mem-{kind}")
            for kind in ("ours", "ours-full")
            if args.memory_iterations
        }
        facts = model_facts(s)
        recipe = recipe_facts(s, work)

    import torch

    ours = [r for r in runs if r["impl"] == "ours"]
    theirs = [r for r in runs if r["impl"] == "trl"]
    pairs = list(zip(ours, theirs, strict=True))
    ratio = [round(a["iteration_s_median"] / b["iteration_s_median"], 3) for a, b in pairs]
    tok_ratio = [
        round(a["tokens_generated_per_s"] / b["tokens_generated_per_s"], 3) for a, b in pairs
    ]
    rss_ratio = [round(a["peak_rss_mb"] / b["peak_rss_mb"], 3) for a, b in pairs]
    command = "python bench/bench_peer.py " + " ".join(sys.argv[1:])
    report = {
        "what": "\n\n".join(__doc__.split("\n\n")[1:5]),
        "command": command.strip(),
        "smoke": args.smoke,
        "settings": {
            "policy": model_name,
            "policy_parameters": facts["parameters"],
            "dtype": "float32",
            "device": "cpu",
            "lora": facts["lora"],
            "lora_trainable_parameters": facts["lora_trainable_parameters"],
            "reward_model": {
                "what": "all-MiniLM-L6-v2 + 1-logit head trained by `rlhf "
                "train-rm` on recipes/tiny.yaml (data/tiny/preferences.jsonl)",
                "template": REWARD_TEMPLATE,
                **{k: v for k, v in rm.items() if k != "path"},
            },
            "prompts": recipe["prompts"],
            **recipe["optimisation"],
            "batch_size": s.batch_size,
            "mini_batch_size": s.mini_batch_size,
            "gradient_accumulation_steps": 1,
            "ppo_epochs": s.ppo_epochs,
            "trl_num_iterations": s.ppo_epochs,
            "trl_num_generations": s.num_generations,
            "prompts_per_iteration": {
                "ours": s.batch_size,
                "trl": s.batch_size // s.num_generations,
            },
            "optimizer_steps_per_iteration": s.steps_per_iteration,
            "max_new_tokens": s.max_new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "trl_gradient_checkpointing": False,
            "trl_optim": "adamw_torch",
            "iterations_per_run": s.iterations,
            "rounds": args.rounds,
            "order": [r["tag"] for r in runs],
            "threads": args.threads or ours[0]["threads"],
            "memory_iterations_per_run": args.memory_iterations,
            "seed": s.seed,
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch_threads_default": torch.get_num_threads(),
            "load_average_1m": {
                "start": round(load_at_start[0], 2),
                "end": round(os.getloadavg()[0], 2),
            },
            **versions(),
        },
        "timing_definitions": {
            "iteration_s": "ours: time/iteration_s from metrics.jsonl; trl: sum of the "
            "on_step_begin→on_step_end times of the optimizer steps that share "
            "one generation batch; medians skip iteration 1 (warm-up)",
            "step_s_median": "trl only: per optimizer step, skipping step 1",
            "tokens_generated_per_s": "completion tokens (EOS included) / generation time "
            "(ours: time/generate_s; trl: _generate_single_turn)",
            "throughput_tokens_per_s": "completion tokens / iteration_s",
            "peak_rss_mb": "getrusage ru_maxrss of the run's own process (imports, models, "
            "training; ours also its final checkpoint and adapter save)",
            "peak_rss_train_mb": "ours only: ru_maxrss just before the final checkpoint",
            "rss_before_run_ppo_mb": "ours: ru_maxrss with the libraries imported, before "
            "run_ppo loads any model",
            "rss_before_train_mb": "trl: ru_maxrss with the policy, reward model and trainer "
            "built, before trainer.train()",
            "ratios": "ours / trl per round: iteration_s > 1 means ours is slower; "
            "tokens_generated_per_s > 1 means ours generates faster",
        },
        "runs": runs,
        "medians": {
            impl: {
                key: summarize(group, key)
                for key in (
                    "iteration_s_median",
                    "generation_s_median",
                    "tokens_generated_per_s",
                    "throughput_tokens_per_s",
                    "completion_length_mean",
                    "peak_rss_mb",
                    "peak_rss_train_mb",
                )
            }
            for impl, group in (("ours", ours), ("trl", theirs))
        },
        "ratio_ours_over_trl": {
            "iteration_s": {"per_round": ratio, "median": median(ratio, 3)},
            "tokens_generated_per_s": {"per_round": tok_ratio, "median": median(tok_ratio, 3)},
            "peak_rss_mb": {"per_round": rss_ratio, "median": median(rss_ratio, 3)},
        },
    }
    if memory:
        report["memory_reference"] = memory_reference(memory, args.memory_iterations)
    report["total_wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if out.is_file() else {}
    if args.policy == "local-55m":  # the top level; the other policies' keys are kept
        written = report | {k: v for k, v in earlier.items() if k in POLICIES}
    else:
        written = earlier | {args.policy: report}
    out.write_text(json.dumps(written, indent=2) + "\n")
    print(
        f"wrote {args.out} in {report['total_wall_s']} s: ours/trl iteration time "
        f"{report['ratio_ours_over_trl']['iteration_s']['median']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
