"""Every table and report the CLI prints (rich), from the plain dicts the stages return: a
command resolves its recipe, calls one stage, and shows the result with one function here."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlhf_cli.audit.detectors import GUIDE_FLAGS
from rlhf_cli.recipe import AuditSection
from rlhf_cli.tracking import fmt_number, metrics_line

MEMORY_KEYS = ("peak_memory", "planned_peak")
ACTION = "Increase KL coefficient (β) by {step} and recheck in 25 iterations."
BREVITY_ACTION = (
    "Answers collapsed in length against the reference's: a per-token KL penalty charges every "
    "token, so do not raise β; lower it or check the reward model's preference for short answers."
)


def fmt_gib(size: int, unit: bool = True) -> str:
    return f"{size / 1024**3:.2f}" + (" GiB" if unit else "")


def memory_cell(metrics: dict[str, Any]) -> str:
    """The measured peak beside the plan's estimate when they measure the same thing (CUDA's
    allocated bytes, or on the CPU the bytes of live tensors, against the plan's tensor bytes);
    where only the CPU's peak RSS was measured (runtime and libraries included: a vLLM engine
    in the process, several processes), each named for what it is."""
    measured, planned = metrics.get("peak_memory_bytes"), metrics.get("planned_peak_bytes")
    if measured is None:
        return ""
    plan = fmt_gib(planned) if planned is not None else "—"
    if metrics.get("peak_memory_kind") == "cpu_rss":
        return f"RSS {fmt_gib(measured)}; plan {plan} of tensors"
    return f"{fmt_gib(measured)} / {plan}"


def stage_summary(manifest: dict[str, Any], title: str, out: Console) -> None:
    """A stage's manifest, `dir` (its folder) added: status, metrics, memory, warnings."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_row("status", manifest["status"])
    table.add_row("run dir", str(manifest.get("dir", "")))
    metrics = manifest.get("metrics", {})
    for key, value in metrics.items():
        if not key.startswith(MEMORY_KEYS):
            table.add_row(key, fmt_number(value))
    if "peak_memory_bytes" in metrics:
        cpu = metrics.get("peak_memory_kind") == "cpu_rss"
        table.add_row("peak memory" + ("" if cpu else " / plan"), memory_cell(metrics))
    if "peak_memory_rss_bytes" in metrics:
        table.add_row("peak RSS (process)", fmt_gib(metrics["peak_memory_rss_bytes"]))
    for warning in manifest.get("warnings", []):
        table.add_row("[yellow]warning[/]", warning)
    out.print(table)
    if "eval/judge_reward_mean" in metrics:
        judge_summary(manifest, out)


JUDGE_ROWS = (  # the last held-out evaluation's judge numbers (`audit.judge`), then the proxy's
    ("Judge reward, policy", "eval/judge_reward_mean", "{:+.4f}"),
    ("Judge reward, SFT policy", "eval/judge_reward_reference_mean", "{:+.4f}"),
    ("Judge win rate against SFT", "eval/judge_win_rate", "{:.0%}"),
    ("Judge gain (σ of its SFT scores)", "eval/judge_reward_gain", "{:+.3f}"),
    ("Proxy gain (σ of its SFT scores)", "eval/reward_gain", "{:+.3f}"),
    ("Proxy − judge gain", "eval/proxy_judge_gap", "{:+.3f}"),
)


def judge_summary(manifest: dict[str, Any], out: Console) -> None:
    """PPO's judge (`audit.judge`) at its last held-out evaluation beside the proxy, whether
    evaluations flagged over-optimisation, the rollbacks made and the best checkpoint."""
    metrics = manifest["metrics"]
    table = Table(title="judge · last held-out evaluation", show_header=False, title_justify="left")
    for label, key, form in JUDGE_ROWS:
        if key in metrics:
            table.add_row(label, form.format(metrics[key]))
    if "overoptimization_flags" in metrics:
        flags = metrics["overoptimization_flags"]
        shown = f"[red]⚠ {flags} evaluation(s)[/]" if flags else "[green]✓ none[/]"
        table.add_row("Overoptimization flagged", shown)
    rollbacks = manifest.get("rollbacks") or []
    if rollbacks:
        back = ", ".join(f"{r['iteration']} → {r['restored']}" for r in rollbacks)
        table.add_row("Rollbacks (iteration → restored)", back)
    best = manifest.get("best")
    if best:
        table.add_row(
            "Best checkpoint",
            f"{best['checkpoint']} ({best['metric']} {best['value']:+.4f}): "
            "`rlhf merge --checkpoint best`",
        )
    out.print(table)


