"""vLLM servers of their own as the rollout engine (`generation.backend: vllm_server`): generation
on other GPUs or machines, reached over vLLM's OpenAI-compatible HTTP API. No serving layer of
our own: `rlhf serve` starts vLLM's server; this module is its client.

- Requests carry token ids (no re-tokenising), each row's seed, the recipe's sampling settings
  and stop ids; answers come back as token ids with the sampler's processed log-probs (the
  server runs with `--logprobs-mode processed_logprobs`), as the colocated engine gives them.
- `sync` sends the policy after every update under a new, never reused name: `lora` writes the
  adapter into `server.shared_dir` and loads it (`/v1/load_lora_adapter`, runtime LoRA
  loading), every request naming it; `weights` writes the merged weights there and reloads them
  in place (`/collective_rpc reload_weights`), or with `server.weight_transfer: nccl` sends
  them GPU to GPU over vLLM's NCCL weight-transfer engine (the server started with
  `--weight-transfer-config '{"backend": "nccl"}'`); then `/update_weight_version` (vLLM's dev
  endpoints, `VLLM_SERVER_DEV_MODE=1`), checking `/weight_info` before and after each batch. An
  answer that names another model or version than the one asked is refused: a batch never
  mixes versions.
- Every call has a timeout; a request that fails or times out is retried `server.retries`
  times, then `GenerationServerLost` (exit 2) names the server; the PPO loop checkpoints first.
- At start (`check_servers`, before any model loads) every server must answer its model list;
  once the policy is built (`verify`), a log-prob probe against the local forward refuses a
  server that serves another base model.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf_cli.errors import GenerationServerLost, ModelLoadError
from rlhf_cli.generation.core import (
    Generations,
    generations_from,
    left_pad,
    response_logits,
    response_logprobs,
)
from rlhf_cli.generation.vllm import adapter_in_use, merged_weights
from rlhf_cli.generation.weight_transfer import (
    PolicyWeights,
    SyncClient,
    has_vllm,
    open_nccl_transfer,
    weight_transfer,
)
from rlhf_cli.recipe import GenerationSection, ServerSection

START_TIMEOUT_S = 10.0  # the model-list call at start: a server that is up answers at once
PROBE = GenerationSection(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0)
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# Mean |log-prob| gap on the probe's tokens above which the server serves another model: the
# same weights give ~1e-5 in float32 and ~1e-2 in bfloat16; another checkpoint, nats.
PROBE_BOUND = 0.1
MAX_IN_FLIGHT = 64  # concurrent requests per server (vLLM batches them itself)


class ServerReply(Exception):
    """A server answered, but with an error (HTTP 4xx/5xx)."""

    def __init__(self, status: int, text: str):
        self.status = status
        super().__init__(f"HTTP {status}: {text[:300]}")


def call(url: str, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    """One HTTP call: POST `body` as JSON (GET without one); the JSON answer, its text when it
    is not JSON (vLLM's adapter routes answer in words), or None."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as exc:
        raise ServerReply(exc.code, exc.read().decode(errors="replace")) from None
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError):
        return "no answer within the timeout"
    return str(exc) or type(exc).__name__


