"""Datasets: every layout each stage takes (TRL's standard and conversational types, HH-RLHF,
UltraFeedback-binarized, Alpaca, ShareGPT), multi-turn prompts, column mapping, splits and
slices, several files and mixtures, and bad rows named in one line."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest

from rlhf_cli.data import (
    Example,
    Pair,
    audit_prompts,
    hold_out,
    load_preferences,
    load_prompts,
    load_sft,
    prompt_text,
    read_source,
    split_eval,
)
from rlhf_cli.errors import DataError
from rlhf_cli.recipe import AuditSection, DataSource, PromptSource

HH_ONE = "\n\nHuman: What is X?\n\nAssistant: It is Y."
HH_MULTI = (
    "\n\nHuman: Hi there, can you help me?\n\nAssistant: Sure, what with?"
    "\n\nHuman: Cooking rice.\n\nAssistant: Rinse it first."
)
HH_MULTI_BAD = (
    "\n\nHuman: Hi there, can you help me?\n\nAssistant: Sure, what with?"
    "\n\nHuman: Cooking rice.\n\nAssistant: No."
)
SYSTEM = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "Hi there, can you help me?"}
A1 = {"role": "assistant", "content": "Sure, what with?"}
U2 = {"role": "user", "content": "Cooking rice."}
MULTI_PROMPT = [SYSTEM, U1, A1, U2]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def prompts_of(path: Path, tmp_path: Path, **kw: Any) -> list[str]:
    data = load_prompts(PromptSource(path=str(path), **kw), cache_dir=tmp_path / "cache")
    return [prompt_text(p) for p in data.items]


def pairs_of(path: Path, tmp_path: Path, **kw: Any) -> list[Pair]:
    return load_preferences(DataSource(path=str(path), **kw), tmp_path / "c").items


def sft_of(path: Path, tmp_path: Path, **kw: Any) -> list[Example]:
    return load_sft(DataSource(path=str(path), **kw), tmp_path / "c").items


# ── one prompt text for the reward model and plain prompts ──────────────────────────────────


def test_a_single_turn_prompt_is_its_text() -> None:
    assert prompt_text([user("What is X?")]) == "What is X?"


def test_a_dialogue_prompt_rebuilds_hh_rlhf_through_the_reward_template() -> None:
    text = prompt_text([U1, A1, U2])
    assert (
        text == "Hi there, can you help me?\n\nAssistant: Sure, what with?\n\nHuman: Cooking rice."
    )
    template = "Human: {prompt}\n\nAssistant: {response}"
    assert template.format(prompt=text, response="Rinse it first.") == HH_MULTI.strip()
    assert prompt_text(MULTI_PROMPT) == "You are terse.\n\n" + text  # system: first paragraph


# ── prompts ─────────────────────────────────────────────────────────────────────────────────


def test_min_words_drops_five_words_or_fewer(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "one two three four five"},  # 5 words: dropped
            {"prompt": "one two three four five six"},  # 6 words: kept
            {"prompt": "a b c d e f g h"},  # kept
        ],
    )
    assert prompts_of(path, tmp_path) == ["one two three four five six", "a b c d e f g h"]
    assert len(prompts_of(path, tmp_path, min_words=0)) == 3
    data = load_prompts(PromptSource(path=str(path)), tmp_path / "c")
    assert data.dropped == {"fewer than 6 words (data.prompts.min_words)": 1}
    assert (data.rows, data.layouts) == (3, {str(path): "prompt-only · standard"})


def test_a_blank_prompt_is_one_line_naming_its_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b c d e f g"}, {"prompt": "  "}])
    with pytest.raises(DataError, match=r"p.jsonl:2: column `prompt` holds an empty text"):
        prompts_of(path, tmp_path)


def test_max_chars_cuts_each_turn_before_the_word_count(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "aa bb cc dd ee ff gg hh"}, {"prompt": "a b c d e f g"}]
    )
    # cut to 11 characters: "aa bb cc dd" has 4 words (dropped), "a b c d e f" has 6 (kept)
    assert prompts_of(path, tmp_path, max_chars=11) == ["a b c d e f"]
    with pytest.raises(DataError, match="6 words or more"):
        prompts_of(path, tmp_path, max_chars=8)


@pytest.mark.parametrize("column", ["prompt", "instruction"])
def test_prompt_and_instruction_columns(tmp_path: Path, column: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{column: "How do I boil an egg well?"}])
    assert prompts_of(path, tmp_path) == ["How do I boil an egg well?"]


def test_a_conversational_prompt_is_a_conversation_not_its_repr(tmp_path: Path) -> None:
    """TRL's conversational prompt-only rows: the messages, never `[{'role': ...}]` as text."""
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": [SYSTEM, user("How should I store fresh basil at home?")]}],
    )
    data = load_prompts(PromptSource(path=str(path)), tmp_path / "c")
    assert data.items == [[SYSTEM, user("How should I store fresh basil at home?")]]
    assert data.layouts == {str(path): "prompt-only · conversational"}
    assert "{'role'" not in prompt_text(data.items[0])


