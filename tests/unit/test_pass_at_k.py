"""The held-out evaluation's pass@k (`ppo.eval_samples_per_prompt`): the unbiased estimate of
Chen et al. 2021 against its closed form by hand and against every subset of k answers, and
the evaluation answering each prompt n times and reporting mean@k, pass@1 and pass@n."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch

from rlhf_cli.audit.measure import heldout_eval, pass_at_k, sampled_metrics


@pytest.mark.parametrize(
    ("k", "expected"),
    # n = 5, c = 2: 1 - C(3, k)/C(5, k)
    [(1, 1 - 3 / 5), (2, 1 - 3 / 10), (3, 1 - 1 / 10), (4, 1.0), (5, 1.0)],
)
def test_pass_at_k_by_hand(k, expected):
    assert pass_at_k(5, 2, k) == pytest.approx(expected)


@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_answer(n):
    for c in range(n + 1):
        answers = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(combinations(answers, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_pass_at_k_refuses_k_beyond_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_sampled_metrics_of_three_prompts_with_four_answers_each():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0, 0, 0, 0, 1, 1, 1, 0.5])
    metrics = sampled_metrics(scores, 4, threshold=1.0)
    # rights per prompt: 2, 0, 3; pass@1 = c/n, pass@4 = 1 when c > 0
    assert metrics == pytest.approx(
        {
            "eval/mean_at_k": 5.5 / 12,
            "eval/pass_at_1": (2 / 4 + 0 + 3 / 4) / 3,
            "eval/pass_at_4": 2 / 3,
        }
    )
    # a lower threshold counts the 0.5 too
    assert sampled_metrics(scores, 4, threshold=0.5)["eval/pass_at_1"] == pytest.approx(
        (2 / 4 + 0 + 4 / 4) / 3
    )


class _Recording:
    """Scores an answer 1 when its text has an even length, and keeps what it was asked."""

    def __init__(self):
        self.calls = []

    def scores_of(self, texts):
        return torch.tensor([float(len(t) % 2 == 0) for t in texts])

    def scored(self, prompts, texts, keywords=None):
        from rlhf_cli.scoring import Scores

        self.calls.append((list(prompts), list(texts), dict(keywords or {})))
        return Scores(self.scores_of(texts), 0, {})

    def score(self, prompts, texts, keywords=None):
        return self.scores_of(texts), 0


def test_the_heldout_evaluation_answers_each_prompt_n_times(llama_config):
    from transformers import LlamaForCausalLM

    from rlhf_cli.generation import HFGenerator
    from rlhf_cli.modeling import Reference, load_tokenizer
    from rlhf_cli.recipe import GenerationSection

    tokenizer = load_tokenizer("builtin:tiny-lm")
    torch.manual_seed(0)
    config = llama_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    policy = LlamaForCausalLM(config).eval()
    prompts = ["hello there", "a friend", "the end"]
    queries = [tokenizer(p)["input_ids"] for p in prompts]
    scorer = _Recording()
    metrics, _ = heldout_eval(
        policy, prompts, queries,
        GenerationSection(max_new_tokens=4, temperature=1.0, top_p=1.0),
        seed=1, reference=Reference(policy, frozen_copy=policy), scorer=scorer,
        generator=HFGenerator(policy, tokenizer, [tokenizer.eos_token_id]),
        keywords={"solution": ["1", "2", "3"]}, samples_per_prompt=4,
    )  # fmt: skip
    asked, texts, given = scorer.calls[0]
    assert asked == [p for p in prompts for _ in range(4)]
    assert given["solution"] == [s for s in "123" for _ in range(4)]
    expected = sampled_metrics(scorer.scores_of(texts), 4, 1.0)
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert metrics["eval/reward_mean"] == pytest.approx(expected["eval/mean_at_k"])
