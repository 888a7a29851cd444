"""What a stage's data looks like in tokens, before anything trains on it: the figures
`rlhf validate --data` prints and every stage writes into its manifest (`data`).

Per stage: rows read and kept, the layout of each source, token-length percentiles of prompts
and answers against the recipe's limits, how many rows the limits cut or drop and why; for
preferences (the reward model's, or an offline method's under the policy's tokenizer) the pairs
with identical answers and the length bias (how often the chosen answer is
the longer one: what a reward model learns as a length hack); for PPO prompts the held-out
prompts that are also training prompts, and what the cut to `data.prompts.max_tokens` does
(tokenised as PPO tokenises, so a template that fails on a prompt fails here first).
`*_tokens` split one example's tokens into what the stage reads as context and what it trains on
or scores, so a chat template's effect is visible.

They live beside the commands that print them (`datacheck`) and the stages that record them, not
in `data/`: they measure the data with the tokenizers, the templates and the reward scorer, which
all sit above it.
"""

from __future__ import annotations

import statistics
from typing import Any

from rlhf_cli.data import (
    Conversation,
    Example,
    Pair,
    StageData,
    hold_out,
    overlap,
    prompt_text,
)
from rlhf_cli.data.prompts import prompt_tokens, tokenize_prompts
from rlhf_cli.scoring import RewardScorer

SAMPLE = 2000  # rows tokenised for the figures (the first ones); all rows are counted


def percentiles(lengths: list[int]) -> dict[str, int]:
    """p50, p95 and max of token lengths (nearest rank; zeros when there are none)."""
    if not lengths:
        return {"p50": 0, "p95": 0, "max": 0}
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {"p50": rank(0.5), "p95": rank(0.95), "max": ordered[-1]}


def _base(data: StageData[Any], sample: int) -> dict[str, Any]:
    return {**data.summary(), "tokenised": min(sample, len(data.items))}


# ── SFT ─────────────────────────────────────────────────────────────────────────────────────────


def sft_tokens(example: Example, tokenizer: Any, chat: bool) -> tuple[list[int], int]:
    """(the ids TRL's SFTTrainer builds for an example, how many of them come before the answer):
    the chat template over prompt and answer (`chat`), else the prompt's text then the answer's,
    EOS last."""
    if example.prompt is None:
        ids = tokenizer(example.answer)["input_ids"]
        return ids + [tokenizer.eos_token_id] * (ids[-1:] != [tokenizer.eos_token_id]), 0
    (prompt_ids,) = tokenize_prompts(tokenizer, [example.prompt], chat, 10**9)
    if chat:
        turns = [*example.prompt, {"role": "assistant", "content": example.answer}]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt_text(example.prompt) + example.answer)["input_ids"]
        ids += [tokenizer.eos_token_id] * (ids[-1:] != [tokenizer.eos_token_id])
    return ids, len(prompt_ids)


def sft_figures(
    data: StageData[Example], tokenizer: Any, chat: bool, max_length: int, sample: int = SAMPLE
) -> dict[str, Any]:
    """`sft.max_length` cuts the end of a longer example; one whose prompt fills it has no
    answer token left and is dropped (TRL drops it)."""
    prompts, answers, cut, dropped = [], [], 0, 0
    for example in data.items[:sample]:
        ids, start = sft_tokens(example, tokenizer, chat)
        prompts.append(start)
        answers.append(len(ids) - start)
        cut += len(ids) > max_length
        dropped += start >= max_length
    return {
        **_base(data, sample),
        "prompt_tokens": percentiles(prompts),
        "answer_tokens": percentiles(answers),
        "limits": {"sft.max_length": max_length},
        "over_limit": {"cut at sft.max_length": cut - dropped, "no answer token left": dropped},
    }


# ── preferences ─────────────────────────────────────────────────────────────────────────────────


def reward_tokens(scorer: RewardScorer, prompt: str, answer: str) -> tuple[list[int], int]:
    """(the reward model's input ids for a pair, as scoring encodes it, how many of them come
    before the answer: the start they share with the pair's encoding without an answer)."""
    features, _ = scorer.encode([prompt, prompt], [answer, ""])
    full, bare = features["input_ids"]
    shared = 0
    while shared < min(len(full), len(bare)) and full[shared] == bare[shared]:
        shared += 1
    return full, shared


def preference_figures(
    data: StageData[Pair], scorer: RewardScorer, sample: int = SAMPLE
) -> dict[str, Any]:
    """Token lengths under the reward tokenizer; pairs over `reward.max_length` lose the start
    of their prompt (scoring's cut); the length bias of the pairs."""
    tokenizer = scorer.tokenizer
    prompts, chosen, rejected, over = [], [], [], 0
    for pair in data.items[:sample]:
        text = prompt_text(pair.prompt)
        prompts.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"])
                   for a in (pair.chosen, pair.rejected)]  # fmt: skip
        chosen.append(lengths[0])
        rejected.append(lengths[1])
        over += scorer.encode([text, text], [pair.chosen, pair.rejected])[1] > 0
    return {
        **_base(data, sample),
        "prompt_tokens": percentiles(prompts),
        "answer_tokens": percentiles(chosen + rejected),
        "limits": {"reward.max_length": scorer.max_length},
        "over_limit": {"prompt start cut at reward.max_length": over},
        "identical_answers": data.dropped.get("identical answers", 0),
        "length_bias": _length_bias(chosen, rejected),
    }


