"""How the loop's batch is spread over processes, and the collectives that make every statistic
the global batch's: a run on N processes takes the optimiser steps of one process on the whole
batch (tests/stages/test_sharded_ppo.py checks it under DDP, FSDP2 and ZeRO).

Process `rank` of `world` holds rows rank, rank + world, ... of the global batch.

Every decision that all processes act on is agreed here, never in its caller, and each of these
is a collective every process reaches at the same point: `main_decides` (what the main process
alone measured or keeps: the audit's flags, the held-out evaluation, the best checkpoint, a
rollback's target, a non-finite stop), `any_process` (a signal any process may receive: a stop
asked for) and `answered_everywhere` (generation that may fail on one process only: a lost
rollout server ends every process's run, together).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from accelerate.utils import broadcast_object_list, gather_object
from torch import Tensor

from rlhf_cli.errors import GenerationServerLost, ProcessLostError
from rlhf_cli.ppo import core
from rlhf_cli.resume import PPO_CHECKPOINT, checkpoint_folders

GlobalRows = Callable[[Callable[[Tensor], Tensor], Tensor], Tensor]
T = TypeVar("T")


def prompt_rows(
    acc: Any, pool: int, batch_size: int, num_generations: int, sampler: torch.Generator
) -> list[int]:
    """This process's share of `batch_size` prompt indices into a pool of `pool` (the same
    draw on every process): batch_size / k prompts, each on k = `num_generations` consecutive
    rows (a group)."""
    n = batch_size // num_generations
    draws: list[int] = []
    while len(draws) < n:  # epochs over the prompt pool when it is smaller than a batch
        draws.extend(torch.randperm(pool, generator=sampler).tolist())
    rows = [i for i in draws[:n] for _ in range(num_generations)]
    return rows[acc.process_index :: acc.num_processes]


def global_sum(acc: Any) -> core.Reducer:
    """Sums over every process (an all-reduce), so whitening and statistics are those of the
    global batch; None on one process."""
    if acc.num_processes == 1:
        return None
    return lambda t: acc.reduce(t.to(acc.device).contiguous(), "sum").to(t.device)


def global_rows(acc: Any) -> GlobalRows:
    """`apply(fn, local)`: `fn` on the global batch's rows in order, and this process's rows of
    the result: how a group statistic sees every member of a group, wherever it was
    generated."""
    world, rank = acc.num_processes, acc.process_index

    def apply(fn: Callable[[Tensor], Tensor], local: Tensor) -> Tensor:
        if world == 1:
            return fn(local)
        gathered = acc.gather(local.to(acc.device).contiguous()).view(world, -1)
        out = fn(gathered.t().reshape(-1)).view(-1, world)
        return out[:, rank].to(local.device)

    return apply


def minibatch_rows(
    batch_size: int, mini_batch_size: int, world: int, rank: int, generator: torch.Generator
) -> list[Tensor]:
    """This process's rows (indices into its share of the batch) of each mini-batch of one
    epoch, in order.

    Global mini-batch k takes one row of each residue class modulo `mini_batch_size`, every
    class's rows in a random order (`generator` draws alike on every process). The rows were
    drawn in random order (`prompt_rows`), so this is as good as a uniform reshuffle; and it
    splits every mini-batch into the same rows, evenly, for any number of processes dividing
    `mini_batch_size`: N processes take the optimiser steps of one."""
    groups = batch_size // mini_batch_size
    order = torch.stack(
        [torch.randperm(groups, generator=generator) for _ in range(mini_batch_size)], dim=1
    )
    rows = order * mini_batch_size + torch.arange(mini_batch_size)  # (groups, mb), global
    return [r[r % world == rank] // world for r in rows]


class Shares(NamedTuple):
    """This process's part of a global mini-batch, each share times the number of processes: a
    mean over this process's part, multiplied by its share, averages over the processes (as
    DDP, DeepSpeed and FSDP average gradients) to the mean over the whole mini-batch."""

    loss: float  # of the units `ppo.loss_aggregation` averages over (core.aggregation_units)
    tokens: float  # of the response tokens (the token means logged: clip fractions, entropy)
    all_finite: bool  # every process's loss is finite


def minibatch_shares(acc: Any, loss: Tensor, mask: Tensor, aggregation: str) -> Shares:
    """This process's `Shares` of the global mini-batch whose rows here have response `mask`
    (b_mb, r) and loss `loss`: one all-reduce.

    Weighted so, a loss aggregated as `aggregation` over this process's rows gives the loss and
    gradient one process would compute on the whole mini-batch, whatever the split of tokens
    and responses between processes (tests/unit/test_ppo_core.py checks each aggregation)."""
    units = core.aggregation_units(mask, aggregation).to(acc.device)
    tokens = mask.sum().float().to(acc.device)
    nonfinite = (~torch.isfinite(loss.detach())).float().to(acc.device)
    total_units, total_tokens, bad = acc.reduce(
        torch.stack([units, tokens, nonfinite]), "sum"
    ).tolist()
    world = acc.num_processes
    return Shares(
        float(units) * world / max(total_units, 1.0),
        float(tokens) * world / max(total_tokens, 1.0),
        bad == 0,
    )


def gather_mean_std(acc: Any, x: Tensor) -> tuple[float, float]:
    """Mean and standard deviation of `x` over every process's rows."""
    allx = acc.gather(x.float().contiguous())
    return float(allx.mean()), float(allx.std()) if allx.numel() > 1 else 0.0


