"""`make bench`, second step: the memory of ONE PPO mini-batch update (forward + backward) with
each memory change on and off → the `update_memory` key of bench/ppo.json.

The model is bench_ppo.py's `local-55m` policy (rlhf_cli.tiny.LOCAL_55M_CONFIG, random weights)
with a LoRA adapter and a shared zero-initialised value head, as PPO trains it, in train() mode;
the loss is PPO's own (response_logprobs, clipped policy and value losses, entropy) on random
token ids and random rollout tensors. The three changes:

- `entropy_no_grad`: the entropy (a diagnostic when `ppo.entropy_coef` is 0) computed under
  no_grad (new) rather than inside the autograd graph (old);
- `response_logits`: `PolicyAndValue.forward(..., response_width)`, only the response positions'
  logits materialised (`logits_to_keep`, new), rather than the full (b, prompt+response, vocab)
  logits sliced afterwards (old);
- `checkpointing`: non-reentrant activation checkpointing on (new) or off (old).

Variants: all on (the new path), each change off alone, all off (the old path). Each variant
runs in its own process, on two shapes: the tiny tokenizer's vocabulary and a 32k one. Figures:
- `saved_mib`: bytes of the tensors kept for backward (saved_tensors_hooks, distinct storages,
  parameters left out, plus the layer inputs a checkpointed layer keeps for its recompute, which
  bypass the outer hooks): the activation memory these changes target;
- `peak_rss_growth_mib`: peak RSS during the update above the RSS just before it (peak reset
  through /proc/self/clear_refs; Linux only, else null);
- `update_s`: the time of one forward + backward, the faster of two after a warm-up, in the same
  process (after the measured one, with glibc's usual heap caching back on).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
import warnings
import weakref
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHANGES = ("entropy_no_grad", "response_logits", "checkpointing")
VARIANTS = {
    "all on": dict.fromkeys(CHANGES, True),
    **{f"{c} off": {k: k != c for k in CHANGES} for c in CHANGES},
    "all off": dict.fromkeys(CHANGES, False),
}
SHAPES = {"tokenizer-vocab": None, "vocab-32k": 32000}
BATCH, PROMPT, RESPONSE = 4, 64, 128
MIB = 2**20


# ── one variant, in a child process ─────────────────────────────────────────────────────────────


def build_actor(vocab_size: int | None, checkpointing: bool) -> Any:
    """rlhf_cli.tiny's LOCAL_55M_CONFIG Llama (vocabulary: the tiny tokenizer's unless given),
    LoRA as PPO puts it, a shared zero value head; in train() mode."""
    import torch
    from peft import get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_cli.modeling import lora_config
    from rlhf_cli.ppo.models import PolicyAndValue, hidden_size_of, zero_value_head
    from rlhf_cli.recipe import LoraSection
    from rlhf_cli.tiny import LOCAL_55M_CONFIG, tiny_lm_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_path())
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size or len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **LOCAL_55M_CONFIG,
        )
    )
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    policy = get_peft_model(model, lora_config(LoraSection(), "CAUSAL_LM", no_dropout=True))
    actor = PolicyAndValue(policy, value_head=zero_value_head(hidden_size_of(model)))
    return actor.train()


def random_batch(vocab: int, b: int = BATCH, p: int = PROMPT, r: int = RESPONSE) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (b, r)
    ids = torch.randint(0, vocab, (b, p + r), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "response_ids": ids[:, p:],
        "response_mask": torch.ones(shape, dtype=torch.bool),
        "old_logprobs": -torch.rand(shape, generator=g) * 8,
        "old_values": torch.randn(shape, generator=g),
        "advantages": torch.randn(shape, generator=g),
        "returns": torch.randn(shape, generator=g),
    }


def logits_and_values(actor: Any, batch: dict, response_logits: bool) -> tuple[Any, Any]:
    """New path: PolicyAndValue.forward with response_width. Old path: the full logits and last
    hidden state, sliced to the positions that predict the response."""
    from rlhf_cli.generation import position_ids_from

    ids, attn = batch["input_ids"], batch["attention_mask"]
    r = batch["response_ids"].shape[1]
    if response_logits:
        return actor(ids, attn, r)
    out = actor.policy(
        input_ids=ids,
        attention_mask=attn,
        position_ids=position_ids_from(attn),
        output_hidden_states=True,
        use_cache=False,
    )
    p = ids.shape[1] - r
    states = slice(p - 1, p - 1 + r)
    hidden = out.hidden_states[-1][:, states]
    values = actor.value_head(hidden.to(actor.value_head.weight.dtype)).squeeze(-1)
    return out.logits[:, states], values.float()


def ppo_loss(actor: Any, batch: dict, variant: dict[str, bool]) -> Any:
    """PPO's mini-batch loss (as ppo/loop.py: minibatch_loss), entropy_coef 0."""
    import torch

    from rlhf_cli.generation import response_logprobs, score_temperature
    from rlhf_cli.ppo import core
    from rlhf_cli.recipe import PpoSection

    cfg = PpoSection()
    mask = batch["response_mask"]
    logits, values = logits_and_values(actor, batch, variant["response_logits"])
    logprobs = response_logprobs(logits, batch["response_ids"], cfg.generation)
    pg_loss, _ = core.ppo_policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], mask, cfg.cliprange
    )
    vf_loss, _ = core.ppo_value_loss(
        values, batch["old_values"], batch["returns"], mask, cfg.cliprange_value
    )
    with torch.no_grad() if variant["entropy_no_grad"] else nullcontext():
        entropy = core.entropy_from_logits(logits, score_temperature(cfg.generation))
        entropy = core.masked_mean(entropy, mask)
    return pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * entropy


