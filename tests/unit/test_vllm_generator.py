"""The vLLM backend's own logic (`rlhf_cli/generation/vllm.py`) over a fake `vllm.LLM`: where its
answers land and when the engine sleeps. Runs without vLLM; the engine itself is tested against
the HF policy in tests/stages/test_vllm_engine.py (`make test-vllm`)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rlhf_cli.generation.vllm import VLLMGenerator
from rlhf_cli.recipe import GenerationSection

EOS, PAD = 2, 0


class FakeTokenizer:
    pad_token_id = PAD

    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids.tolist())


class FakeLLM:
    """`vllm.LLM`'s surface the generator uses; every call recorded in `calls`. Each request
    answers `answer` (its tokens, each with log-prob -0.5)."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer
        self.calls: list[str] = []
        self.asleep = False

    def generate(self, prompts: list[dict], params: list[dict], use_tqdm: bool) -> list:
        self.calls.append("generate")
        assert not self.asleep, "generate on a sleeping engine"
        logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in self.answer]
        completion = SimpleNamespace(token_ids=self.answer, logprobs=logprobs)
        return [SimpleNamespace(outputs=[completion]) for _ in prompts]

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")
        self.asleep = True

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        self.asleep = False

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append(method)
        assert not self.asleep, f"{method} on a sleeping engine"

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


@pytest.fixture(autouse=True)
def fake_sampling_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm.SamplingParams` as a plain dict of its settings (vLLM is not installed here)."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)


def test_answers_land_on_the_device_the_engine_was_built_for():
    meta = torch.device("meta")  # neither the CPU the answers are built on nor any default
    engine = VLLMGenerator(FakeLLM([7, EOS, 9]), FakeTokenizer(), [EOS], meta)
    answers = engine.generate([[4, 5], [6]], GenerationSection(max_new_tokens=3))
    tensors = {k: v for k, v in vars(answers).items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == {
        "query_ids", "query_mask", "response_ids", "response_mask", "ended", "sampler_logprobs"
    }  # fmt: skip
    assert {k: v.device for k, v in tensors.items()} == dict.fromkeys(tensors, meta)
    assert answers.texts == ["7 2", "7 2"]  # decoded before the move, up to the stop token
    assert answers.response_ids.shape == (2, 3) and answers.query_ids.shape == (2, 2)


@pytest.mark.parametrize("sleeps", [True, False])
def test_a_sleeping_engine_wakes_before_every_generation_and_sleeps_after(sleeps):
    llm = FakeLLM([7, EOS])
    engine = VLLMGenerator(llm, FakeTokenizer(), [EOS], torch.device("cpu"), sleeps=sleeps)
    gen, policy = GenerationSection(max_new_tokens=2), torch.nn.Linear(2, 2)
    engine.generate([[4]], gen)  # compare: straight after the engine is built
    engine.sync(policy)  # a rollout
    engine.generate([[4]], gen)
    engine.generate([[5]], gen)  # the held-out evaluation: two batches, no sync between
    engine.generate([[6]], gen)
    engine.sync(policy)  # the next rollout
    engine.generate([[4]], gen)
    asleep = ["generate", "sleep(1)"] if sleeps else ["generate"]
    woken = ["wake_up"] if sleeps else []
    reload = ["reload_weights", "reset_prefix_cache"]
    assert llm.calls == (
        [*asleep, *woken, *reload, *asleep] + [*woken, *asleep] * 2 + [*woken, *reload, *asleep]
    )
