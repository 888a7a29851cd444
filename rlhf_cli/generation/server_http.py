"""HTTP to the vLLM servers, for their client (`server.py`) and `rlhf serve`: one call with its
timeout, the parsers that refuse an answer that is not the route's (`Malformed`), the retries,
the one deadline a batch of calls shares (`Batch`), and the check at start that every server
answers (`check_servers`). A failed try is anything short of a
whole, well-formed answer: refused, reset, timed out, cut short mid-answer, not JSON, missing
fields; an HTTP 4xx is the server's refusal and is not tried again."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import torch

from rlhf_cli.errors import GenerationServerLost, ModelLoadError
from rlhf_cli.generation.vllm import has_vllm
from rlhf_cli.recipe import ServerSection

START_TIMEOUT_S = 10.0  # the model-list call at start: a server that is up answers at once


class ServerReply(Exception):
    """A server answered, but with an error (HTTP 4xx/5xx)."""

    def __init__(self, status: int, text: str):
        self.status = status
        super().__init__(f"HTTP {status}: {text[:300]}")


class Malformed(ValueError):
    """A server answered, but not as the route answers: retried like a failed request."""


def call(
    url: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout: float = 60.0,
    headers: dict[str, str] | None = None,
) -> Any:
    """One HTTP call: POST `body` as JSON (GET without one), with `headers` besides (an
    endpoint's `Authorization`); the JSON answer, its text when it is not JSON (vLLM's adapter
    routes answer in words), or None. An answer cut short (the server died mid-answer) is a
    `ConnectionError`, as a dropped connection is."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        raise ServerReply(exc.code, exc.read().decode(errors="replace")) from None
    except http.client.HTTPException as exc:  # IncompleteRead, BadStatusLine, ...
        raise ConnectionError(f"the answer was cut short ({exc!r})") from None
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError):
        return "no answer within the timeout"
    return str(exc) or type(exc).__name__


def models_in(reply: Any) -> list[dict[str, Any]]:
    """The model list of a `/v1/models` answer (`Malformed` when it is none)."""
    data = reply.get("data") if isinstance(reply, dict) else None
    if (
        not isinstance(data, list)
        or not data
        or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data)
    ):
        raise Malformed(f"an answer that is no model list: {str(reply)[:100]!r}")
    return data