class SavedLedger:
    """The tensors kept for backward: distinct storages (by data pointer) still alive when the
    forward ends, parameters and buffers left out. Alive, because a graph that is dropped
    during the forward (top-p's sort and softmax, whose result is a bool mask) frees what it
    saved. Checkpointed layers keep their inputs outside saved_tensors_hooks (and their own
    hooks shadow the outer ones inside), so `watch_checkpoints` records those inputs too."""

    def __init__(self, model: Any):
        self.skip = {
            t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]
        }
        self.refs: list[weakref.ref] = []

    def add(self, t: Any) -> Any:
        import torch

        if isinstance(t, torch.Tensor):
            self.refs.append(weakref.ref(t))
        return t

    def watch_checkpoints(self, model: Any) -> None:
        for module in model.modules():
            inner = getattr(module, "_gradient_checkpointing_func", None)
            if inner is not None and getattr(module, "gradient_checkpointing", False):
                module._gradient_checkpointing_func = self._recording(inner)

    def _recording(self, inner: Any) -> Any:
        def run(function: Any, *args: Any, **kwargs: Any) -> Any:
            keywords = getattr(function, "keywords", {})
            for value in [*args, *kwargs.values(), *keywords.values()]:
                for t in value if isinstance(value, tuple | list) else (value,):
                    self.add(t)
            return inner(function, *args, **kwargs)

        return run

    def mib(self) -> float:
        sizes = {}
        for ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in self.skip:
                sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(sizes.values()) / MIB


def rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def malloc_gives_back(on: bool) -> None:
    """glibc: on, every allocation over 64 KiB is its own mapping, unmapped when freed, so the
    RSS follows the live tensors; off, blocks up to 32 MiB come from (and stay in) the heap, close
    to glibc's default once its threshold has grown, for the timed update."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024 if on else 32 * MIB)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def reset_peak_rss() -> int | None:
    """Reset the peak RSS to the current one (/proc/self/clear_refs); the current RSS in KiB,
    or None where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return rss_kib("VmRSS")


