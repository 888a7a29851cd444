"""DAPO's dynamic sampling (`ppo.dynamic_sampling`): groups whose answers all score the same are
replaced by fresh prompts' groups, the drop rate logged as counted by hand from what the
engine was asked, on a fixture where half the prompts score 1 for every answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from rlhf_cli.generation import Generations
from rlhf_cli.ppo.core import uniform_groups
from rlhf_cli.ppo.rollout import refilled
from rlhf_cli.recipe import PpoSection

PROMPTS = [f"p{i}" for i in range(8)]  # even: every answer scores 1; odd: by the seed's parity


class _Acc:
    num_processes, process_index, device = 1, 0, torch.device("cpu")

    def reduce(self, t, op):
        return t


class _Engine:
    """Answers each query (a prompt's number) with text `p<i>:<seed>`, a response as wide as
    the call's number plus one (so rounds pad differently); records every call."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def generate(self, queries, gen, seeds, policy):
        self.calls.append([q[0] for q in queries])
        b, r = len(queries), len(self.calls) + 1
        return Generations(
            query_ids=torch.tensor(queries),
            query_mask=torch.ones(b, 1, dtype=torch.long),
            response_ids=torch.full((b, r), len(self.calls)),
            response_mask=torch.ones(b, r, dtype=torch.bool),
            ended=torch.ones(b, dtype=torch.bool),
            texts=[f"p{q[0]}:{s}" for q, s in zip(queries, seeds, strict=True)],
            sampler_logprobs=None,
        )


class _Rule:
    """1 for every answer of a `same` prompt, the seed's parity for the others (two consecutive
    rows of a group have consecutive seeds: one right, one wrong)."""

    def scored(self, prompts, texts, keywords):
        kinds = keywords["kind"]
        rewards = [1.0 if k == "same" else float(int(t.split(":")[1]) % 2) for k, t in
                   zip(kinds, texts, strict=True)]  # fmt: skip
        return SimpleNamespace(rewards=torch.tensor(rewards))


def _run(max_rounds: int, kinds: list[str]) -> SimpleNamespace:
    ppo = PpoSection(
        batch_size=8, mini_batch_size=4, gradient_accumulation_steps=1,
        advantage_estimator="grpo", num_generations=2, dynamic_sampling=True,
        dynamic_sampling_max_rounds=max_rounds,
    )  # fmt: skip
    engine = _Engine()
    sampler = torch.Generator().manual_seed(3)
    return SimpleNamespace(
        recipe=SimpleNamespace(ppo=ppo, run=SimpleNamespace(seed=7)),
        accelerator=_Acc(),
        models=SimpleNamespace(scorer=_Rule(), generator=engine),
        prompts=PROMPTS,
        queries=[[i] for i in range(8)],
        columns=[{"kind": k} for k in kinds],
        state=SimpleNamespace(sampler=sampler),
        engine=engine,
    )


def _first_round(run):
    from rlhf_cli.ppo.rollout import ask_rollout

    draft = ask_rollout(run, 1, "v1")
    return draft.index, draft.answers.result()[0]


def test_uniform_groups_marks_every_row_of_a_group_with_one_score():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert uniform_groups(scores, 2).tolist() == [True, True, False, False, True, True]


def test_uniform_groups_are_refilled_and_the_drop_rate_is_the_hand_count():
    kinds = ["same" if i % 2 == 0 else "varied" for i in range(8)]
    run = _run(3, kinds)
    index, answers = _first_round(run)
    new_index, merged, metrics = refilled(run, 1, "v1", index, answers)
    calls = run.engine.calls  # each call: 8 rows, 4 groups of 2
    groups = [c[g * 2] for c in calls for g in range(4)]
    uniform = sum(1 for p in groups if p % 2 == 0)
    assert uniform > 0 and len(calls) > 1  # the fixture does drop groups
    assert metrics["rollout/dropped_groups_rate"] == pytest.approx(uniform / len(groups))
    assert metrics["rollout/sampling_rounds"] == len(calls)
    # slot by slot: the first round's group that is varied, else the first round's own
    for slot in range(4):
        offered = [c[slot * 2] for c in calls]
        expected = next((p for p in offered if p % 2), offered[0])
        assert new_index[slot * 2 : slot * 2 + 2] == [expected, expected]
        assert merged.texts[slot * 2].startswith(f"p{expected}:")
    left = sum(1 for slot in range(4) if new_index[slot * 2] % 2 == 0)
    assert metrics["rollout/uniform_groups_kept"] == left
    # rows from rounds with narrower responses are padded to the widest, masked
    sources = [next((n for n, c in enumerate(calls) if c[s * 2] % 2), 0) for s in range(4)]
    assert max(sources) > 0  # some slot was filled from a later round
    assert merged.response_ids.shape == (8, max(sources) + 2)
    assert merged.response_mask.sum(1).tolist() == [n + 2 for n in sources for _ in range(2)]


def test_every_group_uniform_stops_after_max_rounds_and_trains_on_the_first():
    run = _run(2, ["same"] * 8)
    index, answers = _first_round(run)
    new_index, merged, metrics = refilled(run, 1, "v1", index, answers)
    assert len(run.engine.calls) == 2
    assert metrics == {
        "rollout/dropped_groups_rate": 1.0,
        "rollout/sampling_rounds": 2.0,
        "rollout/uniform_groups_kept": 4.0,
    }
    assert new_index == index and merged is answers


def test_no_uniform_group_takes_one_round():
    run = _run(3, ["varied"] * 8)
    index, answers = _first_round(run)
    _, merged, metrics = refilled(run, 1, "v1", index, answers)
    assert len(run.engine.calls) == 1 and merged is answers
    assert metrics["rollout/dropped_groups_rate"] == 0.0


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_dynamic_sampling_needs_a_group_estimator(estimator):
    with pytest.raises(ValidationError, match=r"dynamic_sampling: .*group estimator"):
        PpoSection(advantage_estimator=estimator, dynamic_sampling=True)


def test_the_recipe_refusal_is_one_line_naming_the_field(tmp_path, small_recipe):
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.recipe import load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe(small_recipe(tmp_path, {"ppo": {"dynamic_sampling": True}}))
    (line,) = str(caught.value).splitlines()
    assert line.endswith(
        "ppo.dynamic_sampling: drops groups of a prompt's answers that all score the same, "
        "which needs a group estimator (rloo, grpo), not gae"
    )


class _RankAcc:
    """Process `rank` of 2, run as a thread: gather and reduce meet the other's at a barrier."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self, rank, shared):
        self.process_index, self.shared = rank, shared

    def _both(self, t):
        self.shared["slots"][self.process_index] = t
        self.shared["barrier"].wait()
        both = list(self.shared["slots"])
        self.shared["barrier"].wait()
        return both

    def gather(self, t):
        return torch.cat(self._both(t))

    def reduce(self, t, op):
        a, b = self._both(t)
        return a + b if op == "sum" else torch.maximum(a, b)


def test_two_processes_make_the_same_calls_and_the_batch_of_one(monkeypatch):
    import threading

    import rlhf_cli.ppo.rollout as rollout

    monkeypatch.setattr(rollout, "answered_everywhere", lambda acc, generate: generate())
    kinds = ["same" if i % 2 == 0 else "varied" for i in range(8)]
    alone = _run(3, kinds)
    index, answers = _first_round(alone)
    expected_index, expected, expected_metrics = refilled(alone, 1, "v1", index, answers)
    shared = {"barrier": threading.Barrier(2), "slots": [None, None]}
    runs = [_run(3, kinds) for _ in range(2)]
    out: list = [None, None]

    def process(rank):
        runs[rank].accelerator = _RankAcc(rank, shared)
        index, answers = _first_round(runs[rank])
        out[rank] = refilled(runs[rank], 1, "v1", index, answers)

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(o is not None for o in out)
    assert len(runs[0].engine.calls) == len(runs[1].engine.calls) == len(alone.engine.calls)
    rows = [out[r][0][i] for i in range(4) for r in range(2)]  # process r holds rows r, r + 2, ...
    texts = [out[r][1].texts[i] for i in range(4) for r in range(2)]
    assert rows == expected_index and texts == expected.texts
    assert out[0][2] == out[1][2] == expected_metrics
