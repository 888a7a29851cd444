"""PPO maths for language models as small, pure tensor functions.

No model, no I/O: every function maps tensors to tensors.

Shape notation: ``b`` = batch size, ``response_len`` = number of response tokens,
``t`` = sequence positions, ``vocab`` = vocabulary size.

Mask convention (one for the whole module): a mask is a bool or 0/1 tensor of shape
``(b, response_len)`` where True/1 marks a valid token. Tokens after the end of a
response (padding) are masked out. Values at masked positions never influence a
result, even when they are huge, inf or garbage.

References
----------
- [PPO] Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using
  Generalized Advantage Estimation", eq. 16.
- [Ziegler] Ziegler et al. 2019, "Fine-Tuning Language Models from Human
  Preferences", adaptive KL controller (sec. 2.2).
- [Huang] Huang et al. 2023, "The N Implementation Details of RLHF with PPO".
- [TRL] TRL's old ``ppo_trainer.py`` / ``core.py`` (``masked_whiten``,
  ``compute_advantages``, ``loss``, ``AdaptiveKLController``).
- [DAPO] Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale":
  token-level loss (eq. 8), clip-higher (sec. 3.1).
- [Dr. GRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
  sec. 3.1: the per-sequence length normalisation replaced by a constant.

Long because it is the whole of the PPO maths, one short pure function per formula, each with
its hand-checked test: split, the formulas read together would be scattered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Sums a tensor over every process (an all-reduce); None = this process's data is all there is.
# With it, the masked statistics below are those of the global batch, whatever the split.
Reducer = Callable[[Tensor], Tensor] | None

WHITEN_EPS = 1e-8


def _bool_mask(mask: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor (accepts bool or 0/1 masks)."""
    return mask if mask.dtype == torch.bool else mask != 0


# --------------------------------------------------------------------------- masked statistics


def masked_mean(
    x: Tensor, mask: Tensor, dim: int | None = None, reduce_sum: Reducer = None
) -> Tensor:
    """Mean of ``x`` over the valid (mask True) elements. [TRL ``masked_mean``]

    Args:
        x: ``(b, response_len)`` (any shape equal to ``mask``'s).
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        dim: if given, the mean is taken along this dim only (one value per row).
        reduce_sum: sums over every process (``dim`` None only): the global batch's mean.

    Returns:
        A scalar tensor, or ``(b,)`` when ``dim=1``. An all-masked row along ``dim``
        (or an all-masked input when ``dim`` is None) gives 0, not NaN.
    """
    m = _bool_mask(mask)
    total = torch.where(m, x, torch.zeros_like(x)).sum(dim=dim)
    count = m.sum(dim=dim).to(total.dtype)
    if reduce_sum is not None:
        if dim is not None:
            raise ValueError("reduce_sum needs dim=None")
        total, count = reduce_sum(torch.stack([total, count]))
    return total / count.clamp(min=1)


def masked_var(
    x: Tensor, mask: Tensor, unbiased: bool = True, reduce_sum: Reducer = None
) -> Tensor:
    """Variance of ``x`` over all valid elements (one scalar). [TRL ``masked_var``]

    Args:
        x: ``(b, response_len)``.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        unbiased: apply Bessel's correction ``n / (n - 1)``.
        reduce_sum: sums over every process: the global batch's variance (two passes, as on
            one process: the global mean first, then the squared deviations from it).

    Returns:
        Scalar tensor. With fewer than 2 valid elements the unbiased variance is
        0 (denominator clamped to 1), not NaN/inf.
    """
    m = _bool_mask(mask)
    mean = masked_mean(x, m, reduce_sum=reduce_sum)
    centered = torch.where(m, x - mean, torch.zeros_like(x))
    squares, n = (centered**2).sum(), m.sum().to(x.dtype)
    if reduce_sum is not None:
        squares, n = reduce_sum(torch.stack([squares, n]))
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return squares / denom


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, reduce_sum: Reducer = None
) -> Tensor:
    """Whiten ``x`` with statistics of its valid elements. [TRL ``masked_whiten``, Huang]

    ``whitened = (x - mean) * rsqrt(var + 1e-8)`` with mean and unbiased variance over
    the valid elements only; if ``shift_mean`` is False the mean is added back.

    Args:
        x: ``(b, response_len)``.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        shift_mean: if False, keep the original mean (used for rewards).
        reduce_sum: sums over every process: whiten with the global batch's statistics.

    Returns:
        ``(b, response_len)``; masked-out positions are 0.
    """
    m = _bool_mask(mask)
    mean = masked_mean(x, m, reduce_sum=reduce_sum)
    var = masked_var(x, m, unbiased=True, reduce_sum=reduce_sum)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------- advantages, rewards