def measure(shape: str, variant_name: str) -> dict[str, Any]:
    """One variant on one shape: a tiny update, then the measured update (saved bytes, peak RSS
    growth), before any large one so no allocator cache hides its memory; then a warm-up and
    two timed ones."""
    import torch

    variant = VARIANTS[variant_name]
    actor = build_actor(SHAPES[shape], variant["checkpointing"])
    vocab = actor.policy.get_base_model().config.vocab_size
    batch = random_batch(vocab)
    malloc_gives_back(True)
    ppo_loss(actor, random_batch(vocab, 1, 4, 4), variant).backward()  # libraries' first-call
    actor.zero_grad(set_to_none=True)  # set-up (code pages, kernels: ~15 MiB RSS) out of the way
    malloc_gives_back(True)
    ledger = SavedLedger(actor)
    ledger.watch_checkpoints(actor)
    rss_before = reset_peak_rss()
    with torch.autograd.graph.saved_tensors_hooks(ledger.add, lambda t: t):
        loss = ppo_loss(actor, batch, variant)
    saved = ledger.mib()
    loss.backward()
    peak = rss_kib("VmHWM") if rss_before is not None else None
    del loss
    malloc_gives_back(False)
    times = []
    for _ in range(3):  # a warm-up, then the fastest of two (the CPUs may be shared)
        actor.zero_grad(set_to_none=True)
        start = time.perf_counter()
        ppo_loss(actor, batch, variant).backward()
        times.append(time.perf_counter() - start)
    return {
        "shape": shape,
        "variant": variant_name,
        **variant,
        "vocab": vocab,
        "saved_mib": round(saved, 1),
        "peak_rss_growth_mib": None if peak is None else round((peak - rss_before) / 1024, 1),
        "update_s": round(min(times[1:]), 2),
        "policy_parameters": sum(p.numel() for p in actor.policy.get_base_model().parameters()),
        "threads": torch.get_num_threads(),
    }


# ── the parent: every variant, the table, the JSON ──────────────────────────────────────────────


def run_all() -> list[dict[str, Any]]:
    rows = []
    for shape in SHAPES:
        for name in VARIANTS:
            out = subprocess.run(
                [sys.executable, __file__, "--one", shape, "--variant", name],
                check=True,
                capture_output=True,
                text=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def savings(rows: list[dict[str, Any]], shape: str) -> dict[str, dict[str, float | None]]:
    """Per change, what switching it on saves against the new path with it off alone; and all
    three together (all off − all on). Times: the extra seconds the new path costs."""
    by = {r["variant"]: r for r in rows if r["shape"] == shape}
    on = by["all on"]
    pairs = {c: by[f"{c} off"] for c in CHANGES} | {"all three": by["all off"]}
    result = {}
    for change, off in pairs.items():
        result[change] = {
            "saved_mib": round(off["saved_mib"] - on["saved_mib"], 1),
            "peak_rss_growth_mib": None
            if on["peak_rss_growth_mib"] is None
            else round(off["peak_rss_growth_mib"] - on["peak_rss_growth_mib"], 1),
            "update_s_cost": round(on["update_s"] - off["update_s"], 2),
        }
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'shape':<16}{'variant':<22}{'saved MiB':>10}{'peak RSS +MiB':>15}{'update s':>10}")
    for r in rows:
        rss = "-" if r["peak_rss_growth_mib"] is None else f"{r['peak_rss_growth_mib']:.1f}"
        print(
            f"{r['shape']:<16}{r['variant']:<22}{r['saved_mib']:>10.1f}{rss:>15}"
            f"{r['update_s']:>10.2f}"
        )


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from rlhf_cli.recipe import PpoSection

    gen = PpoSection().generation
    return {
        "settings": {
            "batch": BATCH,
            "prompt_tokens": PROMPT,
            "response_tokens": RESPONSE,
            "policy_parameters": {r["shape"]: r["policy_parameters"] for r in rows},
            "vocab": {r["shape"]: r["vocab"] for r in rows},
            "generation": {"temperature": gen.temperature, "top_p": gen.top_p},
            "lora": True,
            "value_model": "shared",
            "entropy_coef": PpoSection().entropy_coef,
            "threads": rows[0]["threads"],
        },
        "variants": [
            {k: v for k, v in r.items() if k not in ("policy_parameters", "threads")} for r in rows
        ],
        "savings": {shape: savings(rows, shape) for shape in SHAPES},
    }


def write_key(out: Path, value: dict[str, Any]) -> None:
    """Merge `update_memory` into `out` (bench_ppo.py's report), keeping its other keys."""
    data = json.loads(out.read_text()) if out.exists() else {}
    data["update_memory"] = value
    out.write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "ppo.json"))
    parser.add_argument("--one", choices=list(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("RLHF_CLI_CACHE", str(ROOT / ".cache" / "rlhf-cli"))
    if args.one:
        from rlhf_cli.tracking import quiet_libraries

        quiet_libraries()
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames
        print(json.dumps(measure(args.one, args.variant)))
        return
    rows = run_all()
    print_table(rows)
    write_key(Path(args.out), report(rows))
    print(f"wrote update_memory into {args.out}")


if __name__ == "__main__":
    main()