def test_a_dialogue_prompt_keeps_its_whole_history(tmp_path: Path) -> None:
    """HH-RLHF, a `messages` conversation and a conversational pair give PPO everything before
    the final assistant turn, as the reward model trains on it (no first-human-turn cut)."""
    rows = {
        "hh.jsonl": {"chosen": HH_MULTI, "rejected": HH_MULTI_BAD},
        "hh_alone.jsonl": {"chosen": HH_MULTI},
        "messages.jsonl": {"messages": [U1, A1, U2, assistant("Rinse it first.")]},
        "open.jsonl": {"messages": [U1, A1, U2]},
        "pair.jsonl": {
            "chosen": [U1, A1, U2, assistant("Rinse it.")],
            "rejected": [U1, A1, U2, assistant("No.")],
        },
    }
    for name, row in rows.items():
        data = load_prompts(
            PromptSource(path=str(write_jsonl(tmp_path / name, [row])), min_words=0), tmp_path / "c"
        )
        assert data.items == [[U1, A1, U2]], name
    pairs = pairs_of(tmp_path / "hh.jsonl", tmp_path)
    assert pairs[0].prompt == [U1, A1, U2]


QUESTION = "How should I store fresh basil at home?"
ULTRAFEEDBACK_ROW = {  # HuggingFaceH4/ultrafeedback_binarized's columns
    "prompt": QUESTION,
    "chosen": [user(QUESTION), assistant("In water.")],
    "rejected": [user(QUESTION), assistant("No.")],
    "messages": [user(QUESTION), assistant("In water.")],
    "score_chosen": 8.0,
    "score_rejected": 2.0,
}


def test_prompts_of_an_ultrafeedback_row_are_its_prompt(tmp_path: Path) -> None:
    question, row = QUESTION, ULTRAFEEDBACK_ROW
    assert prompts_of(write_jsonl(tmp_path / "uf.jsonl", [row]), tmp_path) == [question]


def test_prompts_missing_column_names_what_is_needed_and_what_is_there(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "what is this about then?"}])
    with pytest.raises(DataError) as info:
        prompts_of(path, tmp_path)
    message = str(info.value)
    assert "needs `prompt`, `messages`, or `chosen` and `rejected`" in message
    assert "its first row has question" in message and "`columns`" in message


def test_a_source_mixing_layouts_is_one_error_naming_the_first_odd_row(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "How do I boil an egg well?"},
            {"prompt": "How do I poach an egg well?"},
            {"prompt": [user("How do I fry an egg well?")]},
            {"prompt": [user("How do I scramble an egg well?")]},
        ],
    )
    with pytest.raises(DataError) as info:
        prompts_of(path, tmp_path)
    assert str(info.value).startswith(f"{path}:3: a prompt-only · conversational row")
    assert "first row is prompt-only · standard" in str(info.value)