def plan_report(result: dict[str, Any], out: Console) -> None:
    """`rlhf plan`: each stage's parts in GiB (and PPO's vLLM server's apart), the verdict, the
    suggestions."""
    for name, stage in result["stages"].items():
        title = f"{name}: {fmt_gib(stage['peak_bytes'])} at peak ({stage['phase']})"
        if stage.get("device") == "cpu":
            title += ", on the CPU (host memory, not counted in the fit)"
        if "iteration_s" in stage:
            title += f", one iteration ≥ {stage['iteration_s']:.1f} s at the GPU's peak figures"
        out.print(title, _parts_table(stage["parts"]))
        if "server" in stage:
            server = stage["server"]
            out.print(
                f"{name}'s vLLM server (each of server.urls): {fmt_gib(server['peak_bytes'])}, "
                "on its own GPUs, outside the fit",
                _parts_table({f"vLLM server: {k}": v for k, v in server["parts"].items()}),
            )
    if result["fits"]:  # otherwise the error line says it
        out.print(result["verdict"])
    for s in result["suggestions"]:
        args = " ".join(f"--set {a}" for a in s["set"])
        how = " ".join(part for part in (s.get("launch"), args) if part)
        out.print(f"  {how}  → {fmt_gib(s['peak_bytes'])}")


def _parts_table(parts: dict[str, int]) -> Table:
    table = Table("part", "GiB")
    for part, size in parts.items():
        table.add_row(part, fmt_gib(size, unit=False))
    return table


def run_status(result: dict[str, Any], out: Console) -> None:
    """`rlhf status RUN`: each stage's status, when, memory, key numbers and data; the last
    eval results, a line per policy; what next."""
    table = Table(
        "stage", "status", "finished", "peak memory", "key numbers",
        title=f"run '{result['run']}'",
    )  # fmt: skip
    for row in result["stages"]:
        shown = row["status"] + (f" (pid {row['pid']})" if "pid" in row else "")
        if "last_attempt" in row:
            shown += f"; last attempt {row['last_attempt']}"
        if "from_run" in row:
            shown += f" (run {row['from_run']}'s)"
        metrics = row.get("metrics", {})
        numbers = metrics_line(metrics, lambda key: not key.startswith(MEMORY_KEYS))
        if "data" in row:
            numbers += ("\n" if numbers else "") + f"data: {row['data']}"
        finished = row.get("finished_at") or ""
        table.add_row(row["stage"], shown, finished, memory_cell(metrics), numbers)
    out.print(table)
    if "eval" in result:
        out.print(f"last rlhf eval (baseline {result['eval']['baseline']}):")
        for label, suites in result["eval"]["policies"].items():
            out.print(f"  {label}: {eval_line(suites)}", highlight=False)
    out.print(f"next: {result['next']}" if result["next"] else "next: nothing to run now")


def all_runs(rows: list[dict[str, Any]], out: Console) -> None:
    """`rlhf status --all`: every run, its completed stages, what next."""
    table = Table("run", "completed stages", "next")
    for row in rows:
        name = row["run"] + (" (latest)" if row["latest"] else "")
        table.add_row(name, ", ".join(row["completed"]) or "—", row["next"] or "—")
    out.print(table)


def comparison(rows: list[dict[str, Any]], out: Console) -> None:
    """`rlhf compare`: each prompt's SFT answer and the trained policy's (`ppo`, or the offline
    stage that trained the run: `dpo`, ...), with their rewards."""
    trained = next((k for k in rows[0] if k not in ("prompt", "sft") and not k.endswith("_score")),
                   "ppo") if rows else "ppo"  # fmt: skip
    table = Table(show_lines=True)
    for column in ("prompt", "SFT", trained.upper()):
        table.add_column(column, overflow="fold")
    for row in rows:
        score = {
            k: f"\n[dim]reward {row[k + '_score']:+.3f}[/]" if k + "_score" in row else ""
            for k in ("sft", trained)
        }
        table.add_row(row["prompt"], row["sft"] + score["sft"], row[trained] + score[trained])
    out.print(table)


