"""What the project's fake HTTP endpoints share (tests/fake_vllm.py, tests/fake_judge.py): a
threaded server on a free port of 127.0.0.1, its URL, and a stop that first releases the
requests a fake left hanging (`released`)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer:
    released: threading.Event  # set by `stop`: hung requests end

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        """Answer with `handler` from now on, in daemon threads."""
        self.released = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()
