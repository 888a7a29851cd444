"""A row as read (with where it came from), what each stage makes of it (an SFT
`Example`, a preference `Pair`, a prompt `Conversation`), and the conversation helpers every
layout shares: messages checked where they enter, a prompt's one text for the reward model."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rlhf_cli.errors import DataError

Message = dict[str, str]
Conversation = list[Message]  # a prompt: the messages before the answer
T = TypeVar("T")

HH_HUMAN = "\n\nHuman:"
HH_ASSISTANT = "\n\nAssistant:"
HH_TURN = re.compile(r"\n\n(Human|Assistant):")
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "tool": "tool"}  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One row of a source, its columns under our names, and where it came from (for errors)."""

    values: dict[str, Any]
    where: str  # `file:line`, or `dataset [split] row N`


@dataclass(frozen=True)
class Example:
    """An SFT example: the answer trained on after `prompt` (None: a `text` row, all trained)."""

    prompt: Conversation | None
    answer: str


@dataclass(frozen=True)
class Pair:
    """A preference pair: two answers to one prompt."""

    prompt: Conversation
    chosen: str
    rejected: str


class Unusable(Exception):
    """A row the stage cannot use that is no mistake of the source's layout (a pair whose
    answers cannot be told apart): dropped and counted under `reason`, as other dropped rows."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class StageData(Generic[T]):
    """What a stage reads: its items, and how they were got (the data check and the manifest
    show these). Each kept row is one item, whatever its source's weight: weights apply after
    the train / held-out split (`data.hold_out`), so no copy of a held-out row trains."""

    items: list[T]
    rows: int = 0  # rows read
    layouts: dict[str, str] = field(default_factory=dict)  # source -> layout
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    cut: dict[str, int] = field(default_factory=dict)  # reason -> rows shortened
    sampled: bool = False  # a hub source was read only in part (`limit`)
    origins: list[int] = field(default_factory=list)  # per item: its source's index in `weights`
    weights: list[float] = field(default_factory=list)  # per source: its `weight`
    warnings: list[str] = field(default_factory=list)  # for the stage's manifest (`hold_out`)
    texts: list[str] = field(default_factory=list)  # PPO prompts: each one's text before the cut
    columns: list[dict[str, Any]] = field(default_factory=list)  # PPO prompts: extra columns

    def summary(self) -> dict[str, Any]:
        return {"rows_read": self.rows, "kept": len(self.items), "layouts": self.layouts,
                "dropped": self.dropped, "cut": self.cut, "sampled": self.sampled}  # fmt: skip


# ── conversations ───────────────────────────────────────────────────────────────────────────────


def user_turn(text: str) -> Conversation:
    return [{"role": "user", "content": text}]


def prompt_text(prompt: Conversation | str) -> str:
    """A prompt as one text, for `prompt_format: plain` and the reward model's `{prompt}`: a
    single user turn is its content; a longer conversation is HH-RLHF's dialogue after its first
    `Human: ` (so `Human: {prompt}\\n\\nAssistant: {response}` rebuilds it), a system message
    its first paragraph."""
    if isinstance(prompt, str):
        return prompt
    parts, seen_user = [], False
    for message in prompt:
        content = message["content"]
        if message["role"] == "system" or (message["role"] == "user" and not seen_user):
            parts.append(("\n\n" if parts else "") + content)
        else:
            parts.append(f"{HH_HUMAN if message['role'] == 'user' else HH_ASSISTANT} {content}")
        seen_user = seen_user or message["role"] == "user"
    return "".join(parts)


def as_conversation(prompt: Conversation | str) -> Conversation:
    return user_turn(prompt) if isinstance(prompt, str) else prompt


def hh_messages(dialogue: str, where: str, column: str) -> Conversation:
    """An HH-RLHF dialogue (`\\n\\nHuman: ... \\n\\nAssistant: ...`) as messages."""
    pieces = HH_TURN.split(dialogue)
    if pieces[0].strip() or len(pieces) < 3:
        raise DataError(
            f"{where}: column `{column}` is not an HH-RLHF dialogue (it must start with "
            "'\\n\\nHuman:')"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[role], "content": content.strip()}
        for role, content in zip(pieces[1::2], pieces[2::2], strict=True)
    ]


def split_answer(conversation: Conversation, where: str, column: str) -> tuple[Conversation, str]:
    """(everything before the final assistant turn, that turn's content)."""
    if not conversation or conversation[-1]["role"] != "assistant":
        last = conversation[-1]["role"] if conversation else "nothing"
        raise DataError(
            f"{where}: column `{column}` must end with an assistant turn (the answer); "
            f"it ends with {last}"
        )
    prompt = conversation[:-1]
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{where}: column `{column}` has no user turn before its answer")
    return prompt, nonempty(conversation[-1]["content"], where, column)


# ── values, checked where they enter ────────────────────────────────────────────────────────────


def describe(value: Any) -> str:
    """What a value is, in words (never its repr used as text)."""
    if value is None:
        return "nothing"
    if isinstance(value, str):
        return "an empty text" if not value.strip() else "text"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return f"an object with keys {', '.join(map(str, value)) or 'none'}"
    return f"a {type(value).__name__}"


def blank(value: Any) -> bool:
    """Whether an optional value is absent: nothing, or a text of white space only."""
    return value is None or (isinstance(value, str) and not value.strip())


def nonempty(value: Any, where: str, column: str, expected: str = "text") -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column `{column}` holds {describe(value)}; expected {expected}")
    return value


def _content(value: Any, where: str, label: str) -> str:
    """A message's content: text, or a list of text parts (TRL's multimodal form, text only)."""
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get("text") for p in value]
        if all(isinstance(t, str) for t in texts) and texts:
            value = "".join(texts)  # type: ignore[arg-type]
    if not isinstance(value, str):
        raise DataError(f"{where}: {label} has content of {describe(value)}; expected text")
    return value


