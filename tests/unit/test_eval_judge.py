"""The judge head to head (`rlhf_cli/evals/judge.py`): the length-controlled win rate against a
hand-computed logistic fit, finite where the plain MLE is not; both-orders judging against a
stand-in OpenAI-compatible judge (tests/fake_judge.py): a judge that always picks the first
answer gives ties, one that likes longer answers wins on raw rate and reads 0.5 once length is
controlled; unreadable verdicts are ties and counted; a judge that is missing, keyless, without
the model, refusing or hung is one line naming it, within seconds, and its key is in no result
or message."""

from __future__ import annotations

import json
import math
import socket
import time

import pytest
import torch
from fake_judge import FakeJudge

from rlhf_cli.errors import EvalError
from rlhf_cli.evals.judge import (
    RIDGE,
    check_judge,
    deadline_s,
    judge_pairs,
    length_fit,
    verdict,
    win_rates,
)
from rlhf_cli.recipe.eval import EvalJudgeSection

KEY_ENV = "RLHF_TEST_JUDGE_KEY"
SECRET = "sk-test-0123456789abcdef"


def _cfg(url: str, **fields) -> EvalJudgeSection:
    return EvalJudgeSection(url=url, model="judge", **fields)


@pytest.fixture
def serve():
    started: list[FakeJudge] = []

    def start(reply=lambda a, b: "A", **kw) -> FakeJudge:
        started.append(FakeJudge(reply, **kw))
        return started[-1]

    yield start
    for fake in started:
        fake.stop()


# ── the figures ─────────────────────────────────────────────────────────────────────────────


def test_length_controlled_win_rate_is_the_hand_computed_logistic_fit():
    # two length differences (+2, -2): the logistic fit is saturated, P(win | +2) = 3/4 and
    # P(win | -2) = (1 + 0.5) / 4 = 3/8, so intercept = (logit 3/4 + logit 3/8) / 2 = ln(1.8)/2
    # and slope = (logit 3/4 - logit 3/8) / (2 * 2) = ln(5) / 4 per unit of difference
    outcomes = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5]
    diffs = [2.0] * 4 + [-2.0] * 4
    rates = win_rates(outcomes, diffs, bootstrap=200, seed=0)

    assert rates["lc_win_rate"] == pytest.approx(math.sqrt(1.8) / (1 + math.sqrt(1.8)), abs=1e-6)
    assert rates["length_coef"] == pytest.approx(math.log(5) / 4, abs=1e-6)
    assert rates["win_rate"] == 4.5 / 8
    assert (rates["wins"], rates["ties"], rates["losses"], rates["n"]) == (4, 1, 3, 8)
    # the sample standard deviation (sum y^2 = 4.25, sum y = 4.5) over sqrt(n)
    assert rates["se"] == pytest.approx(math.sqrt((4.25 - 4.5**2 / 8) / 7 / 8))
    # the score equations hold at the fit, with the weak prior's pull (the differences scaled
    # by their root mean square, 2)
    y, d = torch.tensor(outcomes, dtype=torch.float64), torch.tensor(diffs, dtype=torch.float64)
    intercept, slope = length_fit(y, d)
    residual = y - torch.sigmoid(intercept + slope * d)
    assert float(residual.sum()) == pytest.approx(RIDGE * intercept, abs=1e-12)
    assert float((residual * d / 2).sum()) == pytest.approx(RIDGE * slope * 2, abs=1e-12)


def test_length_fit_stays_finite_where_the_plain_fit_diverges():
    # every longer answer wins: the outcomes are separated by the length difference, and a
    # symmetric fixture reads exactly 0.5 at zero difference
    diffs = [-30.0, -20.0, -10.0, 10.0, 20.0, 30.0]
    rates = win_rates([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], diffs, bootstrap=100, seed=0)
    assert rates["lc_win_rate"] == pytest.approx(0.5, abs=1e-9)
    assert math.isfinite(rates["length_coef"]) and rates["length_coef"] > 0.5
    # the policy longer and winning every time: no evidence at zero, but a number, not NaN
    swept = win_rates([1.0] * 5, [3.0, 5.0, 8.0, 9.0, 20.0], bootstrap=100, seed=0)
    assert 0.5 < swept["lc_win_rate"] <= 1.0
    # equal lengths everywhere: nothing to control for, the LC win rate is the win rate
    same = win_rates([1.0, 0.5, 0.0, 1.0], [0.0] * 4, bootstrap=100, seed=0)
    assert same["lc_win_rate"] == pytest.approx(same["win_rate"], abs=1e-6)
    assert same["length_coef"] == pytest.approx(0.0, abs=1e-9)


