"""Math grading shared by `rlhf eval`'s checks (evals/checks.py) and the built-in reward
`builtin:math_accuracy` (verifiable.py): the answer a grader reads (`extract_answer`) and the
bounded worker process that parses and verifies under a deadline (`bounded`, `math_verdicts`).
Why a process and not math-verify's own timeouts: see evals/checks.py's docstring. The worker's
side (`serve` and its jobs) stays in evals/checks.py, run as `python -c WORKER`; this module
imports nothing of the recipe, so the reward functions can grade without an import circle."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import selectors
import subprocess
import sys
import time
from typing import Any

from rlhf_cli.errors import EvalError

BOXED = "\\boxed{"
# the last number: an integer or decimal, thousands commas allowed, or a fraction `a/b`
NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
TIMEOUT = "timeout"
WORKER = "from rlhf_cli.evals.checks import serve; serve()"
WORKER_START_S = 120.0  # the worker's start-up and warm-up (imports, a first parse)
INSTALL_HINT = "pip install 'rlhf-cli[eval]'"


def require_math_verify() -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise EvalError(f"math checks need math-verify: {INSTALL_HINT}")


def extract_answer(text: str) -> str | None:
    """The answer a math grader reads: the content of the last `\\boxed{}` whose braces close,
    else the last number (thousands commas dropped), else None."""
    start = text.rfind(BOXED)
    while start != -1:
        depth, begin = 0, start + len(BOXED) - 1
        for end in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[begin + 1 : end]
        start = text.rfind(BOXED, 0, start)  # cut off before it closed: the one before
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def math_verdicts(
    golds: list[str], answers: list[str], timeout_s: float, worker: str = WORKER
) -> list[str]:
    """`correct`, `wrong`, `no_answer` (math-verify reads nothing in it) or `timeout` for each
    extracted answer against its gold, in the bounded worker (the built-in reward
    `builtin:math_accuracy` grades here too). Safe to call from any thread."""
    require_math_verify()
    return bounded(
        [["verdict", "math", gold, answer] for gold, answer in zip(golds, answers, strict=True)],
        timeout_s,
        worker,
    )


def bounded(jobs: list[list], timeout_s: float, script: str = WORKER) -> list:
    """Each job (`[name, *args]`, a function of `evals.checks.serve`'s table) run in a worker
    process (`python -c script`), one at
    a time, each given `timeout_s`: one without a result by then gives TIMEOUT, and its worker is
    killed (the only way to stop a call that will not return) and a fresh one started."""
    out: list[Any] = []
    worker = None
    try:
        for job in jobs:
            worker = worker or _Worker(script)
            result = worker.ask(job, timeout_s)
            if result is _Worker.NONE:
                worker.kill()
                worker = None
            out.append(TIMEOUT if result is _Worker.NONE else result)
    finally:
        if worker is not None:
            worker.kill()
    return out


class _Worker:
    """`python -c script`: a job a line on its stdin, the result a line on its stdout. A plain
    subprocess, not multiprocessing: a spawned child re-runs the caller's main script (which
    may lack the `__main__` guard) and a forked one inherits the locks of the caller's threads;
    this one imports rlhf_cli alone. Warmed (imports, a first parse) before any deadline."""

    NONE = object()  # no result: the deadline passed or the worker died

    def __init__(self, script: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.pending = b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.process.stdout, selectors.EVENT_READ)
        if self.ask(["warm"], WORKER_START_S) is self.NONE:
            self.kill()
            raise EvalError(
                f"the checks' worker process did not start (waited up to {WORKER_START_S:g} s; "
                "its errors, if any, are above)"
            )

    def ask(self, job: list, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        try:
            self.process.stdin.write((json.dumps(job) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            return self.NONE
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.selector.select(left):
                return self.NONE
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            if not chunk:
                return self.NONE
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        self.selector.close()
        self.process.kill()
        self.process.wait(timeout=30)
        with contextlib.suppress(BrokenPipeError):  # a job left unsent to a worker that died
            self.process.stdin.close()
        self.process.stdout.close()