def global_max(acc: Any, values: dict[str, float]) -> dict[str, float]:
    """Each value's maximum over the processes (one all-reduce): the slowest process sets the
    pace."""
    maxima = acc.reduce(torch.tensor(list(values.values()), device=acc.device), "max")
    return dict(zip(values, maxima.tolist(), strict=True))


def any_process(acc: Any, flag: bool) -> bool:
    """Whether `flag` holds on any process (every process must call it)."""
    return bool(acc.reduce(torch.tensor(float(flag), device=acc.device), "max").item())


def main_decides(acc: Any, decide: Callable[[], T]) -> T:
    """`decide()` on the main process, its answer on every process (a broadcast every process
    must reach at the same point): a decision taken from what the main process alone holds (its
    audit report, the evaluations it logged, `run.best`, the checkpoints it wrote) is acted on
    alike everywhere. The others never call `decide`. Should `decide` raise, the main process
    still reaches the broadcast, so the others raise too instead of waiting in it."""
    if acc.num_processes == 1:
        return decide()
    answer: list[Any] = [None, None]  # the decision, or the main process's failure
    if acc.is_main_process:
        try:
            answer = [decide(), None]
        except BaseException as exc:
            broadcast_object_list([None, f"{type(exc).__name__}: {exc}"])
            raise
    decision, failure = broadcast_object_list(answer)
    if failure is not None:
        raise RuntimeError(f"the main process failed while deciding for all: {failure}")
    return decision


def answered_everywhere(acc: Any, generate: Callable[[], T]) -> T:
    """`generate()` on this process, then one collective every process reaches whether its own
    call failed or not: a rollout server lost on any process (`GenerationServerLost`) is raised
    on every process, with the first such process's message, so that all of them take the
    lost-server path (checkpoint, exit 2) together instead of one waiting in a checkpoint's
    barrier while the others wait in the rollout's gather."""
    answer, failure = None, None
    try:
        answer = generate()
    except GenerationServerLost as exc:
        failure = str(exc)
    if acc.num_processes > 1:
        failure = next((f for f in gather_object([failure]) if f is not None), None)
    if failure is not None:
        raise GenerationServerLost(failure)
    return answer


def scalar(x: Any) -> float:
    """A gradient norm as a float: a tensor, a DTensor (FSDP2) or DeepSpeed's float."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x) if x is not None else float("nan")


# What a collective raises when a peer is gone: gloo's transport errors (a closed or reset
# connection, or its timeout, 30 min by default) name their source file; NCCL's come as DistError.
LOST_PEER_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective's report that another process is gone."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in LOST_PEER_MARKERS)


@contextmanager
def lost_process_as_error(acc: Any, checkpoints: Path) -> Iterator[None]:
    """A collective that fails because another process is gone (a machine died, was stopped, or
    lost the network) becomes one line naming the newest checkpoint and the command that
    continues from it; the stage's manifest then says `failed` and `--resume` accepts it."""
    try:
        yield
    except RuntimeError as exc:
        if acc.num_processes == 1 or not lost_peer(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = first.split("] ", 1)[-1].split(". ")[0]  # gloo's "[file:line] What. Hint."
        saved = checkpoint_folders(checkpoints, PPO_CHECKPOINT)
        then = (
            f"its newest checkpoint is {saved[-1].name}: once every machine is back, start the "
            "same launch on each with `rlhf ppo --resume`"
            if saved
            else "no checkpoint yet: once every machine is back, start the same launch again"
        )
        raise ProcessLostError(
            f"another process of this {acc.num_processes}-process run is gone or unreachable "
            f"({reason}); {then}"
        ) from None
