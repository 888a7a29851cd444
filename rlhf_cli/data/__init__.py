"""Every dataset layout a stage takes, named by the recipe, read into one shape per stage.

Layouts, detected per source from its first row (every later row must share it):
| layout | columns | sft | preferences | prompts |
|---|---|---|---|---|
| language modelling | `text`, or `messages` | yes | | `messages` |
| prompt-completion | `prompt`, `completion` (or `response`, `output`) | yes | | yes |
| prompt-only | `prompt` | | | yes |
| preference | `prompt`, `chosen`, `rejected` | | yes | yes |
| preference, implicit prompt | `chosen`, `rejected` | | yes | yes |
Each is standard (text) or conversational (lists of `{role, content}` messages; ShareGPT's
`{from, value}` with `human`/`gpt` too). HH-RLHF (`chosen`/`rejected` dialogues of `Human:` and
`Assistant:` turns) and UltraFeedback-binarized (a text `prompt`, `chosen`/`rejected` message lists
that repeat the user turn) are read as conversations; Alpaca's `instruction`/`input`/`output` as
prompt-completion; `columns` maps other names onto ours.

One rule for every stage: a conversation's prompt is every message before its final assistant
turn, system message included, and the answer is that turn. SFT trains on the answer after the
prompt, the reward model scores the answer after the prompt's text (`prompt_text`), and PPO
generates from the prompt through the policy's chat template: the three see the same prompt.

A mixture's weights apply after the train / held-out split (`hold_out`): the rows are drawn
first, then each source's training rows are repeated (or a seeded share kept), so no copy of a
held-out row trains. Rows the data holds twice can still land on both sides: they are counted and
warned about, for every stage.

The package: `rows` (rows, what each stage makes of them, conversations), `layouts`
(detection and each stage's conversion), `sources` (reading files and hub datasets), `prompts`
(a prompt in tokens, as the policy generates from it), and here each stage's loader, the splits,
and the audit's prompts and responses. What a stage's data looks like in tokens (`rlhf validate
--data`, the manifests) is measured beside that command, in `stages/data_figures.py`.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlhf_cli.data.layouts import example_of, pair_of, prompt_of, source_layout
from rlhf_cli.data.rows import (
    Conversation,
    Example,
    Message,
    Pair,
    Row,
    StageData,
    T,
    Unusable,
    as_conversation,
    prompt_text,
)
from rlhf_cli.data.sources import ALIASES, copies, json_lines, read_source, read_text, slice_rows
from rlhf_cli.errors import DataError
from rlhf_cli.recipe import AuditSection, PromptSource, StageSource
from rlhf_cli.recipe.data import COLUMNS


def _load(
    source: StageSource,
    stage: str,
    convert: Callable[[Row], T],
    cache_dir: str | Path | None,
    limit: int | None,
) -> StageData[T]:
    """Every source of a stage's data, each checked for one layout and converted row by row (an
    `Unusable` row dropped and counted); each row once, its source's weight kept for
    `hold_out`."""
    out: StageData[T] = StageData([])
    for index, spec in enumerate(source.parts()):
        rows, sampled = read_source(spec, cache_dir, limit)
        out.layouts[spec.where()] = source_layout(rows, stage, spec.where())
        out.rows += len(rows)
        out.sampled = out.sampled or sampled
        out.weights.append(spec.weight)
        for row in rows:
            try:
                out.items.append(convert(row))
                out.origins.append(index)
            except Unusable as exc:
                out.dropped[exc.reason] = out.dropped.get(exc.reason, 0) + 1
    return out


def _drop(data: StageData[T], keep: Callable[[T], bool], reason: str) -> None:
    kept = [i for i, item in enumerate(data.items) if keep(item)]
    if len(kept) < len(data.items):
        data.dropped[reason] = data.dropped.get(reason, 0) + len(data.items) - len(kept)
    data.items = [data.items[i] for i in kept]
    data.origins = [data.origins[i] for i in kept]
    data.texts = [data.texts[i] for i in kept] if data.texts else []
    data.columns = [data.columns[i] for i in kept] if data.columns else []


def load_sft(
    source: StageSource, cache_dir: str | Path | None = None, limit: int | None = None
) -> StageData[Example]:
    """SFT examples of every layout SFT takes; text rows and prompted rows do not mix (TRL's
    SFTTrainer takes one format)."""
    data = _load(source, "sft", example_of, cache_dir, limit)
    kinds = {item.prompt is None for item in data.items}
    if len(kinds) > 1:
        raise DataError(
            f"data.sft mixes `text` rows with prompt/answer rows ({source.where()}); SFT trains "
            "on one kind"
        )
    return data


def load_preferences(
    source: StageSource, cache_dir: str | Path | None = None, limit: int | None = None
) -> StageData[Pair]:
    """Preference pairs of every preference layout; pairs whose answers are the same text are
    dropped (they teach nothing), and none left is an error."""
    data = _load(source, "preferences", pair_of, cache_dir, limit)
    _drop(data, lambda p: p.chosen.strip() != p.rejected.strip(), "identical answers")
    if not data.items and set(data.dropped) == {"identical answers"}:
        raise DataError(f"{source.where()}: every pair's chosen and rejected answers are the same")
    if not data.items:
        raise DataError(f"{source.where()}: no pair is left ({_reasons(data)})")
    return data


def load_prompts(
    source: PromptSource, cache_dir: str | Path | None = None, limit: int | None = None
) -> StageData[Conversation]:
    """PPO prompts of any layout: each turn cut to `max_chars`, prompts of fewer than
    `min_words` words (over all turns) dropped; each one's extra columns (`extra_columns`) kept
    in `data.columns` for the reward functions."""
    rows = _load(
        source, "prompts", lambda row: (prompt_of(row), extra_columns(row)), cache_dir, limit
    )
    data = replace(rows, items=[prompt for prompt, _ in rows.items])
    data.columns = [columns for _, columns in rows.items]
    data.texts = [prompt_text(p) for p in data.items]  # as the reward data holds them
    cut = 0
    for prompt in data.items:
        for message in prompt:
            if len(message["content"].strip()) > source.max_chars:
                message["content"] = message["content"].strip()[: source.max_chars]
                cut += 1
    if cut:
        data.cut[f"turns over {source.max_chars} characters (data.prompts.max_chars)"] = cut
    short = f"fewer than {source.min_words} words (data.prompts.min_words)"
    _drop(data, lambda p: sum(len(m["content"].split()) for m in p) >= source.min_words, short)
    if not data.items and set(data.dropped) == {short}:
        raise DataError(
            f"no prompt of '{source.where()}' has {source.min_words} words or more "
            f"(data.prompts.min_words)"
        )
    if not data.items:
        raise DataError(f"no prompt of '{source.where()}' is left ({_reasons(data)})")
    return data


def extra_columns(row: Row) -> dict[str, Any]:
    """A prompt row's columns beyond the layouts' (ours and their aliases), by name after
    `columns` renamed them: the keyword arguments of the reward functions (`solution`, ...)."""
    layout = {*COLUMNS, *(name for names in ALIASES.values() for name in names)}
    return {name: value for name, value in row.values.items() if name not in layout}


def reward_keywords(columns: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows' extra columns as the reward functions take them (TRL's convention): one list per
    column, one value per row; a column a row lacks (a mixture's other source) is None there."""
    names = dict.fromkeys(name for row in columns for name in row)
    return {name: [row.get(name) for row in columns] for name in names}


