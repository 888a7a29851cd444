"""Datasets: HH-RLHF parsing, prompt filtering, preference shapes, local file formats, splits."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from rlhf_cli.data import (
    audit_prompts,
    hh_human_turn,
    hh_split,
    load_preferences,
    load_prompts,
    load_rows,
    load_sft,
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


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def prompts_of(path: Path, tmp_path: Path, **kw: Any) -> list[str]:
    return load_prompts(PromptSource(path=str(path), **kw), cache_dir=tmp_path / "cache")


# ── HH-RLHF parsing ─────────────────────────────────────────────────────────────────────────


def test_hh_human_turn_single() -> None:
    assert hh_human_turn(HH_ONE) == "What is X?"


def test_hh_human_turn_takes_the_first_turn() -> None:
    assert hh_human_turn(HH_MULTI) == "Hi there, can you help me?"


def test_hh_split_single_turn() -> None:
    assert hh_split(HH_ONE) == ("What is X?", "It is Y.")


def test_hh_split_multi_turn_keeps_the_history_in_the_prompt() -> None:
    prompt, response = hh_split(HH_MULTI)
    assert prompt == (
        "Hi there, can you help me?\n\nAssistant: Sure, what with?\n\nHuman: Cooking rice."
    )
    assert response == "Rinse it first."
    # the reward template rebuilds the dialogue
    template = "Human: {prompt}\n\nAssistant: {response}"
    assert template.format(prompt=prompt, response=response) == HH_MULTI.strip()


def test_hh_split_without_assistant_turn() -> None:
    with pytest.raises(DataError, match="no '.*Assistant:' turn"):
        hh_split("\n\nHuman: hello")


# ── prompts ─────────────────────────────────────────────────────────────────────────────────


def test_min_words_drops_five_words_or_fewer(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "one two three four five"},  # 5 words: dropped
            {"prompt": "one two three four five six"},  # 6 words: kept
            {"prompt": "  "},  # blank: dropped
            {"prompt": "a b c d e f g h"},  # kept
        ],
    )
    assert prompts_of(path, tmp_path) == ["one two three four five six", "a b c d e f g h"]
    assert len(prompts_of(path, tmp_path, min_words=0)) == 3  # blank still dropped


def test_max_chars_truncates(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "abcd " * 10}])
    (prompt,) = prompts_of(path, tmp_path, max_chars=12, min_words=0)
    assert prompt == "abcd abcd ab"


def test_max_chars_applies_before_the_word_count(tmp_path: Path) -> None:
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


def test_hh_chosen_column_gives_the_first_human_turn(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"chosen": HH_MULTI, "rejected": HH_MULTI_BAD},
            {
                "chosen": (
                    "\n\nHuman: How should I store fresh basil at home?\n\nAssistant: In water."
                ),
                "rejected": "\n\nHuman: How should I store fresh basil at home?\n\nAssistant: No.",
            },
        ],
    )
    assert prompts_of(path, tmp_path) == [
        "Hi there, can you help me?",
        "How should I store fresh basil at home?",
    ]


def test_prompts_missing_column_names_the_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "what is this about then?"}])
    with pytest.raises(DataError) as info:
        prompts_of(path, tmp_path)
    message = str(info.value)
    assert "needs columns prompt or instruction or chosen" in message
    assert "it has question" in message


def test_prompts_from_csv_and_json(tmp_path: Path) -> None:
    rows = [
        {"prompt": "What is a good way to learn the guitar?"},
        {"prompt": "How do I keep my kitchen knives sharp?"},
    ]
    with open(tmp_path / "p.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt"])
        writer.writeheader()
        writer.writerows(rows)
    (tmp_path / "p.json").write_text(json.dumps(rows), encoding="utf-8")
    expected = [r["prompt"] for r in rows]
    assert prompts_of(tmp_path / "p.csv", tmp_path) == expected
    assert prompts_of(tmp_path / "p.json", tmp_path) == expected


def test_txt_file_is_one_prompt_a_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("What is the best way to fold a shirt?\n\nHow do I clean my oven door?\n")
    assert prompts_of(path, tmp_path) == [
        "What is the best way to fold a shirt?",
        "How do I clean my oven door?",
    ]


def test_max_samples_keeps_the_first_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"row {i}"} for i in range(10)])
    rows = load_rows(DataSource(path=str(path), max_samples=3), cache_dir=tmp_path / "c")
    assert rows == [{"prompt": "row 0"}, {"prompt": "row 1"}, {"prompt": "row 2"}]


@pytest.mark.parametrize("name", ["e.jsonl", "e.json", "e.csv", "e.txt"])
def test_empty_file_is_a_data_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        load_rows(DataSource(path=str(path)), cache_dir=tmp_path / "c")


def test_file_without_rows_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text("[]")
    with pytest.raises(DataError, match="e.json"):
        load_rows(DataSource(path=str(path)), cache_dir=tmp_path / "c")


def test_unknown_hub_name_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot load dataset 'nobody/nothing-here'"):
        load_rows(DataSource(path="nobody/nothing-here"), cache_dir=tmp_path / "c")


GOOD_PAIR = {"prompt": "P", "chosen": "good", "rejected": "bad"}


# ── preferences ─────────────────────────────────────────────────────────────────────────────


def test_preferences_explicit_shape(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "P", "chosen": "good", "rejected": "bad"}])
    assert load_preferences(DataSource(path=str(path)), tmp_path / "c") == (
        [{"prompt": "P", "chosen": "good", "rejected": "bad"}],
        0,
    )


def test_preferences_hh_shape(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"chosen": HH_ONE, "rejected": HH_ONE.replace("It is Y.", "Dunno.")},
            {"chosen": HH_MULTI, "rejected": HH_MULTI_BAD},
        ],
    )
    pairs, _ = load_preferences(DataSource(path=str(path)), tmp_path / "c")
    assert pairs[0] == {"prompt": "What is X?", "chosen": "It is Y.", "rejected": "Dunno."}
    assert pairs[1]["prompt"].endswith("\n\nHuman: Cooking rice.")
    assert (pairs[1]["chosen"], pairs[1]["rejected"]) == ("Rinse it first.", "No.")


def test_preferences_missing_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "P", "chosen": "good"}])
    with pytest.raises(DataError) as info:
        load_preferences(DataSource(path=str(path)), tmp_path / "c")
    assert "prompt/chosen/rejected or chosen/rejected" in str(info.value)
    assert "it has chosen, prompt" in str(info.value)


def test_shipped_tiny_preferences(repo_root: Path, tmp_path: Path) -> None:
    pairs, same = load_preferences(
        DataSource(path=str(repo_root / "data/tiny/preferences.jsonl")), tmp_path / "c"
    )
    assert len(pairs) == 400 and same == 0
    assert all(p["chosen"] != p["rejected"] for p in pairs)


# ── SFT rows ────────────────────────────────────────────────────────────────────────────────


def test_sft_prompt_response_chat_and_plain(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Q", "response": "A"}])
    source = DataSource(path=str(path))
    assert load_sft(source, chat=True, cache_dir=tmp_path / "c") == [
        {
            "prompt": [{"role": "user", "content": "Q"}],
            "completion": [{"role": "assistant", "content": "A"}],
        }
    ]
    assert load_sft(source, chat=False, cache_dir=tmp_path / "c") == [
        {"prompt": "Q", "completion": "A"}
    ]


def test_sft_text_and_messages(tmp_path: Path) -> None:
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    assert load_sft(DataSource(path=str(text)), chat=True, cache_dir=tmp_path / "c") == [
        {"text": "hello"}
    ]
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    chat = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    assert load_sft(DataSource(path=str(chat)), chat=True, cache_dir=tmp_path / "c") == [
        {"messages": msgs}
    ]


def test_sft_missing_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [{"question": "Q", "answer": "A"}])
    with pytest.raises(DataError, match="messages or prompt/response .* or text; it has answer"):
        load_sft(DataSource(path=str(path)), chat=True, cache_dir=tmp_path / "c")


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
    "rows, message",
    [
        (
            [GOOD_PAIR, {"prompt": "P", "chosen": "good", "rejected": None}],
            "row 2: `rejected` must be text, it holds nothing",
        ),
        ([GOOD_PAIR, {"prompt": "P", "chosen": "good"}], "row 2: `rejected` must be text"),
        (
            [{"prompt": "P", "chosen": 3, "rejected": "bad"}],
            "row 1: `chosen` must be text, it holds int",
        ),
        ([{"prompt": ["P"], "chosen": "a", "rejected": "b"}], "row 1: `prompt` must be text"),
        (
            [{"prompt": "P", "chosen": "same", "rejected": "same"}],
            "every pair's chosen and rejected",
        ),
    ],
)
def test_preference_rows_that_cannot_teach_are_refused(tmp_path: Path, rows, message) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_preferences(DataSource(path=str(path)), tmp_path / "c")


def test_pairs_with_the_same_two_answers_are_skipped_and_counted(tmp_path: Path) -> None:
    same = {"prompt": "P", "chosen": "same", "rejected": "same "}
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD_PAIR, same, same])
    assert load_preferences(DataSource(path=str(path)), tmp_path / "c") == ([GOOD_PAIR], 2)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Hi there"}, "row 2: `response` must be text, it holds nothing"),
        ({"prompt": "Hi there", "response": None}, "row 2: `response` must be text"),
        ({"prompt": "Hi there", "response": "  "}, "row 2: `response` must be text"),
        ({"prompt": None, "response": "Hello"}, "row 2: `prompt` must be text"),
    ],
)
def test_sft_rows_without_their_text_are_refused(tmp_path: Path, row, message) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Q", "response": "A"}, row])
    with pytest.raises(DataError, match=message):
        load_sft(DataSource(path=str(path)), chat=True, cache_dir=tmp_path / "c")


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
        load_sft(DataSource(path=str(path)), chat=True, cache_dir=tmp_path / "c")


def test_a_non_utf8_audit_prompts_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a fine prompt\nanother \xe9t\xe9\n")
    with pytest.raises(DataError, match="prompts.txt:2: not UTF-8 text"):
        audit_prompts(AuditSection.model_construct(prompts_file=str(path)))
