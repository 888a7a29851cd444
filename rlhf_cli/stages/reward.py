"""Stage 2 of 4 (the guide's stage 3): a reward model from preference pairs, with TRL's
RewardTrainer.

Pairs are pre-tokenised here (`chosen_ids` / `rejected_ids`, and their token type ids for
pair-encoding tokenizers) by the scorer PPO uses later, so as `reward.input` says (a text pair,
or `reward.template`'s text), truncated to `reward.max_length` with the count reported. TRL then
skips its own processing, which also avoids its need for an EOS token (MiniLM has none).

With `reward.judge_fraction`, a share of the training pairs' prompts is kept from the reward model
(the proxy PPO trains against) and a second one, the judge (`audit.judge.from_rm`), is trained on
them afterwards by the same code, into `rm/judge/`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from trl.trainer.reward_trainer import DataCollatorForPreference
from trl.trainer.utils import pad

from rlhf_cli.data import Pair, hold_out, load_preferences, prompt_text, split_eval
from rlhf_cli.errors import StageError
from rlhf_cli.model_checks import check_lora_targets
from rlhf_cli.modeling import (
    freeze,
    load_reward_model,
    load_tokenizer,
    lora_config,
    pick_device,
    resolve_dtype,
    upcast_trainable,
)
from rlhf_cli.recipe import Recipe
from rlhf_cli.record import StageRecord
from rlhf_cli.resume import trainer_resume_point
from rlhf_cli.rundir import Manifest, RunDir, atomic_write_json
from rlhf_cli.scoring import RewardScorer
from rlhf_cli.stages.common import drop_checkpoints, seed_everything
from rlhf_cli.stages.data_figures import preference_figures
from rlhf_cli.stages.trainers import (
    StageCallback,
    drop_printer,
    run_train_loss,
    start_or_resume_trainer,
    train_resumable,
    trainer_kwargs,
)
from rlhf_cli.tracking import MetricsWriter, Trackers


def pairwise_eval(scorer: RewardScorer, pairs: list[dict[str, str]]) -> dict[str, float]:
    """Held-out pairwise accuracy (chosen scored above rejected) and mean margin."""
    prompts = [p["prompt"] for p in pairs]
    chosen, _ = scorer.score(prompts, [p["chosen"] for p in pairs])
    rejected, _ = scorer.score(prompts, [p["rejected"] for p in pairs])
    margin = chosen - rejected
    return {
        "accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
        "chosen_mean": float(chosen.mean()),
        "rejected_mean": float(rejected.mean()),
    }


def run_train_rm(recipe: Recipe, console: Console, resume: bool = False) -> Manifest:
    """Train the reward model; write `runs/<name>/rm/`; return its manifest. With `resume`,
    continue from the newest checkpoint of an interrupted attempt."""
    from accelerate import PartialState

    cfg, run = recipe.reward, RunDir.for_recipe(recipe)
    if cfg.pretrained is not None:
        raise StageError(
            f"reward.pretrained is set ({cfg.pretrained}): there is no reward model "
            "to train, `rlhf ppo` uses it directly"
        )
    if cfg.base_model is None:
        raise StageError(
            "reward.base_model is not set: there is no reward model to train, `rlhf ppo` "
            "uses reward.functions alone"
        )
    is_main = PartialState().is_main_process
    seed_everything(recipe.run.seed)
    device = pick_device(recipe.run.device)
    trackers = Trackers.for_stage(recipe.run, "rm", run.stage_dir("rm"))
    # found before the manifest is touched: a refused --resume leaves the last result intact
    checkpoint = trainer_resume_point(run.stage_dir("rm"), "rlhf train-rm") if resume else None
    with (
        StageRecord(run, "rm", recipe, inputs={}, write=is_main) as record,
        trackers.environment(),
    ):
        # 1. Data and model: pairs → reward-tokenizer ids (`reward.input`), truncation counted;
        # the judge's pairs (`reward.judge_fraction`) kept apart.
        data = setup(recipe, run, device, record)
        start = pairwise_eval(data.scorer, data.eval_pairs)  # the fresh weights, also on resume

        # 2. Train (full fine-tuning, or LoRA merged back afterwards), then evaluate on the
        # held-out pairs with the scorer PPO will use.
        result, final = train(recipe, data, device, (record, console), trackers, checkpoint)

        # 3. Save a plain model.
        if is_main:
            save(recipe, record, data, (start, final), result)

        # 4. The judge: another reward model, trained the same way on its own prompts (the
        # first one's weights let go before the second's load).
        if data.judge_pairs:
            pairs = data.judge_pairs, data.eval_pairs
            del data
            train_judge(recipe, device, (record, console), *pairs)
    return record.manifest


class RewardData(NamedTuple):
    scorer: RewardScorer  # on the model being trained
    train_pairs: list[dict[str, str]]
    eval_pairs: list[dict[str, str]]
    train_ds: Any  # pre-tokenised `chosen_ids` / `rejected_ids` (+ `*_token_type_ids`)
    n_truncated: int  # training texts longer than reward.max_length
    judge_pairs: list[dict[str, str]] = []  # kept from this model for the judge's training


def setup(recipe: Recipe, run: RunDir, device: torch.device, record: StageRecord) -> RewardData:
    """The preference pairs split into training and held-out pairs (`data.preferences`'s
    `eval_fraction`), and the training pairs into the reward model's and the judge's
    (`split_judge`); the reward model's `RewardData`, the judge's pairs in it."""
    cfg = recipe.reward
    data = load_preferences(recipe.data.preferences, cache_dir=run.path / ".cache")
    same = data.dropped.get("identical answers", 0)
    if same:
        record.warn(
            f"{same} preference pair(s) of {recipe.data.preferences.where()} have the same "
            "chosen and rejected answer: skipped"
        )
    train, held = hold_out(data, recipe.data.preferences.eval_fraction, recipe.run.seed)
    for warning in data.warnings:  # pairs the data holds twice, held out and trained on
        record.warn(warning)
    train_pairs, eval_pairs = list(map(_as_text, train)), list(map(_as_text, held))
    train_pairs, judge_pairs = split_judge(train_pairs, cfg.judge_fraction, recipe.run.seed)
    proxy = reward_data(recipe, device, record, train_pairs, eval_pairs)
    record.manifest["data"] = {"preferences": preference_figures(data, proxy.scorer)}
    return proxy._replace(judge_pairs=judge_pairs)


def _as_text(pair: Pair) -> dict[str, str]:
    """A pair as the reward model reads it: its prompt as text, the text PPO's rollouts are
    scored with."""
    return {"prompt": prompt_text(pair.prompt), "chosen": pair.chosen, "rejected": pair.rejected}


def split_judge(
    pairs: list[dict[str, str]], fraction: float, seed: int
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(the reward model's pairs, the judge's): `fraction` of the pairs' distinct prompts, a
    seeded draw (`data.split_eval`), go to the judge with all their pairs, so the two models
    share no prompt. No judge's pairs at 0."""
    if fraction == 0:
        return pairs, []
    _, drawn = split_eval(sorted({p["prompt"] for p in pairs}), fraction, seed)
    judged = set(drawn)
    return (
        [p for p in pairs if p["prompt"] not in judged],
        [p for p in pairs if p["prompt"] in judged],
    )