def matched_keywords(
    prompts: list[str], texts: list[str], columns: list[dict[str, Any]]
) -> dict[str, list[Any]]:
    """`reward_keywords` for `prompts` written apart from the data (the audit's): a prompt that
    is a prompt of the data (`texts`, each row's `columns`) carries that row's columns, any
    other None in each."""
    known = dict(zip(texts, columns, strict=True))
    names = dict.fromkeys(name for row in columns for name in row)
    return reward_keywords([{name: known.get(p, {}).get(name) for name in names} for p in prompts])


def _reasons(data: StageData[Any]) -> str:
    """Why rows were dropped, for the error that none is left."""
    return "; ".join(f"{n} with {reason}" for reason, n in data.dropped.items())


# ── splits ──────────────────────────────────────────────────────────────────────────────────────

HELDOUT_SEED = 20240229  # the held-out draw's: fixed, so every run holds out the same prompts


def split_heldout(prompts: list[T], fraction: float) -> tuple[list[T], list[T]]:
    """(training prompts, held-out prompts): `fraction` of them (at least one when above 0), a
    draw with a fixed seed: the same split on every process, every resume and every `run.seed`,
    so runs of different seeds are evaluated on the same prompts."""
    if fraction <= 0:
        return prompts, []
    order = list(range(len(prompts)))
    random.Random(HELDOUT_SEED).shuffle(order)
    n = min(max(1, round(len(prompts) * fraction)), len(prompts) - 1)
    held = set(order[:n])
    return (
        [p for i, p in enumerate(prompts) if i not in held],
        [p for i, p in enumerate(prompts) if i in held],
    )