def test_prompts_from_csv_json_and_txt(tmp_path: Path) -> None:
    rows = [
        {"prompt": "What is a good way to learn the guitar?"},
        {"prompt": "How do I keep my kitchen knives sharp?"},
    ]
    with open(tmp_path / "p.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt"])
        writer.writeheader()
        writer.writerows(rows)
    (tmp_path / "p.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "p.txt").write_text("\n".join(r["prompt"] for r in rows) + "\n\n")
    expected = [r["prompt"] for r in rows]
    for name in ("p.csv", "p.json", "p.txt"):
        assert prompts_of(tmp_path / name, tmp_path) == expected, name


# ── sources: columns, splits, files, mixtures ───────────────────────────────────────────────


def test_columns_map_other_names_onto_ours(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "qa.jsonl", [{"question": "What is X?", "answer": "It is Y.", "id": 1}]
    )
    examples = sft_of(path, tmp_path, columns={"prompt": "question", "completion": "answer"})
    assert examples == [Example([user("What is X?")], "It is Y.")]
    with pytest.raises(
        DataError,
        match=r"qa.jsonl:1: no column `query` \(columns.prompt\); it has question, answer, id",
    ):
        sft_of(path, tmp_path, columns={"prompt": "query", "completion": "answer"})


def test_alpaca_instruction_input_output(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
            {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        ],
    )
    assert sft_of(path, tmp_path) == [
        Example([user("Translate to French.\n\nGood morning")], "Bonjour"),
        Example([user("Say hi.")], "Hi!"),
    ]


def test_sharegpt_conversations_through_columns(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "Hi there, can you help me?"},
            {"from": "gpt", "value": "Sure, what with?"},
            {"from": "human", "value": "Cooking rice."},
            {"from": "gpt", "value": "Rinse it first."},
        ]
    }
    path = write_jsonl(tmp_path / "s.jsonl", [row])
    assert sft_of(path, tmp_path, columns={"messages": "conversations"}) == [
        Example(MULTI_PROMPT, "Rinse it first.")
    ]


def test_a_system_column_opens_the_prompt(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl", [{"sys": "You are terse.", "prompt": "Q?", "completion": "A."}]
    )
    assert sft_of(path, tmp_path, columns={"system": "sys"}) == [
        Example([SYSTEM, user("Q?")], "A.")
    ]


def test_split_slices_and_max_samples_on_a_local_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"row {i}"} for i in range(10)])

    def texts(**kw: Any) -> list[str]:
        rows, _ = read_source(DataSource(path=str(path), **kw), tmp_path / "c")
        return [r.values["prompt"] for r in rows]

    assert texts(split="train[:50%]") == [f"row {i}" for i in range(5)]
    assert texts(split="train[2:4]") == ["row 2", "row 3"]
    assert texts(split="train[-2:]") == ["row 8", "row 9"]
    assert texts(split="train[5:]", max_samples=2) == ["row 5", "row 6"]
    assert read_source(DataSource(path=str(path)), tmp_path / "c")[0][0].where == f"{path}:1"


def test_data_files_globs_read_files_with_different_columns_one_by_one(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"prompt": "Q1?", "completion": "A1.", "source": "x"}])
    write_jsonl(folder / "b.jsonl", [{"prompt": "Q2?", "completion": "A2."}])
    write_jsonl(folder / "c.jsonl", [{"prompt": "Q3?", "completion": "A3.", "score": 3}])
    examples = load_sft(DataSource(data_files=[str(folder / "*.jsonl")]), tmp_path / "c").items
    assert [e.answer for e in examples] == ["A1.", "A2.", "A3."]


def test_a_mixture_weights_each_source(tmp_path: Path) -> None:
    a = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x"} for i in range(10)]
    )
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "t"}])
    c = write_jsonl(
        tmp_path / "c.jsonl",
        [{"prompt": [user("conversational prompt")], "completion": [assistant("y")]}],
    )
    mixed = DataSource(sources=[{"path": str(a), "weight": 0.5}, {"path": str(c), "weight": 2}])
    data = load_sft(mixed, tmp_path / "c")
    assert len(data.items) == 10 + 1 and data.rows == 11  # each row once: weights at the split
    train, held = hold_out(data, 0.2, seed=0)  # holds out a8, a9; a seeded half of the rest
    assert [e.prompt[0]["content"] for e in held] == ["a8", "a9"]
    prompts = [e.prompt[0]["content"] for e in train]
    assert prompts == ["a1", "a7", "a4", "conversational prompt", "conversational prompt", "a6"]
    assert data.layouts == {
        str(a): "prompt-completion · standard",
        str(c): "prompt-completion · conversational",
    }  # each source its own layout
    assert load_sft(mixed, tmp_path / "c").items == data.items  # the same draw every time
    with pytest.raises(DataError, match="mixes `text` rows with prompt/answer rows"):
        load_sft(DataSource(sources=[{"path": str(a)}, {"path": str(b)}]), tmp_path / "c")


@pytest.mark.parametrize("name", ["e.jsonl", "e.json", "e.csv", "e.txt"])
def test_empty_file_is_a_data_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        read_source(DataSource(path=str(path)), cache_dir=tmp_path / "c")


