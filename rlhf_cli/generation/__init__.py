"""Answers to prompts, for every caller: PPO rollouts, the audit, the merge check and compare.

One interface (`core.py`): a `Generator` takes tokenised prompts and a `GenerationSection` and
returns a `Generations` record (token ids, masks, `ended`, decoded text) from the policy a
`PolicyVersion` names (`sync` returns it); `generator_for` builds
the recipe's backend, `gen.backend`: transformers `generate` (`hf.py`) or a colocated vLLM
engine (`vllm.py`). Callers never name a backend. `core.py` also holds what makes sampled
tokens and their log-probs agree, for every backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlhf_cli.data.prompts import tokenize_prompts
from rlhf_cli.generation.core import (
    LOGPROB_CHUNK_ROWS,
    Generations,
    Generator,
    PolicyVersion,
    decode,
    forward_logits,
    left_pad,
    logprobs_from_logits,
    position_ids_from,
    response_logits,
    response_logprobs,
    response_mask_from,
    row_seed,
    sampler_support,
    sampling_warpers,
    score_temperature,
    stop_token_ids,
)
from rlhf_cli.generation.hf import HFGenerator
from rlhf_cli.recipe import GenerationSection

__all__ = [
    "Generations",
    "Generator",
    "HFGenerator",
    "LOGPROB_CHUNK_ROWS",
    "PolicyVersion",
    "require_engine",
    "decode",
    "forward_logits",
    "generator_for",
    "left_pad",
    "logprobs_from_logits",
    "position_ids_from",
    "response_logits",
    "response_logprobs",
    "response_mask_from",
    "row_seed",
    "sampler_support",
    "sampling_warpers",
    "score_temperature",
    "stop_token_ids",
    "tokenize_prompts",
]


def require_engine(gen: GenerationSection, section: str = "ppo.generation") -> None:
    """What `gen.backend` needs, checked before any model loads (one line, exit 2): vLLM
    installed for the colocated engine, every server answering for `vllm_server`. Building the
    engine checks it again, so a caller that skips this only fails later. A 4-bit policy with
    vLLM is refused by the recipe itself."""
    if gen.backend == "vllm_server":
        from rlhf_cli.generation.server_http import check_servers

        check_servers(gen.server, section)
    if gen.backend == "vllm":
        from rlhf_cli.generation.vllm import check_vllm

        check_vllm()


def generator_for(
    model: Any,
    tokenizer: Any,
    gen: GenerationSection | None = None,
    *,
    max_len: int = 0,
    seed: int = 0,
    scratch: Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Generator:
    """`gen.backend`'s engine answering as `model` (transformers `generate` without `gen`).
    vLLM's is built from `model`'s whole weights, for prompts and answers of `max_len` tokens
    together, seeded from `seed`, computing in `dtype` on CUDA, its weights written under
    `scratch` while it loads them; the servers' client syncs through `server.shared_dir`
    (default: `scratch`'s `.server-sync`) and is checked against `model`."""
    if gen is None or gen.backend == "hf":
        return HFGenerator(model, tokenizer, stop_token_ids(tokenizer, model))
    if gen.backend == "vllm_server":
        from rlhf_cli.generation.server import server_generator

        if scratch is None or max_len <= 0:
            raise ValueError("the servers' client needs max_len and a scratch folder")
        shared = Path(gen.server.shared_dir) if gen.server.shared_dir else scratch / ".server-sync"
        stops = stop_token_ids(tokenizer, model)
        return server_generator(model, tokenizer, gen, max_len, shared.resolve(), stops)
    from rlhf_cli.generation.vllm import vllm_generator

    if scratch is None or max_len <= 0:
        raise ValueError("the vLLM engine needs max_len and a scratch folder")
    return vllm_generator(model, tokenizer, gen, max_len, seed, scratch, dtype)