def compute_gae(
    values: Tensor, rewards: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation per response. [GAE eq. 16, TRL, Huang]

    Computed backwards over ``response_len``::

        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = delta_t + gamma * lam * m_{t+1} * A_{t+1}

    Values and rewards at masked positions are zeroed first, so nothing leaks in
    from padding. Advantages are not whitened. No detaching is done: pass detached
    tensors if no gradient should flow.

    Args:
        values: ``(b, response_len)`` float, value estimates V_t.
        rewards: ``(b, response_len)`` float, per-token rewards r_t.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``(b, response_len)``; ``returns =
        advantages + values`` at valid positions; both are 0 at masked positions.
    """
    if values.shape[1] == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    m = _bool_mask(mask)
    mf = m.to(values.dtype)
    values = torch.where(m, values, torch.zeros_like(values))
    rewards = torch.where(m, rewards, torch.zeros_like(rewards))
    pad = torch.zeros_like(values[:, :1])
    next_mask = torch.cat([mf[:, 1:], pad], dim=1)
    next_values = torch.cat([values[:, 1:], pad], dim=1) * next_mask
    deltas = rewards + gamma * next_values - values

    last = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        last = deltas[:, t] + gamma * lam * next_mask[:, t] * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1) * mf
    returns = (advantages + values) * mf
    return advantages, returns


def _last_valid_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the last True position per row of a ``(b, response_len)`` mask.

    Returns ``(index, has_any)``, both ``(b,)``; ``index`` is 0 where ``has_any`` is
    False. Works for any mask layout, not only right-padded prefix masks.
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    idx = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    has_any = idx >= 0
    return idx.clamp(min=0), has_any


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: str,
    old_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-token estimates of KL(π‖π_ref) on tokens sampled from π. [Schulman 2020,
    "Approximating KL divergence"; GRPO (Shao et al. 2024) uses k3 in its loss]

    With ``log r = ref_logprobs - logprobs`` (r = π_ref/π at the sampled token)::

        k1 = -log r                 unbiased, can be negative per token
        k2 = (log r)^2 / 2          biased, low variance, >= 0
        k3 = (r - 1) - log r        unbiased, >= 0

    Differentiable in both arguments (the loss placement backpropagates through it). As a loss
    on tokens sampled from π_old the plain estimate has the wrong gradient: k3's is the
    gradient of KL(π_ref‖π), k1's is 0 in expectation (k2's is KL(π‖π_ref)'s). With
    ``old_logprobs`` each token's estimate is weighted by the differentiable ratio
    ``ρ = π/π_old`` (1 in value on-policy); the gradient of ``ρ·k1`` or ``ρ·k3`` is then that of
    KL(π‖π_ref), unbiased. [DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv 2512.02556, the unbiased
    KL estimate; TRL ``use_bias_correction_kl``, on by default]

    Args:
        logprobs: ``(b, response_len)`` log-probs of the policy.
        ref_logprobs: ``(b, response_len)`` log-probs of the reference.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        old_logprobs: ``(b, response_len)`` log-probs of the policy that sampled, or None.

    Returns:
        ``(b, response_len)``, 0 at masked positions.
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    if old_logprobs is not None:
        kl = kl * torch.exp(logprobs - old_logprobs)
    return torch.where(_bool_mask(mask), kl, torch.zeros_like(kl))


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor | None]:
    """Per-token rewards: KL penalty plus the score on the last token. [Ziegler, Huang, TRL]

    ``rewards = -kl_coef * kl_estimate(..., estimator)`` and ``scores[i]`` is added at the
    last valid token of row i (found as the max index where the mask is True). An all-masked
    row gets no score. The returned ``kl`` is the k1 estimate (``logprobs - ref_logprobs``),
    whatever penalises: its sum per response is what ``objective/kl`` reports.

    Args:
        scores: ``(b,)`` reward-model scores, one per response.
        logprobs: ``(b, response_len)`` log-probs of the policy.
        ref_logprobs: ``(b, response_len)`` log-probs of the reference model, or None when no
            reference ran (β = 0, a no-KL run): the rewards are then the scores alone.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        kl_coef: KL penalty coefficient beta (0: the scores alone).
        estimator: the penalty's per-token estimator (``kl_estimate``).

    Returns:
        ``(rewards, kl)``, both ``(b, response_len)``, 0 at masked positions; ``kl`` is None
        without ``ref_logprobs``.
    """
    m = _bool_mask(mask)
    if ref_logprobs is None:
        if kl_coef != 0:
            raise ValueError("a KL penalty (kl_coef != 0) needs the reference log-probs")
        rewards, kl = torch.zeros_like(logprobs), None
    else:
        kl = kl_estimate(logprobs, ref_logprobs, m, "k1")
        penalty = kl if estimator == "k1" else kl_estimate(logprobs, ref_logprobs, m, estimator)
        rewards = -kl_coef * penalty
    idx, has_any = _last_valid_index(m)
    bonus = torch.where(has_any, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    rewards = rewards.scatter_add(1, idx.unsqueeze(1), bonus.unsqueeze(1))
    return rewards, kl


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each completion's reward minus the mean reward of the other completions of its
    prompt. [Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs", eq. 5; TRL ``RLOOTrainer``]

    ``A_i = R_i - (sum_j R_j - R_i) / (k - 1)`` over the group of k = ``group_size``.

    Args:
        rewards: ``(n,)`` sequence rewards, groups of ``group_size`` consecutive rows.
        group_size: completions per prompt, at least 2.

    Returns:
        ``(n,)`` advantages.
    """
    grouped = rewards.view(-1, group_size)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).view(-1)


