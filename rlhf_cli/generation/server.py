"""vLLM servers of their own as the rollout engine (`generation.backend: vllm_server`): generation
on other GPUs or machines, reached over vLLM's OpenAI-compatible HTTP API. No serving layer of
our own: `rlhf serve` starts vLLM's server; this module is its client.

- Requests carry token ids (no re-tokenising), each row's seed, the recipe's sampling settings
  and stop ids; answers come back as token ids with the sampler's processed log-probs (the
  server runs with `--logprobs-mode processed_logprobs`), as the colocated engine gives them.
- `sync` sends the policy under a new, never reused name and returns its handle
  (`PolicyVersion`): `lora` writes the adapter into `server.shared_dir` and loads it on every
  server (`/v1/load_lora_adapter`, runtime LoRA loading), the calls naming the handle naming
  the adapter; `weights` writes the merged weights there and reloads them in place
  (`/collective_rpc reload_weights`), or with `server.weight_transfer: nccl` sends them GPU to
  GPU over vLLM's NCCL weight-transfer engine (the server started with
  `--weight-transfer-config '{"backend": "nccl"}'`); then `/update_weight_version` (vLLM's dev
  endpoints, `VLLM_SERVER_DEV_MODE=1`), checking `/weight_info` before and after each batch. An
  answer that names another model or version than the one asked is refused: a batch never
  mixes versions. A version stays on the servers while a call made later names it (`pinned`:
  pins are counts on handles); the others go at the next sync.
- Every call has a timeout and `server.retries` retries (`server_http.py`), then
  `GenerationServerLost` (exit 2) names the server; the PPO loop checkpoints first. A batch has
  one deadline and ends at its first lost row (`_ask_all`).
- At start (`check_servers`, before any model loads) every server must answer its model list;
  once the policy is built (`verify`), a log-prob probe against the local forward refuses a
  server that serves another base model.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf_cli.errors import GenerationServerLost, ModelLoadError
from rlhf_cli.generation.core import (
    Generations,
    PolicyVersion,
    generations_from,
    left_pad,
    response_logits,
    response_logprobs,
)
from rlhf_cli.generation.server_http import (
    Batch,
    ServerReply,
    batch_deadline_s,
    completion,
    field_of,
    reason,
    retrying,
    served_models,
)
from rlhf_cli.generation.vllm import adapter_in_use, merged_weights
from rlhf_cli.generation.weight_transfer import (
    PolicyWeights,
    SyncClient,
    open_nccl_transfer,
    weight_transfer,
    within,
)
from rlhf_cli.recipe import GenerationSection, ServerSection

PROBE = GenerationSection(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0)
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# Mean |log-prob| gap on the probe's tokens above which the server serves another model: the
# same weights give ~1e-5 in float32 and ~1e-2 in bfloat16; another checkpoint, nats.
PROBE_BOUND = 0.1
MAX_IN_FLIGHT = 64  # concurrent requests per server (vLLM batches them itself)
# An upload in the shared folder that no server holds and nothing touched this long was left by
# a run that stopped; a younger one may be another process's, written and about to be loaded.
STALE_AFTER_S = 3600.0


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
    latest: PolicyVersion | None = None  # the last synced: what a call naming none gets
    _busy: threading.Condition = field(default_factory=threading.Condition)
    _held: list[PolicyVersion] = field(default_factory=list)  # synced, not dropped, oldest first
    _pins: Counter[PolicyVersion] = field(default_factory=Counter)  # calls asked, not answered
    _nccl: dict[str, Any] = field(default_factory=dict)  # url -> vLLM's trainer-side engine

    # ── sync ────────────────────────────────────────────────────────────────────────────────

    def sync(self, model: Any) -> PolicyVersion:
        """Send `model` as it is now to the servers, under a name never used before, and return
        its handle: the policy's adapter (`lora`; the reference, adapter off, is the servers'
        base itself) or its merged weights (`weights`, once no call names an older version).
        The versions older than this one that no call names any more are dropped."""
        self.uploads += 1
        name = f"rlhf-{self.tag}-v{self.uploads}"
        if self.mode == "weights":
            self._send_weights(model, name)
            policy = PolicyVersion(name)
        elif adapter_in_use(model):
            self._send_adapter(model, name)
            policy = PolicyVersion(name, adapter=name)
        else:
            policy = PolicyVersion(name)
        with self._busy:
            self._held.append(policy)
            self.latest = policy
        self._drop_old()
        return policy

    def _answerable(self, policy: PolicyVersion) -> bool:
        """Whether the servers can answer as `policy` now: adapters stay loaded until dropped;
        weights are replaced by the next sync's."""
        return policy in self._held and (self.mode == "lora" or policy == self.latest)

    def _send_adapter(self, model: Any, name: str) -> None:
        """Write the adapter and load it on every server; if one fails, none keeps it."""
        folder = self.shared_dir / name
        model.save_pretrained(folder)  # the adapter alone (a peft model)
        loaded: list[str] = []
        try:
            for url in self.server.urls:
                self._load_adapter(url, name, folder)
                loaded.append(url)
        except GenerationServerLost:
            self._unload(name, loaded)
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _load_adapter(self, url: str, name: str, folder: Path) -> None:
        body = {"lora_name": name, "lora_path": str(folder)}
        try:
            self._post(url, "/v1/load_lora_adapter", body)
        except GenerationServerLost:
            # a try that timed out after loading it makes the retry answer 400 "already
            # loaded": the same name from the same folder is what was asked for
            if not self._holds_adapter(url, name, folder):
                raise

    def _holds_adapter(self, url: str, name: str, folder: Path) -> bool:
        try:
            listed = served_models(url, self.server.timeout_s)
        except (OSError, ServerReply, ValueError):
            return False
        return any(m["id"] == name and m.get("root") == str(folder) for m in listed)

    def _unload(self, adapter: str, urls: list[str]) -> None:
        for url in urls:
            try:
                self._post(url, "/v1/unload_lora_adapter", {"lora_name": adapter}, tries=1)
            except GenerationServerLost:
                pass  # gone already, or the server is: nothing asks it for the adapter again

    def _drop_old(self) -> None:
        """Unload and delete the versions before the latest that no call names any more."""
        with self._busy:
            old = [p for p in self._held[:-1] if not self._pins[p]]
            self._held = [p for p in self._held if p not in old]
        for policy in old:
            if policy.adapter:
                self._unload(policy.adapter, self.server.urls)
            shutil.rmtree(self.shared_dir / policy.name, ignore_errors=True)

    def _send_weights(self, model: Any, name: str) -> None:
        if self.transfer == "disk":
            folder = self.shared_dir / name
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            merged = merged_weights(model)
            weights = {key: value.detach().cpu().contiguous() for key, value in merged}
            base.save_pretrained(folder, state_dict=weights)
        with self._busy:  # reloading in place under a batch would mix two versions in it
            if not self._busy.wait_for(lambda: not +self._pins, self.server.timeout_s):
                raise GenerationServerLost(
                    f"the rollouts in flight did not finish within server.timeout_s "
                    f"({self.server.timeout_s:g} s), so the weights could not be reloaded"
                )
            for url in self.server.urls:
                if self.transfer == "nccl":
                    self._send_nccl(url, model)
                else:
                    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                    self._post(url, "/collective_rpc", rpc)
                self._post(url, "/reset_prefix_cache", {})
                self._post(url, "/update_weight_version", {"new_version": name})
                self._check_version(url, name)

    def _send_nccl(self, url: str, model: Any) -> None:
        """The weights as they are now (gathered) over NCCL: start, update beside the
        broadcast, finish; a broadcast the server stopped taking part in ends at
        `server.timeout_s`."""
        engine = self._nccl_engine(url, model)
        engine.source.model = model
        try:
            within(self.server.timeout_s, engine.send_weights, f"the NCCL weight transfer to {url}")
        except TimeoutError as exc:
            raise GenerationServerLost(f"{exc} (server.timeout_s)") from None

    def _nccl_engine(self, url: str, model: Any) -> Any:
        """The NCCL group to the server at `url` (opened at the first sync: this process is
        rank 0, the server's workers the rest); a group a stopped trainer left is shut first."""
        if url not in self._nccl:
            try:
                self._post(url, "/shutdown_weight_transfer_engine", {}, tries=1)
            except GenerationServerLost:
                pass  # none was open
            try:
                workers = self._get(url, "/get_world_size", field_of("world_size", int))
                client = SyncClient(lambda path, body: self._post(url, path, body, tries=1))
                weights = PolicyWeights(model)
                self._nccl[url] = within(
                    self.server.timeout_s,
                    lambda: open_nccl_transfer(url, client, weights, workers),
                    "the NCCL rendezvous",
                )
            except (GenerationServerLost, TimeoutError) as exc:
                raise ModelLoadError(
                    f"the server at {url} opened no NCCL weight transfer ({exc}): start it with "
                    '`rlhf serve` (it adds --weight-transfer-config \'{"backend": "nccl"}\' '
                    "on GPUs) or set server.weight_transfer: disk"
                ) from None
        return self._nccl[url]

    def _check_version(self, url: str, expected: str) -> None:
        held = self._get(url, "/weight_info", field_of("weight_version", (str, type(None))))
        if held != expected:
            raise GenerationServerLost(
                f"the server at {url} holds weight version {held!r}, not {expected!r}: another "
                "trainer is syncing to it; give each run servers of its own"
            )

    # ── generate ────────────────────────────────────────────────────────────────────────────

    def generate(
        self,
        queries: list[list[int]],
        gen: GenerationSection,
        seeds: list[int] | None = None,
        policy: PolicyVersion | None = None,
    ) -> Generations:
        """Answers to `queries` by `policy` (the last synced by default) from the servers (rows
        split across them in order), each row from its seed; every answer checked to come from
        the version this call names."""
        return self.pinned(policy)(queries, gen, seeds)

    def pinned(self, policy: PolicyVersion | None = None) -> Pinned:
        """`generate` by `policy` (the last synced by default) for a call made later (a rollout
        drawn ahead, `async_steps`): pinned, its adapter stays loaded, and its weights stay in
        place, until the call is made or released. Refused for a version already dropped."""
        policy = policy or self.latest
        with self._busy:
            if policy is None or not self._answerable(policy):
                raise RuntimeError(
                    f"a generate call names policy {policy and policy.name}, which the servers "
                    f"no longer hold (the last synced is {self.latest and self.latest.name})"
                )
            self._pins[policy] += 1
        return Pinned(self, policy)

    def _unpin(self, policy: PolicyVersion) -> None:
        with self._busy:
            self._pins[policy] -= 1
            self._busy.notify_all()

    def _generate(
        self,
        queries: list[list[int]],
        gen: GenerationSection,
        seeds: list[int] | None,
        urls: list[str],
        policy: PolicyVersion,
        batch: Batch,
    ) -> Generations:
        seeds = seeds if seeds is not None else [None] * len(queries)
        share = -(-len(queries) // len(urls))
        rows = enumerate(zip(queries, seeds, strict=True))
        jobs = [(urls[row // share], query, seed) for row, (query, seed) in rows]
        if self.mode == "weights":
            for url in urls:
                self._check_version(url, policy.name)
        answers = self._ask_all(jobs, gen, policy, batch)
        if self.mode == "weights":
            for url in urls:
                self._check_version(url, policy.name)
        tokens = [a[0] for a in answers]
        drawn = [a[1] for a in answers]
        generations = generations_from(self.tokenizer, self.stop_ids, queries, tokens, drawn)
        return generations.to(self.device)

    def _ask_all(
        self, jobs: list[tuple[str, list[int], int | None]], gen: GenerationSection,
        policy: PolicyVersion, batch: Batch,
    ) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """Every job's answer, asked for by daemon threads (MAX_IN_FLIGHT per server) within
        the batch's deadline; the first failure ends the batch (`Batch`) and is raised."""

        def late() -> GenerationServerLost:
            url = next(job[0] for job, got in zip(jobs, batch.answers, strict=True) if got is None)
            return GenerationServerLost(
                f"the rollout server at {url} did not answer every row of a batch within "
                f"{batch.deadline_s:g} s ((server.retries + 1) x server.timeout_s and the pauses)"
            )

        urls = {url for url, _, _ in jobs}
        return batch.run(
            lambda row: self._answer(*jobs[row], gen, policy, batch),
            min(len(jobs), MAX_IN_FLIGHT * len(urls)),
            late,
        )

    def _answer(
        self,
        url: str,
        query: list[int],
        seed: int | None,
        gen: GenerationSection,
        policy: PolicyVersion,
        batch: Batch,
    ) -> tuple[list[int], list[float]]:
        name = policy.adapter or self.bases[url]
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
        model, tokens, drawn = self._post(url, "/v1/completions", body, None, completion, batch)
        if model != name:
            raise GenerationServerLost(
                f"the server at {url} answered as {model!r}, asked for {name!r}: an answer of "
                "an unknown policy version is never trained on"
            )
        if len(tokens) > gen.max_new_tokens:
            raise GenerationServerLost(
                f"the server at {url} answered {len(tokens)} tokens, past max_new_tokens"
            )
        return tokens, drawn

    # ── HTTP with timeouts and retries ──────────────────────────────────────────────────────

    def _post(
        self, url: str, path: str, body: Any, tries: int | None = None, parse: Any = None,
        batch: Batch | None = None,
    ) -> Any:  # fmt: skip
        """One call, tried `tries` times (default `server.retries` + 1: `retrying`)."""
        tries = self.server.retries + 1 if tries is None else tries
        return retrying(url, path, body, self.server.timeout_s, tries, parse, batch)

    def _get(self, url: str, path: str, parse: Any) -> Any:
        return self._post(url, path, None, parse=parse)

    # ── the start-up check ──────────────────────────────────────────────────────────────────

    @torch.inference_mode()
    def verify(self, model: Any) -> None:
        """Refuse servers that serve another model than `model`: sync it, sample a probe
        (temperature 1, no truncation) and compare the server's log-probs of the drawn tokens
        with the local forward's (mean gap at most PROBE_BOUND nats)."""
        policy = self.sync(model)
        ids = self.tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"]
        for url in self.server.urls:
            batch = Batch(1, batch_deadline_s(self.server))
            answers = self._generate([ids], PROBE, [0], [url], policy, batch)
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
    """One `generate` call of a `ServerGenerator` by the version it was asked of, made now or
    later; released (by the call itself, or for a call never made) it unpins the version, and
    a call still waiting for its answers is abandoned at once."""

    owner: ServerGenerator
    policy: PolicyVersion
    done: bool = False
    batch: Batch | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(
        self, queries: list[list[int]], gen: GenerationSection, seeds: list[int] | None = None
    ) -> Generations:
        with self._lock:
            if self.done:
                raise GenerationServerLost("a call made after it was released")
            self.batch = Batch(len(queries), batch_deadline_s(self.owner.server))
        try:
            urls = self.owner.server.urls
            return self.owner._generate(queries, gen, seeds, urls, self.policy, self.batch)
        finally:
            self.release()

    def release(self) -> None:
        """Let the servers move on; a call still waiting for its answers raises at once."""
        with self._lock:
            if self.done:
                return
            self.done = True
        if self.batch is not None:
            self.batch.abandon()
        self.owner._unpin(self.policy)


def drop_stale(shared_dir: Path, in_use: set[str]) -> None:
    """Delete the uploads in `shared_dir` left by runs that stopped: no server holds them and
    nothing touched them for STALE_AFTER_S. Younger ones may be another process's (a
    trainer sharing the folder), written and about to be loaded."""
    for upload in shared_dir.glob("rlhf-*"):
        try:
            age = time.time() - upload.stat().st_mtime
        except FileNotFoundError:
            continue  # its owner dropped it meanwhile
        if upload.name not in in_use and age > STALE_AFTER_S:
            shutil.rmtree(upload, ignore_errors=True)


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
        try:
            listed = served_models(url, server.timeout_s)
        except (OSError, ServerReply, ValueError) as exc:
            raise GenerationServerLost(
                f"the rollout server at {url} failed /v1/models ({reason(exc)})"
            ) from None
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
    drop_stale(shared_dir, in_use)
    device = next(model.parameters()).device
    transfer = weight_transfer(server) if mode == "weights" else "disk"
    generator = ServerGenerator(
        tokenizer, stop_ids, device, server, mode, transfer, shared_dir, bases, max_len
    )
    generator.verify(model)
    return generator
