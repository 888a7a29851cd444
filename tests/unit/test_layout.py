"""The shape CONTRIBUTING.md promises: imports run down the layers, no import circle, stages are
leaves over shared helpers, no function too long to read at once and no module too big to hold
in mind without a stated reason, a fact declared once, and one module that prints tables."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_cli"
STAGE_HELPERS = {
    "rlhf_cli.stages.common",
    "rlhf_cli.stages.trainers",
    "rlhf_cli.stages.trained",
    "rlhf_cli.stages.data_figures",
    "rlhf_cli.stages.offline_health",  # the offline stages' health table
    "rlhf_cli.stages.reference_cache",  # the offline stages' reference log-probs
}
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
LONG_REASON = "Long because"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the rlhf_cli modules it imports, lazy (in-function) imports included."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        graph[name] = {t for t in targets if t != "rlhf_cli" and not t.endswith("__init__")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_planted_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    assert _cycle(import_graph()) is None


def test_ppo_and_audit_import_no_stage_and_no_cli():
    for module, targets in import_graph().items():
        if module.startswith(("rlhf_cli.ppo", "rlhf_cli.audit")):
            upward = {t for t in targets if t.startswith(("rlhf_cli.stages", "rlhf_cli.cli"))}
            assert not upward, f"{module} imports {upward}"


def test_shared_helpers_import_no_layer_above():
    lower = (
        "rlhf_cli.generation",
        "rlhf_cli.generation.core",
        "rlhf_cli.generation.hf",
        "rlhf_cli.generation.vllm",
        "rlhf_cli.modeling",
        "rlhf_cli.model_checks",
        "rlhf_cli.scoring",
        "rlhf_cli.data",
        "rlhf_cli.rundir",
        "rlhf_cli.record",
        "rlhf_cli.resume",
        "rlhf_cli.stopping",
        "rlhf_cli.tracking",
        "rlhf_cli.recipe",
        "rlhf_cli.errors",
        "rlhf_cli.tiny",
        "rlhf_cli.plan",
        "rlhf_cli.plan.gpus",
        "rlhf_cli.plan.shapes",
        "rlhf_cli.plan.parts",
        "rlhf_cli.plan.memory",
        "rlhf_cli.plan.suggest",
    )
    above = ("rlhf_cli.ppo", "rlhf_cli.audit", "rlhf_cli.stages", "rlhf_cli.cli")
    for module, targets in import_graph().items():
        if module in lower or module.startswith(("rlhf_cli.recipe", "rlhf_cli.data")):
            assert not {t for t in targets if t.startswith(above)}, module


def test_data_imports_nothing_it_is_measured_with():
    """`data/` sits below generation, models and scoring: the figures that measure the data with
    tokenizers, templates and the reward scorer live in `stages/data_figures.py`, and prompt
    tokenisation lives in `data/prompts.py`, so `generation` imports `data`, never the reverse.
    (On f41b8ed `data/figures.py` imported `generation.core` and `scoring`.)"""
    above = ("rlhf_cli.generation", "rlhf_cli.scoring", "rlhf_cli.modeling", "rlhf_cli.stages")
    for module, targets in import_graph().items():
        if module.startswith("rlhf_cli.data"):
            assert not {t for t in targets if t.startswith(above)}, module
    assert not {
        t for t in import_graph()["rlhf_cli.generation.core"] if t.startswith("rlhf_cli.data")
    }


def test_each_stage_is_a_leaf():
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("rlhf_cli.stages.") and module not in STAGE_HELPERS:
            others = {t for t in targets if t.startswith("rlhf_cli.stages.")} - STAGE_HELPERS
            assert not others, f"{module} imports other stages: {others}"
    for helper in STAGE_HELPERS:
        assert not {t for t in graph[helper] if t.startswith("rlhf_cli.stages.")} - STAGE_HELPERS


def test_one_generation_module_serves_every_caller():
    graph = import_graph()
    for caller in (
        "rlhf_cli.ppo.rollout",
        "rlhf_cli.audit.measure",
        "rlhf_cli.stages.trained",  # the merge's logit check, for rlhf merge and rlhf eval
        "rlhf_cli.stages.compare",
    ):
        assert "rlhf_cli.generation" in graph[caller], caller
    sources = {name: path.read_text() for name, path in _modules().items()}
    callers = [name for name, text in sources.items() if ".generate(" in text]
    assert set(callers) <= {
        "rlhf_cli.generation.hf",
        "rlhf_cli.generation.vllm",  # the second backend, behind the same Generator interface
        "rlhf_cli.ppo.rollout",
        "rlhf_cli.audit.measure",
        "rlhf_cli.stages.compare",
    }, callers
    model_generate = [n for n, t in sources.items() if "model.generate(" in t]
    assert model_generate == ["rlhf_cli.generation.hf"]


def test_only_generator_for_names_a_backend():
    """Callers ask `generation.generator_for` (and `require_engine`): no module outside the
    generation package imports a backend or builds one."""
    backends = {"rlhf_cli.generation.hf", "rlhf_cli.generation.vllm"}
    sources = {name: path.read_text() for name, path in _modules().items()}
    for module, targets in import_graph().items():
        if module.startswith("rlhf_cli.generation"):
            continue
        assert not targets & backends, f"{module} imports {targets & backends}"
        for builder in ("HFGenerator(", "VLLMGenerator(", "vllm_generator("):
            assert builder not in sources[module], f"{module} builds a backend: {builder}"


def long_functions() -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines (docstring excluded) whose docstring does not say
    why ("Long because ...")."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node) or ""
            first = node.body[1] if doc and len(node.body) > 1 else node.body[0]
            length = node.end_lineno - first.lineno + 1
            if length > MAX_FUNCTION_LINES and LONG_REASON not in doc:
                found.append(f"{name}.{node.name}: {length} lines")
    return found


def test_no_function_is_too_long_to_read_at_once():
    assert long_functions() == []


def test_the_estimator_is_chosen_from_the_table_alone():
    """`ppo.advantage_estimator` is compared with a name only where the recipe validates it;
    everything else looks the name up in `ppo/estimators.py: ESTIMATORS`."""
    found = []
    for name, path in _modules().items():
        if name.startswith("rlhf_cli.recipe") or name == "rlhf_cli.ppo.estimators":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(
                    isinstance(s, ast.Attribute) and s.attr == "advantage_estimator" for s in sides
                ):
                    found.append(f"{name}:{node.lineno}")
    assert found == []


def test_no_module_is_too_big_without_a_stated_reason():
    """A module over MAX_MODULE_LINES lines says why in its docstring ("Long because ...")."""
    found = []
    for name, path in _modules().items():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_MODULE_LINES and LONG_REASON not in doc:
            found.append(f"{name}: {len(text.splitlines())} lines")
    assert found == []


def test_only_views_builds_tables():
    """Every table the CLI prints is built in views.py; commands and stages hand it dicts."""
    for name, path in _modules().items():
        if name != "rlhf_cli.views":
            assert "rich.table" not in path.read_text(), f"{name} builds a table"


def test_the_estimator_names_are_declared_once():
    """recipe/names.py declares the estimators and their flags; no other module spells a list of
    them (ppo/estimators.py keys its functions by them, and must key exactly the table's)."""
    from rlhf_cli.ppo.estimators import FUNCTIONS
    from rlhf_cli.recipe.names import ESTIMATORS

    assert list(FUNCTIONS) == list(ESTIMATORS)
    names = set(ESTIMATORS)
    for module, path in _modules().items():
        if module in ("rlhf_cli.recipe.names", "rlhf_cli.ppo.estimators"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                spelled = {i.value for i in items if isinstance(i, ast.Constant)} & names
                assert len(spelled) < 2, f"{module}:{node.lineno} lists estimators {spelled}"


def test_test_modules_have_unique_names():
    """pytest imports test files by basename (no packages under tests/): two files of one name
    in two folders stop the whole collection."""
    names = [p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