def test_bootstrap_interval_is_seeded_and_covers_the_rate():
    outcomes = [1.0, 0.0] * 50
    rates = win_rates(outcomes, [0.0] * 100, bootstrap=2000, seed=3)
    assert rates == win_rates(outcomes, [0.0] * 100, bootstrap=2000, seed=3)
    # the normal approximation: 0.5 -/+ 1.96 * sqrt(0.25 / 100)
    assert rates["ci_low"] == pytest.approx(0.5 - 0.098, abs=0.02)
    assert rates["ci_high"] == pytest.approx(0.5 + 0.098, abs=0.02)
    every = win_rates([1.0] * 10, [1.0] * 10, bootstrap=50, seed=0)
    assert (every["ci_low"], every["win_rate"], every["ci_high"]) == (1.0, 1.0, 1.0)
    with pytest.raises(EvalError, match="no pairs"):
        win_rates([], [], bootstrap=10, seed=0)


def test_verdict_is_the_first_standalone_letter():
    assert verdict("B") == "B"
    assert verdict("Answer B is better; A rambles.") == "B"
    assert verdict("**A**") == "A"
    assert verdict("Both are fine.") is None  # a B inside a word is no verdict
    assert verdict("a") is None
    assert verdict("") is None
    assert verdict(None) is None


# ── both orders, against a stand-in judge ───────────────────────────────────────────────────


def test_a_judge_that_always_picks_the_first_answer_gives_ties_not_wins(serve):
    fake = serve(lambda a, b: "A")
    prompts = [f"question {i}" for i in range(5)]
    policy = [f"policy answer {i}" for i in range(5)]
    baseline = [f"baseline answer {i}" for i in range(5)]
    pairs = judge_pairs(_cfg(fake.url, concurrency=3), prompts, policy, baseline)

    assert pairs == [{"first": "policy", "second": "baseline", "outcome": 0.5, "unreadable": 0}] * 5
    assert win_rates([p["outcome"] for p in pairs], [0.0] * 5, 100, 0)["win_rate"] == 0.5
    # each pair asked twice, the policy's answer once as A and once as B
    asked = [body["messages"][0]["content"] for path, _, body in fake.requests]
    assert len(asked) == 10
    for i in range(5):
        mine = [c for c in asked if f"question {i}\n" in c]
        assert [c.index(policy[i]) < c.index(baseline[i]) for c in mine] in (
            [True, False],
            [False, True],
        )
    body = fake.requests[0][2]
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("judge", 8, 0)


def test_a_judge_that_prefers_the_policy_in_both_orders_gives_wins(serve):
    fake = serve(lambda a, b: "A" if a.startswith("good") else "B")
    pairs = judge_pairs(_cfg(fake.url), ["p0", "p1"], ["good 0", "bad 1"], ["bad 0", "good 1"])
    assert [p["outcome"] for p in pairs] == [1.0, 0.0]
    assert pairs[0] == {"first": "policy", "second": "policy", "outcome": 1.0, "unreadable": 0}


def _prefers_longer(a: str, b: str) -> str:
    """A judge that picks the policy's answer (its words are `p<row>w<j>`) with probability
    sigmoid(words longer than the baseline's / 3), in either order: the draw is the row's
    rank in its block of 8 rows of one length difference ((rank + 0.5) / 8), so the judge's
    frequencies follow its curve without sampling noise."""
    ours, theirs = (a, b) if a.startswith("p") else (b, a)
    row = int(ours.split("w")[0][1:])
    longer = len(ours.split()) - len(theirs.split())
    picks_ours = (row % 8 + 0.5) / 8 < 1 / (1 + math.exp(-longer / 3))
    return "A" if picks_ours == (ours == a) else "B"


def test_a_judge_that_prefers_longer_answers_wins_on_rate_not_on_length_controlled_rate(serve):
    fake = serve(_prefers_longer)
    diffs = [longer for longer in range(-4, 13) for _ in range(8)]  # the policy mostly longer
    prompts = [f"question {row}" for row in range(len(diffs))]
    policy = [" ".join(f"p{row}w{j}" for j in range(10 + d)) for row, d in enumerate(diffs)]
    baseline = [" ".join(f"b{row}w{j}" for j in range(10)) for row in range(len(diffs))]
    pairs = judge_pairs(_cfg(fake.url, concurrency=8), prompts, policy, baseline)
    rates = win_rates([p["outcome"] for p in pairs], diffs, bootstrap=500, seed=0)

    assert all(p["first"] == p["second"] for p in pairs)  # decisive in either order
    assert rates["win_rate"] > 0.65 and rates["ci_low"] > 0.6
    assert rates["lc_win_rate"] == pytest.approx(0.5, abs=0.03)  # the confound removed
    assert rates["length_coef"] == pytest.approx(1 / 3, abs=0.05)  # the judge's own 1/3


def test_an_unreadable_verdict_is_a_tie_and_counted(serve):
    replies = {"clear": "Answer B", "vague": "Both are fine.", "empty": None}
    fake = serve(lambda a, b: replies[a.split()[0]] if a.split()[0] in replies else "B")
    pairs = judge_pairs(
        _cfg(fake.url), ["p0", "p1", "p2"], ["clear 0", "vague 1", "empty 2"],
        ["x 0", "x 1", "x 2"],
    )  # fmt: skip
    # p0: the policy as A reads B (the baseline), as B reads B (the policy): a tie, readable
    assert pairs[0] == {"first": "baseline", "second": "policy", "outcome": 0.5, "unreadable": 0}
    # p1, p2: the policy as A is unreadable (words without a verdict, no text at all)
    assert pairs[1] == {"first": None, "second": "policy", "outcome": 0.5, "unreadable": 1}
    assert pairs[2] == {"first": None, "second": "policy", "outcome": 0.5, "unreadable": 1}


