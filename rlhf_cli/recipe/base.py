"""What every recipe section shares: the strict base model, the described field, and how
paths in a recipe resolve (relative to the recipe's folder; hub ids kept; built-ins checked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
)

from rlhf_cli.recipe.names import BUILTIN_PREFIX

LOCAL_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")


def described(default: Any, description: str, **kw: Any) -> Any:
    return Field(default, description=description, **kw)


def near_recipe(value: str, info: ValidationInfo) -> Path:
    """`value` as a path, relative ones taken from the recipe's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / path


def resolve_local(value: str, info: ValidationInfo, what: str) -> str:
    """Make a local path absolute against the recipe's folder and check that it exists.

    Strings that look like hub ids (`org/name`, no file suffix, not on disk) are kept as they are;
    a built-in model's name is checked (known, its package installed) without building it.
    """
    if value.startswith(BUILTIN_PREFIX):
        from rlhf_cli.errors import ModelLoadError
        from rlhf_cli.tiny import check_builtin

        try:
            check_builtin(value.removeprefix(BUILTIN_PREFIX))
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None
        return value
    candidate = near_recipe(value, info)
    looks_local = (
        value.startswith((".", "/", "~"))
        or value.endswith(LOCAL_DATA_SUFFIXES)
        or candidate.exists()
    )
    if not looks_local:
        return value
    if not candidate.exists():
        raise ValueError(f"{what} not found: {candidate}")
    return str(candidate.resolve())


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
