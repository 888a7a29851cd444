"""`rlhf validate --data`: each stage's data and tokenizer loaded (no model weights), and its
figures (`data_figures`, tokenised as the stage tokenises: PPO's prompts cut to
`data.prompts.max_tokens` through the chat template), with one example's tokens marked when
asked; for the stages the recipe runs, or those `--stage` names (the offline methods only so:
no recipe field says which one runs). A stage that would get no rows, cannot read its data,
whose chat template fails on a row or whose prompts lack a column a reward function needs is
reported and fails the check (exit 2)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rlhf_cli.data import Example, load_preferences, load_prompts, load_sft, prompt_text
from rlhf_cli.data.offline import read_pairs, read_thumbs
from rlhf_cli.data.prompts import tokenize_prompts
from rlhf_cli.errors import DataError, ModelLoadError
from rlhf_cli.modeling import load_policy_tokenizer, load_tokenizer
from rlhf_cli.recipe import Recipe
from rlhf_cli.rewards import lacking_columns
from rlhf_cli.scoring import RewardScorer
from rlhf_cli.stages.data_figures import (
    offline_figures,
    preference_figures,
    prompt_figures,
    reward_tokens,
    sft_figures,
    sft_tokens,
)

CHECKS = {"sft": "sft", "train-rm": "preferences", "ppo": "prompts"}  # --stage -> its check
OFFLINE = ("dpo", "kto", "orpo", "simpo")  # checked when asked (`--stage`): not in the recipe


def check_data(
    recipe: Recipe, row: int | None, sample: int, stages: list[str] | None = None
) -> dict[str, Any]:
    """{stage: figures or {"error": ...}} for `stages` (a stage command's name: sft, train-rm,
    ppo, dpo, kto, orpo, simpo) or, without them, the stages this recipe runs; and `ok`. A hub
    dataset is read for its first `sample` rows (streamed unless a percentage or negative slice
    of its split needs the whole split, as training reads it); the figures tokenise at most
    `sample` rows of each stage."""
    known = [*CHECKS, *OFFLINE]
    for stage in stages or []:
        if stage not in known:
            raise DataError(f"--stage {stage}: one of {', '.join(known)}")
    checks: dict[str, Callable[[], dict[str, Any]]] = {}
    if stages is None:
        if recipe.sft.enabled and recipe.data.sft is not None:
            checks["sft"] = lambda: _sft(recipe, row, sample)
        if recipe.reward.base_model is not None and recipe.data.preferences is not None:
            checks["preferences"] = lambda: _preferences(recipe, row, sample)
        checks["prompts"] = lambda: _prompts(recipe, row, sample)
    for stage in stages or []:
        run = {"sft": _sft, "train-rm": _preferences, "ppo": _prompts}.get(stage)
        if run is not None:
            checks[CHECKS[stage]] = functools.partial(_needing, run, recipe, row, sample)
        else:
            checks[stage] = functools.partial(_offline, recipe, stage, row, sample)
    results = {}
    for stage, check in checks.items():
        try:
            results[stage] = check()
        except (DataError, ModelLoadError) as exc:
            results[stage] = {"error": str(exc), "kept": 0}
        if not results[stage]["kept"] and "error" not in results[stage]:
            results[stage]["error"] = "no row is left for this stage"
    return {"stages": results, "ok": all("error" not in s for s in results.values())}


def _needing(check: Callable[..., dict[str, Any]], recipe: Recipe, *args: Any) -> dict[str, Any]:
    """An asked stage whose data or model the recipe does not set: one line naming the field."""
    needs = {
        _sft: ("data.sft", recipe.data.sft),
        _preferences: ("data.preferences and reward.base_model", recipe.data.preferences
                       and recipe.reward.base_model),
        _prompts: ("data.prompts", recipe.data.prompts),
    }  # fmt: skip
    field, value = needs[check]
    if value is None:
        raise DataError(f"the recipe does not set {field}")
    return check(recipe, *args)


def _offline(recipe: Recipe, method: str, row: int | None, sample: int) -> dict[str, Any]:
    """An offline method's rows (pairs; KTO's thumbs rows) under the policy's tokenizer."""
    source = recipe.data.preferences
    if source is None:
        raise DataError(f"rlhf {method} trains on preference data: set data.preferences")
    paired, chat = method != "kto", recipe.model.prompt_format == "chat"  # KTO: thumbs rows
    tokenizer = _policy_tokenizer(recipe, "right")
    data = read_pairs(source, method, None, sample) if paired else read_thumbs(source, None, sample)
    limit = (f"{method}.max_length", getattr(recipe, method).max_length)
    figures = offline_figures(data, tokenizer, chat, limit, sample)
    item = _row(data.items, row, method)
    if item is not None:
        sides = ("chosen", "rejected") if paired else ("completion",)
        marked = {
            side: _marked(tokenizer, *sft_tokens(Example(item.prompt, getattr(item, side)),
                                                 tokenizer, chat), "trained")
            for side in sides
        }  # fmt: skip
        figures["row"] = marked if paired else marked["completion"]
    return figures


