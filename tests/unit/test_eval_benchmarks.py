"""Benchmarks through lm-evaluation-harness (`rlhf_cli/evals/benchmarks.py`): lm-eval's scores on
the tiny model and the shipped offline tasks equal a count made here by hand (the prompts
rendered as training renders them, greedy answers, summed log-likelihoods), with the chat
template on and off; the harness missing. The alignment tax is in tests/unit/test_eval_gate.py."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlhf_cli.errors import EvalError
from rlhf_cli.evals.benchmarks import run_benchmarks
from rlhf_cli.generation import tokenize_prompts
from rlhf_cli.modeling import load_tokenizer, resolve_model_path
from rlhf_cli.recipe import BenchmarksSection

TASKS = Path(__file__).resolve().parents[2] / "data" / "eval" / "tasks"


@pytest.fixture(scope="module")
def policy() -> tuple[Any, Any]:
    """The tiny LM with its layers' weights redrawn (N(0, 0.2), seed 0): freshly initialised it
    repeats one token whatever the prompt, so its greedy answers would all be alike."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-lm")).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "layers" in name and weight.dim() == 2:
                weight.normal_(0.0, 0.2)
    return model, load_tokenizer("builtin:tiny-lm")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prompt_ids(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """A prompt's tokens as training has them (PPO's rollouts, the audit)."""
    return tokenize_prompts(tokenizer, [text], chat, max_tokens=512)[0]


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, docs: list[dict], chat: bool) -> list[str]:
    """tiny_arith's answers, all prompts in one left-padded batch: 12 new tokens at most, cut at
    the first newline (its `generation_kwargs`)."""
    prompts = [prompt_ids(tokenizer, f"Question: {d['question']}\nAnswer:", chat) for d in docs]
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")  # padded on the left
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return [text.split("\n")[0] for text in texts]


@torch.no_grad()
def picked_choices(model: Any, tokenizer: Any, docs: list[dict], chat: bool) -> list[int]:
    """tiny_polite's picks: the choice of the largest summed log-likelihood after the question
    (after the generation prompt with the template; after a space without)."""
    picks = []
    for doc in docs:
        context = prompt_ids(tokenizer, doc["question"], chat)
        sums = []
        for choice in doc["choices"]:
            reply = tokenizer(choice if chat else " " + choice, add_special_tokens=False)
            ids = torch.tensor([context + reply["input_ids"]])
            logprobs = model(ids).logits[0, len(context) - 1 : -1].log_softmax(-1)
            sums.append(logprobs.gather(1, ids[0, len(context) :, None]).sum().item())
        picks.append(max(range(len(sums)), key=sums.__getitem__))
    return picks


def last_number(answer: str) -> str | None:
    numbers = re.findall(r"-?[0-9]+", answer)
    return numbers[-1] if numbers else None


def planted_task(folder: Path, answers: list[str]) -> Path:
    """tiny_arith with the answers of `answers` as targets on even documents (and no number
    filter): a score of exactly one half says the harness generated those same answers."""
    config = yaml.safe_load((TASKS / "tiny_arith.yaml").read_text(encoding="utf-8"))
    del config["filter_list"]
    config["task"] = "planted_arith"
    config["dataset_kwargs"]["data_files"]["test"] = "planted.jsonl"
    docs = read_jsonl(TASKS / "tiny_arith.jsonl")
    for i in range(0, len(docs), 2):
        docs[i]["answer"] = answers[i]
    folder.mkdir()
    (folder / "planted.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), "utf-8")
    (folder / "planted_arith.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def hand(policy) -> dict[bool, dict[str, list]]:
    """Per rendering (True: the chat template), tiny_arith's greedy answers and tiny_polite's
    picks, made here."""
    model, tokenizer = policy
    arith, polite = read_jsonl(TASKS / "tiny_arith.jsonl"), read_jsonl(TASKS / "tiny_polite.jsonl")
    return {
        chat: {
            "answers": greedy_answers(model, tokenizer, arith, chat),
            "picks": picked_choices(model, tokenizer, polite, chat),
        }
        for chat in (True, False)
    }


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "plain"])
def test_lm_eval_scores_equal_a_hand_count(policy, hand, chdir_tmp, chat) -> None:
    model, tokenizer = policy
    arith, polite = read_jsonl(TASKS / "tiny_arith.jsonl"), read_jsonl(TASKS / "tiny_polite.jsonl")
    answers, picks = hand[chat]["answers"], hand[chat]["picks"]
    assert len(set(answers)) > 20  # the answers differ from prompt to prompt

    # the shipped tasks, read from the repository while the working directory is elsewhere
    cfg = BenchmarksSection(tasks=["tiny_arith", "tiny_polite"], include_path=str(TASKS))
    scores = run_benchmarks(cfg, model, tokenizer, chat)
    right = sum(last_number(a) == doc["answer"] for a, doc in zip(answers, arith, strict=True))
    polite_right = sum(p == doc["label"] for p, doc in zip(picks, polite, strict=True))
    assert scores["tiny_arith"]["score"] == pytest.approx(right / 30)
    assert scores["tiny_polite"]["score"] == pytest.approx(polite_right / 20)
    assert 0 < polite_right < 20
    se = math.sqrt(polite_right / 20 * (1 - polite_right / 20) / 19)  # the harness's: sample sd/√n
    assert scores["tiny_polite"]["stderr"] == pytest.approx(se)
    assert scores["tiny_arith"]["metric"] == "exact_match,last_number"
    assert scores["tiny_polite"]["metric"] == "acc,none"
    assert [scores[t]["n"] for t in ("tiny_arith", "tiny_polite")] == [30, 20]
    assert all(s["chat_template"] is chat for s in scores.values())

    # targets planted from the chat template's answers: half right with it, none without
    with_template = hand[True]["answers"]
    planted = run_benchmarks(
        BenchmarksSection(
            tasks=["planted_arith"],
            include_path=str(planted_task(chdir_tmp / "tasks", with_template)),
        ),
        model,
        tokenizer,
        chat,
    )["planted_arith"]
    hits = sum(a == w for a, w in zip(answers[::2], with_template[::2], strict=True))
    assert hits == (15 if chat else 0)
    assert planted == {
        "metric": "exact_match,none",
        "score": pytest.approx(hits / 30),
        "stderr": pytest.approx(math.sqrt(hits / 30 * (1 - hits / 30) / 29)),
        "higher_is_better": True,
        "chat_template": chat,
        "backend": "hf",
        "n": 30,
    }