# ── a judge that cannot judge ───────────────────────────────────────────────────────────────


def _one_line_error(action, within_s: float) -> str:
    started = time.monotonic()
    with pytest.raises(EvalError) as caught:
        action()
    assert time.monotonic() - started < within_s
    assert caught.value.exit_code == 2
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_check_judge_refuses_a_missing_key_variable_before_any_request(serve, monkeypatch):
    fake = serve()
    monkeypatch.delenv(KEY_ENV, raising=False)
    cfg = _cfg(fake.url, api_key_env=KEY_ENV)
    message = _one_line_error(lambda: check_judge(cfg), within_s=1.0)
    assert f"the environment variable {KEY_ENV}" in message and "not set" in message
    assert fake.requests == []
    assert KEY_ENV in _one_line_error(lambda: judge_pairs(cfg, ["p"], ["a"], ["b"]), 1.0)


def test_check_judge_refuses_a_model_the_endpoint_does_not_serve(serve):
    fake = serve(models=("Qwen/Qwen3-8B", "judge-lora"))
    message = _one_line_error(lambda: check_judge(_cfg(fake.url)), within_s=2.0)
    assert message == (
        f"eval.judge.model: the judge at {fake.url} does not serve 'judge' (it serves "
        "'Qwen/Qwen3-8B', 'judge-lora')"
    )
    check_judge(EvalJudgeSection(url=fake.url, model="judge-lora"))  # served: no error


def test_check_judge_refuses_an_endpoint_that_does_not_answer(serve):
    hung = serve()
    hung.hang = True
    message = _one_line_error(lambda: check_judge(_cfg(hung.url, timeout_s=0.5)), within_s=3.0)
    assert f"eval.judge.url: the judge at {hung.url} does not answer /v1/models" in message
    assert "no answer within the timeout" in message
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    message = _one_line_error(lambda: check_judge(_cfg(closed)), within_s=3.0)
    assert f"the judge at {closed} does not answer /v1/models" in message


def test_the_key_is_sent_and_never_written(serve, monkeypatch):
    fake = serve(lambda a, b: "A", key=SECRET)
    monkeypatch.setenv(KEY_ENV, SECRET)
    cfg = _cfg(fake.url, api_key_env=KEY_ENV)
    check_judge(cfg)
    pairs = judge_pairs(cfg, ["p"], ["a"], ["b"])
    rates = win_rates([p["outcome"] for p in pairs], [0.0], 10, 0)
    assert {auth for _, auth, _ in fake.requests} == {f"Bearer {SECRET}"}
    assert SECRET not in json.dumps([pairs, rates, cfg.model_dump()])
    # a wrong key: the endpoint echoes it back (as OpenAI's API does); the message blanks it
    wrong = "sk-wrong-fedcba9876543210"
    monkeypatch.setenv(KEY_ENV, wrong)
    for action in (lambda: check_judge(cfg), lambda: judge_pairs(cfg, ["p"], ["a"], ["b"])):
        message = _one_line_error(action, within_s=2.0)
        assert f"the judge at {fake.url} refused" in message and "HTTP 401" in message
        assert f"check the key in {KEY_ENV}" in message
        assert wrong not in message and SECRET not in message


def test_a_refusal_is_not_asked_again_and_ends_the_batch(serve):
    fake = serve()
    fake.fail = [400]
    cfg = _cfg(fake.url, concurrency=1, retries=2)
    message = _one_line_error(lambda: judge_pairs(cfg, list("abcde"), list("fghij"),
                                                  list("klmno")), within_s=2.0)  # fmt: skip
    assert f"the judge at {fake.url} refused /v1/chat/completions (HTTP 400" in message
    assert len(fake.requests) == 1  # neither retried nor followed by the other nine


def test_a_server_error_is_retried(serve):
    fake = serve(lambda a, b: "A")
    fake.fail = [503]
    pairs = judge_pairs(_cfg(fake.url, concurrency=1, retries=1), ["p"], ["a"], ["b"])
    assert pairs[0]["outcome"] == 0.5 and len(fake.requests) == 3


def test_a_hung_judge_ends_within_the_batch_deadline_naming_it(serve):
    fake = serve()
    fake.hang = True
    cfg = _cfg(fake.url, timeout_s=0.3, retries=1, concurrency=2)
    limit = deadline_s(cfg, 8)
    assert limit == pytest.approx((4 + 1) * 0.3 + 1.0)  # 4 waves, one retry and its 1 s pause
    message = _one_line_error(lambda: judge_pairs(cfg, list("abcd"), list("efgh"), list("ijkl")),
                              within_s=limit + 1.0)  # fmt: skip
    assert f"the judge at {fake.url}" in message