def group_normalized_advantages(rewards: Tensor, group_size: int, eps: float = 1e-4) -> Tensor:
    """GRPO: each completion's reward standardised within its prompt's group. [Shao et al.
    2024, "DeepSeekMath", sec. 4.1.2 (outcome supervision); TRL ``GRPOTrainer``]

    ``A_i = (R_i - mean(R_group)) / (std(R_group) + eps)``, the unbiased std as TRL takes it.

    Args:
        rewards: ``(n,)`` sequence rewards, groups of ``group_size`` consecutive rows.
        group_size: completions per prompt, at least 2.
        eps: keeps a group of equal rewards at advantage 0.

    Returns:
        ``(n,)`` advantages.
    """
    grouped = rewards.view(-1, group_size)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def reinforce_pp_advantages(
    rewards: Tensor, mask: Tensor, gamma: float, reduce_sum: Reducer = None
) -> Tensor:
    """REINFORCE++: per-token returns of the KL-shaped rewards, whitened over the batch; no
    critic. [Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", eq. 6-8; OpenRLHF ``advantage_estimator=reinforce``]

    ``G_t = sum_{s>=t} gamma^(s-t) r_s`` (GAE with V = 0 and lambda = 1), then
    ``A = (G - mean) / std`` over every valid token of the (global) batch.

    Args:
        rewards: ``(b, response_len)`` per-token rewards (``kl_penalized_rewards``).
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        gamma: discount factor.
        reduce_sum: sums over every process: whiten with the global batch's statistics.

    Returns:
        ``(b, response_len)`` advantages, 0 at masked positions.
    """
    returns, _ = compute_gae(torch.zeros_like(rewards), rewards, mask, gamma, 1.0)
    return masked_whiten(returns, mask, reduce_sum=reduce_sum)