def reward_data(
    recipe: Recipe,
    device: torch.device,
    record: StageRecord,
    train_pairs: list[dict[str, str]],
    eval_pairs: list[dict[str, str]],
) -> RewardData:
    """The scorer on an untrained model and the pre-tokenised training set (`chosen_ids`,
    `rejected_ids`, and `chosen_token_type_ids`, `rejected_token_type_ids` where pairs are
    encoded with token types), each exactly as the scorer encodes it: TRL then skips its own
    processing, which also avoids its need for an EOS token."""
    from datasets import Dataset

    cfg = recipe.reward
    tokenizer = load_tokenizer(
        cfg.tokenizer or cfg.base_model, cfg.trust_remote_code, padding_side="right"
    )
    dtype = cfg.dtype if cfg.lora.enabled else "float32"  # fully trained: fp32 master weights
    model = load_reward_model(cfg.base_model, device, dtype, cfg.trust_remote_code)
    scorer = RewardScorer(
        model, tokenizer, cfg.template, cfg.max_length, cfg.score_batch_size, input=cfg.input
    )
    prompts = [p["prompt"] for p in train_pairs]
    encoded, n_truncated = {}, 0
    for side in ("chosen", "rejected"):
        features, count = scorer.encode(prompts, [p[side] for p in train_pairs])
        encoded[f"{side}_ids"] = features["input_ids"]
        if "token_type_ids" in features:
            encoded[f"{side}_token_type_ids"] = features["token_type_ids"]
        n_truncated += count
    if n_truncated:
        record.warn(
            f"{n_truncated} of {2 * len(train_pairs)} training texts were longer than "
            f"reward.max_length ({cfg.max_length}) and truncated"
        )
    if cfg.lora.enabled:
        from peft import get_peft_model

        # The adapter and the score head train in fp32 (peft leaves the head in the base dtype).
        check_lora_targets(model, cfg.lora, "reward.lora.target_modules")
        scorer.model = upcast_trainable(get_peft_model(model, lora_config(cfg.lora, "SEQ_CLS")))
    return RewardData(scorer, train_pairs, eval_pairs, Dataset.from_dict(encoded), n_truncated)


