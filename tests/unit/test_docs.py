"""docs/recipes.md is generated from the schema and must not drift from it."""

from pathlib import Path

from rlhf_cli.recipe import Recipe, schema_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def test_recipe_reference_is_current():
    assert DOC.read_text() == schema_markdown() + "\n", "run `make docs`"


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            nested = [
                a
                for a in (ann, *getattr(ann, "__args__", ()))
                if isinstance(a, type) and hasattr(a, "model_fields")
            ]
            for sub in nested:
                walk(sub)

    walk(Recipe)
