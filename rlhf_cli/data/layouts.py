"""Layouts: which one a row is in, for the stage that reads it, one per source; and each
stage's conversion of a row (`example_of`, `pair_of`, `prompt_of`)."""

from __future__ import annotations

from typing import Any

from rlhf_cli.data.rows import (
    HH_ASSISTANT,
    Conversation,
    Example,
    Pair,
    Row,
    Unusable,
    answer_text,
    blank,
    hh_messages,
    messages,
    nonempty,
    prompt_turns,
    split_answer,
    user_turn,
)
from rlhf_cli.errors import DataError

# ── layouts ─────────────────────────────────────────────────────────────────────────────────────


def _has(values: dict[str, Any], *columns: str) -> bool:
    return all(values.get(c) is not None for c in columns)


def _hh(values: dict[str, Any]) -> bool:
    return isinstance(values.get("chosen"), str) and HH_ASSISTANT in values["chosen"]


def _style(*values: Any) -> str:
    return "conversational" if any(isinstance(v, list) for v in values) else "standard"


def layout_of(values: dict[str, Any], stage: str) -> str:
    """The layout of one row, as the stage reads it; a DataError-free name, or "" when the row
    has none of the stage's columns."""
    v = values
    if stage == "preferences":
        if not _has(v, "chosen", "rejected"):
            return ""
        if _has(v, "prompt"):
            if isinstance(v["prompt"], str) and isinstance(v["chosen"], list):
                return "UltraFeedback-binarized"
            return f"preference · {_style(v['prompt'], v['chosen'])}"
        if _hh(v):
            return "HH-RLHF"
        return f"preference, implicit prompt · {_style(v['chosen'])}"
    if _has(v, "messages") and (stage == "sft" or not _has(v, "prompt")):
        return "language modelling · conversational"
    if stage == "sft":
        if _has(v, "prompt", "completion"):
            return f"prompt-completion · {_style(v['prompt'], v['completion'])}"
        return "language modelling · standard" if _has(v, "text") else ""
    if _has(v, "prompt"):
        kind = "preference" if _has(v, "chosen") else (
            "prompt-completion" if _has(v, "completion") else "prompt-only")  # fmt: skip
        return f"{kind} · {_style(v['prompt'])}"
    if _hh(v):
        return "HH-RLHF"
    if _has(v, "chosen", "rejected"):
        return layout_of(v, "preferences")
    return ""


STAGE_COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected")
NEEDS = {
    "sft": "`text`, `messages`, or `prompt` with `completion`",
    "preferences": "`chosen` and `rejected` (with or without `prompt`)",
    "prompts": "`prompt`, `messages`, or `chosen` and `rejected`",
}


def source_layout(rows: list[Row], stage: str, where: str) -> str:
    """The source's one layout; a row of another is one error naming it (a row that lacks a
    column of the layout: that column)."""
    first = layout_of(rows[0].values, stage)
    if not first:
        present = [k for k, v in rows[0].values.items() if v is not None]
        raise DataError(
            f"{where}: the {stage} stage needs {NEEDS[stage]}; its first row has "
            f"{', '.join(present) or 'no columns'} (map yours with `columns`)"
        )
    for row in rows[1:]:
        layout = layout_of(row.values, stage)
        if layout != first:
            missing = [
                k for k in STAGE_COLUMNS if _has(rows[0].values, k) and not _has(row.values, k)
            ]
            if not layout and missing:
                raise DataError(
                    f"{row.where}: column `{missing[0]}` holds nothing; the source's rows are "
                    f"{first}"
                )
            raise DataError(
                f"{row.where}: a {layout or 'different'} row, but the source's first row is "
                f"{first}: one source holds one layout (make two `sources`)"
            )
    return first


# ── per stage: rows to items ────────────────────────────────────────────────────────────────────


def _with_system(prompt: Conversation, values: dict[str, Any], where: str) -> Conversation:
    """The prompt opened by the `system` column; an empty one is none (ShareGPT and Orca sets
    hold many)."""
    system = values.get("system")
    if blank(system) or (prompt and prompt[0]["role"] == "system"):
        return prompt
    return [{"role": "system", "content": nonempty(system, where, "system")}, *prompt]


def _prompted(values: dict[str, Any], where: str) -> Conversation:
    return _with_system(prompt_turns(values["prompt"], where, "prompt"), values, where)


