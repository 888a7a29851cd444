"""The guide's recipe on long HH-RLHF dialogues under a template that insists on alternating
roles (Mistral-Instruct v0.2's, as its tokenizer ships it): a prompt longer than
`data.prompts.max_tokens` loses whole exchanges, so the window still starts with the user;
`rlhf validate --data` tokenises as PPO does and reports the cut; a template that fails on a row
is one line naming it (exit 2). On f41b8ed the window lost one turn at a time, started with the
assistant, and PPO set-up died with jinja2's TemplateError (exit 70), while validate, tokenising
with no limit, saw nothing wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.data import load_prompts
from rlhf_cli.data.prompts import prompt_tokens
from rlhf_cli.errors import DataError
from rlhf_cli.modeling import load_policy_tokenizer
from rlhf_cli.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]

# Mistral-7B-Instruct-v0.2's chat template (tokenizer_config.json), verbatim
MISTRAL_V02 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# renders one user turn (so the recipe takes it) and fails on dialogue 3 alone
FAILS_ON_ROW_4 = (
    "{% if 'dialogue 3' in messages[0]['content'] %}{{ raise_exception('no rice here') }}"
    "{% endif %}" + MISTRAL_V02
)
ROWS = 10
EXCHANGES = 3  # before the last user turn


def write_dialogues(folder: Path, template: str = MISTRAL_V02) -> tuple[Path, Path]:
    """An HH-RLHF-shaped JSONL file (`chosen`/`rejected` dialogues of `Human:` and
    `Assistant:` turns), each prompt three exchanges and a last question, and a Jinja file."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(ROWS):
        turns = "".join(
            f"\n\nHuman: Question {k} of dialogue {i}: how do I keep the flowers fresh?"
            f"\n\nAssistant: Answer {k}: change the water every day."
            for k in range(EXCHANGES)
        )
        turns += f"\n\nHuman: And the last one, number {i}: how long should I cook the rice?"
        rows.append(
            {
                "chosen": turns + "\n\nAssistant: Twenty minutes.",
                "rejected": turns + "\n\nAssistant: No.",
            }
        )
    data = folder / "hh.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    jinja = folder / "template.jinja"
    jinja.write_text(template, encoding="utf-8")
    return data, jinja


def _prompts_and_tokenizer(make_recipe, tmp_path: Path, template: str = MISTRAL_V02):
    data, jinja = write_dialogues(tmp_path / "data", template)
    recipe = load_recipe(
        make_recipe(
            {"data": {"prompts": {"path": str(data)}}, "model": {"chat_template": str(jinja)}}
        )
    )
    tokenizer = load_policy_tokenizer(recipe.model, recipe.model.name_or_path, "left")
    return load_prompts(recipe.data.prompts).items, tokenizer


def _rendered(tokenizer, turns) -> list[int]:
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_long_dialogue_loses_whole_exchanges_and_starts_with_the_user(make_recipe, tmp_path):
    """Token counts on the tiny tokenizer: the whole prompt 181, from the second exchange 132,
    the last exchange and question 83, the question alone 34. At 90 tokens two exchanges go; at
    60, all three; at 20 the question loses its start inside the template."""
    prompts, tokenizer = _prompts_and_tokenizer(make_recipe, tmp_path)
    assert len(prompts) == ROWS and [m["role"] for m in prompts[0]] == ["user", "assistant"] * 3 + [
        "user"
    ]
    for max_tokens, dropped, window in ((10**6, 0, 7), (90, 2, 3), (60, 3, 1)):
        for prompt, tokens in zip(
            prompts, prompt_tokens(tokenizer, prompts, True, max_tokens), strict=True
        ):
            assert tokens.full_tokens == 181 and len(tokens.ids) <= max_tokens
            assert (tokens.exchanges_dropped, tokens.text_cut) == (dropped, False)
            assert tokens.ids == _rendered(tokenizer, prompt[-window:])  # starts with the user
            assert tokenizer.decode(tokens.ids).startswith("<s>[INST] ")
    (tokens,) = prompt_tokens(tokenizer, prompts[:1], True, 20)
    assert (tokens.exchanges_dropped, tokens.text_cut, len(tokens.ids)) == (3, True, 20)
    text = tokenizer.decode(tokens.ids)
    assert text.startswith("<s>[INST] ") and text.endswith("cook the rice? [/INST]")
    assert "And the last one" not in text