@dataclass
class PreferenceCollator(DataCollatorForPreference):
    """TRL's preference batches (chosen rows, then rejected rows, right-padded), plus the pairs'
    `token_type_ids` padded the same way when the data set has them: TRL's collator drops
    them, and a BERT-like model would then train on segment 0 only while scoring reads 0 / 1."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        if "chosen_token_type_ids" in examples[0]:
            types = [
                torch.tensor(example[f"{side}_token_type_ids"])
                for side in ("chosen", "rejected")
                for example in examples
            ]
            batch["token_type_ids"] = pad(
                types,
                padding_value=0,
                padding_side="right",
                pad_to_multiple_of=self.pad_to_multiple_of,
            )
        return batch


def train(
    recipe: Recipe,
    data: RewardData,
    device: torch.device,
    out: tuple[StageRecord, Console],
    trackers: Trackers,
    checkpoint: tuple[Path, list[str]] | None,
    judge: Path | None = None,
) -> tuple[Any, Any]:
    """TRL's RewardTrainer over the pre-tokenised pairs, from `checkpoint` when resuming, then
    the held-out pairs scored by the trained model (left in `data.scorer`, a plain frozen model)
    and logged as the Trainer logs, to metrics.jsonl and the trackers; (its TrainOutput, the
    held-out results). The judge's training gives its folder (`judge`): its Trainer's
    checkpoints and metrics.jsonl go there, and it starts afresh."""
    from trl import RewardConfig, RewardTrainer

    cfg, (record, console) = recipe.reward, out
    kwargs = trainer_kwargs(
        cfg,
        device,
        resolve_dtype(cfg.dtype, device),
        judge or record.dir,
        recipe.run.seed,
        trackers,
        recipe.model.gradient_checkpointing,
    )
    kwargs["eval_strategy"] = "no"  # held-out pairs are scored by `pairwise_eval` instead
    # the token type columns reach `PreferenceCollator` (TRL would keep only `chosen_ids`, ...)
    args = RewardConfig(**kwargs, max_length=cfg.max_length, remove_unused_columns=False)
    stage = StageCallback(console, "train-rm")
    trainer = RewardTrainer(
        model=data.scorer.model,
        args=args,
        processing_class=data.scorer.tokenizer,
        train_dataset=data.train_ds,
        data_collator=PreferenceCollator(
            data.scorer.tokenizer.pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of
        ),
        callbacks=[stage],
    )
    drop_printer(trainer)
    stage.writer = (
        start_or_resume_trainer(record, checkpoint, console)
        if judge is None
        else MetricsWriter(judge / "metrics.jsonl", enabled=record.write)
    )
    try:
        folder = checkpoint[0] if checkpoint else None
        result = train_resumable(trainer, stage, folder, console, "rlhf train-rm")
        model = trainer.model.merge_and_unload() if cfg.lora.enabled else trainer.model
        data.scorer.model = freeze(model)
        final = pairwise_eval(data.scorer, data.eval_pairs)
        trainer.log({"eval_accuracy": final["accuracy"], "eval_margin": final["margin"]})
    finally:
        stage.progress.stop()
        stage.writer.close()
    return result, final


def save(
    recipe: Recipe,
    record: StageRecord,
    data: RewardData,
    evals: tuple[dict[str, float], dict[str, float]],
    result: Any,
) -> None:
    """The model and tokenizer (one from_pretrained folder), held-out results, the training
    prompts (for PPO's overlap warning) and the manifest."""
    cfg, (start, final) = recipe.reward, evals
    scorer, train_pairs, eval_pairs = data.scorer, data.train_pairs, data.eval_pairs
    save_model(data, record.dir, evals)
    record.manifest["outputs"] = {
        "model": "model",
        "tokenizer": "model",
        "eval": "eval.json",
        "metrics": "metrics.jsonl",
        "train_prompts": "train_prompts.json",
    }
    record.manifest["input"] = scorer.input  # `auto` resolved: pair or template
    record.manifest["template"] = cfg.template
    record.manifest["max_length"] = cfg.max_length
    record.manifest["metrics"] = {
        "eval_accuracy": final["accuracy"],
        "eval_margin": final["margin"],
        "eval_accuracy_start": start["accuracy"],
        "train_loss": run_train_loss(record, result),
        "steps": result.global_step,
        "train_pairs": len(train_pairs),
        "eval_pairs": len(eval_pairs),
        "truncated_texts": data.n_truncated,
    }
    drop_checkpoints(record)  # the result is saved: the resumable state is no longer needed


def save_model(
    data: RewardData, folder: Path, evals: tuple[dict[str, float], dict[str, float]]
) -> None:
    """Into `folder`: the model and tokenizer (`model/`, one from_pretrained folder), the
    held-out results before and after training (`eval.json`) and the training prompts
    (`train_prompts.json`: PPO's overlap warning, the judge's disjointness)."""
    (start, final), scorer = evals, data.scorer
    scorer.model.save_pretrained(folder / "model")
    scorer.tokenizer.save_pretrained(folder / "model")
    atomic_write_json(
        folder / "eval.json", {"before": start, "after": final, "eval_pairs": len(data.eval_pairs)}
    )
    atomic_write_json(
        folder / "train_prompts.json", sorted({p["prompt"] for p in data.train_pairs})
    )


def train_judge(
    recipe: Recipe,
    device: torch.device,
    out: tuple[StageRecord, Console],
    pairs: list[dict[str, str]],
    eval_pairs: list[dict[str, str]],
) -> None:
    """The judge (`reward.judge_fraction`): a fresh reward model trained as the first was
    (`reward_data`, `train`, `save_model`) on `pairs`, whose prompts the first never saw,
    evaluated on the same held-out pairs, into `rm/judge/` (its metrics.jsonl and tracker run
    `<name>-rm-judge` apart), added to the manifest's outputs and metrics. It writes no
    periodic checkpoints and is not resumed: a stop while it trains leaves the stage
    interrupted, and `rlhf train-rm` trains both again."""
    record = out[0]
    folder = record.dir / "judge"
    trackers = Trackers.for_stage(recipe.run, "rm-judge", folder)
    once = recipe.model_copy(update={"reward": recipe.reward.model_copy(update={"save_steps": 0})})
    data = reward_data(once, device, record, pairs, eval_pairs)
    start = pairwise_eval(data.scorer, eval_pairs)
    try:
        with trackers.environment():
            result, final = train(once, data, device, out, trackers, None, judge=folder)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            "stopped while training the judge (the reward model is saved, the judge is not): "
            "`rlhf train-rm` trains both again"
        ) from None
    finally:  # a Ctrl-C's checkpoint too: nothing resumes it
        if record.write:
            shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    if not record.write:
        return
    save_model(data, folder, (start, final))
    record.manifest["outputs"].update(
        judge="judge/model",
        judge_eval="judge/eval.json",
        judge_metrics="judge/metrics.jsonl",
        judge_train_prompts="judge/train_prompts.json",
    )
    record.manifest["metrics"].update(
        judge_eval_accuracy=final["accuracy"],
        judge_eval_margin=final["margin"],
        judge_train_loss=result.training_loss,
        judge_steps=result.global_step,
        judge_train_pairs=len(pairs),
    )