def example_of(row: Row) -> Example:
    """An SFT row: `text`, `messages` (split at the final assistant turn), or prompt/completion."""
    v, where = row.values, row.where
    if _has(v, "messages"):
        prompt, answer = split_answer(messages(v["messages"], where, "messages"), where, "messages")
        return Example(_with_system(prompt, v, where), answer)
    if not _has(v, "prompt"):
        return Example(None, nonempty(v["text"], where, "text"))
    prompt = _prompted(v, where)
    return Example(prompt, answer_text(v["completion"], prompt, where, "completion"))


def pair_of(row: Row) -> Pair:
    """A preference row with its prompt explicit, implicit (the answers' shared start), HH-RLHF
    dialogues, or UltraFeedback's repeated user turn."""
    v, where = row.values, row.where
    if _has(v, "prompt"):
        prompt = _prompted(v, where)
        return Pair(prompt, *(answer_text(v[k], prompt, where, k) for k in ("chosen", "rejected")))
    if isinstance(v["chosen"], str) and isinstance(v["rejected"], str):
        if _hh(v):
            sides = [hh_messages(v[k], where, k) for k in ("chosen", "rejected")]
        else:
            return _text_pair(v["chosen"], v["rejected"], where)
    else:
        sides = [messages(v[k], where, k) for k in ("chosen", "rejected")]
    if any(s and s[-1]["role"] == "assistant" and blank(s[-1]["content"]) for s in sides):
        raise Unusable(EMPTY_ANSWER)  # HH-RLHF holds dialogues that end in an empty answer
    prompt, chosen = split_answer(sides[0], where, "chosen")
    other, rejected = split_answer(sides[1], where, "rejected")
    if prompt != other:  # one dialogue going on past the other's answer too
        raise Unusable(DIFFERENT_PROMPTS)
    return Pair(_with_system(prompt, v, where), chosen, rejected)


DIFFERENT_PROMPTS = "`chosen` and `rejected` differ before their last assistant turn"
NO_CUT = "`chosen` or `rejected` is the start of the other (no prompt to cut off)"
EMPTY_ANSWER = "an empty last assistant turn in `chosen` or `rejected`"


def _text_pair(chosen: str, rejected: str, where: str) -> Pair:
    """TRL's implicit prompt for texts: the answers' longest shared start, cut back to a word
    boundary that leaves text in both answers (a space at the cut stays with the answers). A
    pair where one text is the other's start with no such boundary is `Unusable`."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n and not (chosen[n - 1].isspace() and chosen[n:].strip() and rejected[n:].strip()):
        n -= 1  # a shared first letter is not a prompt, and neither is a whole answer
    if not chosen[:n].strip():
        if chosen.startswith(rejected.rstrip()) or rejected.startswith(chosen.rstrip()):
            raise Unusable(NO_CUT)
        raise DataError(
            f"{where}: `chosen` and `rejected` share no start to take as the prompt; name the "
            "prompt column (`columns: {prompt: ...}`)"
        )
    return Pair(user_turn(chosen[:n].strip()), chosen[n:].strip(), rejected[n:].strip())


def prompt_of(row: Row) -> Conversation:
    """The prompt of any layout: `prompt`, a conversation before its final assistant turn (or
    the whole one when it ends with the user), or a preference pair's shared prompt."""
    v, where = row.values, row.where
    if _has(v, "prompt"):
        return _prompted(v, where)
    if _has(v, "messages"):
        conversation = messages(v["messages"], where, "messages")
        return _with_system(_before_answer(conversation, where, "messages"), v, where)
    if _hh(v):  # a dialogue alone (HH-RLHF's `chosen` without its pair) has its prompt too
        dialogue = hh_messages(v["chosen"], where, "chosen")
        return _with_system(_before_answer(dialogue, where, "chosen"), v, where)
    return pair_of(row).prompt


def _before_answer(conversation: Conversation, where: str, column: str) -> Conversation:
    """A conversation's prompt: the messages before its final assistant turn, if it has one
    (the answer, empty or not, is not read: PPO generates its own)."""
    ends = conversation and conversation[-1]["role"] == "assistant"
    prompt = conversation[:-1] if ends else conversation
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{where}: column `{column}` has no user turn before its answer")
    return prompt
