"""A prompt in tokens, as the policy generates from it: through the chat template with the
generation prompt (`prompt_format: chat`) or as its text (`prompt_text`), cut to
`data.prompts.max_tokens`. PPO's rollouts and held-out prompts, the audit, compare, the merge
check and `rlhf validate --data` all tokenise here, so the data check reports exactly what
training will generate from.

A long prompt loses whole exchanges, oldest first (a user turn and every turn up to the next
user turn), never a single turn: the window always starts with a user turn after the system
message, if any, so templates that insist on alternating roles (Mistral-Instruct, Llama-2-chat,
Gemma) render it. When the last exchange alone is still too long, its last turn loses the start
of its text inside the template: BOS, the chat header and the generation prompt survive. A
template that fails on a prompt is the data's problem or the template's: one line naming the
prompt (a `DataError`), never an internal error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_cli.data.rows import Conversation, as_conversation, prompt_text
from rlhf_cli.errors import DataError

SHOWN_CHARS = 48  # of a failing prompt's first user turn, to find it in the data


@dataclass(frozen=True)
class PromptTokens:
    """One prompt's token ids and what the cut to `max_tokens` did to it."""

    ids: list[int]
    full_tokens: int  # the whole prompt's tokens, before any cut
    exchanges_dropped: int  # oldest exchanges left out
    text_cut: bool  # the last turn lost the start of its text


def tokenize_prompts(
    tokenizer: Any, prompts: Sequence[str | Conversation], chat: bool, max_tokens: int
) -> list[list[int]]:
    """Token ids of each prompt, a text (one user turn) or a conversation, at most `max_tokens`
    (see the module's docstring for how a long one is cut)."""
    return [tokens.ids for tokens in prompt_tokens(tokenizer, prompts, chat, max_tokens)]


def prompt_tokens(
    tokenizer: Any,
    prompts: Sequence[str | Conversation],
    chat: bool,
    max_tokens: int,
    where: str = "prompt",
) -> list[PromptTokens]:
    """`tokenize_prompts` with what the cut did to each prompt; a template error names the
    prompt as `{where} {number}` (1-based) and the start of its first user turn."""
    return [
        _prompt_tokens(tokenizer, as_conversation(prompt), chat, max_tokens, f"{where} {number}")
        for number, prompt in enumerate(prompts, 1)
    ]


def _prompt_tokens(
    tokenizer: Any, prompt: Conversation, chat: bool, max_tokens: int, where: str
) -> PromptTokens:
    def wrap(turns: Conversation) -> list[int]:
        if chat and tokenizer.chat_template:
            rendered = _render(tokenizer, turns, prompt, where)
            return tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return tokenizer(prompt_text(turns))["input_ids"]

    ids = wrap(prompt)
    full, window, dropped = len(ids), prompt, 0
    system = prompt[:1] if prompt[0]["role"] == "system" else []
    turns = prompt[len(system) :]
    starts = [i for i, message in enumerate(turns) if i and message["role"] == "user"]
    while len(ids) > max_tokens and dropped < len(starts):  # the oldest exchange goes first
        window = system + turns[starts[dropped] :]
        ids = wrap(window)
        dropped += 1
    if len(ids) <= max_tokens:
        return PromptTokens(ids, full, dropped, False)
    *head, last = window
    text_ids = tokenizer(last["content"], add_special_tokens=False)["input_ids"]
    budget = max_tokens - (len(ids) - len(text_ids))  # what the template itself takes
    while budget > 0:  # piece boundaries can tokenise differently: shrink until it fits
        ids = wrap([*head, {**last, "content": tokenizer.decode(text_ids[-budget:])}])
        if len(ids) <= max_tokens:
            return PromptTokens(ids, full, dropped, True)
        budget -= len(ids) - max_tokens
    return PromptTokens(ids[-max_tokens:], full, dropped, True)  # the template alone is longer


def _render(tokenizer: Any, turns: Conversation, prompt: Conversation, where: str) -> str:
    """The chat template over `turns` with the generation prompt; any failure (the template's
    own `raise_exception`, a type error in its Jinja) is a `DataError` naming the prompt."""
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template is user code: whatever it raises is about this row
        first = next((m["content"] for m in prompt if m["role"] == "user"), prompt[0]["content"])
        shown = " ".join(first.split())
        shown = shown if len(shown) <= SHOWN_CHARS else shown[:SHOWN_CHARS] + "…"
        reason = " ".join(str(exc).split()) or exc.__class__.__name__
        raise DataError(
            f'{where} ("{shown}"): the chat template fails on it: {reason} '
            "(fix the row, or model.chat_template)"
        ) from exc
