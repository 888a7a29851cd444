"""Datasets of each stage: local JSON/JSONL/CSV/Parquet files or hub names, through `datasets`.

Row shapes understood:
- prompts: `prompt`, `instruction`, or HH-RLHF's `chosen` dialogue (the first human turn, as in
  the guide's `prepare_prompt_dataset`).
- preference pairs: `prompt`/`chosen`/`rejected`, or HH-RLHF's two full dialogues
  `chosen`/`rejected` (split at the last assistant turn into a shared prompt and two responses).
- SFT: `messages` (chat), `prompt`/`response` (also `prompt`/`completion`, `instruction`/`output`),
  or `text`.
- audit: prompts from the recipe or a text file (one a line); responses generated elsewhere as
  JSONL rows with `prompt` and `response`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlhf_cli.errors import DataError
from rlhf_cli.recipe import AuditSection, DataSource, PromptSource

HH_HUMAN = "\n\nHuman:"
HH_ASSISTANT = "\n\nAssistant:"
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(source: DataSource, cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """All rows of a data source as dicts (the first `max_samples` when set)."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source.path)
    # `datasets` reports an empty file as a bare "StopIteration"; only small files are read here.
    if path.is_file() and path.stat().st_size < 4096 and not path.read_bytes().strip():
        raise DataError(f"dataset '{source.path}' is empty")
    if path.suffix in (".jsonl", ".txt") and path.is_file():
        rows = read_jsonl(path) if path.suffix == ".jsonl" else read_text_prompts(path)
        return rows[: source.max_samples] if source.max_samples else rows
    try:
        if path.suffix in FORMATS and path.exists():
            ds = datasets.load_dataset(
                FORMATS[path.suffix],
                data_files=str(path),
                split="train",
                cache_dir=str(cache_dir) if cache_dir else None,
            )
        else:
            ds = datasets.load_dataset(
                source.path, split=source.split, cache_dir=str(cache_dir) if cache_dir else None
            )
    except Exception as exc:  # datasets raises many types; all mean "cannot read this source"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise DataError(f"cannot load dataset '{source.path}': {first}") from None
    if source.max_samples:
        ds = ds.select(range(min(source.max_samples, len(ds))))
    rows = ds.to_list()
    if not rows:
        raise DataError(f"dataset '{source.path}' is empty")
    return rows


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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A local JSON Lines file as rows (every row has every column seen; missing ones None,
    as `datasets` reads it). Blank lines are skipped; a line that is not a JSON object is a
    DataError naming the file and its 1-based line."""
    rows = []
    for number, row in json_lines(path, lambda exc: f"not valid JSON ({exc.msg})"):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: a row must be a JSON object")
        rows.append(row)
    if not rows:
        raise DataError(f"dataset '{path}' has no rows (only blank lines)")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{k: row.get(k) for k in columns} for row in rows]


def read_text_prompts(path: Path) -> list[dict[str, Any]]:
    """A .txt file of one prompt a line as `prompt` rows."""
    rows = [{"prompt": line.strip()} for line in read_text(path).splitlines() if line.strip()]
    if not rows:
        raise DataError(f"'{path}' has no prompts (only blank lines)")
    return rows


def _require(rows: list[dict[str, Any]], source: DataSource, *options: tuple[str, ...]) -> None:
    columns = set(rows[0]) if rows else set()
    if not any(set(opt) <= columns for opt in options):
        wanted = " or ".join("/".join(opt) for opt in options)
        raise DataError(
            f"dataset '{source.path}' needs columns {wanted}; "
            f"it has {', '.join(sorted(columns)) or 'none'}"
        )


def hh_human_turn(dialogue: str) -> str:
    """The first human turn of an HH-RLHF dialogue (the guide's parsing)."""
    return dialogue.split(HH_ASSISTANT)[0].replace("Human: ", "").strip()


def hh_split(dialogue: str) -> tuple[str, str]:
    """Split an HH-RLHF dialogue at its last assistant turn: (prompt, response).

    The prompt is the dialogue before that turn without the leading `Human: `, so that the
    reward template `Human: {prompt}\\n\\nAssistant: {response}` rebuilds the dialogue.
    """
    head, sep, response = dialogue.rpartition(HH_ASSISTANT)
    if not sep:
        raise DataError("an HH-RLHF dialogue has no '\\n\\nAssistant:' turn")
    return head.strip().removeprefix("Human:").strip(), response.strip()


def row_prompt(row: dict[str, Any]) -> str:
    if row.get("prompt"):
        return str(row["prompt"])
    if row.get("instruction"):
        return str(row["instruction"])
    if row.get("chosen"):
        return hh_human_turn(str(row["chosen"]))
    return ""


def load_prompts(source: PromptSource, cache_dir: str | Path | None = None) -> list[str]:
    """PPO prompts: short ones dropped (`min_words`), long ones cut to `max_chars`."""
    rows = load_rows(source, cache_dir)
    _require(rows, source, ("prompt",), ("instruction",), ("chosen",))
    prompts = [p.strip()[: source.max_chars] for p in map(row_prompt, rows)]
    prompts = [p for p in prompts if p and len(p.split()) >= source.min_words]
    if not prompts:
        raise DataError(
            f"no prompt of '{source.path}' has {source.min_words} words or more "
            f"(data.prompts.min_words)"
        )
    return prompts


HELDOUT_SEED = 20240229  # the held-out draw's: fixed, so every run holds out the same prompts


def split_heldout(prompts: list[str], fraction: float) -> tuple[list[str], list[str]]:
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


def _text(row: dict[str, Any], keys: tuple[str, ...], source: DataSource, number: int) -> str:
    """The first of `keys` the row has, which must be non-empty text; else a DataError naming
    the file, the row and what it holds instead."""
    key = next((k for k in keys if row.get(k) is not None), keys[0])
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        held = "nothing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
        raise DataError(f"{source.path}: row {number}: `{key}` must be text, it holds {held}")
    return value


def load_preferences(
    source: DataSource, cache_dir: str | Path | None = None
) -> tuple[list[dict[str, str]], int]:
    """Preference pairs as `prompt`/`chosen`/`rejected` strings, and how many pairs were
    skipped because their two answers are the same text (they teach nothing). A row whose
    answer is missing, null or not text is a DataError naming it."""
    rows = load_rows(source, cache_dir)
    _require(rows, source, ("prompt", "chosen", "rejected"), ("chosen", "rejected"))
    pairs, same = [], 0
    for number, row in enumerate(rows, start=1):
        chosen, rejected = (_text(row, (k,), source, number) for k in ("chosen", "rejected"))
        if row.get("prompt") is not None:
            pair = {"prompt": _text(row, ("prompt",), source, number), "chosen": chosen,
                    "rejected": rejected}  # fmt: skip
        else:
            prompt, chosen = hh_split(chosen)
            pair = {"prompt": prompt, "chosen": chosen, "rejected": hh_split(rejected)[1]}
        if pair["chosen"].strip() == pair["rejected"].strip():
            same += 1
            continue
        pairs.append(pair)
    if not pairs:
        raise DataError(f"{source.path}: every pair's chosen and rejected answers are the same")
    return pairs, same


def load_sft(
    source: DataSource, chat: bool, cache_dir: str | Path | None = None
) -> list[dict[str, Any]]:
    """SFT rows in one of TRL's formats: conversational prompt/completion, messages, or text.
    A row without its answer (or prompt, or text) as non-empty text is a DataError naming it."""
    rows = load_rows(source, cache_dir)
    _require(
        rows,
        source,
        ("messages",),
        ("prompt", "response"),
        ("prompt", "completion"),
        ("instruction", "output"),
        ("text",),
    )
    out = []
    for number, row in enumerate(rows, start=1):
        if row.get("messages") is not None:
            out.append({"messages": row["messages"]})
            continue
        if row.get("text") is not None and row.get("prompt") is row.get("instruction") is None:
            out.append({"text": _text(row, ("text",), source, number)})
            continue
        prompt = _text(row, ("prompt", "instruction"), source, number)
        answer = _text(row, ("response", "completion", "output"), source, number)
        if chat:
            out.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "completion": [{"role": "assistant", "content": answer}],
                }
            )
        else:
            out.append({"prompt": prompt, "completion": answer})
    return out


def split_eval(rows: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seeded shuffle split into (train, eval); at least one row on each side."""
    if len(rows) < 2:
        raise DataError(f"need at least 2 rows to hold some out for evaluation, got {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(len(rows) * fraction)), len(rows) - 1)
    return [rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]]


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
