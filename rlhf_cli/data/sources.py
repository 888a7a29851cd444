"""Reading a source: local JSON Lines, JSON, CSV, Parquet and text files (or globs of them)
or a hub dataset (streamed when sampled, with the rows training reads); the split's slice,
`max_samples`, the `columns` mapping and the usual aliases; a mixture's weights."""

from __future__ import annotations

import glob
import itertools
import json
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rlhf_cli.data.rows import Row, T, describe
from rlhf_cli.errors import DataError
from rlhf_cli.recipe import SourceSpec

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ALIASES = {"prompt": ("instruction",), "completion": ("response", "output")}
MIX_SEED = 20240229  # the mixture's draws (a weight's fractional part): the same on every process


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
    not JSON is a DataError `path:line: not_json(error)`, and so is an object that gives a key
    twice (JSON keeps the last)."""
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: {not_json(exc)}") from None
        except _DuplicateKey as exc:
            raise DataError(f"{path}:{number}: {exc}") from None
        yield number, value


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it gives one key twice (the first value would be dropped
    unseen)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key `{key}` is given twice in one object; JSON keeps the last")
        out[key] = value
    return out


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
        value = json.loads(read_text(path), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError:
        return _jsonl_rows(path)
    except _DuplicateKey as exc:
        raise DataError(f"{path}: {exc}") from None
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a list of objects (or one JSON object a line)")
    for number, values in enumerate(value, start=1):
        if not isinstance(values, dict):
            raise DataError(f"{path}: row {number} is {describe(values)}; expected an object")
    return [Row(values, f"{path}: row {n}") for n, values in enumerate(value, start=1)]


def _library_rows(load: Callable[[], Any], what: str, limit: int | None) -> list[Row]:
    """Rows through `datasets` (Parquet, CSV, the hub), the first `limit` when streaming."""
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
        rows = _library_rows(lambda: _hub_rows(spec, cache, limit), what, limit)
        sampled = limit is not None and len(rows) == limit
    rows = rows[: spec.max_samples] if spec.max_samples else rows
    if not rows:
        raise DataError(f"dataset '{spec.where()}' has no rows")
    return [_renamed(row, spec) for row in rows], sampled


def _hub_rows(spec: SourceSpec, cache: str | None, limit: int | None) -> Iterable[Any]:
    """A hub source's rows, the same rows in the same order whether all are read (training) or
    the first `limit` (`rlhf validate --data`): streamed when only `limit` are wanted and every
    slice of the split counts rows from its start (`datasets` streams no sliced split: the slice
    is taken here, on the stream); else loaded whole and sliced by `datasets` (a percentage or
    a negative bound needs the split's size)."""
    import datasets

    def load(split: str, streaming: bool) -> Any:
        return datasets.load_dataset(
            spec.path, spec.name, split=split, data_files=spec.data_files or None,
            cache_dir=cache, streaming=streaming,
        )  # fmt: skip

    parts = _stream_slices(spec.split) if limit is not None else None
    if parts is None:
        return load(spec.split, streaming=False)
    return itertools.chain.from_iterable(
        itertools.islice(load(name, streaming=True), start, stop) for name, start, stop in parts
    )


def _stream_slices(split: str) -> list[tuple[str, int | None, int | None]] | None:
    """`train[10:20]+test` as (split, start, stop) per part, or None when a bound is a
    percentage or negative (counted from the split's size, which a stream does not know)."""
    parts = []
    for part in split.split("+"):
        name, _, bounds = part.partition("[")
        ends = bounds.rstrip("]").split(":") if bounds else ["", ""]
        if any(end.endswith("%") or end.startswith("-") for end in ends):
            return None
        start, stop = (int(end) if end else None for end in ends)
        parts.append((name, start, stop))
    return parts


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


def copies(n: int, weight: float) -> list[int]:
    """How many times each of `n` rows is taken at `weight`: its whole part, and one more for a
    seeded draw of the rows for the fraction (0.5 keeps a seeded half)."""
    whole, fraction = int(weight), weight - int(weight)
    drawn = set(random.Random(MIX_SEED).sample(range(n), round(n * fraction)))
    return [whole + (i in drawn) for i in range(n)]
