"""What the review of the data code found (#50): a sliced split read by `datasets` the same way
for the data check as for training, a mixture's weights applied after the held-out split (and
rows the data holds twice counted for every stage), an empty system column or message taken as
none, implicit-prompt pairs whose answers cannot be told apart dropped and counted, and a key
given twice in a JSON data row refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlhf_cli.data import (
    Example,
    Pair,
    hold_out,
    load_preferences,
    load_prompts,
    load_sft,
    prompt_text,
    read_source,
    split_eval,
    split_heldout,
)
from rlhf_cli.errors import DataError
from rlhf_cli.recipe import DataSource, PromptSource


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ── a sliced split through `datasets`: the check reads the rows training reads ──────────────


@pytest.fixture
def dataset_folder(tmp_path: Path) -> Path:
    """A local dataset folder: read through `datasets`, as a hub dataset is (not a file)."""
    rows = [{"prompt": f"row {i}"} for i in range(10)]
    return write_jsonl(tmp_path / "folder" / "data.jsonl", rows).parent


@pytest.mark.parametrize(
    ("split", "rows"),
    [
        ("train[2:5]", [2, 3, 4]),  # counted from the start: the slice taken on the stream
        ("train[:50%]", [0, 1, 2, 3, 4]),  # a percentage needs the size: read whole
        ("train[-3:]", [7, 8, 9]),
        ("train[7:]+train[:2]", [7, 8, 9, 0, 1]),
    ],
)
def test_a_sliced_split_sampled_is_the_start_of_what_training_reads(
    dataset_folder: Path, tmp_path: Path, split: str, rows: list[int]
) -> None:
    spec = DataSource(path=str(dataset_folder), split=split)
    whole, sampled = read_source(spec, tmp_path / "c")
    assert [r.values["prompt"] for r in whole] == [f"row {i}" for i in rows] and not sampled
    first, sampled = read_source(spec, tmp_path / "c", limit=2)
    assert [r.values for r in first] == [r.values for r in whole[:2]] and sampled


# ── a mixture's weights apply after the held-out split ──────────────────────────────────────


def test_a_weighted_mixture_holds_out_no_row_it_trains_on(tmp_path: Path) -> None:
    """20 rows, 4 held out (seed 0 draws rows 10, 14, 16, 18: b0, b4, b6, b8), then a's 10
    training rows 3 times each and a seeded half of b's 6 (b7, b9, b3): 33 training items and
    none of them a held-out row. Weighted first (the old order), copies of a's rows trained and
    were held out too."""
    a = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x"} for i in range(10)]
    )
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": f"b{i}", "completion": "y"} for i in range(10)]
    )
    mixed = DataSource(sources=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 0.5}])
    data = load_sft(mixed, tmp_path / "c")
    assert len(data.items) == 20 and data.rows == 20  # each row once until the split
    train, heldout = hold_out(data, 0.2, seed=0)
    assert sorted(e.prompt[0]["content"] for e in heldout) == ["b0", "b4", "b6", "b8"]
    names = [e.prompt[0]["content"] for e in train]
    assert len(train) == 33 and {n: names.count(n) for n in names} == {
        **{f"a{i}": 3 for i in range(10)},
        "b7": 1,
        "b9": 1,
        "b3": 1,
    }
    assert data.warnings == []
    assert hold_out(load_sft(mixed, tmp_path / "c"), 0.2, seed=0) == (train, heldout)
    ppo_train, ppo_heldout = hold_out(data, 0.2)  # PPO's fixed draw, the same rule
    assert len(ppo_heldout) == 4 and not set(map(str, ppo_train)) & set(map(str, ppo_heldout))


def test_one_unweighted_source_splits_as_before(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl", [{"prompt": f"q{i}", "completion": "a"} for i in range(30)]
    )
    data = load_sft(DataSource(path=str(path)), tmp_path / "c")
    assert hold_out(data, 0.1, seed=7) == split_eval(data.items, 0.1, 7)
    assert hold_out(data, 0.2) == split_heldout(data.items, 0.2)


PROMPT = "please tell me how to cook rice well"  # 8 words: over `min_words`


@pytest.mark.parametrize(
    ("stage", "row"),
    [
        ("sft", {"prompt": PROMPT, "completion": "Rinse it first."}),
        ("preferences", {"prompt": PROMPT, "chosen": "Rinse it first.", "rejected": "No."}),
        ("prompts", {"prompt": PROMPT}),
    ],
)
def test_rows_the_data_holds_twice_are_counted_when_held_out(
    tmp_path: Path, stage: str, row: dict[str, Any]
) -> None:
    """Nine copies of one row and one other row: 2 of 10 held out, both copies of the repeated
    row, which trains too."""
    other = {
        k: (f"{v} once" if k in ("prompt", "completion", "chosen") else v) for k, v in row.items()
    }
    path = write_jsonl(tmp_path / "d.jsonl", [row] * 9 + [other])
    if stage == "prompts":
        data: Any = load_prompts(PromptSource(path=str(path)), tmp_path / "c")
        train, heldout = hold_out(data, 0.2)
    else:
        load = load_sft if stage == "sft" else load_preferences
        data = load(DataSource(path=str(path)), tmp_path / "c")
        train, heldout = hold_out(data, 0.2, seed=0)
    assert len(heldout) == 2  # rows 7 and 8 (seed 0), 1 and 4 (PPO's draw): copies both
    assert all(item == data.items[0] for item in heldout)
    assert data.warnings == [
        f"2 of 2 held-out rows of {path} are training rows too (the data holds them twice): the "
        "held-out figures read high; remove the duplicates"
    ]


# ── blank optional columns and turns are absent ─────────────────────────────────────────────


@pytest.mark.parametrize("system", ["", "   ", None])
def test_an_empty_system_column_is_no_system_message(tmp_path: Path, system: Any) -> None:
    rows = [
        {"prompt": "Q", "completion": "A", "system": system},
        {"prompt": "Q2", "completion": "A2", "system": "Be kind."},
    ]
    data = load_sft(DataSource(path=str(write_jsonl(tmp_path / "s.jsonl", rows))), tmp_path / "c")
    assert data.items == [
        Example([user("Q")], "A"),
        Example([{"role": "system", "content": "Be kind."}, user("Q2")], "A2"),
    ]
    pairs = [{"prompt": "Q", "chosen": "good", "rejected": "bad", "system": system}]
    path = write_jsonl(tmp_path / "p.jsonl", pairs)
    assert load_preferences(DataSource(path=str(path)), tmp_path / "c").items == [
        Pair([user("Q")], "good", "bad")
    ]
    prompts = [{"prompt": PROMPT, "system": system}]
    path = write_jsonl(tmp_path / "q.jsonl", prompts)
    assert load_prompts(PromptSource(path=str(path)), tmp_path / "c").items == [[user(PROMPT)]]


def test_an_empty_system_message_is_none_in_every_layout(tmp_path: Path) -> None:
    """ShareGPT / Orca rows open with `{from: system, value: ""}`."""
    sharegpt = [{"from": "system", "value": ""}, {"from": "human", "value": PROMPT}]
    rows = [{"conversations": [*sharegpt, {"from": "gpt", "value": "Rinse it."}]}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    spec = {"path": str(path), "columns": {"messages": "conversations"}}
    assert load_sft(DataSource(**spec), tmp_path / "c").items == [
        Example([user(PROMPT)], "Rinse it.")
    ]
    assert load_prompts(PromptSource(**spec), tmp_path / "c").items == [[user(PROMPT)]]
    sharegpt[0]["value"] = None  # no text at all: none too
    pair = {
        "chosen": [*sharegpt, {"from": "gpt", "value": "Rinse it."}],
        "rejected": [*sharegpt, {"from": "gpt", "value": "No."}],
        "system": " ",
    }
    path = write_jsonl(tmp_path / "p.jsonl", [pair])
    assert load_preferences(DataSource(path=str(path)), tmp_path / "c").items == [
        Pair([user(PROMPT)], "Rinse it.", "No.")
    ]


def test_a_prompt_whose_last_answer_is_empty_is_its_turns_before(tmp_path: Path) -> None:
    """PPO reads no answer: an empty final assistant turn is none."""
    rows = [{"messages": [user(PROMPT), {"role": "assistant", "content": ""}]}]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    assert load_prompts(PromptSource(path=str(path)), tmp_path / "c").items == [[user(PROMPT)]]


# ── implicit prompts: answers that cannot be told apart ─────────────────────────────────────

PREFIX = "`chosen` or `rejected` is the start of the other (no prompt to cut off)"
DIFFERENT = "`chosen` and `rejected` differ before their last assistant turn"
EMPTY = "an empty last assistant turn in `chosen` or `rejected`"
HH = "\n\nHuman: What is X?\n\nAssistant: It is Y."


def pairs_in(tmp_path: Path, rows: list[dict[str, Any]]) -> Any:
    return load_preferences(DataSource(path=str(write_jsonl(tmp_path / "p.jsonl", rows))))


def test_an_answer_that_is_the_start_of_the_other_is_cut_at_an_earlier_word(
    tmp_path: Path,
) -> None:
    rows = [{"chosen": "What is X? It is Y.", "rejected": "What is X? It is Y. And Z."}]
    assert pairs_in(tmp_path, rows).items == [Pair([user("What is X? It is")], "Y.", "Y. And Z.")]
    rows = [{"chosen": "What is X? It is Y. And Z. ", "rejected": "What is X? It is Y. "}]
    assert pairs_in(tmp_path, rows).items == [Pair([user("What is X? It is")], "Y. And Z.", "Y.")]


def test_pairs_that_cannot_be_split_are_dropped_and_counted(tmp_path: Path) -> None:
    good = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    no_word = {"chosen": "Yes", "rejected": "Yes sir"}  # no boundary leaves both answers text
    same = {"chosen": "Same", "rejected": "Same"}
    data = pairs_in(tmp_path, [good, no_word, same])
    assert data.items == [Pair([user("The sky is")], "blue.", "green.")]
    assert data.dropped == {PREFIX: 2}
    longer = HH + "\n\nHuman: Sure?\n\nAssistant: Yes."  # HH-RLHF: one dialogue goes on
    hh = pairs_in(tmp_path, [{"chosen": HH, "rejected": HH.replace("Y.", "Z.")},
                             {"chosen": HH, "rejected": longer}])  # fmt: skip
    assert hh.items == [Pair([user("What is X?")], "It is Y.", "It is Z.")]
    assert hh.dropped == {DIFFERENT: 1}
    unanswered = HH + "\n\nHuman: Sure?\n\nAssistant:"  # HH-RLHF's empty last answers
    hh = pairs_in(tmp_path, [{"chosen": HH, "rejected": HH.replace("Y.", "Z.")},
                             {"chosen": longer, "rejected": unanswered}])  # fmt: skip
    assert len(hh.items) == 1 and hh.dropped == {EMPTY: 1}
    path = write_jsonl(tmp_path / "q.jsonl", [good, no_word])
    prompts = load_prompts(PromptSource(path=str(path), min_words=0))
    assert [prompt_text(p) for p in prompts.items] == ["The sky is"]
    assert prompts.dropped == {PREFIX: 1}
    path = write_jsonl(tmp_path / "q.jsonl", [no_word])
    with pytest.raises(DataError) as info:
        load_prompts(PromptSource(path=str(path), min_words=0))
    assert str(info.value) == f"no prompt of '{path}' is left (1 with {PREFIX})"
    with pytest.raises(DataError) as info:
        pairs_in(tmp_path, [no_word, same])
    assert str(info.value) == f"{tmp_path / 'p.jsonl'}: no pair is left (2 with {PREFIX})"


# ── a key given twice in a JSON data row ────────────────────────────────────────────────────


def test_a_json_row_that_gives_a_key_twice_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(
        '{"prompt": "Q", "completion": "A"}\n{"prompt": "Q", "prompt": "R", "completion": "A"}\n'
    )
    with pytest.raises(DataError) as info:
        load_sft(DataSource(path=str(path)), tmp_path / "c")
    assert (
        str(info.value)
        == f"{path}:2: key `prompt` is given twice in one object; JSON keeps the last"
    )
    listed = tmp_path / "s.json"
    listed.write_text('[{"text": "a", "text": "b"}]')
    with pytest.raises(DataError) as info:
        load_sft(DataSource(path=str(listed)), tmp_path / "c")
    assert (
        str(info.value) == f"{listed}: key `text` is given twice in one object; JSON keeps the last"
    )
