"""One PPO check on a lent GPU: iteration time split and peak GPU memory at real model sizes.

No hub is reachable from the device machine, so the policies are locally built models with the
shapes of the recipes' hub models (random weights, the tiny tokenizer's vocabulary), and the
reward model is all-MiniLM-L6-v2 with an untrained head: the figures are about time and memory,
not learning.
- `qwen0.5b`: Qwen2.5-0.5B's shape, bf16, LoRA r=16 (recipes/qwen2.5-0.5b.yaml's PPO settings);
- `mistral7b`: Mistral-7B's shape, 4-bit NF4 with double quantisation, LoRA r=16, gradient
  checkpointing and the EOS penalty as in recipes/mistral7b.yaml, the guide's PPO batch (32 / 4 /
  accumulation 2, 4 epochs, 200 new tokens, top-p 0.9). The guide estimates ~20 GB.
- `tiny`: a smoke test of this script anywhere (CPU included).
Writes one JSON object per shape to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml
from bench_ppo import tiny_recipe_data

SHAPES = {
    "tiny": (
        "llama",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),
    "qwen0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "mistral7b": (
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
    ),
}
PPO = {
    "tiny": dict(
        batch_size=8,
        mini_batch_size=4,
        gradient_accumulation_steps=1,
        ppo_epochs=1,
        generation=dict(max_new_tokens=16),
    ),
    "qwen0.5b": dict(
        batch_size=16,
        mini_batch_size=4,
        gradient_accumulation_steps=2,
        ppo_epochs=4,
        generation=dict(max_new_tokens=128, temperature=0.8, top_p=0.9),
    ),
    "mistral7b": dict(
        batch_size=32,
        mini_batch_size=4,
        gradient_accumulation_steps=2,
        ppo_epochs=4,
        generation=dict(max_new_tokens=200, temperature=0.8, top_p=0.9),
    ),
}


def build(shape: str, folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_cli.tiny import tiny_lm_path

    kind, dims = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_path())
    config = AutoConfig.for_model(
        kind,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **dims,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # a 7B model is initialised on the GPU in seconds
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return folder


def recipe(
    shape: str, work: Path, iterations: int, backend: str = "hf", server_url: str | None = None
) -> Path:
    data = tiny_recipe_data(work, f"gpu-{shape}", iterations)
    data["run"]["device"] = "auto"
    data["sft"]["enabled"] = False
    data["model"].update(name_or_path=str(build(shape, work / shape)), dtype="bfloat16")
    if shape == "mistral7b":
        data["model"]["quantization"] = {
            "load_in_4bit": True,
            "quant_type": "nf4",
            "double_quant": True,
            "compute_dtype": "bfloat16",
        }
        data["model"]["gradient_checkpointing"] = True
        data["ppo"]["missing_eos_penalty"] = 1.0
    data["reward"] = {**data["reward"], "base_model": None, "pretrained": "builtin:minilm"}
    data["ppo"].update(PPO[shape], learning_rate=1.4e-5)
    data["ppo"]["generation"] = {**data["ppo"]["generation"], "backend": backend}  # PPO stays as is
    if backend == "vllm_server":
        data["ppo"]["generation"]["server"] = {"urls": [server_url]}
    path = work / f"{shape}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def check(shape: str, iterations: int, backend: str = "hf") -> dict:
    import torch
    from rich.console import Console

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import quiet_libraries, read_metrics

    quiet_libraries()
    with tempfile.TemporaryDirectory(prefix=f"gpu-{shape}-") as work:
        start = time.perf_counter()
        r = load_recipe(recipe(shape, Path(work), iterations, backend))
        build_s = time.perf_counter() - start
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        memory = run_ppo(r, Console(stderr=True, quiet=True))["metrics"]
        rows = read_metrics(Path(r.run.output_dir) / r.run.name / "ppo" / "metrics.jsonl")
    keys = [
        "time/rollout_s",
        "time/score_s",
        "time/logprobs_s",
        "time/update_s",
        "time/iteration_s",
    ]
    return {
        "shape": shape,
        "backend": backend,
        "iterations": len(rows),
        "build_s": round(build_s, 1),
        "ppo": {k: v for k, v in PPO[shape].items()},
        "median_s": {k: round(statistics.median(x[k] for x in rows), 3) for k in keys},
        "tokens_generated_per_s": round(
            statistics.median(x["tokens/generated_per_s"] for x in rows), 1
        ),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else None,
        **plan_beside_measured(memory),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def plan_beside_measured(metrics: dict) -> dict:
    """A stage manifest's measured peak (`max_memory_allocated` on CUDA, the RSS on the CPU)
    beside `rlhf plan`'s estimate for it, and their gap."""
    measured, planned = metrics.get("peak_memory_bytes"), metrics.get("planned_peak_bytes")
    return {
        "measured_peak_gib": round(measured / 2**30, 2) if measured else None,
        "measured_kind": metrics.get("peak_memory_kind"),
        "planned_peak_gib": round(planned / 2**30, 2) if planned else None,
        "plan_gap": round((planned - measured) / measured, 3) if measured and planned else None,
    }


