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


@pytest.mark.parametrize(
    ("version", "refused"), [("0.11.2", True), ("0.31.9", True), ("0.32.0", False)]
)
def test_a_vllm_older_than_the_tested_floor_is_refused_in_one_line(monkeypatch, version, refused):
    from rlhf_cli.errors import ModelLoadError
    from rlhf_cli.generation import vllm as backend

    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(backend, "installed_vllm", lambda: version)
    if not refused:
        backend.check_vllm()
        return
    with pytest.raises(ModelLoadError, match=rf"needs vLLM >= 0.32 .*; {version} is installed"):
        backend.check_vllm()


def test_merged_weights_stream_one_layer_at_a_time_and_equal_peft_merge():
    """The weights reach vLLM one at a time: no LoRA delta is computed before the first weight
    is handed over, and together they are peft's own merge."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_cli.generation.vllm import merged_weights

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    policy = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    calls = []
    for module in policy.modules():
        if hasattr(module, "get_delta_weight"):
            real = module.get_delta_weight
            module.get_delta_weight = lambda adapter, real=real: calls.append(1) or real(adapter)
    stream = merged_weights(policy)
    first_key, _ = next(stream)
    assert first_key == "model.embed_tokens.weight" and calls == []
    streamed = {first_key: _, **dict(stream)}
    assert len(calls) == 4  # q and v of two layers, each once
    expected = policy.merge_and_unload().state_dict()
    assert streamed.keys() == expected.keys()
    for key, value in streamed.items():
        torch.testing.assert_close(value, expected[key], msg=key)
