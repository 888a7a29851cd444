"""A stand-in for an OpenAI-compatible judge endpoint (`eval.judge.url`), answering chat
completions from a Python function of the two answers in the default judge prompt, so the
judge's client (rlhf_cli/evals/judge.py) can be tested without a model. A real vLLM judge is
tested in `make test-vllm`.

Routes: `GET /v1/models` (`models`), `POST /v1/chat/completions` (404 for a model not in
`models`, as vLLM answers). Knobs: `key` (every request must carry `Authorization: Bearer
<key>`; otherwise 401 with the header echoed back, as OpenAI's API does), `fail` (HTTP statuses
to answer the next completions with), `hang` (no request is answered until `stop`),
`requests` (path, Authorization header, body of each)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from fake_http import LocalServer

# the two answers in rlhf_cli.recipe.eval.DEFAULT_JUDGE_PROMPT
ANSWERS = re.compile(r"\nAnswer A:\n(.*)\n\nAnswer B:\n(.*)\n\nWhich answer", re.DOTALL)


def answers(content: str) -> tuple[str, str]:
    """(answer A, answer B) of a judge prompt written from the default template."""
    found = ANSWERS.search(content)
    assert found, content
    return found[1], found[2]


class FakeJudge(LocalServer):
    def __init__(
        self,
        reply: Callable[[str, str], str | None],
        models: tuple[str, ...] = ("judge",),
        key: str | None = None,
    ) -> None:
        self.reply = reply  # (answer A, answer B) -> the judge's reply text
        self.models = models
        self.key = key
        self.fail: list[int] = []
        self.hang = False
        self.requests: list[tuple[str, str | None, Any]] = []
        self._lock = threading.Lock()
        self.serve(_handler(self))

    def route(self, path: str, auth: str | None, body: Any) -> tuple[int, Any]:
        with self._lock:
            self.requests.append((path, auth, body))
            failed = self.fail.pop(0) if self.fail and path.endswith("/completions") else None
        if self.key is not None and auth != f"Bearer {self.key}":
            return 401, {"error": {"message": f"Incorrect API key provided: {auth}"}}
        if path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": m, "object": "model"} for m in self.models],
            }
        if path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {path}"}}
        if failed is not None:
            return failed, {"error": {"message": "injected"}}
        if body["model"] not in self.models:
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
        content = self.reply(*answers(body["messages"][-1]["content"]))
        message = {"role": "assistant", "content": content}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return 200, {"object": "chat.completion", "model": body["model"], "choices": [choice]}


def _handler(fake: FakeJudge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            if fake.hang:
                fake.released.wait()
                self.close_connection = True
                return
            status, answer = fake.route(self.path, self.headers.get("Authorization"), body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._serve()

        def do_POST(self) -> None:  # noqa: N802
            self._serve()

    return Handler
