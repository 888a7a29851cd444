"""Error types for user mistakes. The CLI prints each as one line and exits with `exit_code`.

Anything that is not an `RlhfError` is a bug and keeps its traceback.
"""

from __future__ import annotations


class RlhfError(Exception):
    """A user-facing error: bad input, missing stage, unusable hardware."""

    exit_code = 2


class RecipeError(RlhfError):
    """The recipe file cannot be read or does not validate; one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class StageError(RlhfError):
    """A stage cannot start: its input stage is missing, failed, or the run is busy."""


class DataError(RlhfError):
    """A dataset is missing, empty, or lacks the columns a stage needs."""


class ModelLoadError(RlhfError):
    """A model cannot be loaded as the recipe asks (e.g. 4-bit where bitsandbytes cannot)."""


class HackingDetected(RlhfError):
    """The audit found reward hacking: exit 1 so that a shell pipeline can gate on it."""

    exit_code = 1
