"""The `rlhf` command: one thin function per subcommand, no logic.

Each parses options, loads the recipe, calls one stage function, prints a summary, and maps known
errors to exit codes: user mistakes 2 (one line each, no traceback), hacking detected 1, Ctrl-C
130 (after the stage has saved what it can). Anything else is a bug: exit 70, its traceback in
`error.log` in the folder of the stage that was running (else of the run, else a file in the
temp folder), and one stderr line naming the error and that file (`_internal_error`).

Long because each command declares its options where Typer reads them; the work is in stages/.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import click
import typer
from rich.console import Console
from rich.markup import escape

from rlhf_cli import views
from rlhf_cli.errors import (
    INTERNAL_ERROR,
    RecipeError,
    RlhfError,
    internal_error_line,
    write_crash_log,
)
from rlhf_cli.recipe import Recipe, default_recipe_path, load_recipe
from rlhf_cli.rundir import Manifest, RunDir, recipe_near
from rlhf_cli.stopping import sigterm_as_ctrl_c
from rlhf_cli.tracking import (
    make_console,
    quiet_libraries,
    require_trackers,
)

FLAG = ""  # a flag's help shows no value type (typer would print <bool>)


def _flag_help(option: Any) -> Any:
    if option is not None:
        option.metavar = FLAG
    return option


class _Command(typer.core.TyperCommand):
    """`--help` is a flag too: no `<bool>` beside it."""

    def get_help_option(self, ctx: Any) -> Any:
        return _flag_help(super().get_help_option(ctx))


class _Group(typer.core.TyperGroup):
    def get_help_option(self, ctx: Any) -> Any:
        return _flag_help(super().get_help_option(ctx))


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="The four-stage RLHF pipeline (SFT, reward model, PPO, audit) from one "
    "YAML recipe. Run the stages in order; each reads the previous one's "
    "run directory.",
)
F = TypeVar("F", bound=Callable[..., Any])

RecipeOpt = Annotated[
    Path | None,
    typer.Option(
        "--recipe",
        "-r",
        help="Recipe YAML. Default: the latest run's recipe; recipes/tiny.yaml when no run exists.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="PATH=VALUE",
        help="Override a recipe field, dotted.path=value (repeatable), validated like the file: "
        "--set ppo.learning_rate=1e-5 --set model.lora.r=8.",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", metavar=FLAG, help="Print one JSON object on stdout.")
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", metavar=FLAG, help="No progress or summary output.")
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        metavar=FLAG,
        help="Continue an interrupted run from its newest good checkpoint.",
    ),
]
RunsOpt = Annotated[
    Path,
    typer.Option(
        "--runs-dir",
        envvar="RLHF_RUNS_DIR",
        help="Where runs/LATEST is looked up without --recipe.",
    ),
]


def _exit_on_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        err = make_console()
        sigterm_as_ctrl_c()
        try:
            return fn(*args, **kwargs)
        except RecipeError as exc:
            for line in exc.problems:
                err.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except RlhfError as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:  # the training stages say which checkpoint they saved
            saved = str(exc) or "nothing was saved"
            note = getattr(exc, "manifest_note", "no run was changed")
            err.print(f"[yellow]interrupted[/]: {escape(saved)}; {escape(note)}", soft_wrap=True)
            raise typer.Exit(130) from None
        except OSError as exc:  # the machine said no: a read-only folder, a file in the way
            if exc.filename is None:
                _internal_error(exc, err, fn.__name__, kwargs)
            reason = exc.strerror or exc.__class__.__name__
            err.print(
                f"[red]error:[/] {escape(str(exc.filename))}: {escape(reason)}", soft_wrap=True
            )
            raise typer.Exit(2) from None
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise  # click's own ways out (typer.Exit among them), not failures
        except Exception as exc:  # noqa: BLE001 - a bug: never exit 1, which reads as a result
            _internal_error(exc, err, fn.__name__, kwargs)

    return wrapper  # type: ignore[return-value]


def _internal_error(exc: Exception, err: Console, name: str, args: dict[str, Any]) -> NoReturn:
    """A bug: its traceback to a log file, in the folder of the stage that was open (its
    `StageRecord` names it), else of the run the command's arguments name, else the temp
    folder; one line on stderr naming the error and the log; exit 70."""
    command = name.strip("_").replace("_", "-")  # `eval_` is `rlhf eval`
    log = write_crash_log(exc, getattr(exc, "log_dir", None) or _run_folder(args), command)
    if log is None:  # nowhere to write it: the traceback is all there is to go on
        traceback.print_exception(exc)
    err.print(f"[red]error:[/] {escape(internal_error_line(exc, log))}", soft_wrap=True)
    raise typer.Exit(INTERNAL_ERROR) from None


def _run_folder(args: dict[str, Any]) -> Path | None:
    """The existing folder of the run a command's arguments name (`run` of status and report,
    else the recipe they resolve to), found again from them: nothing is kept while a command
    runs. None when they name no run folder, or finding it fails too."""
    runs_dir = args.get("runs_dir", Path("runs"))
    try:
        if "run" in args:
            folder = RunDir.named_or_latest(runs_dir, args["run"]).path
        else:
            recipe = args.get("recipe") or recipe_near(args.get("checkpoint"))
            folder = RunDir.for_recipe(resolve_recipe(recipe, runs_dir, args.get("sets"))).path
    except Exception:  # noqa: BLE001 - already reporting a bug: this only loses the folder
        return None
    return folder if folder.is_dir() else None


def resolve_recipe(recipe: Path | None, runs_dir: Path, sets: list[str] | None = None) -> Recipe:
    """--recipe, else the latest run's snapshot, else the embedded default; `--set` on top."""
    if recipe is not None:
        return load_recipe(recipe, sets)
    latest = RunDir.latest(runs_dir)
    if latest is not None and latest.recipe_path().is_file():
        return load_recipe(latest.recipe_path(), sets)
    runs = sorted(p.parent.name for p in runs_dir.glob("*/recipe.yaml"))
    if runs:  # never guess among them (the embedded default could name one of them)
        raise RlhfError(
            f"{runs_dir / 'LATEST'} does not name a run, and {runs_dir} holds "
            f"{', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}: pass --recipe"
        )
    return load_recipe(default_recipe_path(), sets)


