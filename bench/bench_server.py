"""`make bench-server`: PPO iteration time and generated tokens/s with the colocated vLLM engine,
a vLLM server (`rlhf serve`), and the server with `async_steps: 1` → bench/server.json.

The policy is the locally built ~55M-parameter Llama with LoRA (bench_ppo's `local-55m`: GAE, the
value head on the policy, the tiny run's reward model); every configuration runs the same PPO
settings for `--iterations` iterations, each in its own process. How the 2 cores are shared
(`taskset`, and each side's OpenMP threads to match):
- `colocated-2cores`: the trainer and its in-process engine on both cores (all of this machine);
- `colocated-1core`: the same on core 0 alone (the trainer's share in the server runs);
- `server-1+1cores`: the trainer on core 0, `rlhf serve` on core 1 (a GPU of its own, in
  miniature);
- `server-async-1+1cores`: the same with `ppo.generation.async_steps: 1` (and `tis_cap: 2`).

Figures are medians over iterations 2..N (the first includes warm-up). `rollout_s` is what the
loop waited for its answers (sync included); `generate_s` what generating them took (with
`async_steps` in a thread, overlapping the update).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bench_ppo import ROOT, recipe_for

KEYS = ["time/iteration_s", "time/rollout_s", "time/generate_s", "time/update_s",
        "tokens/generated_per_s", "rollout/staleness"]  # fmt: skip
CONFIGS = {
    "colocated-2cores": {"trainer": "0,1", "server": None, "generation": {"backend": "vllm"}},
    "colocated-1core": {"trainer": "0", "server": None, "generation": {"backend": "vllm"}},
    "server-1+1cores": {"trainer": "0", "server": "1", "generation": {}},
    "server-async-1+1cores": {
        "trainer": "0", "server": "1", "generation": {"async_steps": 1, "tis_cap": 2.0},
    },
}  # fmt: skip


def pinned(cores: str) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that keep a process (and its OpenMP threads) on
    `cores`."""
    threads = str(len(cores.split(",")))
    env = {"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": cores.replace(",", "|")}
    return ["taskset", "-c", cores], env


def serve(recipe: Path, port: int, cores: str, log: Path) -> subprocess.Popen:
    """`rlhf serve` on `cores`, once it prints its --set line."""
    prefix, env = pinned(cores)
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", "rlhf_cli.cli", "serve", "--recipe", str(recipe),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env={**os.environ, **env},
    )  # fmt: skip
    for line in process.stdout:  # type: ignore[union-attr]
        if line.startswith("rlhf ppo --set"):
            return process
    process.wait()
    tail = "\n".join(log.read_text().splitlines()[-30:])
    raise RuntimeError(f"rlhf serve exited ({process.returncode}):\n{tail}")


def run(name: str, base: Path, work: Path, port: int) -> dict:
    config = CONFIGS[name]
    data = yaml.safe_load(base.read_text())
    data["run"]["name"] = f"bench-server-{name}".replace("+", "and")  # run names: [A-Za-z0-9._-]
    generation = {**config["generation"]}
    if config["server"]:
        generation.update(backend="vllm_server", server={"urls": [f"http://127.0.0.1:{port}"]})
    data["ppo"]["generation"].update(generation)
    recipe = work / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    server = (
        serve(recipe, port, config["server"], work / f"{name}.serve.log")
        if (config["server"])
        else None
    )
    try:
        prefix, env = pinned(config["trainer"])
        start = time.perf_counter()
        subprocess.run(
            [*prefix, sys.executable, "-m", "rlhf_cli.cli", "ppo", "--recipe", str(recipe),
             "--quiet"],
            check=True, env={**os.environ, **env},
        )  # fmt: skip
        wall = time.perf_counter() - start
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    metrics = work / "runs" / data["run"]["name"] / "ppo" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = rows[1:]
    return {
        "config": name,
        "trainer_cores": config["trainer"],
        "server_cores": config["server"],
        "iterations": len(rows),
        "wall_s": round(wall, 1),
        "median": {k: round(statistics.median(r[k] for r in steady), 4) for k in KEYS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "server.json"))
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--port", type=int, default=8077)
    args = parser.parse_args()
    os.environ.setdefault("RLHF_CLI_CACHE", str(ROOT / ".cache" / "rlhf-cli"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-server-") as folder:
        work = Path(folder)
        tiny = recipe_for("tiny", work, 1)  # the reward model the 55M policy is scored by
        for stage in ("sft", "train-rm"):
            subprocess.run(
                [sys.executable, "-m", "rlhf_cli.cli", stage, "--recipe", str(tiny), "--quiet"],
                check=True,
            )
        base = recipe_for("local-55m", work, args.iterations)
        ppo = yaml.safe_load(base.read_text())["ppo"]
        results = [run(name, base, work, args.port) for name in CONFIGS]
    out = {
        "what": __doc__.splitlines()[0],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "policy": "local-55m (bench_ppo.py), LoRA",
        "settings": {k: ppo.get(k) for k in ("batch_size", "mini_batch_size", "ppo_epochs")},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
