"""`rlhf serve`'s command line (`serve_command`): what the client needs of the server, per
device and policy: LoRA at the recipe's rank, processed log-probs, lengths for the recipe's
longest prompt and answer, eager float32 on the CPU, and on GPUs the NCCL weight-transfer
config for a full-weight policy whose weights may travel over NCCL; and stopping it ends every
process it started, whatever died first."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlhf_cli.errors import ModelLoadError
from rlhf_cli.recipe import load_recipe
from rlhf_cli.stages.serve import ServeSettings, serve_command, serve_info

NCCL = ["--weight-transfer-config", json.dumps({"backend": "nccl"})]


def _command(make_recipe, overrides: dict, gpu: bool) -> tuple[list[str], dict[str, str]]:
    recipe = load_recipe(make_recipe(overrides))
    return serve_command(recipe, "/m", "/t", ServeSettings(port=8123), gpu)


def _value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _has(command: list[str], part: list[str]) -> bool:
    return any(command[i : i + len(part)] == part for i in range(len(command)))


def test_cpu_lora_server(make_recipe):
    lengths = {"data": {"prompts": {"max_tokens": 40}}, "model": {"lora": {"r": 12}},
               "ppo": {"generation": {"max_new_tokens": 30}},
               "audit": {"generation": {"max_new_tokens": 50}}}  # fmt: skip
    command, env = _command(make_recipe, lengths, gpu=False)
    assert _value(command, "--max-lora-rank") == "16"  # 12, up to a rank vLLM has
    assert _value(command, "--max-model-len") == str(40 + 50)  # the longest prompt and answer
    assert _value(command, "--logprobs-mode") == "processed_logprobs"
    assert _has(command, ["--dtype", "float32"]) and "--enforce-eager" in command
    assert not _has(command, NCCL[:1])
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]


@pytest.mark.parametrize(
    ("lora", "transfer", "nccl"),
    [(False, "auto", True), (False, "nccl", True), (False, "disk", False), (True, "auto", False)],
)
def test_gpu_server_opens_nccl_weight_transfer_for_full_weights(make_recipe, lora, transfer, nccl):
    overrides = {
        "model": {"lora": {"enabled": lora}},
        "ppo": {"generation": {"server": {"weight_transfer": transfer}}},
    }
    command, _ = _command(make_recipe, overrides, gpu=True)
    assert _has(command, NCCL) is nccl
    assert "--enforce-eager" not in command and ("--enable-lora" in command) is lora


# A stand-in for vLLM's API server: it answers its model list and starts a child that, like
# vLLM's `EngineCore` and `Worker`, ignores SIGINT and SIGTERM (the child writes its pid once
# it does).
FAKE_SERVER = """
import http.server, json, subprocess, sys
CHILD = '''
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)
'''
subprocess.Popen([sys.executable, "-c", CHILD, sys.argv[2]])

class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
"""


def _runs(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("server_died", [True, False])
def test_stopping_serve_ends_every_process_it_started(tmp_path, monkeypatch, server_died):
    """Whether the API server was killed first (SIGKILL, as seen) or is stopped with the rest,
    its child that ignores SIGINT and SIGTERM ends too: the group gets SIGKILL after the
    waits (on f41b8ed the child outlived `rlhf serve`)."""
    import signal
    import socket

    from rlhf_cli.stages import serve

    monkeypatch.setattr(
        serve, "STOP_SIGNALS", ((signal.SIGINT, 0.5), (signal.SIGTERM, 0.5), (signal.SIGKILL, 5.0))
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, "-c", FAKE_SERVER, str(port), str(pid_file)]
    url = f"http://127.0.0.1:{port}"
    child = None
    try:
        with serve.running_server(command, {}, tmp_path / "server.log", url, 30.0) as process:
            for _ in range(100):
                if pid_file.exists() and pid_file.read_text():
                    break
                time.sleep(0.1)
            child = int(pid_file.read_text())
            if server_died:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
        assert not _runs(child)
    finally:
        if child is not None and _runs(child):
            os.kill(child, signal.SIGKILL)


def test_a_tensor_parallel_size_above_the_gpus_is_refused_before_anything_starts(
    make_recipe, monkeypatch
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    recipe = load_recipe(
        make_recipe({"ppo": {"generation": {"vllm": {"tensor_parallel_size": 2}}}})
    )
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size: 2 GPUs asked for, .* has 1"):
        serve_info(recipe, ServeSettings(port=8123))
