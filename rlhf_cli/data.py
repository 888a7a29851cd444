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
"""

from __future__ import annotations

import glob
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from rlhf_cli.errors import DataError
from rlhf_cli.recipe import AuditSection, PromptSource, SourceSpec, StageSource

Message = dict[str, str]
Conversation = list[Message]  # a prompt: the messages before the answer
T = TypeVar("T")

HH_HUMAN = "\n\nHuman:"
HH_ASSISTANT = "\n\nAssistant:"
HH_TURN = re.compile(r"\n\n(Human|Assistant):")
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "tool": "tool"}  # fmt: skip
ALIASES = {"prompt": ("instruction",), "completion": ("response", "output")}
MIX_SEED = 20240229  # the mixture's draws (a weight's fractional part): the same on every process


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


@dataclass
class StageData(Generic[T]):
    """What a stage reads: its items, and how they were got (the data check and the manifest
    show these)."""

    items: list[T]
    rows: int = 0  # rows read
    layouts: dict[str, str] = field(default_factory=dict)  # source -> layout
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    cut: dict[str, int] = field(default_factory=dict)  # reason -> rows shortened
    sampled: bool = False  # a hub source was read only in part (`limit`)

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
    return prompt, _nonempty(conversation[-1]["content"], where, column)


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


def _nonempty(value: Any, where: str, column: str, expected: str = "text") -> str:
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
        content = _content(message.get("content", message.get("value")), where, label)
        out.append({"role": ROLES[role], "content": content})
    return out


def _prompt_of(value: Any, where: str, column: str) -> Conversation:
    if isinstance(value, list):
        prompt = messages(value, where, column)
        if not any(m["role"] == "user" for m in prompt):
            raise DataError(f"{where}: column `{column}` has no user turn")
        return prompt
    return user_turn(_nonempty(value, where, column, "text or a list of messages").strip())


def _answer_of(value: Any, prompt: Conversation, where: str, column: str) -> str:
    """An answer given as text, as one assistant message, or (UltraFeedback) as the prompt's
    messages followed by one assistant message."""
    if not isinstance(value, list):
        return _nonempty(value, where, column, "text or a list of messages")
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


def _layout(rows: list[Row], stage: str, where: str) -> str:
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
    system = values.get("system")
    if system is None or (prompt and prompt[0]["role"] == "system"):
        return prompt
    return [{"role": "system", "content": _nonempty(system, where, "system")}, *prompt]


def _prompted(values: dict[str, Any], where: str) -> Conversation:
    return _with_system(_prompt_of(values["prompt"], where, "prompt"), values, where)


def example_of(row: Row) -> Example:
    """An SFT row: `text`, `messages` (split at the final assistant turn), or prompt/completion."""
    v, where = row.values, row.where
    if _has(v, "messages"):
        prompt, answer = split_answer(messages(v["messages"], where, "messages"), where, "messages")
        return Example(_with_system(prompt, v, where), answer)
    if not _has(v, "prompt"):
        return Example(None, _nonempty(v["text"], where, "text"))
    prompt = _prompted(v, where)
    return Example(prompt, _answer_of(v["completion"], prompt, where, "completion"))


def pair_of(row: Row) -> Pair:
    """A preference row with its prompt explicit, implicit (the answers' shared start), HH-RLHF
    dialogues, or UltraFeedback's repeated user turn."""
    v, where = row.values, row.where
    if _has(v, "prompt"):
        prompt = _prompted(v, where)
        return Pair(prompt, *(_answer_of(v[k], prompt, where, k) for k in ("chosen", "rejected")))
    if isinstance(v["chosen"], str) and isinstance(v["rejected"], str):
        if _hh(v):
            sides = [hh_messages(v[k], where, k) for k in ("chosen", "rejected")]
        else:
            return _text_pair(v["chosen"], v["rejected"], where)
    else:
        sides = [messages(v[k], where, k) for k in ("chosen", "rejected")]
    prompt, chosen = split_answer(sides[0], where, "chosen")
    other, rejected = split_answer(sides[1], where, "rejected")
    if prompt != other:
        raise DataError(f"{where}: `chosen` and `rejected` differ before their last assistant turn")
    return Pair(_with_system(prompt, v, where), chosen, rejected)


def _text_pair(chosen: str, rejected: str, where: str) -> Pair:
    """TRL's implicit prompt for texts: the answers' longest shared start (a space at the cut
    stays with the answers)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n and not chosen[n - 1].isspace() and n < len(chosen):
        n -= 1  # cut at a word boundary: a shared first letter is not a prompt
    if not chosen[:n].strip():
        raise DataError(
            f"{where}: `chosen` and `rejected` share no start to take as the prompt; name the "
            "prompt column (`columns: {prompt: ...}`)"
        )
    answers = (_nonempty(text[n:], where, key) for text, key in
               ((chosen, "chosen"), (rejected, "rejected")))  # fmt: skip
    return Pair(user_turn(chosen[:n].strip()), *(a.strip() for a in answers))


def prompt_of(row: Row) -> Conversation:
    """The prompt of any layout: `prompt`, a conversation before its final assistant turn (or
    the whole one when it ends with the user), or a preference pair's shared prompt."""
    v, where = row.values, row.where
    if _has(v, "prompt"):
        return _prompted(v, where)
    if _has(v, "messages"):
        conversation = messages(v["messages"], where, "messages")
        if conversation[-1]["role"] != "assistant":
            return _with_system(conversation, v, where)
        return _with_system(split_answer(conversation, where, "messages")[0], v, where)
    if _hh(v):  # a dialogue alone (HH-RLHF's `chosen` without its pair) has its prompt too
        dialogue = hh_messages(v["chosen"], where, "chosen")
        return _with_system(split_answer(dialogue, where, "chosen")[0], v, where)
    return pair_of(row).prompt


# ── reading sources ─────────────────────────────────────────────────────────────────────────────


def read_text(path: Path) -> str:
    """A local text file's contents; a DataError naming the file (and the line) when it cannot
    be read or is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None


def json_lines(
    path: Path, not_json: Callable[[json.JSONDecodeError], str]
) -> Iterator[tuple[int, Any]]:
    """Each non-blank line of a UTF-8 file, parsed, with its 1-based number; a line that is
    not JSON is a DataError `path:line: not_json(error)`."""
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: {not_json(exc)}") from None
        yield number, value


def _jsonl_rows(path: Path) -> list[Row]:
    rows = []
    for number, values in json_lines(path, lambda exc: f"not valid JSON ({exc.msg})"):
        if not isinstance(values, dict):
            raise DataError(f"{path}:{number}: a row must be a JSON object")
        rows.append(Row(values, f"{path}:{number}"))
    return rows


def _text_rows(path: Path) -> list[Row]:
    """A .txt file: one prompt a line."""
    lines = read_text(path).splitlines()
    return [Row({"prompt": t.strip()}, f"{path}:{n}") for n, t in enumerate(lines, 1) if t.strip()]


def _json_rows(path: Path) -> list[Row]:
    """A .json file: a list of objects, or JSON Lines under a .json name."""
    try:
        value = json.loads(read_text(path))
    except json.JSONDecodeError:
        return _jsonl_rows(path)
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a list of objects (or one JSON object a line)")
    for number, values in enumerate(value, start=1):
        if not isinstance(values, dict):
            raise DataError(f"{path}: row {number} is {describe(values)}; expected an object")
    return [Row(values, f"{path}: row {n}") for n, values in enumerate(value, start=1)]


def _library_rows(load: Callable[[], Any], what: str, limit: int | None) -> list[Row]:
    """Rows through `datasets` (Parquet, CSV, the hub), the first `limit` when streaming."""
    import itertools

    try:
        ds = load()
        values = list(itertools.islice(ds, limit)) if limit else ds.to_list()
    except Exception as exc:  # datasets raises many types; all mean "cannot read this source"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise DataError(f"cannot load dataset '{what}': {first}") from None
    return [Row(v, f"{what} row {n}") for n, v in enumerate(values, start=1)]


def _file_rows(path: Path, cache_dir: str | None) -> list[Row]:
    with path.open("rb") as file:
        if not file.read(4096).strip() and path.stat().st_size <= 4096:
            raise DataError(f"dataset '{path}' is empty")
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    if path.suffix == ".txt":
        return _text_rows(path)
    if path.suffix == ".json":
        return _json_rows(path)
    import datasets

    builder = FORMATS.get(path.suffix, "json")
    return _library_rows(
        lambda: datasets.load_dataset(
            builder, data_files=str(path), split="train", cache_dir=cache_dir
        ),
        str(path),
        None,
    )


def slice_rows(rows: list[T], split: str) -> list[T]:
    """A split's slice (`train[10:20]`, `train[:5%]`, datasets' notation) of a local source's
    rows; percentages round to the nearest row."""
    if "[" not in split:
        return rows
    ends = split[split.index("[") + 1 : -1].split(":")

    def index(text: str) -> int | None:
        if not text:
            return None
        if text.endswith("%"):
            return round(len(rows) * int(text[:-1]) / 100)
        return int(text)

    return rows[index(ends[0]) : index(ends[1])]


def read_source(
    spec: SourceSpec, cache_dir: str | Path | None = None, limit: int | None = None
) -> tuple[list[Row], bool]:
    """One source's rows, its columns renamed onto ours (`columns`, then the usual aliases),
    after the split's slice and `max_samples`; and whether a hub source was cut at `limit`
    rows (read by streaming, not downloaded whole)."""
    import datasets

    datasets.disable_progress_bars()
    cache = str(cache_dir) if cache_dir else None
    files = _local_files(spec)
    if files is not None:
        rows = [row for path in files for row in _file_rows(path, cache)]
        rows = slice_rows(rows, spec.split)
        sampled = False
    else:
        what = f"{spec.where()} [{spec.split}]"
        rows = _library_rows(
            lambda: datasets.load_dataset(
                spec.path, spec.name, split=spec.split, data_files=spec.data_files or None,
                cache_dir=cache, streaming=limit is not None,
            ),
            what,
            limit,
        )  # fmt: skip
        sampled = limit is not None and len(rows) == limit
    rows = rows[: spec.max_samples] if spec.max_samples else rows
    if not rows:
        raise DataError(f"dataset '{spec.where()}' has no rows")
    return [_renamed(row, spec) for row in rows], sampled


def _local_files(spec: SourceSpec) -> list[Path] | None:
    """The local files a source names (its `path` or its `data_files` globs), or None for a hub
    dataset or a local dataset folder (read by `datasets`)."""
    if spec.path is not None:
        return [Path(spec.path)] if Path(spec.path).is_file() else None
    matches = {Path(p) for pattern in spec.data_files for p in glob.glob(pattern, recursive=True)}
    return sorted(p for p in matches if p.is_file())


def _renamed(row: Row, spec: SourceSpec) -> Row:
    values = dict(row.values)
    for ours, theirs in spec.columns.items():
        if theirs not in row.values:
            raise DataError(
                f"{row.where}: no column `{theirs}` (columns.{ours}); it has "
                f"{', '.join(map(str, row.values)) or 'none'}"
            )
        values[ours] = values.pop(theirs)
    for ours, names in ALIASES.items():
        if values.get(ours) is None:
            values[ours] = next((values[n] for n in names if values.get(n) is not None), None)
    if values.get("input") is not None and values.get("prompt") is not None:
        extra = values.pop("input")  # Alpaca: the instruction, then its input
        if isinstance(extra, str) and extra.strip() and isinstance(values["prompt"], str):
            values["prompt"] = f"{values['prompt']}\n\n{extra}"
    return Row(values, row.where)


def _weighted(items: list[T], weight: float) -> list[T]:
    """`weight` times the items: whole copies, then a seeded draw for the fraction."""
    whole, fraction = int(weight), weight - int(weight)
    drawn = random.Random(MIX_SEED).sample(range(len(items)), round(len(items) * fraction))
    return items * whole + [items[i] for i in sorted(drawn)]


def _load(
    source: StageSource,
    stage: str,
    convert: Callable[[Row], T],
    cache_dir: str | Path | None,
    limit: int | None,
) -> StageData[T]:
    """Every source of a stage's data, each checked for one layout and converted row by row."""
    out: StageData[T] = StageData([])
    for spec in source.parts():
        rows, sampled = read_source(spec, cache_dir, limit)
        out.layouts[spec.where()] = _layout(rows, stage, spec.where())
        out.rows += len(rows)
        out.sampled = out.sampled or sampled
        out.items += _weighted([convert(row) for row in rows], spec.weight)
    return out