def test_file_without_rows_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text("[]")
    with pytest.raises(DataError, match="e.json"):
        read_source(DataSource(path=str(path)), cache_dir=tmp_path / "c")


def test_unknown_hub_name_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"cannot load dataset 'nobody/nothing-here \(sub\) \[train\[:5%\]\]'"
    ):
        read_source(
            DataSource(path="nobody/nothing-here", name="sub", split="train[:5%]"),
            cache_dir=tmp_path / "c",
        )


# ── preferences ─────────────────────────────────────────────────────────────────────────────


def test_preferences_standard_explicit_and_implicit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "P", "chosen": "good", "rejected": "bad"}])
    assert pairs_of(path, tmp_path) == [Pair([user("P")], "good", "bad")]
    implicit = write_jsonl(
        tmp_path / "i.jsonl",
        [{"chosen": "The sky is blue. Because of light.", "rejected": "The sky is blue. Bah."}],
    )
    assert pairs_of(implicit, tmp_path) == [
        Pair([user("The sky is blue.")], "Because of light.", "Bah.")
    ]


def test_preferences_conversational_explicit_and_implicit(tmp_path: Path) -> None:
    explicit = write_jsonl(
        tmp_path / "e.jsonl",
        [
            {
                "prompt": [U1, A1, U2],
                "chosen": [assistant("Rinse it.")],
                "rejected": [assistant("No.")],
            }
        ],
    )
    implicit = write_jsonl(
        tmp_path / "i.jsonl",
        [
            {
                "chosen": [U1, A1, U2, assistant("Rinse it.")],
                "rejected": [U1, A1, U2, assistant("No.")],
            }
        ],
    )
    expected = [Pair([U1, A1, U2], "Rinse it.", "No.")]
    assert pairs_of(explicit, tmp_path) == pairs_of(implicit, tmp_path) == expected


def test_preferences_hh_rlhf(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"chosen": HH_ONE, "rejected": HH_ONE.replace("It is Y.", "Dunno.")},
            {"chosen": HH_MULTI, "rejected": HH_MULTI_BAD},
        ],
    )
    data = load_preferences(DataSource(path=str(path)), tmp_path / "c")
    assert data.items == [
        Pair([user("What is X?")], "It is Y.", "Dunno."),
        Pair([U1, A1, U2], "Rinse it first.", "No."),
    ]
    assert data.layouts == {str(path): "HH-RLHF"}


def test_preferences_ultrafeedback_binarized(tmp_path: Path) -> None:
    question, row = QUESTION, ULTRAFEEDBACK_ROW
    data = load_preferences(
        DataSource(path=str(write_jsonl(tmp_path / "uf.jsonl", [row]))), tmp_path / "c"
    )
    assert data.items == [Pair([user(question)], "In water.", "No.")]
    assert list(data.layouts.values()) == ["UltraFeedback-binarized"]


def test_shipped_tiny_preferences(repo_root: Path, tmp_path: Path) -> None:
    data = load_preferences(
        DataSource(path=str(repo_root / "data/tiny/preferences.jsonl")), tmp_path / "c"
    )
    assert len(data.items) == 400 and data.dropped == {}
    assert all(p.chosen != p.rejected for p in data.items)