@contextlib.contextmanager
def _library_output(as_json: bool, quiet: bool = False) -> Iterator[None]:
    """While a command works, what libraries print on stdout (DeepSpeed's accelerator notice,
    warnings printed rather than logged) goes to stderr when stdout must be pure JSON or
    silent; and under `--quiet` or `--json` the tqdm bars of TRL's own passes (the reference's
    log-probs) stay off too: stderr is then for errors."""
    if not (as_json or quiet):
        yield
        return
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE")
        else:
            os.environ["TQDM_DISABLE"] = before


def _stage(
    run_fn: Callable[[Recipe, Any], Manifest],
    stage: str,
    recipe: Path | None,
    as_json: bool,
    quiet: bool,
    runs_dir: Path,
    sets: list[str] | None,
) -> None:
    quiet_libraries()
    resolved = resolve_recipe(recipe, runs_dir, sets)
    with _library_output(as_json, quiet):
        manifest = run_fn(resolved, make_console(quiet, as_json))
    shown = {**manifest, "dir": str(RunDir.for_recipe(resolved).stage_dir(stage))}
    if as_json:
        typer.echo(json.dumps(shown, indent=2))
    else:
        title = f"rlhf {stage} · run '{resolved.run.name}'"
        views.stage_summary(shown, title, make_console(quiet))


