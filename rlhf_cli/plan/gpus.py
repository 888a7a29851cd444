"""The machine a plan runs on: the GPU table (`--gpu`), `--memory` sizes, and the `Target` the
byte and time formulas read (memory, compute and bandwidth, CUDA or CPU, processes, sharding)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from rlhf_cli.errors import RlhfError

GIB = 1024**3
MIB = 1024**2
Sharding = Literal["none", "zero2", "zero3", "fsdp"]
SHARDINGS: tuple[str, ...] = ("none", "zero2", "zero3", "fsdp")


@dataclass(frozen=True)
class Gpu:
    """A GPU's figures: memory as `nvidia-smi` reports it, dense bf16 tensor TFLOPS (fp16 on
    the T4, which has no bf16) and memory bandwidth, from the vendors' spec sheets."""

    memory_bytes: int
    tflops: float
    bandwidth_gbs: float
    bf16: bool = True


GPUS: dict[str, Gpu] = {
    "T4": Gpu(15360 * MIB, 65.0, 320.0, bf16=False),
    "A10G": Gpu(23028 * MIB, 70.0, 600.0),
    "L4": Gpu(23034 * MIB, 121.0, 300.0),
    "RTX-4090": Gpu(24564 * MIB, 165.0, 1008.0),
    "A100-40GB": Gpu(40960 * MIB, 312.0, 1555.0),
    "A100-80GB": Gpu(81920 * MIB, 312.0, 2039.0),
    "H100": Gpu(81559 * MIB, 989.0, 3350.0),
    "H200": Gpu(143771 * MIB, 989.0, 4800.0),
}


def find_gpu(name: str) -> Gpu:
    """The table's GPU called `name`, matched without case, spaces or dashes (`a100-40gb`,
    `RTX 4090`, `4090`)."""
    wanted = re.sub(r"[^a-z0-9]", "", name.lower())
    for key, gpu in GPUS.items():
        plain = re.sub(r"[^a-z0-9]", "", key.lower())
        if wanted in (plain, plain.removeprefix("rtx")):
            return gpu
    raise RlhfError(f"unknown GPU '{name}': choose one of {', '.join(GPUS)} or pass --memory")


def parse_bytes(text: str) -> int:
    """`24GiB` or `24G` (powers of 1024), `24GB` (powers of 1000), `512MiB`, or bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([KMGT])(i?)(B?))?\s*", text, re.I)
    if match is None:
        raise RlhfError(f"--memory {text}: write it as a size such as 24GiB, 40GB or 512MiB")
    number, prefix, binary, unit = match.groups()
    power = " KMGT".index((prefix or " ").upper())
    base = 1000 if unit and not binary else 1024
    return int(float(number) * base**power)


@dataclass(frozen=True)
class Target:
    """Where the plan runs: the memory there (None: unknown, nothing to fit), peak compute and
    bandwidth, whether it is a CUDA GPU (the CPU: no CUDA context, float32 for `auto`)."""

    memory_bytes: int | None = None
    tflops: float = GPUS["A100-80GB"].tflops
    bandwidth_gbs: float = GPUS["A100-80GB"].bandwidth_gbs
    cuda: bool = True
    bf16: bool = True
    processes: int = 1
    sharding: Sharding = "none"
