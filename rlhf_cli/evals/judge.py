"""The judge head to head (`eval.judge`): AlpacaEval's idea, done locally against any
OpenAI-compatible endpoint (`rlhf serve --model JUDGE`, or a hosted one).

- `check_judge`, before any answer is generated: the key variable is set, the endpoint answers
  its model list within the deadline and serves the judge's model; otherwise one line (exit 2).
- `judge_pairs`: each pair asked in both orders (the policy as A, then as B), so a judge that
  favours a position gives ties, not wins; requests run `concurrency` at once, each within
  `timeout_s` and `retries`, the batch within one deadline, ended at its first request lost for
  good. A reply without a readable verdict is a tie, and counted.
- `win_rates`: the win rate (ties half) with a percentile bootstrap interval, and the
  length-controlled win rate: a logistic regression of the outcome on the length difference,
  read at zero difference (a judge that only likes longer answers reads 0.5 there).

The API key is read from the environment variable the recipe names at each use and sent as a
bearer token; it is never kept in a result, and any message that would carry it (an endpoint
echoing it back) has it blanked.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from rlhf_cli.errors import EvalError
from rlhf_cli.generation.server_http import (
    START_TIMEOUT_S,
    Batch,
    Malformed,
    ServerReply,
    call,
    models_in,
    pause,
    reason,
)
from rlhf_cli.recipe.eval import EvalJudgeSection

CHAT = "/v1/chat/completions"
VERDICT = re.compile(r"\b([AB])\b")  # the first standalone A or B ("Answer B" reads B)
PLACEHOLDER = re.compile(r"\{(prompt|answer_a|answer_b)\}")
# The length fit's Gaussian prior (on the intercept and the standardised slope): too weak to
# move a fit the data determine (~1e-7 in the win rate), strong enough to keep it finite when
# the outcomes are separated by the length difference, where the plain MLE does not exist (the
# NaN of alpaca_eval #453).
RIDGE = 1e-6
NEWTON_STEPS = 100


# ── the endpoint ────────────────────────────────────────────────────────────────────────────


def check_judge(cfg: EvalJudgeSection) -> None:
    """Refuse a judge that cannot judge, before any policy answer is generated: its key
    variable unset, its endpoint not answering `/v1/models` (within `timeout_s`, at most
    START_TIMEOUT_S: an endpoint that is up lists its models at once), or not serving
    `cfg.model`. One line naming it (`EvalError`, exit 2)."""
    key = _key(cfg)
    try:
        listed = models_in(_post(cfg, key, "/v1/models", None, min(cfg.timeout_s, START_TIMEOUT_S)))
    except ServerReply as exc:
        raise _refused(cfg, key, "/v1/models", exc) from None
    except (OSError, ValueError) as exc:
        raise EvalError(
            _blank(
                f"eval.judge.url: the judge at {cfg.url} does not answer /v1/models "
                f"({reason(exc)}): start it (`rlhf serve --model JUDGE`) or fix the URL",
                key,
            )
        ) from None
    served = [m["id"] for m in listed]
    if cfg.model not in served:
        raise EvalError(
            f"eval.judge.model: the judge at {cfg.url} does not serve {cfg.model!r} (it serves "
            f"{', '.join(map(repr, served))})"
        )


def _key(cfg: EvalJudgeSection) -> str | None:
    if cfg.api_key_env is None:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise EvalError(
            f"eval.judge.api_key_env: the environment variable {cfg.api_key_env} that holds the "
            "judge's API key is not set: export it, or set api_key_env: null for a judge "
            "without a key"
        )
    return key


def _post(cfg: EvalJudgeSection, key: str | None, path: str, body: Any, timeout: float) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return call(cfg.url, path, body, timeout, headers=headers)


def _blank(text: str, key: str | None) -> str:
    """`text` on one line and without the key in it (an endpoint may echo the key it refused,
    and answer an error page over several lines)."""
    return " ".join((text.replace(key, "***") if key else text).split())


def _refused(cfg: EvalJudgeSection, key: str | None, path: str, exc: ServerReply) -> EvalError:
    """An HTTP error answer: a 4xx is the endpoint's refusal, which asking again will not
    change; the remedy names what the endpoint checks."""
    remedy = {
        401: f"check the key in {cfg.api_key_env}" if cfg.api_key_env else "set api_key_env",
        403: f"check the key in {cfg.api_key_env}" if cfg.api_key_env else "set api_key_env",
        404: "check eval.judge.url and eval.judge.model",
    }.get(exc.status, "check eval.judge")
    return EvalError(
        _blank(f"eval.judge: the judge at {cfg.url} refused {path} ({exc}): {remedy}", key)
    )


# ── the verdicts ────────────────────────────────────────────────────────────────────────────


def judge_pairs(
    cfg: EvalJudgeSection, prompts: list[str], policy: list[str], baseline: list[str]
) -> list[dict[str, Any]]:
    """Per prompt, the judge's verdict on the policy's answer against the baseline's, asked in
    both orders: `first` (the pick with the policy as A) and `second` (as B), each "policy",
    "baseline" or None (unreadable); `outcome` 1.0 when both pick the policy, 0.0 when both pick
    the baseline, else 0.5; `unreadable`, how many of the two replies had no verdict."""
    key = _key(cfg)
    pairs = list(zip(prompts, policy, baseline, strict=True))
    bodies = [
        _body(cfg, prompt, a, b) for prompt, ours, theirs in pairs
        for a, b in ((ours, theirs), (theirs, ours))
    ]  # fmt: skip
    replies = _ask_all(cfg, key, bodies)
    return [_pair(replies[2 * row], replies[2 * row + 1]) for row in range(len(pairs))]


def _body(cfg: EvalJudgeSection, prompt: str, answer_a: str, answer_b: str) -> dict[str, Any]:
    values = {"prompt": prompt, "answer_a": answer_a, "answer_b": answer_b}
    # one pass: an answer that itself contains "{answer_b}" is not filled in again
    content = PLACEHOLDER.sub(lambda m: values[m[1]], cfg.prompt)
    return {
        "model": cfg.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
    }


def verdict(reply: str | None) -> str | None:
    """ "A" or "B": the first standalone A or B of the reply; None when it has neither."""
    found = VERDICT.search(reply or "")
    return found[1] if found else None


def _pair(first_reply: str | None, second_reply: str | None) -> dict[str, Any]:
    first = {"A": "policy", "B": "baseline"}.get(verdict(first_reply))
    second = {"A": "baseline", "B": "policy"}.get(verdict(second_reply))
    if first == second == "policy":
        outcome = 1.0
    elif first == second == "baseline":
        outcome = 0.0
    else:
        outcome = 0.5  # the orders disagree (position bias) or a verdict is unreadable
    return {
        "first": first,
        "second": second,
        "outcome": outcome,
        "unreadable": [first, second].count(None),
    }


def deadline_s(cfg: EvalJudgeSection, requests: int) -> float:
    """How long a batch of `requests` may take in all: a wave of `concurrency` answered within
    `timeout_s` each, and one request's retries (their timeouts and the pauses between)."""
    waves = math.ceil(requests / cfg.concurrency)
    return (waves + cfg.retries) * cfg.timeout_s + sum(map(pause, range(cfg.retries)))


