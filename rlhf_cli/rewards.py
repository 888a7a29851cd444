"""Rule-based reward functions (`reward.functions`): user callables `(prompts, responses) ->
list[float]`, loaded from `module:callable` or `path/to/file.py:callable`, and their output
checked (one finite number per response; never a silent default)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rlhf_cli.errors import DataError

RewardFn = Callable[[list[str], list[str]], Any]


def load_reward_function(spec: str) -> RewardFn:
    """The callable `spec` names; ValueError (one line) when it cannot be imported or is not
    callable."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            module = _file_module(path, path.stat().st_mtime_ns)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error means "cannot use it"
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise ValueError(f"cannot import {module_name}: {first}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no callable {attr!r}")
    return fn


@functools.cache
def _file_module(path: Path, mtime_ns: int) -> ModuleType:
    """A reward `.py` file, executed once per process while it is unchanged (validation and
    the scorer share it)."""
    loader_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}", path)
    if loader_spec is None or loader_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return module


def call_reward_function(
    spec: str, fn: RewardFn, prompts: list[str], responses: list[str]
) -> torch.Tensor:
    """`fn`'s rewards as a float32 tensor (n,); a DataError naming `spec` when it raises or
    returns anything but one finite number per response."""
    try:
        values = fn(list(prompts), list(responses))
        out = [float(v) for v in values]
    except Exception as exc:  # the user's code
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise DataError(f"reward function {spec} failed: {first}") from None
    if len(out) != len(responses):
        raise DataError(
            f"reward function {spec} returned {len(out)} rewards for {len(responses)} responses"
        )
    if not all(math.isfinite(v) for v in out):
        raise DataError(f"reward function {spec} returned a non-finite reward")
    return torch.tensor(out, dtype=torch.float32)


class RemoteReward:
    """A reward model behind HTTP (`reward.url`), OpenRLHF's `--remote_rm_url` protocol: POST
    `{"query": [template texts], "prompts": [...], "responses": [...]}` and read back
    `{"rewards": [one float per response]}` (`"scores"` is accepted too). A server that is down,
    slow past `timeout` seconds or answers anything else is retried `retries` times, then a
    DataError (exit 2) says what went wrong."""

    def __init__(self, url: str, template: str, timeout: float, retries: int):
        self.url, self.template, self.timeout, self.retries = url, template, timeout, retries

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        import json
        import time
        import urllib.error
        import urllib.request

        texts = [
            self.template.format(prompt=p, response=r)
            for p, r in zip(prompts, responses, strict=True)
        ]
        body = json.dumps({"query": texts, "prompts": prompts, "responses": responses}).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0**attempt * 0.25, 5.0))
            request = urllib.request.Request(
                self.url, body, {"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                    reply = json.loads(answer.read().decode("utf-8"))
            except (OSError, ValueError) as exc:  # refused, timed out, HTTP error, not JSON
                problem = str(getattr(exc, "reason", None) or exc).splitlines()[0]
                continue
            rewards = reply.get("rewards", reply.get("scores")) if isinstance(reply, dict) else None
            if not isinstance(rewards, list):
                raise DataError(f"remote reward {self.url} answered without a `rewards` list")
            return rewards
        raise DataError(
            f"remote reward {self.url} failed after {self.retries + 1} attempts: {problem}"
        )