def _share(flags: Any) -> float | None:
    flags = list(flags)
    return round(sum(flags) / len(flags), 3) if flags else None


# ── the offline methods ─────────────────────────────────────────────────────────────────────────


def offline_figures(
    data: StageData[Any], tokenizer: Any, chat: bool, limit: tuple[str, int], sample: int = SAMPLE
) -> dict[str, Any]:
    """`rlhf dpo`, `kto`, `orpo` and `simpo`'s rows (pairs, or thumbs rows with a `label`) under
    the policy's tokenizer, each answer after its prompt as SFT tokenises it (`sft_tokens`),
    against `limit` (`<method>.max_length`): the answers it cuts, the rows whose prompt fills it
    (TRL drops them); for pairs the length bias (a preference for length is learnt by these
    methods as readily as by a reward model), for thumbs rows the share of thumbs-up."""
    field, max_length = limit
    prompts, answers, chosen, rejected, ups = [], [], [], [], []
    cut = dropped = 0
    for item in data.items[:sample]:
        paired = hasattr(item, "chosen")
        sides = (item.chosen, item.rejected) if paired else (item.completion,)
        lengths = []
        for answer in sides:
            ids, start = sft_tokens(Example(item.prompt, answer), tokenizer, chat)
            lengths.append(len(ids) - start)
            cut += start < max_length < len(ids)
        prompts.append(start)
        answers += lengths
        dropped += start >= max_length
        if paired:
            chosen.append(lengths[0])
            rejected.append(lengths[1])
        else:
            ups.append(item.label)
    figures = {
        **_base(data, sample),
        "prompt_tokens": percentiles(prompts),
        "answer_tokens": percentiles(answers),
        "limits": {field: max_length},
        "over_limit": {f"answers cut at {field}": cut, "rows whose prompt fills it": dropped},
    }
    if ups:
        figures["thumbs_up_share"] = _share(ups)
    else:
        figures["identical_answers"] = data.dropped.get("identical answers", 0)
        figures["length_bias"] = _length_bias(chosen, rejected)
    return figures


def _length_bias(chosen: list[int], rejected: list[int]) -> dict[str, float | None]:
    """How often the chosen answer is the longer, and the mean ratio of their lengths."""
    ratios = [c / max(r, 1) for c, r in zip(chosen, rejected, strict=True)]
    return {
        "chosen_longer_share": _share(c > r for c, r in zip(chosen, rejected, strict=True)),
        "mean_length_ratio": round(statistics.fmean(ratios), 3) if ratios else None,
    }


# ── PPO prompts ─────────────────────────────────────────────────────────────────────────────────


def prompt_figures(
    data: StageData[Conversation],
    tokenizer: Any,
    chat: bool,
    limits: tuple[int, int],
    eval_fraction: float,
    sample: int = SAMPLE,
) -> dict[str, Any]:
    """Prompt tokens (chat template and generation prompt included) against
    `data.prompts.max_tokens`, cut exactly as PPO cuts them (`data.prompts.prompt_tokens`): how
    many are cut, how many of those lose their oldest exchanges (and how many exchanges in all),
    how many the start of their last turn; the answer budget `max_new_tokens`; held-out prompts
    that are training prompts too. A chat template that fails on a prompt is a `DataError`
    naming the source and the prompt's place among the kept ones."""
    max_tokens, max_new_tokens = limits
    where = f"{', '.join(data.layouts)}: kept prompt"
    tokens = prompt_tokens(tokenizer, data.items[:sample], chat, max_tokens, where)
    train, heldout = hold_out(data, eval_fraction)  # as PPO splits: weights after the split
    return {
        **_base(data, sample),
        "prompt_tokens": percentiles([t.full_tokens for t in tokens]),
        "limits": {
            "data.prompts.max_tokens": max_tokens,
            "ppo.generation.max_new_tokens": max_new_tokens,
        },
        "over_limit": {
            "cut at data.prompts.max_tokens": sum(t.full_tokens > max_tokens for t in tokens),
            "of them lose their oldest exchanges": sum(t.exchanges_dropped > 0 for t in tokens),
            "of them lose the start of their last turn": sum(t.text_cut for t in tokens),
        },
        "exchanges_dropped": sum(t.exchanges_dropped for t in tokens),
        "train": len(train),
        "heldout": len(heldout),
        "heldout_also_in_train": overlap(train, heldout),
    }
