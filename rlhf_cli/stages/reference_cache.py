"""The reference's log-probs of the offline stages (`rlhf dpo`, `rlhf kto`), computed once:
kept in `<method>/ref_logps/<split>.safetensors` with the hash of what they depend on, and
attached to the data on a rerun or a resume with no reference forward (TRL's own cache is
keyed on a hash of every weight, in a temporary folder)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from trl import DPOTrainer, KTOTrainer

from rlhf_cli.modeling import SFT_ADAPTER, has_sft_adapter, only_adapter
from rlhf_cli.recipe import Recipe
from rlhf_cli.record import StageRecord

REF_LOGPS = "ref_logps"  # the reference log-prob cache's folder in the stage's folder
SPLITS = ("train", "eval")  # the splits whose log-probs are kept
TRL_REFERENCE_ADAPTER = "ref"  # what TRL names its copy of a PeftModel's adapter


def reference_identity(recipe: Recipe, record: StageRecord, max_length: int) -> dict[str, Any]:
    """What the reference's log-probs depend on besides the tokenised pairs: the SFT weights
    (the sft stage's folder and the attempt that made them, as the manifest's inputs record
    it; the base model's name without SFT), the dtype they compute in, and the cut to
    `<method>.max_length` (TRL cuts in its collator, after tokenising)."""
    sft = record.manifest["inputs"].get("sft")
    weights = (
        {"sft": sft["path"], "finished_at": sft["finished_at"]}
        if sft
        else {"base": recipe.model.name_or_path}
    )
    return {"weights": weights, "dtype": recipe.model.dtype, "max_length": max_length}


class ReferenceCache:
    """`<method>/ref_logps/<split>.safetensors`: the reference's log-probs of each row's answers
    (each trainer's `REF_COLUMNS`), with the hash (`key`) of the identity and the split's token
    ids (its `ID_COLUMNS`), chat template included (what TRL's tokenising made of it)."""

    def __init__(self, folder: Path, identity: dict[str, Any], write: bool):
        self.folder, self.identity, self.write = folder, identity, write
        self.status: dict[str, str] = {}  # split -> reused | computed

    def key(self, dataset: Any, columns: tuple[str, ...], template: str | None) -> str:
        ids = dataset.select_columns([c for c in columns if c in dataset.column_names]).to_dict()
        text = json.dumps({**self.identity, "ids": ids, "template": template}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, split: str) -> Path:
        return self.folder / f"{split}.safetensors"

    def complete(self, splits: tuple[str, ...]) -> bool:
        """Whether every split has a kept file (its key is checked when it is read)."""
        return all(self.path(split).is_file() for split in splits)

    def load(
        self, split: str, key: str, names: tuple[str, ...], rows: int
    ) -> dict[str, torch.Tensor] | None:
        """The split's kept columns `names` when they were made under `key` for `rows` rows."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path(split)), "pt") as kept:
                if (kept.metadata() or {}).get("key") != key:
                    return None
                columns = {name: kept.get_tensor(name) for name in names}
        except (OSError, SafetensorError):
            return None
        return columns if all(len(c) == rows for c in columns.values()) else None

    def save(self, split: str, key: str, columns: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if not self.write:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.path(split).with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in columns.items()}, str(partial), {"key": key})
        partial.replace(self.path(split))

    def summary(self) -> dict[str, Any]:
        return {"log_probs": REF_LOGPS, "splits": dict(self.status)}


class CachedReference:
    """A TRL trainer whose reference log-probs go through `ReferenceCache`. With
    `precompute_ref_log_probs`, TRL's DPOTrainer and KTOTrainer call `_precompute_ref_logps`
    for each split at their construction, whatever columns the data holds, and key their own
    cache on a hash of every weight in a temporary folder (for data held in memory): the
    split's kept columns are attached here instead, with no reference forward; only a miss
    runs TRL's."""

    REF_COLUMNS: tuple[str, ...]  # TRL's names of the reference's log-probs
    ID_COLUMNS: tuple[str, ...]  # the tokenised columns they depend on

    def __init__(self, cache: ReferenceCache, *args: Any, **kwargs: Any):
        self.ref_cache = cache
        super().__init__(*args, **kwargs)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        cache, columns = self.ref_cache, self.ref_columns()
        template = getattr(self.processing_class, "chat_template", None)
        key = cache.key(dataset, self.ID_COLUMNS, template)
        kept = cache.load(name, key, columns, len(dataset))
        if kept is not None:
            cache.status[name] = "reused"
            for column, values in kept.items():
                dataset = dataset.add_column(column, values.tolist())
            return dataset
        with sft_reference(self):
            dataset = super()._precompute_ref_logps(dataset, name, batch_size)  # type: ignore[misc]
        cache.save(name, key, {c: torch.tensor(dataset[c]) for c in columns})
        cache.status[name] = "computed"
        return dataset

    def ref_columns(self) -> tuple[str, ...]:
        return self.REF_COLUMNS


class CachedReferenceDPO(CachedReference, DPOTrainer):
    REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
    ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


class CachedReferenceKTO(CachedReference, KTOTrainer):
    """KTO's reference log-probs: of each row's answer, and of the mismatched answer its KL
    baseline is estimated on (`ref_KL_logps`, for the losses with that baseline)."""

    REF_COLUMNS = ("ref_logps", "ref_KL_logps")
    ID_COLUMNS = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")

    def ref_columns(self) -> tuple[str, ...]:
        return self.REF_COLUMNS if self.calculate_KL else self.REF_COLUMNS[:1]


@contextlib.contextmanager
def sft_reference(trainer: Any) -> Iterator[None]:
    """On a 4-bit base whose policy adapter is stacked over the frozen SFT adapter, the
    reference is the SFT adapter alone: TRL would disable every adapter (or use its "ref" copy
    of the new, zero one), which is the base, so for the pass it is handed the policy with only
    the SFT adapter active as a reference model of its own. Elsewhere TRL's way holds."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not has_sft_adapter(model):
        yield
        return
    with only_adapter(model, SFT_ADAPTER):
        trainer.ref_model = model
        try:
            yield
        finally:
            trainer.ref_model = None


def drop_trl_reference_adapter(model: Any) -> None:
    """TRL copies a given PeftModel's adapter as "ref" to compute the reference from; with the
    log-probs kept (and the 4-bit reference handed over by `sft_reference`) it is never used,
    so it goes, and the adapters that trained and were active stay so."""
    if TRL_REFERENCE_ADAPTER not in getattr(model, "peft_config", {}):
        return
    lora = model.base_model
    active = [a for a in lora.active_adapters if a != TRL_REFERENCE_ADAPTER]
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    model.delete_adapter(TRL_REFERENCE_ADAPTER)
    lora.set_adapter(active)
    for name, param in model.named_parameters():
        param.requires_grad_(trains[name])
