"""PPO on the tiny recipe with a rule-based reward alone (`reward.functions`, no reward model), or
a remote reward served by a local HTTP server (`reward.url`): it learns (the last iterations'
mean reward above the first iteration's by half its std), no reward model is loaded, and the
audit scores with the same reward."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rich.console import Console

from rlhf_cli.recipe import load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import read_metrics

pytestmark = pytest.mark.slow
QUIET = Console(stderr=True, quiet=True)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rewards.py"


@pytest.fixture
def politeness_server():
    """examples/rewards.py:politeness behind HTTP, as a remote reward model would answer."""
    import http.server
    import importlib.util
    import json
    import threading

    spec = importlib.util.spec_from_file_location("example_rewards", EXAMPLE)
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            ask = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"rewards": rules.politeness(ask["prompts"], ask["responses"])})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/score"
    server.shutdown()


@pytest.mark.parametrize("source", ["function", "remote"])
def test_ppo_learns_from_a_rule_or_remote_reward_alone(
    source, pipeline, tmp_path, small_recipe, politeness_server
):
    from rlhf_cli.stages.audit import run_audit
    from rlhf_cli.stages.ppo import run_ppo

    shutil.copytree(pipeline / "runs", tmp_path / "runs")
    shutil.rmtree(tmp_path / "runs" / "tiny" / "rm")  # nothing of a reward model is left
    reward = {"base_model": None}
    if source == "function":
        reward["functions"] = [{"function": f"{EXAMPLE}:politeness"}]
    else:
        reward.update(url=politeness_server, url_timeout=10)
    ppo = {"iterations": 15, "batch_size": 32, "mini_batch_size": 8, "ppo_epochs": 2,
           "save_freq": 15, "log_every": 5, "eval_every": None}  # fmt: skip
    recipe = load_recipe(
        small_recipe(tmp_path, {"sft": {"epochs": 6}, "reward": reward, "ppo": ppo})
    )
    manifest = run_ppo(recipe, QUIET)
    rows = read_metrics(RunDir.for_recipe(recipe).stage_dir("ppo") / "metrics.jsonl")
    assert manifest["status"] == "completed" and manifest["reward_model"] is None
    assert set(manifest["inputs"]) == {"sft"}
    last = sum(r["env/reward_mean"] for r in rows[-3:]) / 3
    first, spread = rows[0]["env/reward_mean"], rows[0]["env/reward_std"]
    assert last > first + spread / 2, (first, spread, [r["env/reward_mean"] for r in rows])
    assert "eval/win_rate" in rows[-1]  # the held-out evaluation scores with the function
    report = run_audit(recipe, QUIET)
    assert "reward_policy_mean" in report and "reward_reference_mean" in report