def _ask_all(cfg: EvalJudgeSection, key: str | None, bodies: list[dict]) -> list[str | None]:
    """Every body's reply text, asked for by `concurrency` daemon threads within the batch's
    deadline; the first request lost for good ends the batch (no more are asked for; those in
    flight end unheard) and is raised."""
    if not bodies:
        return []
    batch = Batch(len(bodies), deadline_s(cfg, len(bodies)))
    return batch.run(
        lambda row: _ask(cfg, key, bodies[row], batch),
        min(cfg.concurrency, len(bodies)),
        lambda: EvalError(
            f"eval.judge: the judge at {cfg.url} did not give {len(bodies)} verdicts within "
            f"{batch.deadline_s:g} s ({cfg.concurrency} at once, each within timeout_s "
            f"{cfg.timeout_s:g} s): give it more time or fewer prompts (max_prompts)"
        ),
    )


def _ask(cfg: EvalJudgeSection, key: str | None, body: dict, batch: Batch) -> str | None:
    """One reply's text (None when it has no text), tried `retries` + 1 times, each within
    `timeout_s` and the batch's deadline; a failed try is anything short of a whole chat
    completion (refused, reset, timed out, cut, malformed, a 5xx); a 4xx is not tried again."""
    error: BaseException | None = None
    for attempt in range(cfg.retries + 1):
        if batch.over.is_set():
            raise EvalError("the judge's batch is over")  # unheard: the batch has its error
        try:
            timeout = min(cfg.timeout_s, max(batch.left_s(), 0.01))
            return _content(_post(cfg, key, CHAT, body, timeout))
        except ServerReply as exc:
            if exc.status < 500:
                raise _refused(cfg, key, CHAT, exc) from None
            error = exc
        except (OSError, ValueError) as exc:  # refused, reset, timed out, cut, malformed
            error = exc
        if attempt < cfg.retries:
            batch.over.wait(pause(attempt))
    raise EvalError(
        _blank(
            f"eval.judge: the judge at {cfg.url} failed {CHAT} {cfg.retries + 1} time(s) "
            f"({reason(error or TimeoutError())}): check that it runs, or give it more time "
            "(eval.judge.timeout_s)",
            key,
        )
    )