def _policy_tokenizer(recipe: Recipe, side: str) -> Any:
    return load_policy_tokenizer(
        recipe.model, recipe.model.tokenizer or recipe.model.name_or_path, side
    )


def _row(items: list[Any], row: int | None, stage: str) -> Any:
    if row is None:
        return None
    if not 1 <= row <= len(items):
        raise DataError(f"--row {row}: the {stage} stage has {len(items)} rows")
    return items[row - 1]


def _marked(tokenizer: Any, ids: list[int], start: int, role: str) -> dict[str, Any]:
    """One example's tokens as text: the context before `start`, then what the stage `role`s."""
    return {
        "context": tokenizer.decode(ids[:start]),
        role: tokenizer.decode(ids[start:]),
        "context_tokens": start,
        f"{role}_tokens": len(ids) - start,
    }


def _sft(recipe: Recipe, row: int | None, sample: int) -> dict[str, Any]:
    assert recipe.data.sft is not None
    chat = recipe.model.prompt_format == "chat"
    tokenizer = _policy_tokenizer(recipe, "right")
    data = load_sft(recipe.data.sft, limit=sample)
    figures = sft_figures(data, tokenizer, chat, recipe.sft.max_length, sample)
    example = _row(data.items, row, "sft")
    if example is not None:
        figures["row"] = _marked(tokenizer, *sft_tokens(example, tokenizer, chat), "trained")
    return figures


def _preferences(recipe: Recipe, row: int | None, sample: int) -> dict[str, Any]:
    assert recipe.data.preferences is not None and recipe.reward.base_model is not None
    cfg = recipe.reward
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code, "right")
    scorer = RewardScorer(None, tokenizer, cfg.template, cfg.max_length, input=cfg.input)
    data = load_preferences(recipe.data.preferences, limit=sample)
    figures = preference_figures(data, scorer, sample)
    pair = _row(data.items, row, "preferences")
    if pair is not None:
        text = prompt_text(pair.prompt)
        figures["row"] = {
            side: _marked(tokenizer, *reward_tokens(scorer, text, answer), "scored")
            for side, answer in (("chosen", pair.chosen), ("rejected", pair.rejected))
        }
    return figures


def _prompts(recipe: Recipe, row: int | None, sample: int) -> dict[str, Any]:
    assert recipe.data.prompts is not None
    source, chat = recipe.data.prompts, recipe.model.prompt_format == "chat"
    tokenizer = _policy_tokenizer(recipe, "left")
    data = load_prompts(source, limit=sample)
    problem = lacking_columns(recipe, data.columns)
    if problem is not None:
        raise DataError(problem)
    limits = (source.max_tokens, recipe.ppo.generation.max_new_tokens)
    figures = prompt_figures(data, tokenizer, chat, limits, source.eval_fraction, sample)
    prompt = _row(data.items, row, "prompts")
    if prompt is not None:
        (ids,) = tokenize_prompts(tokenizer, [prompt], chat, source.max_tokens)
        figures["row"] = {"generates_from": tokenizer.decode(ids), "tokens": len(ids)}
    return figures