# --------------------------------------------------------------------------- losses

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"unknown loss aggregation {aggregation!r}; one of {', '.join(LOSS_AGGREGATIONS)}"
        )


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str = "token_mean",
    norm_len: int | None = None,
) -> Tensor:
    """One scalar from a per-token loss, as ``aggregation`` weighs tokens and sequences. [verl
    ``agg_loss``; TRL ``GRPOTrainer`` ``loss_type``]

    With ``x`` the per-token loss, ``m`` the mask and i over the sequences with a valid token::

        token_mean:               sum_it m_it x_it / sum_it m_it   [DAPO eq. 8; TRL dapo, bnpo]
        seq_mean_token_mean:      mean_i (sum_t m_it x_it / sum_t m_it)   [GRPO eq. 3; TRL grpo]
        seq_mean_token_sum_norm:  mean_i (sum_t m_it x_it / norm_len)     [Dr. GRPO; TRL dr_grpo]

    ``token_mean`` weighs every token alike, so a long response weighs more; the sequence means
    weigh every response alike, and ``seq_mean_token_mean`` gives each token of a short response
    more weight than each of a long one (Dr. GRPO's length bias), which a constant
    ``norm_len`` removes.

    Args:
        per_token: ``(b, response_len)`` per-token loss.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        aggregation: one of ``LOSS_AGGREGATIONS``.
        norm_len: the constant divisor of ``seq_mean_token_sum_norm`` (the longest response
            the sampler may draw).

    Returns:
        Scalar tensor; 0 when nothing is valid.
    """
    _check_aggregation(aggregation)
    m = _bool_mask(mask)
    if aggregation == "token_mean":
        return masked_mean(per_token, m)
    per_sequence = torch.where(m, per_token, torch.zeros_like(per_token)).sum(dim=1)
    if aggregation == "seq_mean_token_mean":
        per_sequence = per_sequence / m.sum(dim=1).clamp(min=1)
    elif aggregation == "seq_mean_token_sum_norm":
        if not norm_len:
            raise ValueError("seq_mean_token_sum_norm needs norm_len > 0")
        per_sequence = per_sequence / norm_len
    return masked_mean(per_sequence, m.any(dim=1))


def aggregation_units(mask: Tensor, aggregation: str) -> Tensor:
    """How many things ``aggregate_loss(..., mask, aggregation)`` averages over: the valid tokens
    (``token_mean``) or the sequences with a valid token (the sequence means).

    The loss of a global batch split between processes is each process's loss weighted by its
    share of these units: ``sum_p units_p * loss_p / sum_p units_p``.

    Args:
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        aggregation: one of ``LOSS_AGGREGATIONS``.

    Returns:
        Scalar float tensor.
    """
    _check_aggregation(aggregation)
    m = _bool_mask(mask)
    return (m.sum() if aggregation == "token_mean" else m.any(dim=1).sum()).float()


