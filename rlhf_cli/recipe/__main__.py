"""`python -m rlhf_cli.recipe` prints docs/recipes.md."""

from rlhf_cli.recipe.docs import schema_markdown

print(schema_markdown())
