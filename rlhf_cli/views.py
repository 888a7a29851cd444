"""Tables and reports the CLI prints (rich), from the plain dicts the stages return."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

STAGE_TITLES = {"sft": "sft", "preferences": "train-rm (preferences)", "prompts": "ppo (prompts)"}


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
    sides = row.items() if stage == "preferences" else [("", row)]
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