def _content(reply: Any) -> str | None:
    try:
        content = reply["choices"][0]["message"].get("content")
    except (AttributeError, IndexError, KeyError, TypeError):
        raise Malformed(f"an answer that is no chat completion: {str(reply)[:100]!r}") from None
    return content if isinstance(content, str) else None


# ── the win rates ───────────────────────────────────────────────────────────────────────────


def win_rates(
    outcomes: list[float], length_diffs: list[float], bootstrap: int, seed: int
) -> dict[str, Any]:
    """The head to head in figures. `outcomes` (n,): 1 win, 0.5 tie, 0 loss per pair;
    `length_diffs` (n,): the policy's answer length minus the baseline's (any unit; `length_coef`
    is per that unit). `win_rate` counts ties half; `ci_low`/`ci_high` its 95% percentile
    bootstrap interval (`bootstrap` resamples from `seed`), `se` its standard error;
    `lc_win_rate` the win rate at zero length difference (`length_fit`)."""
    y = torch.tensor(outcomes, dtype=torch.float64)
    n = len(outcomes)
    if not n:
        raise EvalError("eval.judge: no pairs were judged")
    draws = torch.randint(n, (bootstrap, n), generator=torch.Generator().manual_seed(seed))
    means = y[draws].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64))
    intercept, length_coef = length_fit(y, torch.tensor(length_diffs, dtype=torch.float64))
    return {
        "n": n,
        "win_rate": float(y.mean()),
        "wins": int((y == 1.0).sum()),
        "ties": int((y == 0.5).sum()),
        "losses": int((y == 0.0).sum()),
        "se": float(y.std() / math.sqrt(n)) if n > 1 else 0.0,
        "ci_low": float(low),
        "ci_high": float(high),
        "lc_win_rate": float(torch.sigmoid(torch.tensor(intercept))),
        "length_coef": length_coef,
    }


def length_fit(outcomes: torch.Tensor, length_diffs: torch.Tensor) -> tuple[float, float]:
    """(intercept, slope per unit of length difference) of the logistic regression
    P(win) = sigmoid(intercept + slope * length_diff), fit by Newton's method (IRLS) with step
    halving: the maximum of sum(y * z - softplus(z)) - RIDGE/2 * |theta|^2, z = X @ theta, ties
    as 0.5 targets (a proper Bernoulli likelihood for fractional y). The differences are
    scaled by their root mean square (not centred: zero difference stays at zero), so RIDGE and
    the step's tolerance mean the same at any unit. `outcomes`, `length_diffs`: (n,) float64."""
    scale = float(length_diffs.pow(2).mean().sqrt()) or 1.0
    x = torch.stack([torch.ones_like(length_diffs), length_diffs / scale], dim=1)  # (n, 2)

    def objective(theta: torch.Tensor) -> float:
        z = x @ theta
        return float(
            (outcomes * z - torch.nn.functional.softplus(z)).sum() - RIDGE / 2 * theta @ theta
        )

    theta = torch.zeros(2, dtype=torch.float64)
    for _ in range(NEWTON_STEPS):
        p = torch.sigmoid(x @ theta)
        gradient = x.T @ (outcomes - p) - RIDGE * theta
        hessian = (x.T * (p * (1 - p))) @ x + RIDGE * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hessian, gradient)
        now = objective(theta)
        while objective(theta + step) < now and step.abs().max() > 1e-12:
            step = step / 2
        theta = theta + step
        if step.abs().max() < 1e-10:
            break
    return float(theta[0]), float(theta[1]) / scale
