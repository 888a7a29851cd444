"""The offline methods' rows as their stages read them (`rlhf dpo`, `orpo`, `simpo`: pairs; `rlhf
kto`: thumbs rows), shared with `rlhf validate --data --stage`: a source in the other layout is
a DataError naming it, in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_cli.data import Pair, load_preferences, read_source
from rlhf_cli.data.layouts import example_of, layout_of, source_layout
from rlhf_cli.data.rows import Conversation, StageData, describe
from rlhf_cli.errors import DataError
from rlhf_cli.recipe import StageSource


@dataclass(frozen=True)
class Thumb:
    """One KTO row: an answer to a prompt, with a thumbs-up (`label` true) or down."""

    prompt: Conversation
    completion: str
    label: bool


def read_pairs(
    source: StageSource, method: str, cache_dir: Path | None, limit: int | None = None
) -> StageData[Pair]:
    """The pairs of `source` (the first `limit` rows of each part); rows without a chosen and a
    rejected answer are a DataError naming their layout."""
    try:
        return load_preferences(source, cache_dir=cache_dir, limit=limit)
    except DataError:
        unpaired = unpaired_layout(source, cache_dir)
        if unpaired is None:
            raise
        raise DataError(
            f"{unpaired[0]}: its rows are unpaired ({unpaired[1]}), one answer each; rlhf "
            f"{method} needs a chosen and a rejected answer per row (`prompt`, `chosen`, "
            "`rejected`); rlhf kto trains on such rows"
        ) from None


def read_thumbs(
    source: StageSource, cache_dir: Path | None, limit: int | None = None
) -> StageData[Thumb]:
    """The rows of `source` (the first `limit` of each part): `prompt`, `completion` and a
    boolean `label` (SFT's prompt-completion reader, `example_of`, plus the label); paired
    rows are a DataError naming their layout."""
    data: StageData[Thumb] = StageData([])
    for index, spec in enumerate(source.parts()):
        rows, sampled = read_source(spec, cache_dir, limit=limit)
        data.sampled = data.sampled or sampled
        paired = layout_of(rows[0].values, "preferences")
        if paired:
            raise DataError(
                f"{spec.where()}: its rows are paired ({paired}), a chosen and a rejected "
                "answer each; rlhf kto needs one answer per row with a thumbs-up or down "
                "(`prompt`, `completion`, `label` true/false); rlhf dpo, orpo and simpo train "
                "on pairs"
            )
        data.layouts[spec.where()] = source_layout(rows, "sft", spec.where())
        data.rows += len(rows)
        data.weights.append(spec.weight)
        for row in rows:
            example, label = example_of(row), row.values.get("label")
            if example.prompt is None or not isinstance(label, bool):
                raise DataError(
                    f"{row.where}: rlhf kto needs `prompt`, `completion` and `label` true or "
                    f"false; this row's label is {describe(label)}"
                )
            data.items.append(Thumb(example.prompt, example.answer, label))
            data.origins.append(index)
    return data


def unpaired_layout(source: StageSource, cache_dir: Path | None) -> tuple[str, str] | None:
    """(the source, its layout) of the first source whose rows hold one answer each (a
    prompt-completion row, KTO's with a `label`), or None."""
    for spec in source.parts():
        rows, _ = read_source(spec, cache_dir, limit=1)
        values = rows[0].values
        if layout_of(values, "preferences"):
            continue
        layout = layout_of(values, "sft")
        if not layout:
            return None
        if values.get("label") is not None:
            layout += " with `label`: KTO's thumbs-up/down layout"
        return spec.where(), layout
    return None
