"""Rule-based reward functions (`reward.functions`): user callables `(prompts, responses) ->
list[float]`, loaded from `module:callable`, `path/to/file.py:callable` or `builtin:<name>`
(verifiable.py), and their output checked (one finite number per response; never a silent
default).

TRL's convention for the rest of a prompt's row (GRPOTrainer `_calculate_rewards`): every extra
column of the prompt dataset (`solution`, `answer`, `tests`, ...) arrives as a keyword argument,
a list with one value per response, beside `completion_ids` (each response's token ids) and
`step` (the PPO iteration; TRL passes `trainer_state`). A function is given only the keywords
its signature accepts (`**kwargs` accepts all), so a two-argument function keeps working; one
whose required keyword names a column the data lacks is refused before training
(`missing_columns`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rlhf_cli.errors import DataError
from rlhf_cli.recipe.names import BUILTIN_PREFIX, BUILTIN_REWARDS

RewardFn = Callable[..., Any]
ALWAYS_GIVEN = ("completion_ids", "step")  # keywords every call offers, whatever the data


def load_reward_function(spec: str, options: dict[str, Any] | None = None) -> RewardFn:
    """The callable `spec` names, with `options` bound as keyword arguments; ValueError (one
    line) when it cannot be imported, is not callable or takes no such option."""
    fn, options = named_function(spec), options or {}
    params = inspect.signature(fn).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"{spec} takes no option {', '.join(unknown)}")
    if spec.startswith(BUILTIN_PREFIX):  # a built-in's keyword-only argument is an option
        needed = [
            p.name
            for p in params.values()
            if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in options
        ]
        if needed:
            raise ValueError(
                f"{spec} needs the option {needed[0]} (`options: {{{needed[0]}: ...}}`)"
            )
    return functools.partial(fn, **options) if options else fn


def named_function(spec: str) -> RewardFn:
    """The callable `spec` names, options unbound: `builtin:<name>`, `file.py:name` or
    `module:name`."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_REWARDS:
            raise ValueError(
                f"no built-in reward {name!r}; the built-ins are "
                + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_REWARDS)
            )
        from rlhf_cli.verifiable import BUILTINS

        return BUILTINS[name]
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


def _parameters(fn: RewardFn) -> tuple[set[str] | None, list[str]]:
    """The keywords `fn` accepts after its two positional arguments (None: any, `**kwargs`)
    and those it requires (no default); a `functools.partial`'s bound options count as given."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        accepted = None
    else:
        accepted = {
            p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
    required = [
        p.name
        for p in params[2:]
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return accepted, required


def missing_columns(functions: list[tuple[str, RewardFn]], columns: set[str]) -> str | None:
    """One line naming the first function whose required keyword is a column not in
    `columns` (the prompt data's extra columns), or None when every function has its columns."""
    for spec, fn in functions:
        for name in _parameters(fn)[1]:
            if name not in columns and name not in ALWAYS_GIVEN:
                have = ", ".join(sorted(columns)) or "none"
                return (
                    f"reward function {spec} needs column `{name}`, which data.prompts lacks "
                    f"(its extra columns: {have}; map one with `columns: {{{name}: ...}}`)"
                )
    return None


def lacking_columns(recipe: Any, columns: list[dict[str, Any]]) -> str | None:
    """`missing_columns` for the recipe's reward and judge functions (`reward.functions`,
    `audit.judge.functions`) against the prompts' extra columns (`columns`, one dict a row):
    `rlhf validate --data` and `rlhf ppo` (before any model loads) refuse the same."""
    judge = recipe.audit.judge
    specs = [*recipe.reward.functions, *(judge.functions if judge is not None else [])]
    names = {name for row in columns for name in row}
    return missing_columns([(f.function, f.load()) for f in specs], names)


def call_reward_function(
    spec: str,
    fn: RewardFn,
    prompts: list[str],
    responses: list[str],
    keywords: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`fn`'s rewards as a float32 tensor (n,), with the counts it reports
    (`verifiable.Rewards.metrics`); `keywords` (the row's columns, `completion_ids`, `step`)
    are passed where `fn` accepts them. A DataError naming `spec` when it raises or returns
    anything but one finite number per response."""
    accepted, _ = _parameters(fn)
    given = {k: v for k, v in (keywords or {}).items() if accepted is None or k in accepted}
    try:
        values = fn(list(prompts), list(responses), **given)
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
    return torch.tensor(out, dtype=torch.float32), dict(getattr(values, "metrics", {}))


class RemoteReward:
    """A reward model behind HTTP (`reward.url`), OpenRLHF's `--remote_rm_url` protocol: POST
    `{"query": [template texts], "prompts": [...], "responses": [...]}`, with each extra column
    of the prompts' rows (a list, one value per response) and `step` beside them, and read back
    `{"rewards": [one float per response]}` (`"scores"` is accepted too). A server that is down,
    slow past `timeout` seconds or answers anything else is retried `retries` times, then a
    DataError (exit 2) says what went wrong."""

    def __init__(self, url: str, template: str, timeout: float, retries: int):
        self.url, self.template, self.timeout, self.retries = url, template, timeout, retries

    def __call__(self, prompts: list[str], responses: list[str], **columns: Any) -> list[float]:
        import time
        import urllib.error
        import urllib.request

        texts = [
            self.template.format(prompt=p, response=r)
            for p, r in zip(prompts, responses, strict=True)
        ]
        columns.pop("completion_ids", None)  # token ids: the server has the texts
        fields = {**columns, "query": texts, "prompts": prompts, "responses": responses}
        body = json.dumps(fields, default=str).encode()
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