def split_eval(rows: list[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """A seeded shuffle split into (train, eval); at least one row on each side."""
    if len(rows) < 2:
        raise DataError(f"need at least 2 rows to hold some out for evaluation, got {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(len(rows) * fraction)), len(rows) - 1)
    return [rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]]


def hold_out(
    data: StageData[T], fraction: float, seed: int | None = None
) -> tuple[list[T], list[T]]:
    """(training items, held-out items): the rows are split first (`split_eval`'s draw with
    `seed`, for SFT and the reward model; PPO's fixed draw, `split_heldout`, without), then each
    source's training rows are taken `weight` times (`sources.copies`), in the split's order;
    held-out rows once each. Held-out rows that are training rows too (the data holds them
    twice) are counted in a warning (`data.warnings`)."""
    rows = list(range(len(data.items)))
    train, heldout = (
        split_heldout(rows, fraction) if seed is None else split_eval(rows, fraction, seed)
    )
    times: dict[int, int] = {}
    for index, weight in enumerate(data.weights):
        mine = [i for i in train if data.origins[i] == index]
        times.update(zip(mine, copies(len(mine), weight), strict=True))
    train_items = [data.items[i] for i in train for _ in range(times[i])]
    heldout_items = [data.items[i] for i in heldout]
    repeated = overlap(train_items, heldout_items)
    warning = (
        f"{repeated} of {len(heldout_items)} held-out rows of {' + '.join(data.layouts)} are "
        "training rows too (the data holds them twice): the held-out figures read high; remove "
        "the duplicates"
    )
    if repeated and warning not in data.warnings:  # the same split again: the same warning
        data.warnings.append(warning)
    return train_items, heldout_items


def overlap(train: list[Any], heldout: list[Any]) -> int:
    """Held-out items that are also training items (rows the data holds twice): prompts,
    examples or pairs, compared whole."""
    seen = Counter(map(_identity, train))
    return sum(1 for item in heldout if seen[_identity(item)])


def _identity(item: Any) -> str:
    return json.dumps(item, default=vars, sort_keys=True)


# ── audit prompts and responses ─────────────────────────────────────────────────────────────────


def audit_prompts(cfg: AuditSection) -> list[str]:
    """`audit.prompts_file` (one prompt a line) or else `audit.prompts`."""
    if cfg.prompts_file:
        lines = read_text(Path(cfg.prompts_file)).splitlines()
        prompts = [line.strip() for line in lines if line.strip()]
    else:
        prompts = list(cfg.prompts)
    if not prompts:
        raise DataError("audit: no prompts (audit.prompts or audit.prompts_file)")
    return prompts


def read_responses(path: Path) -> tuple[list[str], list[str]]:
    """Rows with a text `prompt` and a text `response` from a JSONL file; anything else is a
    DataError naming the file and line (never turned into a string)."""
    if not path.is_file():
        raise DataError(f"--responses: file not found: {path}")
    prompts, responses = [], []
    for number, row in json_lines(path, lambda exc: "not a JSON object"):
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) for k in ("prompt", "response")
        ):
            raise DataError(f"{path}:{number}: a row needs `prompt` and `response` as text")
        prompts.append(row["prompt"])
        responses.append(row["response"])
    if not responses:
        raise DataError(f"{path}: no responses")
    return prompts, responses


__all__ = [
    "Conversation",
    "Example",
    "Message",
    "Pair",
    "Row",
    "StageData",
    "as_conversation",
    "extra_columns",
    "audit_prompts",
    "hold_out",
    "load_preferences",
    "load_prompts",
    "load_sft",
    "overlap",
    "prompt_text",
    "read_responses",
    "reward_keywords",
    "read_source",
    "slice_rows",
    "split_eval",
    "split_heldout",
]