def paths(shape: str) -> dict:
    """The GPU paths the CPU tests cannot show: LoRA SFT on 4-bit NF4 weights, one PPO iteration
    on that SFT (its adapter kept on the quantised base, not merged into it), then `rlhf merge`
    of the PPO adapter in bf16 and in fp16 (merged in float32, cast once, logits checked)."""
    import torch
    from rich.console import Console

    from rlhf_cli.errors import RlhfError
    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.merge import run_merge
    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.stages.sft import run_sft
    from rlhf_cli.tracking import quiet_libraries, read_metrics

    quiet_libraries()
    quiet = Console(stderr=True, quiet=True)
    out: dict = {
        "shape": shape,
        "device": str(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
    }
    with tempfile.TemporaryDirectory(prefix=f"gpu-paths-{shape}-") as work:
        path = recipe(shape, Path(work), 1)
        data = yaml.safe_load(path.read_text())
        data["sft"].update(enabled=True, epochs=1.0, full_finetune=False, save_steps=0)
        data["model"]["quantization"] = {"load_in_4bit": True, "compute_dtype": "bfloat16"}
        path.write_text(yaml.safe_dump(data))
        r = load_recipe(path)
        start = time.perf_counter()
        run_sft(r, quiet)
        out["sft_4bit_s"] = round(time.perf_counter() - start, 1)
        run_ppo(r, quiet)
        row = read_metrics(Path(r.run.output_dir) / r.run.name / "ppo" / "metrics.jsonl")[0]
        out["ppo_on_4bit_sft"] = {k: row[k] for k in ("objective/kl", "env/reward_mean")}
        for dtype in ("bfloat16", "float16"):
            merged = r.model_copy(update={"merge": r.merge.model_copy(update={"dtype": dtype})})
            try:
                metrics = run_merge(merged, quiet)["metrics"]
                out[f"merge_{dtype}"] = {**metrics, **plan_beside_measured(metrics)}
            except RlhfError as exc:
                out[f"merge_{dtype}"] = {"error": str(exc)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument(
        "--backend", choices=["hf", "vllm", "vllm_server"], default="hf", help="rollout engine"
    )
    parser.add_argument("--server-url", help="the vLLM server (--backend vllm_server)")
    parser.add_argument(
        "--paths",
        action="store_true",
        help="instead of timing PPO: 4-bit LoRA SFT, PPO on it, bf16 and fp16 merges",
    )
    parser.add_argument(
        "--recipe-to",
        type=Path,
        help="only build the (first) shape's model and recipe in this folder and print the "
        "recipe's path (for a multi-process launch of `rlhf ppo`)",
    )
    args = parser.parse_args()
    if args.recipe_to:
        shape, where = args.shapes[0], args.recipe_to
        print(recipe(shape, where, args.iterations, args.backend, args.server_url))
        return
    if args.paths:
        results = [paths(shape) for shape in args.shapes]
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results), flush=True)
        return
    results = []
    for shape in args.shapes:
        iterations = args.iterations if shape != "mistral7b" else 1
        results.append(check(shape, iterations, args.backend))
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")  # keep what finished
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
