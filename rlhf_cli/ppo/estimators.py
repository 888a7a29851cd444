"""The advantage estimators' functions, attached to the names and flags the recipe declares
(`recipe.names.ESTIMATORS`: whether each needs a critic and compares a prompt's completions):
each maps the per-token KL-shaped rewards to (advantages, returns). The maths is in core.py;
statistics are the global batch's (`reduce_sum` sums over processes, `across` applies a
function to every row of the global batch, wherever it was generated: ppo/distributed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rlhf_cli.ppo import core
from rlhf_cli.ppo.distributed import GlobalRows
from rlhf_cli.recipe import PpoSection, names


class Batch(NamedTuple):
    """What an estimator reads, each (b, r) on this process's rows."""

    rewards: Tensor  # per-token, KL-shaped
    values: Tensor  # the critic's at rollout time (zeros without one)
    mask: Tensor  # response tokens


Fn = Callable[[Batch, PpoSection, core.Reducer, GlobalRows], tuple[Tensor, Tensor]]


class Estimator(NamedTuple):
    needs_critic: bool
    grouped: bool
    fn: Fn  # (advantages, returns) of a batch


def gae(
    b: Batch, cfg: PpoSection, reduce_sum: core.Reducer, across: GlobalRows
) -> tuple[Tensor, Tensor]:
    """GAE on the critic's values, advantages whitened (Huang et al. details 5-7)."""
    advantages, returns = core.compute_gae(b.values, b.rewards, b.mask, cfg.gamma, cfg.lam)
    return core.masked_whiten(advantages, b.mask, reduce_sum=reduce_sum), returns


def reinforce_pp(
    b: Batch, cfg: PpoSection, reduce_sum: core.Reducer, across: GlobalRows
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: the KL-shaped token returns, whitened over the batch."""
    advantages = core.reinforce_pp_advantages(b.rewards, b.mask, cfg.gamma, reduce_sum)
    return advantages, torch.zeros_like(b.rewards)


def _grouped(
    group: Callable[[Tensor, int], Tensor],
) -> Fn:
    """A group statistic of each completion's summed reward, on every token of it."""

    def fn(
        b: Batch, cfg: PpoSection, reduce_sum: core.Reducer, across: GlobalRows
    ) -> tuple[Tensor, Tensor]:
        per_response = across(lambda r: group(r, cfg.num_generations), b.rewards.sum(1))
        return per_response[:, None] * b.mask, torch.zeros_like(b.rewards)

    return fn


FUNCTIONS: dict[str, Fn] = {
    "gae": gae,
    "rloo": _grouped(core.leave_one_out_advantages),
    "grpo": _grouped(core.group_normalized_advantages),
    "reinforce_pp": reinforce_pp,
}
ESTIMATORS: dict[str, Estimator] = {
    name: Estimator(*flags, fn=FUNCTIONS[name]) for name, flags in names.ESTIMATORS.items()
}


def estimator(name: str) -> Estimator:
    """The table's row for `name`; an unknown name is an error, never a default."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown ppo.advantage_estimator {name!r}; one of {', '.join(ESTIMATORS)}"
        ) from None
