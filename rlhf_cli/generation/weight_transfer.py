"""vLLM's NCCL weight transfer from the trainer's side (`server.weight_transfer: nccl`): the
policy's merged weights sent GPU to GPU to a server started with `--weight-transfer-config
'{"backend": "nccl"}'`, through vLLM's own trainer-side engine (`NCCLTrainerWeightTransferEngine`,
vLLM 0.32): this process is rank 0 of a group with the server's workers; the engine drives the
control plane (`/init_weight_transfer_engine` once; `/start_weight_update`, `/update_weights`
beside the broadcast, `/finish_weight_update` every sync) through `SyncClient`. vLLM is
imported only when a transfer opens. Every step that waits on the group (the rendezvous, each
broadcast) runs `within` a deadline: NCCL has none of its own that ends a wait on a server that
died."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from rlhf_cli.generation.vllm import has_vllm, merged_weights
from rlhf_cli.recipe import ServerSection

CONNECT_TIMEOUT_S = 10.0  # finding the address the server reaches this machine at
T = TypeVar("T")


def weight_transfer(server: ServerSection) -> Literal["disk", "nccl"]:
    """How `sync: weights` moves the weights: `server.weight_transfer`, where `auto` is NCCL
    for one training process on CUDA with the vllm package at hand, else the shared folder."""
    if server.weight_transfer != "auto":
        return server.weight_transfer
    one = int(os.environ.get("WORLD_SIZE", "1")) == 1
    return "nccl" if one and torch.cuda.is_available() and has_vllm() else "disk"


@dataclass
class SyncClient:
    """vLLM's `VLLMWeightSyncClient` (a structural protocol) over the servers' client: `post`
    asks one server each step once (a retried NCCL step would leave the two sides out of
    step), within its timeout."""

    post: Callable[[str, dict[str, Any]], Any]

    def _step(self, path: str, body: dict[str, Any]) -> None:
        self.post(path, body)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._step("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._step("/start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        self._step("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._step("/finish_weight_update", {"weight_version": weight_version})


@dataclass
class PolicyWeights:
    """vLLM's `WeightSource` (what the NCCL engine reads): the policy's merged weights by the
    base model's names, on its device; `metadata` declares what iterating yields, in order."""

    model: Any

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in merged_weights(self.model)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return merged_weights(self.model)


def open_nccl_transfer(url: str, client: SyncClient, source: PolicyWeights, workers: int) -> Any:
    """vLLM's trainer-side NCCL engine (`NCCLTrainerWeightTransferEngine`), its group opened
    with the server's `workers` (tensor x pipeline x data parallel): this process is rank 0 and
    the master of the rendezvous, on the address the server reaches it at."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    info = NCCLTrainerInitInfo(
        master_address=address_towards(url), master_port=free_port(), world_size=workers + 1,
        rank=0,
    )  # fmt: skip
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def within(seconds: float, step: Callable[[], T], what: str) -> T:
    """`step()`, waited for at most `seconds` (`TimeoutError` naming `what` past them). It runs
    in a daemon thread on the caller's CUDA device: a collective whose peer died never
    returns, and no NCCL call can stop it; the thread is left behind and never delays exit."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    outcome: dict[str, Any] = {}

    def run() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        try:
            outcome["value"] = step()
        except BaseException as exc:  # noqa: BLE001 — raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="weight-transfer", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def address_towards(url: str) -> str:
    """This machine's address on the route to `url`'s host (what the server dials back)."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    with socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S) as sock:
        return sock.getsockname()[0]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
