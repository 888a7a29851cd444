"""The `rlhf` command: one thin function per subcommand, no logic.

Each parses options, loads the recipe, calls one stage function, prints a summary, and maps known
errors to exit codes: user mistakes 2 (one line each, no traceback), hacking detected 1, Ctrl-C
130 (after the stage has saved what it can). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.table import Table

from rlhf_cli.errors import RecipeError, RlhfError
from rlhf_cli.recipe import Recipe, default_recipe_path, load_recipe
from rlhf_cli.rundir import RunDir
from rlhf_cli.tracking import make_console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="The four-stage RLHF pipeline (SFT, reward model, PPO, audit) from one "
                       "YAML recipe. Run the stages in order; each reads the previous one's "
                       "run directory.")
F = TypeVar("F", bound=Callable[..., Any])

RecipeOpt = Annotated[Path | None, typer.Option(
    "--recipe", "-r", help="Recipe YAML. Default: the latest run's recipe, else recipes/tiny.yaml.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary output.")]
RunsOpt = Annotated[Path, typer.Option("--runs-dir", envvar="RLHF_RUNS_DIR",
                                       help="Where runs/LATEST is looked up without --recipe.")]


def _exit_on_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        err = make_console()
        try:
            return fn(*args, **kwargs)
        except RecipeError as exc:
            for line in exc.problems:
                err.print(f"[red]error:[/] {line}", markup=True, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except RlhfError as exc:
            err.print(f"[red]error:[/] {exc}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]: progress saved; the manifest says 'interrupted'")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _quiet_libraries() -> None:
    """Library chatter (load reports, shard bars) would drown the stage's own progress."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def resolve_recipe(recipe: Path | None, runs_dir: Path) -> Recipe:
    """--recipe, else the latest run's snapshot, else the embedded default."""
    if recipe is not None:
        return load_recipe(recipe)
    latest = RunDir.latest(runs_dir)
    if latest is not None and latest.recipe_path().is_file():
        return load_recipe(latest.recipe_path())
    return load_recipe(default_recipe_path())


def _emit(manifest: dict[str, Any], as_json: bool, quiet: bool, title: str) -> None:
    if as_json:
        typer.echo(json.dumps(manifest, indent=2))
        return
    console = make_console(quiet)
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_row("status", manifest["status"])
    table.add_row("run dir", str(Path(manifest.get("dir", ""))))
    for key, value in manifest.get("metrics", {}).items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    for warning in manifest.get("warnings", []):
        table.add_row("[yellow]warning[/]", warning)
    console.print(table)


def _stage(run_fn: Callable[[Recipe, Any], dict[str, Any]], stage: str, recipe: Path | None,
           as_json: bool, quiet: bool, runs_dir: Path) -> None:
    _quiet_libraries()
    resolved = resolve_recipe(recipe, runs_dir)
    manifest = run_fn(resolved, make_console(quiet, as_json))
    manifest = {**manifest, "dir": str(RunDir.for_recipe(resolved).stage_dir(stage))}
    _emit(manifest, as_json, quiet, f"rlhf {stage} · run '{resolved.run.name}'")


@app.command()
@_exit_on_errors
def validate(recipe: RecipeOpt = None, as_json: JsonOpt = False,
             runs_dir: RunsOpt = Path("runs")) -> None:
    """Validate a recipe and print it fully resolved (defaults filled in)."""
    resolved = resolve_recipe(recipe, runs_dir)
    if as_json:
        typer.echo(json.dumps(resolved.model_dump(mode="json"), indent=2))
    else:
        typer.echo(resolved.to_yaml(), nl=False)


@app.command()
@_exit_on_errors
def sft(recipe: RecipeOpt = None, as_json: JsonOpt = False, quiet: QuietOpt = False,
        runs_dir: RunsOpt = Path("runs")) -> None:
    """Stage 2: supervised fine-tuning (TRL SFTTrainer, LoRA / 4-bit when asked)."""
    from rlhf_cli.stages.sft import run_sft

    _stage(run_sft, "sft", recipe, as_json, quiet, runs_dir)


@app.command("train-rm")
@_exit_on_errors
def train_rm(recipe: RecipeOpt = None, as_json: JsonOpt = False, quiet: QuietOpt = False,
             runs_dir: RunsOpt = Path("runs")) -> None:
    """Stage 3: reward model from preference pairs (TRL RewardTrainer)."""
    from rlhf_cli.stages.reward import run_train_rm

    _stage(run_train_rm, "rm", recipe, as_json, quiet, runs_dir)


def _not_built(stage: str) -> None:
    make_console().print(f"[red]error:[/] `rlhf {stage}` is not built yet in this version")
    raise typer.Exit(2)


@app.command()
@_exit_on_errors
def ppo(recipe: RecipeOpt = None, resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint.")] = False,
        as_json: JsonOpt = False, quiet: QuietOpt = False,
        runs_dir: RunsOpt = Path("runs")) -> None:
    """Stage 4: PPO alignment against the frozen reward model, KL to the frozen reference."""
    from rlhf_cli.stages.ppo import run_ppo

    _stage(functools.partial(run_ppo, resume=resume), "ppo", recipe, as_json, quiet, runs_dir)


@app.command()
def audit(checkpoint: Annotated[Path | None, typer.Argument(help="Checkpoint folder.")] = None,
          as_json: JsonOpt = False) -> None:
    """Reward-hacking audit: verbosity, sycophancy, repetition (exit 1 when detected)."""
    _not_built("audit")


@app.command()
def merge(as_json: JsonOpt = False) -> None:
    """Merge the PPO LoRA adapter into its base model."""
    _not_built("merge")


@app.command()
def push(as_json: JsonOpt = False) -> None:
    """Publish the merged model (or adapter) with a model card."""
    _not_built("push")


def main() -> None:
    app(prog_name="rlhf")


if __name__ == "__main__":
    sys.exit(main())