def eval_results(result: dict[str, Any], out: Console) -> None:
    """`rlhf eval`: per policy and suite, its measures against the baseline; the gate's verdict
    when it passed (a missed gate is the error line that follows)."""
    table = Table(
        "policy", "suite", "measure", "value",
        title=f"rlhf eval · run '{result['run']}' · baseline {result['baseline']}",
        title_justify="left",
    )  # fmt: skip
    for label, suites in result["results"].items():
        for suite, summary in suites.items():
            for measure, value in eval_measures(suite, summary):
                table.add_row(label, suite, measure, value)
    out.print(table)
    if result["gate"]["passed"]:
        out.print("gate: passed")
    out.print(f"results: {result['dir']}", highlight=False)


def _pm(value: float, se: float | None, sign: str = "") -> str:
    """`value ± se` (the standard error left out where there is none)."""
    return f"{value:{sign}.3f}" + ("" if se is None else f" ± {se:.3f}")


def eval_measures(suite: str, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """A suite's summary as (measure, value) texts: the judge's win rate [95% CI] and
    length-controlled win rate, the checks' accuracy ± se, each task's score ± se and its
    alignment tax ± se."""
    s = summary
    if suite == "judge":
        unreadable = f", {s['unreadable']} unreadable" if s.get("unreadable") else ""
        return [
            ("win rate [95% CI]", f"{s['win_rate']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"),
            (f"LC win rate (length in {s.get('length_unit', 'words')})", f"{s['lc_win_rate']:.3f}"),
            ("wins / ties / losses", f"{s['wins']} / {s['ties']} / {s['losses']}{unreadable}"),
        ]
    if suite == "checks":
        rows = [("accuracy ± se", f"{_pm(s['accuracy'], s['se'])} ({s['correct']}/{s['n']})")]
        if "delta" in s:
            rows.append(("baseline accuracy ± se", _pm(s["baseline_accuracy"], s["baseline_se"])))
            if "delta_se" in s:
                rows.append(("gain over baseline ± se", _pm(s["delta"], s["delta_se"], "+")))
        if s.get("no_answer") or s.get("timeouts"):
            rows.append(("no answer / timeouts", f"{s['no_answer']} / {s['timeouts']}"))
        return rows
    rows = []
    for task, t in s.items():
        chat = "chat template" if t.get("chat_template") else "no chat template"
        rows.append((f"{task}: {t['metric']} ({chat})", _pm(t["score"], t.get("stderr"))))
        if "tax" in t:
            rows.append((f"{task}: alignment tax", _pm(t["tax"], t.get("tax_stderr"), "+")))
    return rows


def eval_columns(evaluated: dict[str, Any], out: Console) -> None:
    """`rlhf compare`: each policy's last `rlhf eval` results in columns (`status.eval_results`):
    judge win rate [95% CI], LC win rate, checks accuracy ± se, each task's score (and tax)."""
    policies = evaluated["policies"]
    tasks = sorted({t for suites in policies.values() for t in suites.get("benchmarks", {})})
    table = Table(
        "policy", "judge win rate [95% CI]", "LC win rate", "checks accuracy ± se", *tasks,
        title=f"last rlhf eval (baseline {evaluated['baseline']})", title_justify="left",
    )  # fmt: skip
    for label, suites in policies.items():
        judge, checks = suites.get("judge"), suites.get("checks")
        benchmarks = suites.get("benchmarks", {})
        table.add_row(
            label,
            f"{judge['win_rate']:.3f} [{judge['ci_low']:.3f}, {judge['ci_high']:.3f}]"
            if judge
            else "—",
            f"{judge['lc_win_rate']:.3f}" if judge else "—",
            _pm(checks["accuracy"], checks["se"]) if checks else "—",
            *(_task_cell(benchmarks[t]) if t in benchmarks else "—" for t in tasks),
        )
    out.print(table)


def _task_cell(task: dict[str, Any]) -> str:
    tax = f" (tax {_pm(task['tax'], task.get('tax_stderr'), '+')})" if "tax" in task else ""
    return f"{task['score']:.3f}{tax}"


def eval_line(suites: dict[str, Any]) -> str:
    """A policy's last eval results in one line, for `rlhf status`."""
    parts = []
    for suite, summary in suites.items():
        if suite == "judge":
            parts.append(
                f"judge {summary['win_rate']:.3f} [{summary['ci_low']:.3f}, "
                f"{summary['ci_high']:.3f}] (LC {summary['lc_win_rate']:.3f})"
            )
        elif suite == "checks":
            parts.append(f"checks {_pm(summary['accuracy'], summary['se'])}")
        else:
            parts += [f"{task} {_task_cell(t)}" for task, t in summary.items()]
    return "; ".join(parts)


def serve_ready(info: dict[str, Any], *, started: bool, as_json: bool, console: Console) -> None:
    """`rlhf serve`: the server's command (`--print-command`), or, once it answers, its URL
    and the `--set` line for `rlhf ppo` (a judge's: for `rlhf eval`) on stdout, flushed at
    once (a script waits for it)."""
    import json
    import shlex

    if as_json:
        print(json.dumps({**info, "started": started}), flush=True)
        return
    env = " ".join(f"{k}={v}" for k, v in info["env"].items())
    if not started:
        print(f"{env} {shlex.join(info['command'])}".strip(), flush=True)
        return
    judge = info["role"] == "judge"
    what = f"vLLM judge {info['model']}" if judge else "vLLM server"
    console.print(f"{what} up at {info['url']} (log: {info['log']}); Ctrl-C stops it")
    print(f"rlhf {'eval' if judge else 'ppo'} {info['set']}", flush=True)


def pushed(result: dict[str, Any], dry_run: bool, out: Console) -> None:
    """`rlhf push`: the files sent (or that would be) and where."""
    for name in result["files"]:
        out.print(f"  {name}", highlight=False)
    where = result.get("url", result["repo_id"])
    out.print(
        f"{'would push' if dry_run else 'pushed'} {result['folder']} → {where}", highlight=False
    )


def _mark(report: dict[str, Any], flag: str) -> str:
    return "[red]⚠[/]" if flag in report["flags"] else "[green]✓[/]"


def audit_report(report: dict[str, Any], cfg: AuditSection, out: Console, title: str) -> None:
    """The guide's audit printout as a table, and the recommended action."""
    table = Table(title=title, title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("threshold", justify="right")
    table.add_column("")
    rows = [
        ("Verbosity rate", "verbosity", cfg.verbosity_threshold),
        ("Sycophancy rate", "sycophancy", cfg.sycophancy_threshold),
        ("Repetition rate", "repetition", cfg.repetition_threshold),
    ]
    table.add_row("Avg response length", f"{report['avg_response_len']:.1f} words", "", "")
    for label, key, limit in rows:
        table.add_row(label, f"{report[f'{key}_score']:.1%}", f"> {limit:.0%}", _mark(report, key))
    if "length_ratio" in report:
        table.add_row(
            "Length vs reference",
            f"{report['length_ratio']:.0%}",
            f"< {cfg.min_length_ratio:.0%}",
            _mark(report, "brevity"),
        )
    for key, label in (
        ("reward_policy_mean", "Mean reward, policy"),
        ("reward_reference_mean", "Mean reward, reference"),
        ("judge_policy_mean", "Mean judge reward, policy"),
        ("judge_reference_mean", "Mean judge reward, reference"),
        ("kl_to_reference", "KL to reference (nats)"),
    ):
        if key in report:
            table.add_row(label, f"{report[key]:+.4f}", "", "")
    if "judge_agreement" in report:
        table.add_row("Proxy and judge agree", f"{report['judge_agreement']:.0%}", "", "")
        table.add_row(
            "Proxy prefers policy, judge reference",
            f"{report['proxy_against_judge']:.0%}",
            "> 50%",
            _mark(report, "overoptimization"),
        )
    table.add_row("Responses", str(report["n_responses"]), "", "")
    out.print(table)
    if report["hacking_detected"]:
        out.print("[red bold]REWARD HACKING DETECTED[/] (" + ", ".join(report["flags"]) + ")")
        if set(report["flags"]) & set(GUIDE_FLAGS):
            out.print("Action: " + ACTION.format(step=cfg.kl_coef_step))
        if "brevity" in report["flags"]:
            out.print("Action: " + BREVITY_ACTION)
        if "overoptimization" in report["flags"]:
            out.print(
                "Action: the proxy's gain is not the judge's: audit an earlier checkpoint "
                "(ppo/checkpoints/), or train again with a larger β (ppo.init_kl_coef)."
            )
    else:
        out.print("[green]No reward hacking patterns detected.[/]")
    if "path" in report:
        out.print(f"report: {report['path']}", highlight=False)


STAGE_TITLES = {
    "sft": "sft",
    "preferences": "train-rm (preferences)",
    "prompts": "ppo (prompts)",
    **{m: f"{m} (pairs, policy tokenizer)" for m in ("dpo", "orpo", "simpo")},
    "kto": "kto (thumbs rows, policy tokenizer)",
}


def _lengths(figures: dict[str, Any], key: str) -> str:
    p = figures.get(key)
    return f"{p['p50']} / {p['p95']} / {p['max']}" if p else "—"


def _counts(counts: dict[str, int]) -> str:
    return "; ".join(f"{n} {why}" for why, n in counts.items() if n) or "none"


def data_check(result: dict[str, Any], out: Console) -> None:
    """`rlhf validate --data`: one table per stage, then each asked row's marked tokens."""
    for stage, figures in result["stages"].items():
        table = Table(title=STAGE_TITLES[stage], show_header=False, title_justify="left")
        if "error" in figures:
            table.add_row("[red]error[/]", escape(figures["error"]))
        if "rows_read" in figures:
            read = f"{figures['rows_read']}" + (
                " (a sample: first rows)" if figures["sampled"] else ""
            )
            table.add_row("rows read / kept", f"{read} / {figures['kept']}")
            for source, layout in figures["layouts"].items():
                table.add_row("layout", f"{escape(layout)}  [dim]{escape(source)}[/]")
            table.add_row("dropped", _counts(figures["dropped"]))
            table.add_row("cut", _counts({**figures["cut"], **figures["over_limit"]}))
            if figures.get("exchanges_dropped"):
                table.add_row("exchanges dropped", str(figures["exchanges_dropped"]))
            table.add_row(f"prompt tokens p50/p95/max ({figures['tokenised']} rows)",
                          _lengths(figures, "prompt_tokens"))  # fmt: skip
            if "answer_tokens" in figures:
                table.add_row("answer tokens p50/p95/max", _lengths(figures, "answer_tokens"))
            table.add_row("limits", ", ".join(f"{k} {v}" for k, v in figures["limits"].items()))
        if "length_bias" in figures:
            bias = figures["length_bias"]
            table.add_row(
                "length bias",
                f"chosen longer in {bias['chosen_longer_share']:.0%} of pairs, "
                f"mean length ratio {bias['mean_length_ratio']}",
            )
        if "thumbs_up_share" in figures:
            table.add_row("thumbs up", f"{figures['thumbs_up_share']:.0%} of rows")
        if "heldout" in figures:
            table.add_row(
                "train / held-out",
                f"{figures['train']} / {figures['heldout']} "
                f"({figures['heldout_also_in_train']} held-out also in train)",
            )
        out.print(table)
        if "row" in figures:
            _row(stage, figures["row"], out)


def _row(stage: str, row: dict[str, Any], out: Console) -> None:
    """An example's tokens: context dim, what the stage trains on or scores in green."""
    if stage == "prompts":
        out.print(f"[bold]ppo generates from ({row['tokens']} tokens):[/]")
        out.print(f"[dim]{escape(row['generates_from'])}[/]", highlight=False)
        return
    sides = row.items() if "chosen" in row else [("", row)]  # a pair's two answers
    for side, marked in sides:
        role = "trained" if "trained" in marked else "scored"
        what = f"{stage} {side}".strip()
        out.print(
            f"[bold]{what}: {marked['context_tokens']} context tokens, "
            f"{marked[role + '_tokens']} {role}:[/]"
        )
        out.print(
            f"[dim]{escape(marked['context'])}[/][green]{escape(marked[role])}[/]", highlight=False
        )
