"""Recipe parsing under arbitrary input: a Recipe or one-line errors naming the file, never a
traceback (hypothesis, derandomised so CI sees the same examples every run)."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_cli.errors import RecipeError
from rlhf_cli.recipe import Recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _parse(text: str) -> None:
    try:
        result = parse_recipe(text, "fuzz.yaml", base_dir=REPO / "recipes")
    except RecipeError as err:
        assert err.problems and all(line.startswith("fuzz.yaml") for line in err.problems)
        assert all("\n" not in line for line in err.problems)
    else:
        assert isinstance(result, Recipe)


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.one_of(documents.map(yaml.safe_dump), st.text(max_size=200)))
def test_arbitrary_documents_give_a_recipe_or_one_line_errors(text):
    _parse(text)


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))


PATHS = list(_paths(TINY))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.sampled_from(PATHS), st.one_of(scalars, st.just("__delete__"))),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_tiny_recipe_gives_a_recipe_or_one_line_errors(mutations):
    data = yaml.safe_load(yaml.safe_dump(TINY))
    for path, value in mutations:
        node = data
        for key in path[:-1]:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            if isinstance(node, dict):
                if value == "__delete__":
                    node.pop(path[-1], None)
                else:
                    node[path[-1]] = value
    _parse(yaml.safe_dump(data))


# ── every user-written string handed to a formatter or template engine ─────────────────────────

template_pieces = st.sampled_from(
    ["{prompt}", "{response}", "{", "}", "{{", "}}", "{0}", "{}", "{question}", "{prompt!r}",
     "{prompt:>8}", "{prompt.upper}", "{response[0]}", "Human: ", "\n", "x", "{prompt!z}"]
)  # fmt: skip


def _with(section: str, key: str, value: object) -> str:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data[section][key] = value
    return yaml.safe_dump(data)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(template_pieces, min_size=1, max_size=8).map("".join))
def test_a_reward_template_that_validates_formats_every_pair(template):
    """Validation refuses the template in one line, or every (prompt, response) formats with
    it: a bad placeholder never reaches a stage."""
    try:
        recipe = parse_recipe(_with("reward", "template", template), "fuzz.yaml", REPO / "recipes")
    except RecipeError as err:
        (line,) = err.problems
        assert line.startswith("fuzz.yaml") and "reward.template" in line and "\n" not in line
        return
    text = recipe.reward.template.format(prompt="a {b} c", response="d } e")
    assert "a {b} c" in text or "{prompt" in template  # a format spec may pad or convert


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.text(max_size=30))
def test_a_push_commit_message_is_refused_in_one_line_or_kept(message):
    try:
        recipe = parse_recipe(_with("push", "commit_message", message), "f.yaml", REPO / "recipes")
    except RecipeError as err:
        (line,) = err.problems
        assert "push.commit_message" in line and "\n" not in line
        return
    assert recipe.push.commit_message.strip() and recipe.push.commit_message == message