def messages(value: Any, where: str, column: str) -> Conversation:
    """A column of messages as `{role, content}` dicts (ShareGPT's `{from, value}` too)."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: column `{column}` holds {describe(value)}; expected a list of messages"
        )
    out = []
    for number, message in enumerate(value, start=1):
        label = f"column `{column}` message {number}"
        if not isinstance(message, dict):
            raise DataError(f"{where}: {label} is {describe(message)}; expected {{role, content}}")
        role = message.get("role", message.get("from"))
        if role not in ROLES:
            raise DataError(
                f"{where}: {label} has role {role if isinstance(role, str) else describe(role)}; "
                f"expected one of {', '.join(sorted(set(ROLES.values())))}"
            )
        value, system = message.get("content", message.get("value")), ROLES[role] == "system"
        content = "" if system and value is None else _content(value, where, label)
        if system and blank(content):
            continue  # an empty system message is none (ShareGPT and Orca sets hold many)
        out.append({"role": ROLES[role], "content": content})
    return out


def prompt_turns(value: Any, where: str, column: str) -> Conversation:
    if isinstance(value, list):
        prompt = messages(value, where, column)
        if not any(m["role"] == "user" for m in prompt):
            raise DataError(f"{where}: column `{column}` has no user turn")
        return prompt
    return user_turn(nonempty(value, where, column, "text or a list of messages").strip())


def answer_text(value: Any, prompt: Conversation, where: str, column: str) -> str:
    """An answer given as text, as one assistant message, or (UltraFeedback) as the prompt's
    messages followed by one assistant message."""
    if not isinstance(value, list):
        return nonempty(value, where, column, "text or a list of messages")
    answer = messages(value, where, column)
    if len(answer) > 1 and not _same_turns(answer[:-1], prompt[-(len(answer) - 1) :]):
        raise DataError(
            f"{where}: column `{column}` holds {len(answer)} messages that are not the prompt's "
            "followed by one answer"
        )
    return split_answer(prompt + answer[-1:], where, column)[1]


def _same_turns(a: Conversation, b: Conversation) -> bool:
    return [(m["role"], m["content"].strip()) for m in a] == [
        (m["role"], m["content"].strip()) for m in b
    ]
