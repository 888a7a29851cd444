"""The `eval` section: yardsticks outside the reward model (`rlhf eval`). Each suite is off until
the recipe names it: a judge head to head (`judge`), verifiable checks (`checks`), benchmarks
through lm-evaluation-harness (`benchmarks`); `gate` turns their results into an exit code."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, field_validator, model_validator

from rlhf_cli.recipe.base import Section, described, near_recipe
from rlhf_cli.recipe.ppo import GenerationSection

DEFAULT_JUDGE_PROMPT = """You are comparing two answers to the same request.

Request:
{prompt}

Answer A:
{answer_a}

Answer B:
{answer_b}

Which answer is more helpful, correct and clear? Length alone is not a merit. Reply with one
letter: A or B."""


def _local_file(value: str | None, info: ValidationInfo, what: str) -> str | None:
    if value is None:
        return None
    path = near_recipe(value, info)
    if not path.exists():
        raise ValueError(f"{what} not found: {path}")
    return str(path.resolve())


class EvalJudgeSection(Section):
    url: str = described(
        ...,
        "Base URL of an OpenAI-compatible endpoint (`/v1/chat/completions`), e.g. "
        "`http://127.0.0.1:8001` from `rlhf serve --model JUDGE`.",
    )
    model: str = described(..., "The model name the endpoint serves the judge under.")
    api_key_env: str | None = described(
        None,
        "Name of the environment variable that holds the API key (sent as a bearer token); the "
        "key itself is never written anywhere. None: no key.",
    )
    prompt: str = described(
        DEFAULT_JUDGE_PROMPT,
        "The judge's instruction, with `{prompt}`, `{answer_a}` and `{answer_b}`; the verdict "
        "is the first `A` or `B` of the reply (anything else is unreadable and counts as a tie).",
    )
    prompts_file: str | None = described(
        None,
        "A JSONL file of prompts (`prompt` column, or `messages`) to answer and judge; None: the "
        "run's held-out PPO prompts (`data.prompts`, `eval_fraction`).",
    )
    max_prompts: int = described(200, "At most this many prompts are judged.", gt=0)
    max_tokens: int = described(8, "Longest verdict the judge may write, in tokens.", gt=0)
    timeout_s: float = described(60.0, "Longest wait for one verdict before a retry.", gt=0.0)
    retries: int = described(2, "Tries after the first for a verdict that fails.", ge=0)
    concurrency: int = described(8, "Verdicts asked for at once.", gt=0)
    bootstrap: int = described(1000, "Bootstrap resamples for the win rate's interval.", gt=0)

    @field_validator("prompts_file")
    @classmethod
    def _prompts_exist(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _local_file(value, info, "prompts file")

    @field_validator("prompt")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        missing = [k for k in ("{prompt}", "{answer_a}", "{answer_b}") if k not in value]
        if missing:
            raise ValueError(f"the judge prompt lacks {', '.join(missing)}")
        return value


class ChecksSection(Section):
    path: str = described(
        ...,
        "A JSONL file of prompts to answer and check: `prompt` (or `messages`), and `solution` "
        "(graded by `grader`) and/or `instructions` (IFEval-style checks, a list of "
        '`{"check": name, ...arguments}`).',
    )
    grader: Literal["math", "exact", "contains", "regex"] = described(
        "math",
        "How a `solution` is graded: `math` (math-verify, the gold parsed first, the answer "
        "from the last `\\boxed{}` or the last number), `exact` (equal after stripping), "
        "`contains` (the solution appears in the answer), `regex` (the solution is a pattern "
        "the answer matches).",
    )
    timeout_s: float = described(
        5.0,
        "Longest parse-and-verify of one answer (math), or regex match (regex); past it the "
        "answer is wrong (`timeout`).",
        gt=0.0,
    )
    max_rows: int | None = described(None, "Check at most this many rows.", gt=0)

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str, info: ValidationInfo) -> str:
        return _local_file(value, info, "checks file") or value


class BenchmarksSection(Section):
    tasks: list[str] = described(
        ..., "lm-evaluation-harness task names (`gsm8k`, or tasks of `include_path`).", min_length=1
    )
    include_path: str | None = described(
        None, "A folder of task YAML files (and their local data) to register: offline tasks."
    )
    chat_template: Literal["auto", "on", "off"] = described(
        "auto",
        "Apply the policy's chat template to each task's prompts: `auto` as training did "
        "(`model.prompt_format: chat`); the result names what was applied per task.",
    )
    num_fewshot: int | None = described(None, "Few-shot examples (None: each task's own).", ge=0)
    limit: int | None = described(None, "At most this many documents a task.", gt=0)
    batch_size: int = described(8, "Documents a forward pass.", gt=0)

    @field_validator("include_path")
    @classmethod
    def _include_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _local_file(value, info, "task folder")


# The gate's minimums by the suite whose summary they read (max_alignment_tax: by task).
GATED = {"min_win_rate": "judge", "min_lc_win_rate": "judge", "min_accuracy": "checks"}


class GateSection(Section):
    min_win_rate: float | None = described(
        None,
        "Least judge win rate against the baseline (ties count half); needs `judge`.",
        ge=0.0,
        le=1.0,
    )
    min_lc_win_rate: float | None = described(
        None,
        "Least length-controlled judge win rate against the baseline; needs `judge`.",
        ge=0.0,
        le=1.0,
    )
    min_accuracy: float | None = described(None, "Least accuracy on `checks`.", ge=0.0, le=1.0)
    max_alignment_tax: dict[str, float] = described(
        {},
        "Per benchmark task (one of `benchmarks.tasks`), the lowest allowed gain on the "
        "baseline's score, e.g. `{gsm8k: -0.02}`: the score minus the baseline's, or the "
        "baseline's minus the score for a lower-is-better metric (perplexity), so negative is "
        "always a loss.",
    )


class EvalSection(Section):
    policies: list[str] = described(
        ["ppo"],
        "What `rlhf eval` measures when no label is given: `base`, `sft`, `ppo`, a PPO checkpoint "
        "(`best`, `last`, `iter_N`) or a model folder.",
        min_length=1,
    )
    baseline: str = described("sft", "What every policy is compared with (a label as above).")
    generation: GenerationSection = described(
        GenerationSection(do_sample=False), "How the answers are generated (greedy by default)."
    )
    judge: EvalJudgeSection | None = described(None, "A judge head to head against the baseline.")
    checks: ChecksSection | None = described(None, "Verifiable checks of the answers.")
    benchmarks: BenchmarksSection | None = described(
        None, "Benchmarks through lm-evaluation-harness (`pip install 'rlhf-cli[eval]'`)."
    )
    gate: GateSection = described(
        GateSection(), "Thresholds that make `rlhf eval` exit 4 when a policy misses one."
    )

    @model_validator(mode="after")
    def _gate_measured(self) -> EvalSection:
        """Every gate threshold reads a suite this section runs (and a task it benchmarks): a
        threshold nothing measures would fail every run, and only after the models ran."""
        gate = self.gate
        unmeasured = [
            f"{name} is set but eval.{suite} is not (set both)"
            for name, suite in GATED.items()
            if getattr(gate, name) is not None and getattr(self, suite) is None
        ]
        tasks = self.benchmarks.tasks if self.benchmarks is not None else []
        unknown = ", ".join(sorted(set(gate.max_alignment_tax) - set(tasks)))
        if unknown and not tasks:
            unmeasured.append(f"max_alignment_tax names {unknown} but eval.benchmarks is not set")
        elif unknown:
            unmeasured.append(
                f"max_alignment_tax names {unknown}, not among eval.benchmarks.tasks "
                f"({', '.join(tasks)})"
            )
        if unmeasured:
            raise ValueError(f"gate: {'; '.join(unmeasured)}")
        return self
