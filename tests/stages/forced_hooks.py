"""The live audit and the held-out evaluation with verdicts a test sets, so that a rollback to the
best checkpoint happens at a known iteration and, on several processes, each process's own view
would choose another checkpoint than the main process's: the audit flags verbosity on the main
process alone, at its first call; the held-out reward falls after the first evaluation on the
main process and rises on the others. Nothing is sampled.

`python -m forced_hooks ppo --recipe ...` (as `launching.launch(..., module="forced_hooks")`
starts it on each process) runs the CLI with these hooks, and writes what each process restored
at a rollback to `restored_<rank>.json` in its working folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REWARDS = {True: [1.0, 0.5, 0.4], False: [0.0, 0.5, 0.9]}  # by is-main, evaluation by evaluation
REPORT = {"sycophancy_score": 0.0, "repetition_score": 0.0, "avg_response_len": 3.0}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def audit_hook(*_: Any) -> Callable[[Any, int], dict[str, Any]]:
    """What `stages.ppo._live_audit` returns: every call flags verbosity on the main process."""
    flags = ["verbosity"] if rank() == 0 else []
    report = {**REPORT, "hacking_detected": bool(flags), "flags": flags, "verbosity_score": 1.0}
    return lambda actor, iteration: report


def eval_hook(*_: Any, crash_at: int | None = None) -> Callable[[Any, int], dict[str, float]]:
    """What `stages.ppo._live_eval` returns: `REWARDS` in turn; the `crash_at`-th call (from 1)
    raises, as a crash in the middle of an iteration would."""
    rewards, calls = REWARDS[rank() == 0], []

    def evaluate(actor: Any, iteration: int) -> dict[str, float]:
        calls.append(1)
        if len(calls) == crash_at:
            raise RuntimeError("crashed")
        return {"eval/reward_mean": rewards[min(len(calls), len(rewards)) - 1]}

    return evaluate


def weights_digest(actor: Any) -> str:
    """A digest of the trained weights of `actor` (a PolicyAndValue, unwrapped)."""
    from rlhf_cli.modeling import trainable_state

    digest = hashlib.sha256()
    for key, value in sorted(trainable_state(actor.policy).items()):
        digest.update(key.encode() + value.detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()


def record_rollbacks(folder: Path) -> None:
    """Each rollback's restored iteration and the weights after it, in
    `folder/restored_<rank>.json`."""
    import rlhf_cli.ppo.run as run_module

    real, seen = run_module.roll_back, []

    def spy(run: Any, iteration: int, names: str) -> dict[str, float]:
        out = real(run, iteration, names)
        seen.append(
            {"restored": out["audit/rolled_back_to"], "weights": weights_digest(run.unwrapped)}
        )
        (folder / f"restored_{rank()}.json").write_text(json.dumps(seen))
        return out

    run_module.roll_back = spy


if __name__ == "__main__":
    import rlhf_cli.stages.ppo as stage
    from rlhf_cli.cli import main

    stage._live_audit, stage._live_eval = audit_hook, eval_hook
    record_rollbacks(Path.cwd())
    sys.argv[0] = "rlhf"
    sys.exit(main())
