"""`rlhf serve`'s command line (`serve_command`): what the client needs of the server, per
device and policy: LoRA at the recipe's rank, processed log-probs, lengths for the recipe's
longest prompt and answer, eager float32 on the CPU, and on GPUs the NCCL weight-transfer
config for a full-weight policy whose weights may travel over NCCL."""

from __future__ import annotations

import json

import pytest

from rlhf_cli.recipe import load_recipe
from rlhf_cli.stages.serve import ServeSettings, serve_command

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
