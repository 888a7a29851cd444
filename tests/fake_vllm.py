"""A stand-in for vLLM's OpenAI-compatible server, as `backend: vllm_server` uses it, answering
from a transformers model through `HFGenerator` (per-row seeds, the sampler's processed
log-probs): the protocol, versions, timeouts and failures can be tested without vLLM. The
real server is tested in `make test-vllm` (tests/stages/test_vllm_server.py).

Routes: `GET /v1/models`, `POST /v1/completions` (token-id prompt, one row per request),
`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/collective_rpc` (`reload_weights` from a
folder), `/reset_prefix_cache`, `/update_weight_version`, `GET /weight_info`, and the control
plane of vLLM's weight transfer (`GET /get_world_size`, `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/shutdown_weight_transfer_engine`: recorded in `transfer`; the tensors themselves are the
test's to deliver). Knobs: `fail` (HTTP statuses to answer the next requests with; 0 drops
the connection, `CUT` sends half of the answer then closes, `NOT_JSON` answers a proxy's HTML
page, `WRONG_SHAPE` JSON without the route's fields), `delay_s`, `late` (seconds the next
requests wait after the route ran, before answering: a call that times out but was done),
`hang` (completions are never answered until `stop`), `answer_as` (another model name in every
answer), `die_after` (completions answered before every later one fails as `die_how`, one of
`fail`'s codes or `HANG`), `requests` (what was asked)."""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch
from fake_http import LocalServer
from transformers import AutoModelForCausalLM

from rlhf_cli.generation import HFGenerator
from rlhf_cli.recipe import GenerationSection

CUT, NOT_JSON, WRONG_SHAPE, HANG = -1, -2, -3, -4  # `fail` codes beside HTTP statuses
TRANSFER_ROUTES = (
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update", "/shutdown_weight_transfer_engine",
)  # fmt: skip


class FakeVLLM(LocalServer):
    def __init__(self, model_dir: str, tokenizer: Any, max_model_len: int = 512) -> None:
        self.name = model_dir
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.base = self._load(model_dir)
        self.adapters: dict[str, Any] = {}
        self.version: str | None = None
        self.transfer: list[tuple[str, Any]] = []  # the weight-transfer steps, in order
        self.transfer_open = False
        self.requests: list[tuple[str, Any]] = []
        self.fail: list[int] = []
        self.delay_s = 0.0
        self.late: list[float] = []
        self.hang = False
        self.hung_at: float | None = None  # when the first request was left unanswered
        self.answer_as: str | None = None
        self.die_after: int | None = None  # completions answered before every request fails
        self.die_how = 0
        self.lock = threading.Lock()  # one generation at a time
        self.serve(_handler(self))

    @staticmethod
    def _load(folder: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    # ── routes ──────────────────────────────────────────────────────────────────────────────

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((path, body))
        if path == "/v1/models":
            listed = [{"id": self.name, "root": self.name, "parent": None,
                       "max_model_len": self.max_model_len}]  # fmt: skip
            listed += [{"id": n, "root": path, "parent": self.name}
                       for n, (_, path) in self.adapters.items()]  # fmt: skip
            return 200, {"object": "list", "data": listed}
        if path == "/v1/completions":
            return 200, self.complete(body)
        if path == "/v1/load_lora_adapter":
            from peft import PeftModel

            if body["lora_name"] in self.adapters:
                return 400, {"error": {"message": "already loaded"}}
            model = PeftModel.from_pretrained(copy.deepcopy(self.base), body["lora_path"])
            self.adapters[body["lora_name"]] = (model.eval(), body["lora_path"])
            return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body["lora_name"], None) is None:
                return 404, {"error": {"message": "not found"}}
            return 200, "Success"
        if path == "/collective_rpc":
            assert body["method"] == "reload_weights"
            self.base = self._load(body["kwargs"]["weights_path"])
            return 200, {"results": [None]}
        if path == "/reset_prefix_cache":
            return 200, None
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/get_world_size":
            return 200, {"world_size": 1}
        if path == "/shutdown_weight_transfer_engine" and not self.transfer_open:
            return 400, {"error": "no weight transfer engine"}
        if path in TRANSFER_ROUTES:
            self.transfer.append((path, body))
            self.transfer_open = path != "/shutdown_weight_transfer_engine"
            return 200, {"message": "ok"}
        return 404, {"error": f"no route {path}"}

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["model"]
        model = self.base if name == self.name else self.adapters[name][0]
        temperature = body["temperature"]
        gen = GenerationSection(
            max_new_tokens=body["max_tokens"],
            do_sample=temperature > 0,
            temperature=temperature or 1.0,
            top_p=body["top_p"],
            top_k=body["top_k"],
        )
        with self.lock:
            answer = HFGenerator(model, self.tokenizer, body["stop_token_ids"]).generate(
                [body["prompt"]], gen, [body["seed"]]
            )
        keep = answer.response_mask[0]
        tokens = answer.response_ids[0][keep].tolist()
        logprobs = answer.sampler_logprobs[0][keep].tolist()
        return {
            "model": self.answer_as or name,
            "choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": logprobs}}],
        }


def _handler(fake: FakeVLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            if fake.delay_s:
                time.sleep(fake.delay_s)
            if self.path == "/v1/completions":
                if fake.die_after is not None:
                    if fake.die_after <= 0:
                        fake.fail.append(fake.die_how)
                    fake.die_after -= 1
                if fake.hang:
                    fake.fail.insert(0, HANG)
            status = fake.fail.pop(0) if fake.fail else 200
            if status in (0, HANG):
                self._die(status)
            elif status == NOT_JSON:
                self._send(200, "<html><body>502 Bad Gateway</body></html>")
            elif status == WRONG_SHAPE:
                self._send(200, {"choices": [{"text": "hi"}], "data": "none"})
            elif status not in (200, CUT):
                self._send(status, {"error": "injected"})
            else:
                answer = fake.route(method, self.path, body)
                if fake.late:
                    time.sleep(fake.late.pop(0))
                self._send(*answer, cut=status == CUT)

        def _die(self, how: int) -> None:
            """Drop the connection now (0), or hold it unanswered until `stop` (HANG)."""
            if how == HANG:
                fake.hung_at = fake.hung_at or time.monotonic()
                fake.released.wait()
            self.close_connection = True
            self.connection.shutdown(2)

        def _send(self, status: int, answer: Any, cut: bool = False) -> None:
            data = (
                b""
                if answer is None
                else (answer.encode() if isinstance(answer, str) else json.dumps(answer).encode())
            )
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if cut:  # the server died mid-answer
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

    return Handler