@pytest.mark.parametrize(
    "template, reason",
    [
        (FAILS_ON_ROW_4, "no rice here"),  # the template's own raise_exception (TemplateError)
        ("{{ messages[0]['content'] + 1 }}", 'can only concatenate str (not "int")'),  # any other
    ],
)
def test_a_failing_template_names_the_prompt(make_recipe, tmp_path, template, reason):
    prompts, tokenizer = _prompts_and_tokenizer(make_recipe, tmp_path)
    tokenizer.chat_template = template
    with pytest.raises(DataError) as caught:
        prompt_tokens(tokenizer, prompts, True, 60, where="hh.jsonl: kept prompt")
    message = str(caught.value)
    number = 4 if template == FAILS_ON_ROW_4 else 1
    assert message.startswith(
        f'hh.jsonl: kept prompt {number} ("Question 0 of dialogue {number - 1}'
    )
    assert "the chat template fails on it: " in message and reason in message
    assert "\n" not in message


def _validate(tmp_path: Path, template: str, *extra: str):
    data, jinja = write_dialogues(tmp_path / "data", template)
    sets = {
        "model.name_or_path": "builtin:tiny-lm",
        "model.chat_template": str(jinja),
        "data.prompts.path": str(data),
        "data.prompts.max_tokens": "60",
    }
    args = ["validate", "--data", "--recipe", str(REPO / "recipes" / "mistral7b.yaml")]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return CliRunner().invoke(app, [*args, *extra])


def test_validate_data_on_the_guides_recipe_reports_what_ppo_does(tmp_path):
    result = _validate(tmp_path, MISTRAL_V02, "--json", "--row", "2")
    assert result.exit_code == 0, result.output
    prompts = json.loads(result.stdout)["stages"]["prompts"]
    assert prompts["prompt_tokens"] == {"p50": 181, "p95": 181, "max": 181}
    assert prompts["over_limit"] == {
        "cut at data.prompts.max_tokens": ROWS,
        "of them lose their oldest exchanges": ROWS,
        "of them lose the start of their last turn": 0,
    }
    assert prompts["exchanges_dropped"] == ROWS * EXCHANGES
    assert prompts["row"]["generates_from"] == (
        "<s>[INST] And the last one, number 1: how long should I cook the rice? [/INST]"
    )


def test_validate_data_exits_2_naming_the_row_a_template_fails_on(tmp_path):
    result = _validate(tmp_path, FAILS_ON_ROW_4)
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "data check failed: prompts: " in line and "Traceback" not in result.output
    assert f'{tmp_path / "data" / "hh.jsonl"}: kept prompt 4 ("Question 0 of dialogue 3' in line
    assert line.endswith("no rice here (fix the row, or model.chat_template)")


def _ppo(folder: Path, template: str, **more: str):
    """`rlhf ppo` on the tiny model with the guide recipe's shape (no SFT, a pretrained reward
    model) on the long dialogues, cut to 60 tokens."""
    data, jinja = write_dialogues(folder / "data", template)
    sets = {
        "run.output_dir": str(folder / "runs"),
        "sft.enabled": "false",
        "reward.base_model": "null",
        "reward.pretrained": "builtin:minilm",
        "model.chat_template": str(jinja),
        "data.prompts.path": str(data),
        "data.prompts.max_tokens": "60",
        **more,
    }
    args = ["ppo", "--recipe", str(REPO / "recipes" / "tiny.yaml")]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return CliRunner().invoke(app, args)


def test_ppo_exits_2_naming_the_row_a_template_fails_on(chdir_tmp):
    result = _ppo(chdir_tmp, FAILS_ON_ROW_4)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert line == (
        f'error: {chdir_tmp / "data" / "hh.jsonl"}: kept prompt 4 ("Question 0 of dialogue 3: '
        'how do I keep the flow…"): the chat template fails on it: no rice here (fix the row, '
        "or model.chat_template)"
    )


@pytest.mark.slow
def test_ppo_trains_on_long_dialogues_under_an_alternating_template(chdir_tmp):
    """The tiny equivalent of `rlhf ppo --recipe recipes/mistral7b.yaml` on the long
    dialogues."""
    short = {"ppo.iterations": "1", "ppo.batch_size": "4", "ppo.mini_batch_size": "2",
             "ppo.ppo_epochs": "1", "ppo.eval_every": "1", "ppo.save_freq": "1",
             "ppo.generation.max_new_tokens": "8"}  # fmt: skip
    result = _ppo(chdir_tmp, MISTRAL_V02, **short)
    assert result.exit_code == 0, result.output
    manifest = json.loads((chdir_tmp / "runs" / "tiny" / "ppo" / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["metrics"]["iterations"] == 1
    assert manifest["data"]["prompts"]["over_limit"]["of them lose their oldest exchanges"] == 10