GOOD_PAIR = {"prompt": "P", "chosen": "good", "rejected": "bad"}


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [GOOD_PAIR, {"prompt": "P", "chosen": "good", "rejected": None}],
            "p.jsonl:2: column `rejected` holds nothing; the source's rows are preference · "
            "standard",
        ),
        (
            [GOOD_PAIR, {"prompt": "P", "chosen": "good"}],
            "p.jsonl:2: column `rejected` holds nothing",
        ),
        (
            [{"prompt": "P", "chosen": 3, "rejected": "bad"}],
            "p.jsonl:1: column `chosen` holds a number (3); expected text or a list of messages",
        ),
        (
            [{"prompt": ["P"], "chosen": "a", "rejected": "b"}],
            "p.jsonl:1: column `prompt` message 1 is text; expected {role, content}",
        ),
        (
            [{"prompt": "P", "chosen": [{"role": "assistant", "text": "a"}], "rejected": "b"}],
            "p.jsonl:1: column `chosen` message 1 has content of nothing; expected text",
        ),
        (
            [{"prompt": "P", "chosen": [{"role": "robot", "content": "a"}], "rejected": "b"}],
            "p.jsonl:1: column `chosen` message 1 has role robot; expected one of",
        ),
        (
            [{"prompt": "P", "chosen": [user("Q"), assistant("a")], "rejected": "b"}],
            "p.jsonl:1: column `chosen` holds 2 messages that are not the prompt's",
        ),
        (
            [{"chosen": "same start a", "rejected": "other b"}],
            "p.jsonl:1: `chosen` and `rejected` share no start",
        ),
        (
            [{"prompt": "P", "chosen": "same", "rejected": "same"}],
            "every pair's chosen and rejected",
        ),
    ],
)
def test_preference_rows_that_cannot_teach_are_one_line(tmp_path: Path, rows, message) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError) as info:
        pairs_of(path, tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_pairs_with_the_same_two_answers_are_skipped_and_counted(tmp_path: Path) -> None:
    same = {"prompt": "P", "chosen": "same", "rejected": "same "}
    data = load_preferences(
        DataSource(path=str(write_jsonl(tmp_path / "p.jsonl", [GOOD_PAIR, same, same]))),
        tmp_path / "c",
    )
    assert data.items == [Pair([user("P")], "good", "bad")]
    assert data.dropped == {"identical answers": 2}


# ── SFT rows ────────────────────────────────────────────────────────────────────────────────


def test_sft_prompt_response_and_prompt_completion(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Q", "response": "A"}])
    assert sft_of(path, tmp_path) == [Example([user("Q")], "A")]
    conv = write_jsonl(
        tmp_path / "c.jsonl", [{"prompt": [user("Q")], "completion": [assistant("A")]}]
    )
    assert sft_of(conv, tmp_path) == [Example([user("Q")], "A")]


def test_sft_text_and_multi_turn_messages(tmp_path: Path) -> None:
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    assert sft_of(text, tmp_path) == [Example(None, "hello")]
    chat = write_jsonl(
        tmp_path / "m.jsonl", [{"messages": [*MULTI_PROMPT, assistant("Rinse it first.")]}]
    )
    # the prompt is everything before the final assistant turn, system message included
    assert sft_of(chat, tmp_path) == [Example(MULTI_PROMPT, "Rinse it first.")]


def test_sft_missing_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [{"question": "Q", "answer": "A"}])
    with pytest.raises(
        DataError,
        match="needs `text`, `messages`, or `prompt` with `completion`; its first row has "
        "question, answer",
    ):
        sft_of(path, tmp_path)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Hi there"}, "s.jsonl:2: column `completion` holds nothing"),
        (
            {"prompt": "Hi there", "response": "  "},
            "s.jsonl:2: column `completion` holds an empty text",
        ),
        ({"prompt": None, "response": "Hello"}, "s.jsonl:2: column `prompt` holds nothing"),
        (
            {"prompt": {"a": 1}, "response": "Hello"},
            "s.jsonl:2: column `prompt` holds an object with keys a; expected text",
        ),
        (
            {"messages": [U1, A1, U2]},
            "s.jsonl:2: column `messages` must end with an assistant turn",
        ),
        ({"messages": [A1]}, "s.jsonl:2: column `messages` has no user turn before its answer"),
    ],
)
def test_sft_rows_without_their_text_are_one_line(tmp_path: Path, row, message) -> None:
    first = {"messages": [U1, A1]} if "messages" in row else {"prompt": "Q", "response": "A"}
    path = write_jsonl(tmp_path / "s.jsonl", [first, row])
    with pytest.raises(DataError) as info:
        sft_of(path, tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value)


# ── held-out split ──────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("n", "fraction", "n_eval"),
    [
        (100, 0.1, 10),
        (400, 0.15, 60),
        (10, 0.1, 1),
        (3, 0.01, 1),
        (2, 0.49, 1),
        (7, 0.2, 1),
        (9, 0.2, 2),
    ],
)
def test_split_eval_sizes(n: int, fraction: float, n_eval: int) -> None:
    train, held = split_eval(list(range(n)), fraction, seed=0)
    assert len(held) == n_eval and len(train) == n - n_eval
    assert sorted(train + held) == list(range(n))


def test_split_eval_is_deterministic_per_seed() -> None:
    rows = list(range(50))
    assert split_eval(rows, 0.2, seed=1) == split_eval(rows, 0.2, seed=1)
    assert split_eval(rows, 0.2, seed=1)[1] != split_eval(rows, 0.2, seed=2)[1]
    assert rows == list(range(50))  # input not shuffled in place


