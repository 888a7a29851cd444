"""`make bench`: PPO iteration time split, tokens per second and peak memory → bench/ppo.json.

Configurations, each in its own process (so peak RSS is its own):
- `tiny`: recipes/tiny.yaml as shipped (sft + train-rm first, then PPO);
- `local-55m`: a locally built ~55M-parameter Llama (random weights, the tiny tokenizer) as the
  policy, scored by the tiny run's reward model; same PPO settings otherwise (GAE, the value
  head shared with the policy);
- `local-55m+separate-critic`: the same with `ppo.value_model: separate` (a second backbone
  with its own LoRA, initialised from the policy);
- `local-55m+rloo`: the same critic-free (`ppo.advantage_estimator: rloo`, 4 completions per
  prompt): no value model at all. Its peak RSS against the two above is the critic's memory;
- `smollm2-135m`: a real instruct model, recipes/smollm2-135m.yaml's PPO settings as shipped
  (SmolLM2-135M-Instruct with LoRA r 16, 16 answers of at most 48 tokens, 2 epochs of
  mini-batches of 4), scored by the tiny run's reward model; no SFT (an instruct model);
- `smollm2-135m+no-kl`: the same with β 0 and fixed (`init_kl_coef: 0`, `adaptive_kl: false`):
  no reference forward in the rollout. Its log-prob time and peak RSS against the one above are
  what a no-KL run saves.

Times are medians over iterations 2..N (iteration 1 includes warm-up). `outside_share` is the
share of the iteration spent outside generation, reward scoring, the log-prob/value/reference
forwards and the update (forward + backward + optimizer): Python glue, GAE, logging, metrics.
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
from pathlib import Path

from rlhf_cli.tiny import build_local_55m

ROOT = Path(__file__).resolve().parent.parent
SPLIT = ["time/rollout_s", "time/score_s", "time/logprobs_s", "time/update_s"]


def tiny_recipe_data(work: Path, run_name: str, iterations: int, recipe: str = "tiny.yaml") -> dict:
    """recipes/tiny.yaml (or another shipped recipe on the tiny data) as a dict with absolute
    data paths, runs under `work`, no checkpoints or console blocks during the measured
    iterations."""
    import yaml

    data = yaml.safe_load((ROOT / "recipes" / recipe).read_text())
    for key in ("sft", "preferences", "prompts"):
        data["data"][key]["path"] = str(
            ROOT / "data" / "tiny" / Path(data["data"][key]["path"]).name
        )
    data["audit"]["prompts_file"] = str(ROOT / "data" / "tiny" / "audit_prompts.txt")
    data["run"].update(name=run_name, output_dir=str(work / "runs"))
    data["ppo"].update(iterations=iterations, save_freq=10_000, log_every=10_000, eval_every=None)
    return data


VARIANTS = {
    "separate-critic": {"value_model": "separate", "value_init": "policy"},
    "rloo": {"advantage_estimator": "rloo", "num_generations": 4},
    "no-kl": {"init_kl_coef": 0.0, "adaptive_kl": False},
}


def recipe_for(name: str, work: Path, iterations: int) -> Path:
    import yaml

    base, _, variant = name.partition("+")
    real = base == "smollm2-135m"
    data = tiny_recipe_data(work, "bench-tiny", iterations, f"{base}.yaml" if real else "tiny.yaml")
    if variant:
        data["ppo"].update(VARIANTS[variant])
    if base != "tiny":
        data["run"]["name"] = f"bench-{name.replace('+', '-')}"
        if not real:
            data["model"]["name_or_path"] = str(build_local_55m(work / name.replace("+", "-")))
        data["sft"]["enabled"] = False
        data["reward"] = {
            **data["reward"],
            "base_model": None,
            "pretrained": str(work / "runs" / "bench-tiny" / "rm" / "model"),
        }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def one(name: str, work: Path, iterations: int) -> dict:
    """Run in a child process: PPO on one configuration, its figures as a dict."""
    from rich.console import Console

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import quiet_libraries, read_metrics

    quiet_libraries()
    quiet = Console(stderr=True, quiet=True)
    recipe = load_recipe(recipe_for(name, work, iterations))
    if name == "tiny":
        from rlhf_cli.stages.reward import run_train_rm
        from rlhf_cli.stages.sft import run_sft

        run_sft(recipe, quiet)
        run_train_rm(recipe, quiet)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_ppo(recipe, quiet)
    rows = read_metrics(Path(recipe.run.output_dir) / recipe.run.name / "ppo" / "metrics.jsonl")
    steady = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in steady) for k in SPLIT + ["time/iteration_s"]}
    inside = sum(med[k] for k in SPLIT)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_cli.modeling import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(recipe.model.name_or_path))
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return {
        "config": name,
        "advantage_estimator": recipe.ppo.advantage_estimator,
        "value_model": recipe.ppo.value_model if recipe.ppo.advantage_estimator == "gae" else None,
        "policy_parameters": n_params,
        "iterations": len(rows),
        "settings": {
            k: getattr(recipe.ppo, k)
            for k in ("batch_size", "mini_batch_size", "ppo_epochs", "gradient_accumulation_steps")
        }
        | {
            "max_new_tokens": recipe.ppo.generation.max_new_tokens,
            "lora_r": recipe.model.lora.r,
            "device": recipe.run.device,
        },
        "median_s": {k.removeprefix("time/"): round(v, 4) for k, v in med.items()},
        "share": {
            k.removeprefix("time/").removesuffix("_s"): round(med[k] / med["time/iteration_s"], 3)
            for k in SPLIT
        },
        "outside_share": round(1 - inside / med["time/iteration_s"], 3),
        "tokens_generated_per_s": round(
            statistics.median(r["tokens/generated_per_s"] for r in steady), 1
        ),
        "response_length_mean": round(
            statistics.median(r["response/length_mean"] for r in steady), 1
        ),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_before_ppo_mb": round(rss_before / 1024, 1),
        "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)
        if torch.cuda.is_available()
        else None,
    }


CONFIGS = (
    "tiny",
    "local-55m",
    "local-55m+separate-critic",
    "local-55m+rloo",
    "smollm2-135m",
    "smollm2-135m+no-kl",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "ppo.json"))
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=CONFIGS,
        help="configurations to run (tiny first: the others use its reward model); the "
        "results of the others already in --out are kept",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, Path(args.work), args.iterations)))
        return
    os.environ.setdefault("RLHF_CLI_CACHE", str(ROOT / ".cache" / "rlhf-cli"))
    results = []
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as work:
        for name in args.configs:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    name,
                    "--work",
                    work,
                    "--iterations",
                    str(args.iterations),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), file=sys.stderr)
    import torch

    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "results": results,
    }
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if out.is_file() else {}  # bench_memory's key stays
    kept = [r for r in earlier.get("results", []) if r["config"] not in args.configs]
    report["results"] = sorted(kept + results, key=lambda r: CONFIGS.index(r["config"]))
    out.write_text(json.dumps({**earlier, **report}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