def _drop(data: StageData[T], keep: Callable[[T], bool], reason: str) -> None:
    kept = [item for item in data.items if keep(item)]
    if len(kept) < len(data.items):
        data.dropped[reason] = data.dropped.get(reason, 0) + len(data.items) - len(kept)
    data.items = kept


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
    if not data.items:
        raise DataError(f"{source.where()}: every pair's chosen and rejected answers are the same")
    return data


def load_prompts(
    source: PromptSource, cache_dir: str | Path | None = None, limit: int | None = None
) -> StageData[Conversation]:
    """PPO prompts of any layout: each turn cut to `max_chars`, prompts of fewer than
    `min_words` words (over all turns) dropped."""
    data = _load(source, "prompts", prompt_of, cache_dir, limit)
    cut = 0
    for prompt in data.items:
        for message in prompt:
            if len(message["content"].strip()) > source.max_chars:
                message["content"] = message["content"].strip()[: source.max_chars]
                cut += 1
    if cut:
        data.cut[f"turns over {source.max_chars} characters (data.prompts.max_chars)"] = cut
    _drop(
        data,
        lambda p: sum(len(m["content"].split()) for m in p) >= source.min_words,
        f"fewer than {source.min_words} words (data.prompts.min_words)",
    )
    if not data.items:
        raise DataError(
            f"no prompt of '{source.where()}' has {source.min_words} words or more "
            f"(data.prompts.min_words)"
        )
    return data


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


def overlap(train: list[Conversation], heldout: list[Conversation]) -> int:
    """Held-out prompts whose text is also a training prompt (duplicates in the data)."""
    seen = Counter(prompt_text(p) for p in train)
    return sum(1 for p in heldout if seen[prompt_text(p)])


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