def test_the_recipe_setting_overrides_what_training_did(policy, chdir_tmp) -> None:
    model, tokenizer = policy
    cfg = BenchmarksSection(
        tasks=["tiny_polite"], include_path=str(TASKS), chat_template="off", limit=2
    )
    assert run_benchmarks(cfg, model, tokenizer, chat=True)["tiny_polite"]["chat_template"] is False
    bare = load_tokenizer("builtin:tiny-lm")
    bare.chat_template = None
    on = cfg.model_copy(update={"chat_template": "on"})
    with pytest.raises(EvalError, match="tokenizer has none: set model.chat_template"):
        run_benchmarks(on, model, bare, chat=False)


def test_a_group_of_local_tasks_runs_from_anywhere(policy, hand, chdir_tmp) -> None:
    suite = chdir_tmp / "suite"  # the working directory holds no tiny_polite.jsonl
    suite.mkdir()
    shutil.copy(TASKS / "tiny_polite.jsonl", suite)
    task = (TASKS / "tiny_polite.yaml").read_text(encoding="utf-8")
    (suite / "tiny_polite.yaml").write_text(task + "tag: polite_tag\n", encoding="utf-8")
    groups = {
        "polite_suite": {"aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}]},
        "bare_suite": {},
    }
    for group, extra in groups.items():
        config = {"group": group, "task": ["tiny_polite"], **extra}
        (suite / f"{group}.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")

    cfg = BenchmarksSection(tasks=["polite_suite"], include_path=str(suite), limit=4)
    scores = run_benchmarks(cfg, *policy, chat=True)["polite_suite"]
    labels = [doc["label"] for doc in read_jsonl(TASKS / "tiny_polite.jsonl")[:4]]
    right = sum(p == label for p, label in zip(hand[True]["picks"][:4], labels, strict=True))
    assert (scores["metric"], scores["score"], scores["n"]) == ("acc,none", right / 4, 4)
    with pytest.raises(EvalError, match="bare_suite reports no score of its own"):
        run_benchmarks(cfg.model_copy(update={"tasks": ["bare_suite"]}), *policy, chat=True)
    with pytest.raises(EvalError, match="polite_tag is an lm-eval tag"):
        run_benchmarks(cfg.model_copy(update={"tasks": ["polite_tag"]}), *policy, chat=True)


def test_an_unknown_task_is_one_line_naming_it(policy, tmp_path) -> None:
    shutil.copy(TASKS / "tiny_polite.yaml", tmp_path)
    cfg = BenchmarksSection(tasks=["tiny_polite", "no_such_task"], include_path=str(tmp_path))
    with pytest.raises(
        EvalError, match=f"no lm-eval task no_such_task in the harness or in {tmp_path}"
    ):
        run_benchmarks(cfg, *policy, chat=False)


def test_without_lm_eval_it_is_the_install_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` fails
    cfg = BenchmarksSection(tasks=["tiny_arith"], include_path=str(TASKS))
    with pytest.raises(EvalError, match=re.escape("pip install 'rlhf-cli[eval]'")) as caught:
        run_benchmarks(cfg, model=None, tokenizer=None, chat=True)
    assert caught.value.exit_code == 2
    assert "\n" not in str(caught.value)
