"""Rollout engines compared: transformers `generate` against vLLM, on one machine, alternated.

Runs in an environment with vLLM (`make bench-gen` uses `.venv-vllm`). On the 56M local model
(bench_ppo's `local-55m`: 12 layers, hidden 640) and 32 chat-formatted tiny-recipe prompts, with
the tiny recipe's sampling (temperature 1, top-p 0.9), each child process measures one engine:
- `fixed`: every response exactly `--tokens` long (HF `min_new_tokens`, vLLM `min_tokens`);
- `mixed`: responses end at a stop token (`--tokens` at most), through the rollout interface
  PPO uses (`HFGenerator` / `VLLMGenerator`, rows seeded). The random 56M model never says EOS,
  so forty ordinary token ids count as stops too: responses of mixed lengths, as in training;
- `ppo`: PPO iterations of the 56M recipe with `ppo.generation.backend` set to the engine (the
  first iteration, with vLLM's warm-up, is left out of the median).
Tokens/s count generated tokens after one warm-up call. Children run hf, vllm, hf, vllm, ...
(`--rounds`), each in its own process, so a machine busy for a while slows both alike.
Writes `bench/generation.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ppo import ROOT, tiny_recipe_data  # noqa: E402

from rlhf_cli.tiny import build_local_55m  # noqa: E402

ENGINES = ("hf", "vllm")


def prompts(n: int) -> list[str]:
    lines = (ROOT / "data" / "tiny" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines][:n]


def engine(kind: str, model_dir: Path, work: Path) -> tuple[Any, Any, Any]:
    """(tokenizer, policy with a fresh LoRA, the rollout engine of `kind`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhf_cli.generation import generator_for
    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.recipe import GenerationSection

    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"])).eval()
    if kind == "hf":
        return tokenizer, policy, generator_for(policy, tokenizer)
    from rlhf_cli.generation.vllm import vllm_generator

    gen = GenerationSection()
    generator = vllm_generator(
        policy, tokenizer, gen, 512, seed=0, scratch=work, dtype=torch.float32
    )
    return tokenizer, policy, generator


def fixed_length(kind: str, tokenizer: Any, policy: Any, gen: Any, queries: list, n: int) -> float:
    """Tokens/s when every response is `n` tokens long."""
    import torch

    from rlhf_cli.generation import left_pad

    if kind == "vllm":
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, top_p=0.9, seed=0)
        run = lambda: gen.llm.generate(  # noqa: E731
            [{"prompt_token_ids": q} for q in queries], params, use_tqdm=False
        )
    else:
        ids, mask = left_pad(queries, tokenizer.pad_token_id, torch.device("cpu"))

        def run() -> Any:
            with torch.inference_mode():
                return policy.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=True, top_p=0.9, temperature=1.0, top_k=0,
                    pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip

    run()  # warm-up
    start = time.perf_counter()
    run()
    return len(queries) * n / (time.perf_counter() - start)


def mixed_length(gen: Any, queries: list, n: int) -> tuple[float, float]:
    """(tokens/s, mean response length) when responses end at their stop token."""
    from rlhf_cli.recipe import GenerationSection

    settings = GenerationSection(max_new_tokens=n, temperature=1.0, top_p=0.9)
    seeds = list(range(len(queries)))
    gen.stop_ids = [*gen.stop_ids, *range(100, 140)]  # mixed lengths from a random model
    gen.generate(queries, settings, seeds)  # warm-up
    start = time.perf_counter()
    out = gen.generate(queries, settings, seeds)
    tokens = float(out.response_mask.sum())
    return tokens / (time.perf_counter() - start), tokens / len(queries)


def ppo_iterations(kind: str, work: Path, model_dir: Path, iterations: int) -> dict[str, float]:
    """Median seconds of PPO iterations 2.. on the 56M recipe with `kind` rollouts."""
    import yaml
    from rich.console import Console

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import read_metrics

    data = tiny_recipe_data(work, f"gen-{kind}", iterations)
    data["model"]["name_or_path"] = str(model_dir)
    data["sft"]["enabled"] = False
    data["reward"] = {**data["reward"], "base_model": None, "pretrained": "builtin:minilm"}
    data["ppo"]["generation"]["backend"] = kind
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"gen-{kind}.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    run_ppo(recipe, Console(stderr=True, quiet=True))
    rows = read_metrics(Path(recipe.run.output_dir) / recipe.run.name / "ppo" / "metrics.jsonl")
    steady = rows[1:] or rows
    keys = ("time/iteration_s", "time/rollout_s", "tokens/generated_per_s")
    return {k: round(statistics.median(r[k] for r in steady), 3) for k in keys}


def child(kind: str, work: Path, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from rlhf_cli.generation import tokenize_prompts
    from rlhf_cli.tracking import quiet_libraries

    quiet_libraries()
    tokenizer, policy, gen = engine(kind, model_dir, work / f"{kind}-engine")
    queries = tokenize_prompts(tokenizer, prompts(args.prompts), chat=True, max_tokens=64)
    mixed_tps, mixed_len = mixed_length(gen, queries, args.tokens)
    fixed_tps = fixed_length(kind, tokenizer, policy, gen, queries, args.tokens)
    del gen, policy
    return {
        "engine": kind,
        "fixed_tokens_per_s": round(fixed_tps, 1),
        "mixed_tokens_per_s": round(mixed_tps, 1),
        "mixed_length_mean": round(mixed_len, 1),
        "ppo": ppo_iterations(kind, work / f"{kind}-ppo", model_dir, args.iterations),
    }


def spawn(kind: str, work: Path, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--work", str(work),
           "--model", str(model_dir), "--tokens", str(args.tokens),
           "--prompts", str(args.prompts), "--iterations", str(args.iterations)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{kind} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "generation.json"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.child:
        work = Path(tempfile.mkdtemp(dir=args.work))
        print(json.dumps(child(args.child, work, Path(args.model), args)))
        return
    os.environ.setdefault("RLHF_CLI_CACHE", str(ROOT / ".cache" / "rlhf-cli"))
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-gen-") as tmp:
        model_dir = build_local_55m(Path(tmp) / "local-55m")
        for _ in range(args.rounds):
            for kind in ENGINES:
                runs.append(spawn(kind, Path(tmp), model_dir, args))
                print(json.dumps(runs[-1]), file=sys.stderr)
    report = {"machine": machine(), "settings": vars(args) | {"model": "local-55m"}, "runs": runs}
    report["median"] = {kind: medians([r for r in runs if r["engine"] == kind]) for kind in ENGINES}
    hf, vllm = report["median"]["hf"], report["median"]["vllm"]
    report["vllm_over_hf"] = {k: round(vllm[k] / hf[k], 3) for k in hf}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    flat = [
        {**{k: v for k, v in r.items() if isinstance(v, float)},
         **{f"ppo_{k.split('/')[-1]}": v for k, v in r["ppo"].items()}}
        for r in runs
    ]  # fmt: skip
    return {k: round(statistics.median(f[k] for f in flat), 3) for k in flat[0]}


def machine() -> dict[str, Any]:
    import torch

    versions = {}
    for name in ("vllm", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    facts = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}
    return facts | versions


if __name__ == "__main__":
    main()