def served_models(url: str, timeout: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
    """The server's model list (`/v1/models`): its base model and any loaded adapters."""
    return call(url, "/v1/models", timeout=timeout)["data"]


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
        except (OSError, ServerReply, ValueError, KeyError) as exc:
            raise ModelLoadError(
                f"{section}.server.urls: {url} does not answer ({_reason(exc)}): start it with "
                "`rlhf serve` (or `vllm serve`, docs/rollout-server.md) or fix the URL"
            ) from None


@dataclass
class ServerGenerator:
    """The `Generator` over vLLM servers (`backend: vllm_server`)."""

    tokenizer: Any
    stop_ids: list[int]
    device: torch.device  # where the returned tensors go (the policy's)
    server: ServerSection
    mode: Literal["lora", "weights"]
    transfer: Literal["disk", "nccl"]  # how `weights` travel: the shared folder, or NCCL
    shared_dir: Path  # written here, read by every server
    bases: dict[str, str]  # url -> the base model's name on that server
    max_len: int  # prompt and answer together
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # this run's names
    uploads: int = 0
    model: str | None = None  # the adapter every request names (None: the base)
    weights: str | None = None  # the weight version the servers hold (`weights` mode)
    _busy: threading.Condition = field(default_factory=threading.Condition)
    _in_flight: int = 0  # calls asked for (pinned) and not yet answered or released
    _pins: dict[str | None, int] = field(default_factory=dict)  # the models they name
    _loaded: list[str] = field(default_factory=list)  # adapters / weight folders, oldest first
    _nccl: dict[str, Any] = field(default_factory=dict)  # url -> vLLM's trainer-side engine

    # ── sync ────────────────────────────────────────────────────────────────────────────────

    def sync(self, model: Any) -> None:
        """The servers answer as `model` from now on, under a name never used before: the
        policy's adapter (`lora`; the reference, adapter off, is the base model itself) or its
        merged weights (`weights`, once every batch in flight is answered)."""
        if self.mode == "lora":
            self.model = self._send_adapter(model) if adapter_in_use(model) else None
        else:
            self._send_weights(model)

    def _next_name(self) -> str:
        self.uploads += 1
        return f"rlhf-{self.tag}-v{self.uploads}"

    def _send_adapter(self, model: Any) -> str:
        name = self._next_name()
        folder = self.shared_dir / name
        model.save_pretrained(folder)  # the adapter alone (a peft model)
        for url in self.server.urls:
            self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        self._loaded.append(name)
        self._drop_old(keep=1)
        return name

    def _drop_old(self, keep: int) -> None:
        """Unload and delete all but the newest `keep` uploads, except those a pinned call
        still names."""
        for old in self._loaded[:-keep]:
            if self._pins.get(old):
                continue
            self._loaded.remove(old)
            if self.mode == "lora":
                for url in self.server.urls:
                    try:
                        self._post(url, "/v1/unload_lora_adapter", {"lora_name": old}, tries=1)
                    except (GenerationServerLost, ServerReply):
                        pass  # gone already: nothing holds it
            shutil.rmtree(self.shared_dir / old, ignore_errors=True)

    def _send_weights(self, model: Any) -> None:
        name = self._next_name()
        if self.transfer == "disk":
            folder = self.shared_dir / name
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            merged = merged_weights(model)
            weights = {key: value.detach().cpu().contiguous() for key, value in merged}
            base.save_pretrained(folder, state_dict=weights)
        with self._busy:  # reloading in place under a batch would mix two versions in it
            if not self._busy.wait_for(lambda: self._in_flight == 0, self.server.timeout_s):
                raise GenerationServerLost(
                    f"the rollouts in flight did not finish within server.timeout_s "
                    f"({self.server.timeout_s:g} s), so the weights could not be reloaded"
                )
            for url in self.server.urls:
                if self.transfer == "nccl":
                    engine = self._nccl_engine(url, model)
                    engine.source.model = model  # the weights as they are now (gathered)
                    engine.send_weights()  # start, update (beside the broadcast), finish
                else:
                    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                    self._post(url, "/collective_rpc", rpc)
                self._post(url, "/reset_prefix_cache", {})
                self._post(url, "/update_weight_version", {"new_version": name})
                self._check_version(url, name)
            self.weights = name
        if self.transfer == "disk":
            self._loaded.append(name)
            self._drop_old(keep=1)

    def _nccl_engine(self, url: str, model: Any) -> Any:
        """The NCCL group to the server at `url` (opened at the first sync: this process is
        rank 0, the server's workers the rest); a group a stopped trainer left is shut first."""
        if url not in self._nccl:
            try:
                self._post(url, "/shutdown_weight_transfer_engine", {}, tries=1)
            except GenerationServerLost:
                pass  # none was open
            try:
                workers = int(self._get(url, "/get_world_size")["world_size"])
                client = SyncClient(lambda path, body: self._post(url, path, body, tries=1))
                self._nccl[url] = open_nccl_transfer(url, client, PolicyWeights(model), workers)
            except GenerationServerLost as exc:
                raise ModelLoadError(
                    f"the server at {url} opened no NCCL weight transfer ({exc}): start it with "
                    '`rlhf serve` (it adds --weight-transfer-config \'{"backend": "nccl"}\' '
                    "on GPUs) or set server.weight_transfer: disk"
                ) from None
        return self._nccl[url]

    def _check_version(self, url: str, expected: str | None) -> None:
        held = self._get(url, "/weight_info").get("weight_version")
        if held != expected:
            raise GenerationServerLost(
                f"the server at {url} holds weight version {held!r}, not {expected!r}: another "
                "trainer is syncing to it; give each run servers of its own"
            )

    # ── generate ────────────────────────────────────────────────────────────────────────────

    def generate(
        self, queries: list[list[int]], gen: GenerationSection, seeds: list[int] | None = None
    ) -> Generations:
        """Answers to `queries` from the servers (rows split across them in order), each row
        from its seed; every answer checked to come from the model this call asked for."""
        return self.pinned()(queries, gen, seeds)

    def pinned(self) -> Pinned:
        """`generate` as the servers answer now, for a call made later (a rollout drawn ahead,
        `async_steps`): its adapter stays loaded, and the weights stay in place, until the call
        is made or released."""
        pinned = Pinned(self, self.model, self.weights)
        with self._busy:
            self._in_flight += 1
            self._pins[self.model] = self._pins.get(self.model, 0) + 1
        return pinned

    def _release(self, model: str | None) -> None:
        with self._busy:
            self._in_flight -= 1
            self._pins[model] -= 1
            self._busy.notify_all()

    def _generate(
        self,
        queries: list[list[int]],
        gen: GenerationSection,
        seeds: list[int] | None,
        urls: list[str],
        model: str | None,
        weights: str | None,
    ) -> Generations:
        seeds = seeds if seeds is not None else [None] * len(queries)
        share = -(-len(queries) // len(urls))
        rows = enumerate(zip(queries, seeds, strict=True))
        jobs = [(urls[row // share], query, seed) for row, (query, seed) in rows]
        if weights is not None:
            for url in urls:
                self._check_version(url, weights)
        workers = max(1, min(len(jobs), MAX_IN_FLIGHT * len(urls)))
        with ThreadPoolExecutor(workers, thread_name_prefix="vllm-server") as pool:
            answers = list(pool.map(lambda job: self._answer(*job, gen, model), jobs))
        if weights is not None:
            for url in urls:
                self._check_version(url, weights)
        tokens = [a[0] for a in answers]
        drawn = [a[1] for a in answers]
        generations = generations_from(self.tokenizer, self.stop_ids, queries, tokens, drawn)
        return generations.to(self.device)

    def _answer(
        self,
        url: str,
        query: list[int],
        seed: int | None,
        gen: GenerationSection,
        model: str | None,
    ) -> tuple[list[int], list[float]]:
        name = model or self.bases[url]
        body = {
            "model": name,
            "prompt": query,
            "max_tokens": gen.max_new_tokens,
            "temperature": gen.temperature if gen.do_sample else 0.0,
            "top_p": gen.top_p if gen.do_sample else 1.0,
            "top_k": gen.top_k if gen.do_sample and gen.top_k else 0,
            "seed": seed,
            "logprobs": 1,
            "stop_token_ids": self.stop_ids,
            "ignore_eos": True,  # the stop tokens above decide, as with HF
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        reply = self._post(url, "/v1/completions", body)
        try:
            choice = reply["choices"][0]
            tokens, drawn = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise GenerationServerLost(
                f"the server at {url} answered without token ids and log-probs: it needs vLLM "
                ">= 0.32 (`return_token_ids`)"
            ) from None
        if reply.get("model") != name or len(drawn) != len(tokens):
            raise GenerationServerLost(
                f"the server at {url} answered as {reply.get('model')!r}, asked for {name!r}: "
                "an answer of an unknown policy version is never trained on"
            )
        if len(tokens) > gen.max_new_tokens:
            raise GenerationServerLost(
                f"the server at {url} answered {len(tokens)} tokens, past max_new_tokens"
            )
        return list(tokens), [float(x) for x in drawn]

    # ── HTTP with timeouts and retries ──────────────────────────────────────────────────────

    def _post(self, url: str, path: str, body: dict[str, Any], tries: int | None = None) -> Any:
        return self._retrying(url, path, body, tries)

    def _get(self, url: str, path: str) -> Any:
        return self._retrying(url, path, None, None)

    def _retrying(self, url: str, path: str, body: dict[str, Any] | None, tries: int | None) -> Any:
        tries = tries if tries is not None else self.server.retries + 1
        for attempt in range(tries):
            try:
                return call(url, path, body, self.server.timeout_s)
            except ServerReply as exc:
                if exc.status < 500:  # the server refuses it: asking again will not help
                    raise GenerationServerLost(
                        f"the server at {url} refused {path}: {exc}"
                    ) from None
                error: BaseException = exc
            except (OSError, ValueError) as exc:  # refused, reset, timed out, cut short
                error = exc
            if attempt + 1 < tries:
                time.sleep(min(2.0**attempt, 10.0))
        raise GenerationServerLost(
            f"the rollout server at {url} failed {path} {tries} time(s) ({_reason(error)})"
        )

    # ── the start-up check ──────────────────────────────────────────────────────────────────

    @torch.inference_mode()
    def verify(self, model: Any) -> None:
        """Refuse servers that serve another model than `model`: sync it, sample a probe
        (temperature 1, no truncation) and compare the server's log-probs of the drawn tokens
        with the local forward's (mean gap at most PROBE_BOUND nats)."""
        self.sync(model)
        ids = self.tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"]
        for url in self.server.urls:
            answers = self._generate([ids], PROBE, [0], [url], self.model, self.weights)
            query_ids, query_mask = left_pad([ids], self.tokenizer.pad_token_id, self.device)
            width = answers.response_ids.shape[1]
            input_ids = torch.cat([query_ids, answers.response_ids.to(self.device)], dim=1)
            mask = torch.cat([query_mask, answers.response_mask.long().to(self.device)], dim=1)
            logits = response_logits(model, input_ids, mask, width)
            ours = response_logprobs(logits.float(), answers.response_ids.to(self.device), PROBE)
            keep = answers.response_mask.to(self.device)
            gap = float((ours - answers.sampler_logprobs.to(self.device)).abs()[keep].mean())
            if not gap <= PROBE_BOUND:
                raise ModelLoadError(
                    f"the server at {url} serves another model than this recipe's policy "
                    f"(it serves {self.bases[url]}; its log-probs differ from the policy's by "
                    f"{gap:.3f} nats a token, over {PROBE_BOUND}): start it with `rlhf serve` "
                    "for this recipe"
                )


@dataclass
class Pinned:
    """One `generate` call of a `ServerGenerator`, its model fixed when it was asked for."""

    owner: ServerGenerator
    model: str | None
    weights: str | None
    done: bool = False

    def __call__(
        self, queries: list[list[int]], gen: GenerationSection, seeds: list[int] | None = None
    ) -> Generations:
        try:
            urls = self.owner.server.urls
            return self.owner._generate(queries, gen, seeds, urls, self.model, self.weights)
        finally:
            self.release()

    def release(self) -> None:
        """Let the servers move on (called by the call itself, or for a call never made)."""
        if not self.done:
            self.done = True
            self.owner._release(self.model)


def server_generator(
    model: Any,
    tokenizer: Any,
    gen: GenerationSection,
    max_len: int,
    shared_dir: Path,
    stop_ids: list[int],
) -> ServerGenerator:
    """The client of `gen.server.urls`, checked against `model` (the policy as it starts):
    every server holds prompts and answers of `max_len` tokens, then `verify`."""
    server = gen.server
    mode = server.sync
    if mode == "auto":
        mode = "lora" if adapter_in_use(model) else "weights"
    bases, in_use = {}, set()
    for url in server.urls:
        listed = served_models(url, server.timeout_s)
        longest = max(int(m.get("max_model_len") or 0) for m in listed)
        if 0 < longest < max_len:
            raise ModelLoadError(
                f"the server at {url} holds {longest} tokens (--max-model-len); prompts and "
                f"answers need {max_len}: restart it with `rlhf serve`"
            )
        base = [m for m in listed if not m.get("parent")] or listed
        bases[url] = base[0]["id"]
        in_use.update(m["id"] for m in listed if m.get("parent"))
    shared_dir.mkdir(parents=True, exist_ok=True)
    for stale in shared_dir.glob("rlhf-*"):  # left by a run that stopped; no server holds it
        if stale.name not in in_use:
            shutil.rmtree(stale, ignore_errors=True)
    device = next(model.parameters()).device
    transfer = weight_transfer(server) if mode == "weights" else "disk"
    generator = ServerGenerator(
        tokenizer, stop_ids, device, server, mode, transfer, shared_dir, bases, max_len
    )
    generator.verify(model)
    return generator
