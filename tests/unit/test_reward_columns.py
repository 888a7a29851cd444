"""The prompt row reaches the reward: extra columns as TRL's keyword lists, only the keywords a
function accepts (two-argument functions unchanged), a missing column refused in one line at
`rlhf validate --data`, and the remote reward's request carrying the columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_cli.rewards import call_reward_function, missing_columns
from rlhf_cli.scoring import RewardScorer


def two_arguments(prompts, responses):
    return [float(len(r)) for r in responses]


def with_solution(prompts, responses, solution):
    return [float(r == s) for r, s in zip(responses, solution, strict=True)]


def with_anything(prompts, responses, **kwargs):
    return [float(len(kwargs["solution"][i]) + kwargs["step"]) for i in range(len(responses))]


def test_each_function_gets_only_the_keywords_it_accepts() -> None:
    functions = [("two", two_arguments, 1.0), ("sol", with_solution, 10.0),
                 ("any", with_anything, 100.0)]  # fmt: skip
    scorer = RewardScorer(None, None, "{prompt}{response}", 8, functions=functions)
    keywords = {"solution": ["ab", "x"], "tests": [1, 2], "step": 3, "completion_ids": [[1], [2]]}
    scores, _ = scorer.score(["p", "q"], ["ab", "xyz"], keywords)
    # two: len(r); sol: 10 * (r == s); any: 100 * (len(solution) + step)
    assert scores.tolist() == [2 + 10 + 100 * 5, 3 + 0 + 100 * 4]
    alone = RewardScorer(None, None, "{prompt}{response}", 8, functions=functions[:1])
    assert alone.score(["p"], ["ab"])[0].tolist() == [2.0]  # no keywords: as before


def test_a_required_column_the_data_lacks_is_named_with_its_function() -> None:
    problem = missing_columns([("two", two_arguments), ("f.py:sol", with_solution)], {"answer"})
    assert problem is not None and "f.py:sol" in problem and "`solution`" in problem
    assert "\n" not in problem
    assert missing_columns([("f.py:sol", with_solution)], {"solution"}) is None
    assert missing_columns([("any", with_anything)], set()) is None  # **kwargs needs nothing


def test_a_missing_column_fails_validate_data_in_one_line(make_recipe, tmp_path: Path) -> None:
    from rlhf_cli.cli import app

    (tmp_path / "rules.py").write_text(
        "def graded(prompts, responses, solution):\n    return [0.0] * len(responses)\n"
    )
    rows = [{"prompt": "What is two plus two, said in words?", "answer": "4"}] * 4
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(
        {
            "data": {"prompts": {"path": str(tmp_path / "p.jsonl")}},
            "reward": {"functions": [{"function": "rules.py:graded"}]},
        }
    )
    result = CliRunner().invoke(app, ["validate", "--data", "--recipe", str(recipe)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rules.py:graded" in lines[0] and "`solution`" in lines[0]
    assert "answer" in lines[0]  # what the data has instead
    renamed = make_recipe(
        {
            "data": {
                "prompts": {"path": str(tmp_path / "p.jsonl"), "columns": {"solution": "answer"}}
            },  # fmt: skip
            "reward": {"functions": [{"function": "rules.py:graded"}]},
        },
        name="renamed.yaml",
    )
    result = CliRunner().invoke(app, ["validate", "--data", "--recipe", str(renamed)])
    assert "needs column" not in result.output


def test_the_remote_reward_gets_the_columns() -> None:
    import http.server
    import threading

    from rlhf_cli.rewards import RemoteReward

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"rewards": [1.0, 0.0]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = RemoteReward(
            f"http://127.0.0.1:{server.server_port}/", "{prompt}|{response}", 5, 0
        )
        keywords = {"solution": ["4", "5"], "step": 7, "completion_ids": [[1], [2]]}
        rewards, _ = call_reward_function("remote", remote, ["p", "q"], ["a", "b"], keywords)
    finally:
        server.shutdown()
    assert rewards.tolist() == [1.0, 0.0]
    assert seen[0]["solution"] == ["4", "5"] and seen[0]["step"] == 7
    assert seen[0]["query"] == ["p|a", "q|b"] and "completion_ids" not in seen[0]


def test_a_failing_function_still_names_itself() -> None:
    from rlhf_cli.errors import DataError

    with pytest.raises(DataError, match="reward function sol failed"):
        call_reward_function("sol", with_solution, ["p"], ["a"], {"solution": []})