def tis_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(exp(old_logprobs - sampler_logprobs), cap)``,
    no gradient. [Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"; verl / OpenRLHF ``tis_imp_ratio_cap``]

    The rollout engine (vLLM) drew the tokens from its own numerics, π_sampler; PPO's ratio is
    taken against the training forward's π_old. Weighting each token's surrogate by
    π_old / π_sampler corrects the gradient for that mismatch; the cap bounds its variance.

    Args:
        old_logprobs: ``(b, response_len)`` log-probs under the training forward at rollout.
        sampler_logprobs: ``(b, response_len)`` log-probs the sampler recorded.
        cap: the largest weight.
    """
    return torch.exp(old_logprobs - sampler_logprobs).clamp(max=cap).detach()


def log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """``log π − log π_old`` per token (b, r) (``level="token"``), or each response's mean of
    it over its valid tokens, (b, 1), broadcast over the tokens (``"sequence"``, GSPO's
    length-normalised sequence ratio; an empty response's is 0)."""
    diff = logprobs - old_logprobs
    if level == "token":
        return diff
    if level != "sequence":
        raise ValueError(f"unknown importance-ratio level {level!r}; token or sequence")
    m = mask.to(diff.dtype)
    return ((diff * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def uniform_groups(scores: Tensor, group_size: int) -> Tensor:
    """(n,) bool, True on every row of a group of ``group_size`` consecutive rows whose scores
    are all equal: zero spread, so a group estimator (rloo, grpo) gives them zero advantage
    and no gradient (DAPO's dynamic sampling drops them)."""
    groups = scores.view(-1, group_size)
    same = (groups == groups[:, :1]).all(dim=1)
    return same.repeat_interleave(group_size)


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float,
    weights: Tensor | None = None,
    cliprange_high: float | None = None,
    aggregation: str = "token_mean",
    norm_len: int | None = None,
    level: str = "token",
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate policy loss. [PPO eq. 7, TRL ``loss``; DAPO sec. 3.1 clip-higher;
    GSPO, Zheng et al. 2025, eq. 5-7]

    ``ratio = exp(logprobs - old_logprobs)`` per token, or with ``level="sequence"`` one per
    response, ``exp(mean over its tokens of (logprobs - old_logprobs))``, on every token of it
    (TRL's ``importance_sampling_level="sequence"``: no stop-gradient, the ratio's own gradient
    is GSPO's, ``s_i`` times the mean of the tokens' score functions);
    ``loss = aggregate(max(-A * ratio, -A * clamp(ratio, 1 - eps_low, 1 + eps_high)))``
    (the negation of PPO's min objective), ``eps_low = cliprange``, ``eps_high =
    cliprange_high`` (``cliprange`` when None: the symmetric clip).

    Args:
        logprobs: ``(b, response_len)`` log-probs under the current policy.
        old_logprobs: ``(b, response_len)`` log-probs under the rollout policy.
        advantages: ``(b, response_len)`` advantages.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        cliprange: epsilon (the lower one when ``cliprange_high`` is set).
        weights: ``(b, response_len)`` per-token weights of the surrogate (`tis_weights`), or
            None.
        cliprange_high: the upper epsilon, or None.
        aggregation, norm_len: how the per-token losses become one (``aggregate_loss``).
        level: ``"token"`` or ``"sequence"`` importance ratios (``log_ratio``).

    Returns:
        ``(loss, clipfrac)`` scalar tensors; ``clipfrac`` is the share of valid
        tokens where the clipped term is strictly the one taken (a token mean whatever the
        aggregation).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, mask, level))
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    per_token = torch.max(pg_losses, pg_losses2)
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate_loss(per_token, mask, aggregation, norm_len)
    clipfrac = masked_mean((pg_losses2 > pg_losses).to(logprobs.dtype), mask)
    return loss, clipfrac


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float,
    aggregation: str = "token_mean",
    norm_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss and its clip fraction. [TRL ``loss``, Huang]

    ``values_clipped = old_values + clamp(values - old_values, -c, c)``;
    ``loss = 0.5 * aggregate(max((values - returns)^2, (values_clipped - returns)^2))``;
    ``clipfrac = masked_mean((values_clipped - returns)^2 > (values - returns)^2)``: the share of
    tokens where the clipped term is the one taken (TRL's ``vf_clipfrac``).

    Args:
        values: ``(b, response_len)`` current value predictions.
        old_values: ``(b, response_len)`` value predictions at rollout time.
        returns: ``(b, response_len)`` GAE returns.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        cliprange_value: c.
        aggregation, norm_len: how the per-token losses become one (``aggregate_loss``).

    Returns:
        (loss, clipfrac), scalar tensors.
    """
    values_clipped = old_values + torch.clamp(
        values - old_values, -cliprange_value, cliprange_value
    )
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (values_clipped - returns) ** 2
    per_token = torch.max(vf_losses1, vf_losses2)
    loss = 0.5 * aggregate_loss(per_token, mask, aggregation, norm_len)
    return loss, masked_mean((vf_losses2 > vf_losses1).to(values.dtype), mask)


# --------------------------------------------------------------------------- logits, diagnostics


ENTROPY_CHUNK_ROWS = 128  # token positions a chunk (TRL's chunk size)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position. [TRL ``entropy_from_logits``]

    ``H = logsumexp(x) - sum(softmax(x) * x)``, at least in fp32, `ENTROPY_CHUNK_ROWS` positions
    at a time, so that the softmax's (n, vocab) temporaries exist for one chunk, not the whole
    mini-batch (at SmolLM2's 49k vocabulary, 8 answers of 32 tokens are 50 MB a copy, and the
    formula makes three). With autograd on, each chunk is recomputed in the backward pass
    instead of keeping its copies alive.

    Args:
        logits: ``(..., vocab)``.
        temperature: what the sampler divided the logits by.

    Returns:
        ``(...)``.
    """
    *lead, vocab = logits.shape
    flat = logits.reshape(-1, vocab)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, flat.shape[0], ENTROPY_CHUNK_ROWS):
        rows = flat[start : start + ENTROPY_CHUNK_ROWS]
        if recompute:
            parts.append(checkpoint(_entropy, rows, temperature, use_reentrant=False))
        else:
            parts.append(_entropy(rows, temperature))
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.cat(parts).view(lead) if parts else logits.new_zeros(lead, dtype=dtype)


def _entropy(logits: Tensor, temperature: float) -> Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        x = x / temperature
    return torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(dim=-1)


def explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, reduce_sum: Reducer = None
) -> Tensor:
    """``1 - var(returns - values) / var(returns)`` over valid elements. [Huang, TRL]

    Uses the unbiased :func:`masked_var`. Returns 0.0 when ``var(returns)`` is 0
    (instead of NaN/inf).

    Args:
        values: ``(b, response_len)`` value predictions.
        returns: ``(b, response_len)`` returns.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.
        reduce_sum: sums over every process: the global batch's variances.

    Returns:
        Scalar float tensor.
    """
    var_y = masked_var(returns, mask, reduce_sum=reduce_sum)
    var_diff = masked_var(returns - values, mask, reduce_sum=reduce_sum)
    safe = torch.where(var_y > 0, var_y, torch.ones_like(var_y))
    return torch.where(var_y > 0, 1.0 - var_diff / safe, torch.zeros_like(var_y))


def approx_kl(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Approximate KL between old and new policy: ``0.5 * mean((logp - old_logp)^2)``.

    The k2 estimator as logged in [TRL] / [Huang].

    Args:
        logprobs: ``(b, response_len)``.
        old_logprobs: ``(b, response_len)``.
        mask: ``(b, response_len)`` bool or 0/1, True = valid.

    Returns:
        Scalar tensor.
    """
    return 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask)


# --------------------------------------------------------------------------- KL controllers


class _KLController:
    """What both controllers share: the current β, and a manual raise."""

    _value: float

    @property
    def value(self) -> float:
        """Current KL coefficient."""
        return self._value

    def raise_by(self, delta: float) -> None:
        """Raise the coefficient by ``delta`` (the audit's response to reward hacking)."""
        self._value += float(delta)

    def set_to(self, value: float) -> None:
        """Set the coefficient (a rollback's correction, over the restored one)."""
        self._value = float(value)


class AdaptiveKLController(_KLController):
    """Proportional KL-coefficient controller. [Ziegler sec. 2.2, TRL]

    ``e = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        self._value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient towards ``target`` after ``n_steps`` samples."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self._value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """State for checkpointing."""
        return {"value": self._value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: dict[str, float]) -> None:
        """Restore state saved by :meth:`state_dict`."""
        self._value = float(d["value"])
        self.target = float(d.get("target", self.target))
        self.horizon = int(d.get("horizon", self.horizon))


class FixedKLController(_KLController):
    """Constant KL coefficient with the :class:`AdaptiveKLController` interface."""

    def __init__(self, kl_coef: float) -> None:
        self._value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Do nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """State for checkpointing."""
        return {"value": self._value}

    def load_state_dict(self, d: dict[str, float]) -> None:
        """Restore state saved by :meth:`state_dict`."""
        self._value = float(d["value"])


# --------------------------------------------------------------------------- score normalisation


class RunningMoments:
    """Running mean and (unbiased) standard deviation of every score seen, merged batch by
    batch with Chan et al.'s parallel update. [TRL ``RunningMoments``, OpenRLHF
    ``normalize_reward``]"""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: Tensor) -> None:
        """Fold in a batch ``(n,)`` of scores."""
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_m2 = float(((x - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * max(self.count - 1, 0) + batch_m2 + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / (total - 1) if total > 1 else 1.0
        self.count = total

    @property
    def std(self) -> float:
        return self.var**0.5

    def normalize(self, x: Tensor) -> Tensor:
        """``(x - mean) / (std + 1e-8)`` with the moments as they stand."""
        return (x - self.mean) / (self.std + WHITEN_EPS)

    def state_dict(self) -> dict[str, float]:
        """State for checkpointing."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, d: dict[str, float]) -> None:
        """Restore state saved by :meth:`state_dict`."""
        self.mean, self.var, self.count = float(d["mean"]), float(d["var"]), int(d["count"])
