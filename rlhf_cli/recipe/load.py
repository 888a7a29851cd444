"""Reading a recipe: YAML, `--set` overrides on top, validated once; the embedded default."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from rlhf_cli.errors import RecipeError
from rlhf_cli.recipe.errors import format_errors, printable
from rlhf_cli.recipe.schema import Recipe


class DuplicateKey(ValueError):
    """A mapping gives one key twice: YAML would keep the last and drop the first unseen."""

    def __init__(self, key: object, first: int, second: int):
        super().__init__(
            f"`{key}` is given twice (lines {first} and {second}); YAML keeps only the last"
        )
        self.line = second


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping, at any depth (keys a
    merge, `<<`, brings in may be overridden, as YAML means them to be)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # a list or a mapping as a key: the base class refuses it
                break
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str) -> Any:
    """YAML text as Python values, like `yaml.safe_load`; a key given twice at any depth is a
    `DuplicateKey` (recipe files and `--set` values alike)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: plain values only


def default_recipe_path() -> Path:
    """The embedded default, `recipes/tiny.yaml` next to the package."""
    return Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"


def holds_text(parts: list[str]) -> bool:
    """Whether the recipe field at the dotted path `parts` holds text (a `str`, maybe None)."""
    model: type[BaseModel] = Recipe
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        if depth < len(parts) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            model = annotation
    return annotation is str or set(typing.get_args(annotation)) == {str, type(None)}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, str]:
    """Set each `dotted.path=value` of `--set` in `data` in place, the value read as YAML (so
    typed as in the file); return {dotted path: the argument} for error messages."""
    given: dict[str, str] = {}
    for arg in overrides:
        key, sep, raw = arg.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise RecipeError([f"--set {printable(arg)}: write it as dotted.path=value"])
        try:
            value = read_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except DuplicateKey as exc:
            if not holds_text(parts):
                raise RecipeError([f"--set {printable(arg)}: {exc}"]) from None
            value = raw
        if isinstance(value, dict | list) and holds_text(parts):
            value = raw  # `{prompt} ...` or `[wip] ...` meant as text, not YAML's flow style
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise RecipeError([f"--set {printable(arg)}: {where} is not a section"])
            node = child
        node[parts[-1]] = value
        given[".".join(parts)] = arg
    return given


def parse_recipe(
    text: str,
    source: str = "<recipe>",
    base_dir: Path | None = None,
    overrides: list[str] | None = None,
) -> Recipe:
    """Validate recipe YAML text, with `--set` overrides applied on top; raise RecipeError with
    one line per problem (naming the file and line, or the `--set` argument)."""
    try:
        root = yaml.compose(text)
        data = read_yaml(text)
    except DuplicateKey as exc:
        raise RecipeError([f"{source}:{exc.line}: {exc}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError([f"{where}: YAML syntax error: {problem}"]) from None
    if not isinstance(data, dict):
        raise RecipeError(
            [
                f"{source}: the recipe must be a mapping of sections "
                f"(run, model, data, sft, reward, ppo, audit, merge, push)"
            ]
        )
    overridden = apply_overrides(data, overrides or [])
    context = {"base_dir": str(base_dir or Path.cwd())}
    try:
        return Recipe.model_validate(data, context=context)
    except ValidationError as err:
        raise RecipeError(format_errors(err, source, root, overridden)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read and validate a recipe file, `--set` overrides on top; relative paths inside the
    file resolve against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"{path}: recipe file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([f"{path}: cannot read the recipe ({exc.__class__.__name__})"]) from None
    return parse_recipe(text, str(path), path.resolve().parent, overrides)
