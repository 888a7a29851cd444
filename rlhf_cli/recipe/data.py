"""The `data` section: each stage's sources (one dataset, or a weighted mixture), checked
without reading them: paths and globs exist, splits parse, columns name ours."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlhf_cli.recipe.base import Section, described, near_recipe, resolve_local

COLUMNS = ("text", "messages", "prompt", "input", "system", "completion", "chosen", "rejected")
SPLIT_SPEC = re.compile(r"^[\w.-]+(\[(-?\d+%?)?:(-?\d+%?)?\])?$")


class SourceSpec(Section):
    """One dataset: a local file, local files, or a hub dataset (with its subset and files)."""

    path: str | None = described(
        None,
        "A local .json/.jsonl/.csv/.parquet/.txt file (relative to the recipe) or a hub dataset "
        "name (`org/name`); may be left out when `data_files` names local files.",
    )
    name: str | None = described(
        None, "The hub dataset's subset (configuration), e.g. `harmless-base`."
    )
    split: str = described(
        "train",
        "Split to read, optionally sliced: `train`, `train_prefs`, `train[:5%]`, `train[100:]`. "
        "A local file has the one split `train`.",
    )
    data_files: list[str] = described(
        [],
        "Files to read: local paths or globs (relative to the recipe; each must match a file), "
        "or, with a hub `path`, file patterns inside that dataset. Files with different columns "
        "are read one by one.",
    )
    columns: dict[Literal[COLUMNS], str] = described(  # type: ignore[valid-type]
        {},
        "The dataset's column for each of our names (LLaMA-Factory's `columns`): "
        "`{prompt: question, completion: answer}`. Ours: " + ", ".join(COLUMNS) + " (`input` is "
        "appended to the prompt as Alpaca's; `system` becomes the conversation's system message).",
    )
    max_samples: int | None = described(
        None, "Keep only the first N rows (after the split's slice).", ge=1
    )
    weight: float = described(
        1.0,
        "In a mixture (`sources`): this source's training rows times `weight`, applied after the "
        "held-out split (0.5 keeps a seeded half, 2 takes every row twice).",
        gt=0.0,
    )

    @field_validator("path")
    @classmethod
    def _local_data(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_local(value, info, "data file")

    @field_validator("data_files", mode="before")
    @classmethod
    def _one_file(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("split")
    @classmethod
    def _split_spec(cls, value: str) -> str:
        if not all(SPLIT_SPEC.match(part) for part in value.split("+")):
            raise ValueError(
                f"'{value}' is not a split: write `train`, `train[:5%]`, `train[10:200]` or "
                "`train[:50%]+test[:10%]`"
            )
        return value

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo) -> SourceSpec:
        return _check_files(self, info)

    def where(self) -> str:
        """How errors name this source."""
        if self.path is None:
            return ", ".join(self.data_files)
        return self.path if self.name is None else f"{self.path} ({self.name})"


def _check_files(spec: SourceSpec, info: ValidationInfo) -> Any:
    """A source names something to read; a local one has no subset and only the split `train`;
    its `data_files` globs are made absolute and each must match a file."""
    local_path = spec.path is not None and Path(spec.path).is_file()
    if spec.path is None and not spec.data_files:
        raise ValueError("give `path` (a file or a hub dataset) or `data_files`")
    if spec.path is None or local_path:
        if "+" in spec.split or spec.split.split("[")[0] != "train":
            raise ValueError(
                f"split: a local file has the one split `train` (got '{spec.split}'); "
                "slice it as `train[:5%]`"
            )
        if spec.name is not None:
            raise ValueError("name: a subset names a part of a hub dataset, not a local file")
    if local_path and spec.data_files:
        raise ValueError("data_files: `path` is already a local file; list the files in one")
    if spec.path is None:
        spec.data_files = [_local_glob(pattern, info) for pattern in spec.data_files]
    return spec


def _local_glob(pattern: str, info: ValidationInfo) -> str:
    """A local file or glob made absolute against the recipe's folder; it must match a file."""
    import glob

    absolute = str(near_recipe(pattern, info).resolve())
    if not any(Path(p).is_file() for p in glob.glob(absolute, recursive=True)):
        raise ValueError(f"data_files: no file matches {absolute}")
    return absolute


class StageSource(SourceSpec):
    """A stage's data: one source (its fields here), or a mixture of several (`sources`)."""

    sources: list[SourceSpec] = described(
        [],
        "Several datasets mixed into one (each with its own `path`, `split`, `columns`, `weight` "
        "...), instead of the one named by this section's own fields.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_or_several(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sources"):
            own = sorted(
                k
                for k in set(data) & set(SourceSpec.model_fields)
                if data[k] != SourceSpec.model_fields[k].get_default(call_default_factory=True)
            )
            if own:
                raise ValueError(
                    f"sources: give {', '.join(own)} inside each source, not beside `sources`"
                )
        return data

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo) -> StageSource:
        return self if self.sources else _check_files(self, info)

    def parts(self) -> list[SourceSpec]:
        """The sources to read, in order."""
        if self.sources:
            return list(self.sources)
        return [
            SourceSpec.model_construct(**{k: getattr(self, k) for k in SourceSpec.model_fields})
        ]

    def where(self) -> str:
        return " + ".join(s.where() for s in self.sources) if self.sources else super().where()


class DataSource(StageSource):
    eval_fraction: float = described(0.1, "Share of rows held out for evaluation.", gt=0.0, lt=0.5)


class PromptSource(StageSource):
    columns: dict[str, str] = described(
        {},
        "The dataset's column for each of our names (`{prompt: question}`; ours: "
        + ", ".join(COLUMNS)
        + "), and for any other name a column renamed to it: an extra column, which reaches the "
        "reward functions as a keyword argument (`{solution: answer}`, docs/rewards.md).",
    )
    min_words: int = described(
        6,
        "Drop prompts with fewer words, counted over the whole conversation (the guide drops 5 "
        "words or fewer).",
        ge=0,
    )
    max_chars: int = described(
        512, "Cut each turn of a prompt to this many characters (the guide's `text[:512]`).", gt=0
    )
    max_tokens: int = described(
        256,
        "Longest tokenised prompt (chat template included): a longer one loses its oldest turns, "
        "then the start of its last turn.",
        gt=0,
    )

    @field_validator("columns")
    @classmethod
    def _column_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if name not in COLUMNS and not name.isidentifier():
                raise ValueError(f"{name!r} is neither one of ours nor a keyword argument name")
        return value

    eval_fraction: float = described(
        0.0,
        "Share of the prompts held out of PPO training (a fixed-seed draw: the same for every "
        "run.seed) for the held-out evaluation: every `ppo.eval_every` iterations and at the "
        "end (0: none).",
        ge=0.0,
        lt=0.5,
    )


class DataSection(Section):
    sft: DataSource | None = described(
        None,
        "SFT rows: `text`, `messages` (the last assistant turn is the answer, everything before "
        "it the prompt), or `prompt`/`completion` as text or messages (also `response`, "
        "`output`, Alpaca's `instruction`/`input`/`output`).",
    )
    preferences: DataSource | None = described(
        None,
        "Preference pairs: `prompt`/`chosen`/`rejected` (text or messages, UltraFeedback's "
        "repeated user turn too), or `chosen`/`rejected` alone (HH-RLHF dialogues, message "
        "lists, or texts whose shared start is the prompt).",
    )
    prompts: PromptSource | None = described(
        None,
        "PPO prompts: `prompt` as text or messages, or the prompt of any SFT or preference "
        "layout (a conversation up to its last assistant turn, system message included).",
    )