def served_models(url: str, timeout: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
    """The server's model list (`/v1/models`): its base model and any loaded adapters."""
    return models_in(call(url, "/v1/models", timeout=timeout))


def completion(reply: Any) -> tuple[Any, list[int], list[float]]:
    """(model named, token ids, their log-probs) of a `/v1/completions` answer (`Malformed`
    when it lacks any)."""
    try:
        choice = reply["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        drawn = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        model = reply.get("model")
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        raise Malformed(
            "an answer without token ids and log-probs (they need vLLM >= 0.32 and "
            "`return_token_ids`)"
        ) from None
    if len(drawn) != len(tokens):
        raise Malformed(f"an answer of {len(tokens)} tokens with {len(drawn)} log-probs")
    return model, tokens, drawn


def field_of(key: str, kind: type | tuple[type, ...]) -> Any:
    """A parser of JSON object answers: the value of `key`, of `kind`."""

    def parse(reply: Any) -> Any:
        if not isinstance(reply, dict) or key not in reply or not isinstance(reply[key], kind):
            raise Malformed(f"an answer without a {key}: {str(reply)[:100]!r}")
        return reply[key]

    return parse


def pause(attempt: int) -> float:
    """Seconds between try `attempt` (from 0) and the next."""
    return min(2.0**attempt, 10.0)


def batch_deadline_s(server: ServerSection) -> float:
    """How long a batch's answers may take in all: one request's longest path (every try
    timing out, with the pauses between). The rows go out together (up to MAX_IN_FLIGHT per
    server, which vLLM batches), so a server slower than that on one batch is taken as lost."""
    return (server.retries + 1) * server.timeout_s + sum(map(pause, range(server.retries)))


class Batch:
    """One `generate` call's requests: one deadline for them all, over at the first failure or
    when the call is abandoned (`abandon`); from then on no row is asked for, and the threads
    with a request in flight end with it, unheard."""

    def __init__(self, rows: int, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.ends = time.monotonic() + deadline_s
        self.answers: list[Any] = [None] * rows
        self.error: BaseException | None = None
        self.over = threading.Event()
        self._lock = threading.Lock()
        self._asked = self._left = rows

    def take(self) -> int | None:
        """The next row to ask for; None once every row is asked for or the batch is over."""
        with self._lock:
            if self.over.is_set() or not self._asked:
                return None
            self._asked -= 1
            return len(self.answers) - self._asked - 1

    def answered(self, row: int, answer: Any) -> None:
        with self._lock:
            self.answers[row], self._left = answer, self._left - 1
            if not self._left:
                self.over.set()

    def fail(self, error: BaseException) -> None:
        """End the batch with `error` (the first one stands)."""
        with self._lock:
            self.error = self.error or error
        self.over.set()

    def abandon(self) -> None:
        """End the batch unless it is answered: nobody will read it."""
        with self._lock:
            done = not self._left
        if not done:
            self.fail(GenerationServerLost("the call was abandoned"))

    def left_s(self) -> float:
        return self.ends - time.monotonic()

    def run(
        self, answer: Callable[[int], Any], workers: int, late: Callable[[], BaseException]
    ) -> list[Any]:
        """Every row's `answer(row)`, asked for by `workers` daemon threads until the batch is
        over or its deadline passes (then it fails with `late()`); the first failure ends the
        batch and is raised here, in the caller's thread."""

        def work() -> None:
            while (row := self.take()) is not None:
                try:
                    self.answered(row, answer(row))
                except BaseException as exc:  # noqa: BLE001 — raised in the caller's thread
                    self.fail(exc)

        for _ in range(max(1, workers)):
            threading.Thread(target=work, name="batch", daemon=True).start()
        if not self.over.wait(max(self.left_s(), 0.0)):
            self.fail(late())
        if self.error is not None:
            raise self.error
        return self.answers


def retrying(
    url: str,
    path: str,
    body: dict[str, Any] | None,
    timeout_s: float,
    tries: int,
    parse: Any = None,
    batch: Batch | None = None,
) -> Any:
    """The answer to one call (through `parse`, which raises `Malformed` on an answer that is
    not the route's), tried up to `tries` times, each within `timeout_s` and the batch's
    deadline; no try once the batch is over. Then `GenerationServerLost` names the server."""
    for attempt in range(tries):
        timeout = timeout_s
        if batch is not None:
            if batch.over.is_set():
                raise GenerationServerLost(f"the batch {path} was part of is over")
            timeout = min(timeout, max(batch.left_s(), 0.01))
        try:
            reply = call(url, path, body, timeout)
            return reply if parse is None else parse(reply)
        except ServerReply as exc:
            if exc.status < 500:  # the server refuses it: asking again will not help
                raise GenerationServerLost(f"the server at {url} refused {path}: {exc}") from None
            error: BaseException = exc
        except (OSError, ValueError) as exc:  # refused, reset, timed out, cut, malformed
            error = exc
        if attempt + 1 < tries:
            time.sleep(pause(attempt))
    raise GenerationServerLost(
        f"the rollout server at {url} failed {path} {tries} time(s) ({reason(error)})"
    )


def check_servers(server: ServerSection, section: str) -> None:
    """Every server answers its model list (one line naming the first that does not, exit 2),
    and an explicit `weight_transfer: nccl` has what it needs: checked before any model
    loads."""
    if server.weight_transfer == "nccl":
        missing = (
            "CUDA" if not torch.cuda.is_available()
            else "the vllm package in the trainer's environment" if not has_vllm()
            else "one training process (each would open its own group to the servers)"
            if int(os.environ.get("WORLD_SIZE", "1")) > 1
            else None
        )  # fmt: skip
        if missing:
            raise ModelLoadError(
                f"{section}.server.weight_transfer: nccl needs {missing}; use `disk` (the "
                "weights through server.shared_dir)"
            )
    for url in server.urls:
        try:
            served_models(url)
        except (OSError, ServerReply, ValueError) as exc:
            raise ModelLoadError(
                f"{section}.server.urls: {url} does not answer ({reason(exc)}): start it with "
                "`rlhf serve` (or `vllm serve`, docs/rollout-server.md) or fix the URL"
            ) from None