def test_split_eval_needs_two_rows() -> None:
    with pytest.raises(DataError, match="at least 2 rows"):
        split_eval([1], 0.1, seed=0)


def test_held_out_prompts_are_a_fixed_share_the_same_for_every_run():
    from rlhf_cli.data import split_heldout

    prompts = [f"prompt number {i}" for i in range(50)]
    train, held = split_heldout(prompts, 0.2)
    assert len(held) == 10 and len(train) == 40 and not set(train) & set(held)
    assert sorted(train + held) == sorted(prompts)
    assert split_heldout(prompts, 0.2) == (train, held)  # no seed of the run enters the draw
    assert held != prompts[-10:] and held != prompts[:10]  # a draw, not a slice
    assert split_heldout(prompts, 0.0) == (prompts, [])
    assert len(split_heldout(prompts[:3], 0.01)[1]) == 1  # at least one when asked


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a", "response": "b"}\n{"prompt": \n', "s.jsonl:2: not valid JSON"),
        (b"\n\n   \n", "s.jsonl' is empty"),
        (b'{"prompt": "a", "response": "b"}\n\xff\xfe\n', "s.jsonl:2: not UTF-8 text"),
        (b'{"prompt": "a", "response": "b"}\n[1, 2]\n', "s.jsonl:2: a row must be a JSON object"),
    ],
)
def test_damaged_jsonl_names_the_file_and_line(tmp_path: Path, content, message) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_sft(DataSource(path=str(path)), cache_dir=tmp_path / "c")


def test_a_non_utf8_audit_prompts_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a fine prompt\nanother \xe9t\xe9\n")
    with pytest.raises(DataError, match="prompts.txt:2: not UTF-8 text"):
        audit_prompts(AuditSection.model_construct(prompts_file=str(path)))


# ── the recipe names sources; `rlhf validate` checks them without reading them ──────────────


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"path": "org/set", "split": "train[:5"}, "is not a split"),
        ({"path": "LOCAL", "split": "test"}, "a local file has the one split `train`"),
        ({"path": "LOCAL", "name": "sub"}, "a subset names a part of a hub dataset"),
        ({"data_files": ["nothing-*.jsonl"]}, "data_files: no file matches"),
        ({"split": "train"}, "give `path` (a file or a hub dataset) or `data_files`"),
        ({"path": "org/set", "columns": {"question": "prompt"}}, "columns.question"),
        ({"path": "org/set", "weight": 0}, "weight"),
        (
            {"path": "LOCAL", "sources": [{"path": "org/set"}]},
            "sources: give path inside each source",
        ),
    ],
)
def test_bad_sources_are_refused_at_validate(tmp_path: Path, fields, message) -> None:
    from pydantic import ValidationError

    local = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q"}])
    fields = {k: str(local) if v == "LOCAL" else v for k, v in fields.items()}
    with pytest.raises(ValidationError, match=re.escape(message)):
        DataSource.model_validate(fields, context={"base_dir": str(tmp_path)})


def test_a_mixture_survives_the_run_snapshot(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q"}])
    hub = {"path": "org/set", "name": "sub", "split": "train[:5%]"}
    spec = {"sources": [hub, {"data_files": ["*.jsonl"], "weight": 0.5}], "eval_fraction": 0.2}
    source = DataSource.model_validate(spec, context={"base_dir": str(tmp_path)})
    pattern = str(tmp_path.resolve() / "*.jsonl")  # absolute, matched again when read
    assert source.parts()[1].data_files == [pattern]
    again = DataSource.model_validate(source.model_dump(mode="json"))
    assert again == source and again.where() == f"org/set (sub) + {pattern}"


def test_every_layout_recipe_in_the_docs_validates(tmp_path: Path) -> None:
    """docs/recipes.md's data recipes (HH-RLHF, UltraFeedback, a conversational prompt set, a
    mixture) are recipes `rlhf validate` takes."""
    import yaml

    from rlhf_cli.recipe import DATA_LAYOUTS, DataSection

    (tmp_path / "prompts").mkdir()
    write_jsonl(tmp_path / "prompts" / "a.jsonl", [{"prompt": [user("Hi")]}])
    blocks = re.findall(r"```yaml\n(.*?)```", DATA_LAYOUTS, re.S)
    assert len(blocks) == 4
    for block in blocks:
        data = yaml.safe_load(block)["data"]
        DataSection.model_validate(data, context={"base_dir": str(tmp_path)})