@app.command(cls=_Command)
@_exit_on_errors
def validate(
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    data: Annotated[
        bool,
        typer.Option(
            "--data",
            metavar=FLAG,
            help="Also load each stage's data and tokenizer (no weights) and show rows, layouts, "
            "token lengths against the recipe's limits, cut and dropped rows, length bias; exit 2 "
            "when a stage would get no rows.",
        ),
    ] = False,
    row: Annotated[
        int | None,
        typer.Option(
            "--row", min=1, help="With --data: show row N's tokens as each stage reads them."
        ),
    ] = None,
    sample: Annotated[
        int,
        typer.Option(
            "--sample",
            min=1,
            help="With --data: rows read from a hub dataset (streamed where its split allows) "
            "and tokenised.",
        ),
    ] = 2000,
    stages: Annotated[
        list[str] | None,
        typer.Option(
            "--stage",
            help="With --data: check this stage's data (sft, train-rm, ppo, dpo, kto, orpo, "
            "simpo) instead of the stages the recipe runs; repeatable.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Validate a recipe and print it fully resolved (defaults filled in, --set applied); with
    --data, check each stage's data instead."""
    resolved = resolve_recipe(recipe, runs_dir, sets)
    require_trackers(resolved.run.trackers)  # what the training stages would refuse
    if data:
        _check_data(resolved, row, sample, as_json, stages)
        return
    if as_json:
        typer.echo(json.dumps(resolved.model_dump(mode="json"), indent=2))
    else:
        typer.echo(resolved.to_yaml(), nl=False)


def _check_data(
    recipe: Recipe, row: int | None, sample: int, as_json: bool, stages: list[str] | None
) -> None:
    from rlhf_cli.errors import DataError
    from rlhf_cli.stages.datacheck import check_data

    quiet_libraries()
    with _library_output(as_json):
        result = check_data(recipe, row, sample, stages)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        views.data_check(result, make_console(stdout=True))
    failed = [f"{stage}: {s['error']}" for stage, s in result["stages"].items() if "error" in s]
    if failed:
        raise DataError(f"data check failed: {'; '.join(failed)}")


@app.command(cls=_Command)
@_exit_on_errors
def plan(
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu",
            help="A GPU of the table: T4, A10G, L4, RTX-4090, A100-40GB, A100-80GB, H100, H200.",
        ),
    ] = None,
    memory: Annotated[
        str | None,
        typer.Option("--memory", help="Memory per process, e.g. 24GiB (wins over --gpu)."),
    ] = None,
    processes: Annotated[int, typer.Option("--processes", min=1, help="Processes (GPUs).")] = 1,
    sharding: Annotated[
        str, typer.Option("--sharding", help="none, zero2, zero3 or fsdp (the accelerate config).")
    ] = "none",
    config: Annotated[
        Path | None, typer.Option("--config", help="The policy's config.json (offline hub ids).")
    ] = None,
    reward_config: Annotated[
        Path | None, typer.Option("--reward-config", help="The reward model's config.json.")
    ] = None,
    tflops: Annotated[
        float | None, typer.Option("--tflops", min=0.001, help="Peak dense bf16 TFLOPS.")
    ] = None,
    bandwidth: Annotated[
        float | None, typer.Option("--bandwidth", min=0.001, help="Memory bandwidth, GB/s.")
    ] = None,
    stages: Annotated[
        list[str] | None,
        typer.Option(
            "--stage",
            help="Plan only this stage (sft, train-rm, ppo, audit, merge, dpo, kto, orpo, "
            "simpo); repeatable.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Estimate each stage's peak memory and one PPO iteration's time; exit 2 if it won't fit.

    Nothing loads: the figures come from the models' configs and the recipe."""
    from rlhf_cli.stages.plan import plan_command

    result = plan_command(
        resolve_recipe(recipe, runs_dir, sets),
        gpu=gpu, memory=memory, processes=processes, sharding=sharding,
        configs=(config, reward_config), peaks=(tflops, bandwidth), stages=stages,
    )  # fmt: skip
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        views.plan_report(result, make_console(stdout=True))
    if not result["fits"]:
        from rlhf_cli.errors import DoesNotFit

        raise DoesNotFit(result["verdict"])


@app.command(cls=_Command)
@_exit_on_errors
def sft(
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    resume: ResumeOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Stage 1 of 4: supervised fine-tuning (TRL SFTTrainer, LoRA / 4-bit when asked)."""
    from rlhf_cli.stages.sft import run_sft

    _stage(functools.partial(run_sft, resume=resume), "sft", recipe, as_json, quiet, runs_dir, sets)


@app.command("train-rm", cls=_Command)
@_exit_on_errors
def train_rm(
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    resume: ResumeOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Stage 2 of 4: reward model from preference pairs (TRL RewardTrainer)."""
    from rlhf_cli.stages.reward import run_train_rm

    run = functools.partial(run_train_rm, resume=resume)
    _stage(run, "rm", recipe, as_json, quiet, runs_dir, sets)


@app.command(cls=_Command)
@_exit_on_errors
def ppo(
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    resume: ResumeOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Stage 3 of 4: PPO against the frozen reward model, per-token KL to the frozen reference."""
    from rlhf_cli.stages.ppo import run_ppo

    run = functools.partial(run_ppo, resume=resume)
    _stage(run, "ppo", recipe, as_json, quiet, runs_dir, sets)


OFFLINE_HELP = {  # each offline method's command (`stages.dpo.METHODS`): its section and folder
    "dpo": "Instead of reward model and PPO: DPO from the SFT policy on the preference pairs "
    "(TRL DPOTrainer, `dpo.loss_type`); the reference's log-probs computed once and kept.",
    "kto": "Instead of reward model and PPO: KTO from the SFT policy on thumbs-up/down rows "
    "(`prompt`, `completion`, `label`; TRL KTOTrainer); the reference's log-probs kept.",
    "orpo": "Instead of reward model and PPO: ORPO from the SFT policy (or the base: "
    "`orpo.start`) on the preference pairs, no reference model (TRL's experimental "
    "ORPOTrainer).",
    "simpo": "Instead of reward model and PPO: SimPO from the SFT policy on the preference "
    "pairs, no reference model (TRL's experimental CPOTrainer, its simpo loss).",
}


def _offline_command(method: str) -> None:
    """Register `rlhf <method>`: one command per offline method, all the same but for the
    method (one function here, not four copies of its options)."""

    def command(
        recipe: RecipeOpt = None,
        sets: SetOpt = None,
        resume: ResumeOpt = False,
        as_json: JsonOpt = False,
        quiet: QuietOpt = False,
        runs_dir: RunsOpt = Path("runs"),
    ) -> None:
        from rlhf_cli.stages.dpo import run_offline

        run = functools.partial(run_offline, method=method, resume=resume)
        _stage(run, method, recipe, as_json, quiet, runs_dir, sets)

    command.__doc__ = OFFLINE_HELP[method]
    app.command(method, cls=_Command)(_exit_on_errors(command))


for _method in OFFLINE_HELP:
    _offline_command(_method)


@app.command(cls=_Command)
@_exit_on_errors
def audit(
    checkpoint: Annotated[
        Path | None,
        typer.Argument(
            help="PPO run, checkpoint (ppo/checkpoints/iter_N, or best, last, iter_N), adapter "
            "or merged model folder. Default: the latest run's final policy."
        ),
    ] = None,
    responses: Annotated[
        Path | None,
        typer.Option(
            "--responses",
            help="Audit responses generated elsewhere: JSONL rows with `prompt` and `response`.",
        ),
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option("--samples", min=1, help="Responses per prompt (default: audit.samples)."),
    ] = None,
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Stage 4 of 4: reward-hacking audit (verbosity, sycophancy, repetition); exit 1 if found."""
    from rlhf_cli.errors import HackingDetected
    from rlhf_cli.stages.audit import run_audit

    quiet_libraries()
    resolved = resolve_recipe(recipe or recipe_near(checkpoint), runs_dir, sets)
    with _library_output(as_json, quiet):
        report = run_audit(resolved, make_console(quiet, as_json), checkpoint, responses, samples)
    if as_json:
        typer.echo(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    else:
        title = f"Reward Hack Audit · {report['label']}"
        views.audit_report(report, resolved.audit, make_console(quiet), title)
    if report["hacking_detected"]:
        raise HackingDetected("reward hacking detected: " + ", ".join(report["flags"]))


@app.command(cls=_Command)
@_exit_on_errors
def merge(
    stage: Annotated[
        str,
        typer.Option(
            "--stage", help="Which adapter to merge: ppo (default), dpo, kto, orpo, simpo or sft."
        ),
    ] = "ppo",
    checkpoint: Annotated[
        str,
        typer.Option(
            "--checkpoint", help="PPO's final policy (last), the best evaluated one, or iter_N."
        ),
    ] = "last",
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Merge the latest run's PPO (or --stage's) LoRA adapter into its base (fp16/bf16, never
    4-bit)."""
    from rlhf_cli.errors import RlhfError as UsageError
    from rlhf_cli.rundir import OFFLINE_STAGES
    from rlhf_cli.stages.merge import run_merge

    if stage not in ("ppo", "sft", *OFFLINE_STAGES):
        offline = ", ".join(OFFLINE_STAGES)
        raise UsageError(
            f"--stage must be ppo or sft, or an offline stage ({offline}), not '{stage}'"
        )
    run = functools.partial(run_merge, stage=stage, checkpoint=checkpoint)
    _stage(run, "merged", recipe, as_json, quiet, runs_dir, sets)


@app.command(cls=_Command)
@_exit_on_errors
def push(
    adapter_only: Annotated[
        bool,
        typer.Option(
            "--adapter-only",
            metavar=FLAG,
            help="Push the LoRA adapter instead of the merged model.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            metavar=FLAG,
            help="Write the model card and show what would be sent; no upload.",
        ),
    ] = False,
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Publish the merged model (or adapter) to push.repo_id with a model card.

    The token comes from HF_TOKEN or your saved login (`hf auth login`), never the recipe.
    """
    from rlhf_cli.stages.push import run_push

    resolved = resolve_recipe(recipe, runs_dir, sets)
    with _library_output(as_json, quiet):
        result = run_push(resolved, make_console(quiet, as_json), adapter_only, dry_run)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    elif not quiet:
        views.pushed(result, dry_run, make_console(stdout=True))


@app.command(cls=_Command)
@_exit_on_errors
def status(
    run: Annotated[str | None, typer.Argument(help="Run name (default: the latest run).")] = None,
    every: Annotated[
        bool, typer.Option("--all", metavar=FLAG, help="List every run instead.")
    ] = False,
    as_json: JsonOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Where a run stands: each stage's status, when, key numbers, and what to run next."""
    from rlhf_cli.stages.status import all_runs, run_status

    result: Any = all_runs(runs_dir) if every else run_status(RunDir.named_or_latest(runs_dir, run))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    out = make_console(stdout=True)
    if every:
        views.all_runs(result, out)
    else:
        views.run_status(result, out)


@app.command(cls=_Command)
@_exit_on_errors
def report(
    run: Annotated[str | None, typer.Argument(help="Run name (default: the latest run).")] = None,
    as_json: JsonOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Plot a run's PPO curves to ppo/report.png and ppo/report.html (with rlhf eval's results)."""
    from rlhf_cli.stages.report import run_report

    paths = run_report(RunDir.named_or_latest(runs_dir, run))
    *drawn, page = [paths[k] for k in ("png", "eval_png", "html") if k in paths]
    typer.echo(json.dumps(paths) if as_json else f"wrote {', '.join(drawn)} and {page}")


@app.command(cls=_Command)
@_exit_on_errors
def serve(
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    host: Annotated[
        str, typer.Option("--host", help="Interface to listen on (0.0.0.0: other machines).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port.")] = 8000,
    python: Annotated[
        str | None,
        typer.Option("--python", help="Interpreter with vLLM (default: this one)."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float,
        typer.Option("--gpu-memory-utilization", min=0.05, max=0.99, help="GPU share (CUDA)."),
    ] = 0.9,
    start_timeout: Annotated[
        float, typer.Option("--start-timeout", min=1.0, help="Seconds to wait for it to answer.")
    ] = 600.0,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="NAME_OR_PATH",
            help="Serve this model as an eval judge instead of the policy: a folder, a hub id, "
            "a builtin: name or a .gguf file, served under that name (eval.judge.model).",
        ),
    ] = None,
    print_command: Annotated[
        bool,
        typer.Option("--print-command", metavar=FLAG, help="Print the command; start nothing."),
    ] = False,
    as_json: JsonOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Start vLLM's server for the recipe's policy (backend: vllm_server), or for a judge
    (--model); Ctrl-C stops it.

    Prints the --set line that points `rlhf ppo` (or `rlhf eval`) at it once it answers."""
    from rlhf_cli.stages.serve import ServeSettings, run_serve, serve_info

    quiet_libraries()
    resolved = resolve_recipe(recipe, runs_dir, sets)
    settings = ServeSettings(host, port, python, gpu_memory_utilization, start_timeout, model)
    show = functools.partial(views.serve_ready, as_json=as_json, console=make_console(False))
    if print_command:
        show(serve_info(resolved, settings), started=False)
        return
    run_serve(resolved, settings, functools.partial(show, started=True))


@app.command(cls=_Command)
@_exit_on_errors
def compare(
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", "-p", help="A prompt (repeatable). Default: the audit prompts."),
    ] = None,
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """The guide's quick inference test: SFT vs PPO answers with their reward scores, and the
    last rlhf eval results of each policy beside them."""
    from rlhf_cli.stages.compare import run_compare
    from rlhf_cli.stages.status import eval_results

    quiet_libraries()
    resolved = resolve_recipe(recipe, runs_dir, sets)
    with _library_output(as_json):
        rows = run_compare(resolved, prompt)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    out = make_console(stdout=True)  # the result: stdout, as report's
    views.comparison(rows, out)
    evaluated = eval_results(RunDir.for_recipe(resolved))
    if evaluated is not None:
        views.eval_columns(evaluated, out)


@app.command("eval", cls=_Command)
@_exit_on_errors
def eval_(
    labels: Annotated[
        list[str] | None,
        typer.Argument(
            help="Policies to measure: base, sft, ppo, merged, a PPO checkpoint (best, last, "
            "iter_N) or a model folder. Default: eval.policies.",
            metavar="LABEL",
            show_default=False,
        ),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option("--baseline", help="What each is compared with. Default: eval.baseline."),
    ] = None,
    recipe: RecipeOpt = None,
    sets: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    runs_dir: RunsOpt = Path("runs"),
) -> None:
    """Measure policies by yardsticks outside the reward model (a judge head to head, checks,
    benchmarks) against a baseline; exit 4 when one misses a threshold of eval.gate."""
    from rlhf_cli.errors import EvalGateFailed
    from rlhf_cli.stages.eval import run_eval

    quiet_libraries()
    resolved = resolve_recipe(recipe, runs_dir, sets)
    try:
        with _library_output(as_json, quiet):
            result = run_eval(resolved, make_console(quiet, as_json), labels, baseline)
    except EvalGateFailed as exc:  # the results were written: shown before the gate's line
        _show_eval(exc.result, as_json, quiet)  # type: ignore[attr-defined]
        raise
    _show_eval(result, as_json, quiet)


def _show_eval(result: dict[str, Any], as_json: bool, quiet: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    elif not quiet:
        views.eval_results(result, make_console(stdout=True))


def main() -> None:
    # Before any library import: bitsandbytes logs a missing optional CPU kernel when imported
    # (and `kernels`, which looks it up, that it skipped the hub offline), and transformers warns
    # about its own upcoming renames; none of it is the user's to act on.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("kernels").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    app(prog_name="rlhf")


if __name__ == "__main__":
    sys.exit(main())
