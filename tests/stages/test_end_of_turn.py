"""Every built-in chat template's end of turn ends generation (#50 item 6): on a base model
(a tokenizer without a chat template), the end-of-turn text is one special token, the model
has an embedding for it, and every generator stops on it, also after SFT saved and PPO
reloaded the policy."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rich.console import Console

from rlhf_cli.chat_templates import BUILTIN
from rlhf_cli.recipe import ModelSection, load_recipe

QUIET = Console(stderr=True, quiet=True)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny LM saved as a base model comes: weights and a tokenizer without a chat
    template (`<|im_end|>` is not one of its tokens)."""
    from rlhf_cli.modeling import load_tokenizer
    from rlhf_cli.tiny import tiny_lm_path

    folder = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(tiny_lm_path(), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return str(folder)


def _answer_and_stop(tokenizer, stops: list[int]) -> tuple[str, list[int]]:
    """The text a model trained on the template writes before its first stop id, and the ids
    of the answer part of a rendered one-exchange conversation."""
    user = [{"role": "user", "content": "name a colour"}]
    turn = [*user, {"role": "assistant", "content": "blue"}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(turn, tokenize=False)
    assert full.startswith(prompt)
    answer = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    first_stop = next(i for i, token in enumerate(answer) if token in stops)
    return tokenizer.decode(answer[:first_stop]).strip(), answer


@pytest.mark.parametrize("choice", sorted(BUILTIN))
def test_each_builtin_template_ends_the_answer_on_a_stop_id(base_model: str, choice: str) -> None:
    from rlhf_cli.generation import generator_for, response_mask_from
    from rlhf_cli.modeling import load_causal_lm, load_policy_tokenizer

    cfg = ModelSection(name_or_path=base_model, chat_template=choice, dtype="float32")
    tokenizer = load_policy_tokenizer(cfg, base_model, "left")
    model = load_causal_lm(base_model, cfg, torch.device("cpu"), trainable=False)
    stops = generator_for(model, tokenizer).stop_ids
    text, answer = _answer_and_stop(tokenizer, stops)
    assert text == "blue"  # the stop id comes right after the answer's text
    assert model.get_input_embeddings().num_embeddings >= len(tokenizer)
    mask, ended = response_mask_from(torch.tensor([answer]), stops)
    assert ended.tolist() == [True]
    assert tokenizer.decode(torch.tensor(answer)[mask[0]], skip_special_tokens=True).strip() == text


def test_chatml_on_a_base_model_adds_im_end_as_one_token(base_model: str) -> None:
    from rlhf_cli.modeling import load_causal_lm, load_policy_tokenizer, load_tokenizer

    before = load_tokenizer(base_model)
    assert len(before.encode("<|im_end|>", add_special_tokens=False)) > 1  # the base splits it
    cfg = ModelSection(name_or_path=base_model, chat_template="chatml", dtype="float32")
    tokenizer = load_policy_tokenizer(cfg, base_model, "left")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    assert len(tokenizer) == len(before) + 1 and im_end == len(before)
    model = load_causal_lm(base_model, cfg, torch.device("cpu"), trainable=False)
    rows = model.get_input_embeddings().weight
    assert rows.shape[0] == len(before) + 1  # grown by exactly the new token
    torch.testing.assert_close(rows[im_end], rows[:im_end].mean(dim=0))  # the same on each load
    assert im_end in model.generation_config.eos_token_id
    assert before.eos_token_id in model.generation_config.eos_token_id  # the base's EOS kept


@pytest.mark.slow
def test_sft_with_chatml_on_a_base_model_makes_ppo_stop_at_im_end(
    base_model: str, small_recipe: Callable[..., Path], tmp_path: Path
) -> None:
    """SFT (LoRA) on a base model with `chatml`, then the PPO policy built from its output:
    the tokenizer SFT saved holds `<|im_end|>` as one token, which ends each answer SFT trains
    on, and the PPO generator stops on it."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from rlhf_cli.generation import response_mask_from
    from rlhf_cli.modeling import load_policy_tokenizer
    from rlhf_cli.ppo.models import PpoSources, build_policy
    from rlhf_cli.rundir import RunDir
    from rlhf_cli.stages.sft import run_sft
    from rlhf_cli.stages.trained import generation_engine, policy_source

    updates = {
        "model": {"name_or_path": base_model, "chat_template": "chatml"},
        "sft": {"full_finetune": False, "epochs": 1},
        "data": {"sft": {"max_samples": 40}},
    }
    recipe = load_recipe(small_recipe(tmp_path, updates))
    assert run_sft(recipe, QUIET)["status"] == "completed"

    base, adapter, saved = policy_source(recipe, RunDir.for_recipe(recipe), {})
    assert adapter is not None
    with safe_open(adapter / "adapter_model.safetensors", "pt") as weights:
        assert not [k for k in weights.keys() if "embed_tokens" in k]  # rows rebuilt on load
    im_end = AutoTokenizer.from_pretrained(saved).convert_tokens_to_ids("<|im_end|>")
    tokenizer = load_policy_tokenizer(recipe.model, saved, "left")
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(turn, tokenize=True, return_dict=True)["input_ids"][
        -2:
    ] == [im_end, tokenizer.encode("\n", add_special_tokens=False)[0]]

    sources = PpoSources(base, adapter, saved, None, None)
    policy, _ = build_policy(recipe, sources, torch.device("cpu"))
    generator = generation_engine(recipe.ppo.generation, policy, tokenizer, recipe, tmp_path)
    assert im_end in generator.stop_ids
    answer = torch.tensor([[5, im_end, 7, 7]])
    mask, ended = response_mask_from(answer, generator.stop_ids)
    assert ended.tolist() == [True] and mask.tolist() == [[True, True, False, False]]
