"""The engine choice at start-up: a launch this setup cannot run stops with one line saying what
to change (exit 2) before any model loads; a checkpoint resumes only under the layout that wrote
it. (The engines themselves run on two processes in tests/stages/test_sharded_ppo.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rlhf_cli.errors import StageError
from rlhf_cli.ppo import sharding
from rlhf_cli.recipe import Recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]
LAUNCH_ENV = [
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_FSDP",
    "FSDP_VERSION",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
]
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}


def _recipe(tmp_path: Path, four_bit: bool = False, accumulation: int = 1) -> Recipe:
    data = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    data["run"]["output_dir"] = str(tmp_path / "runs")
    data["model"].setdefault("quantization", {})["load_in_4bit"] = four_bit
    data["ppo"]["gradient_accumulation_steps"] = accumulation
    return parse_recipe(yaml.safe_dump(data), "r.yaml", base_dir=REPO / "recipes")


@pytest.fixture
def launched_with(monkeypatch: pytest.MonkeyPatch):
    """Set the environment `accelerate launch --config_file ...` would set."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)

    def set_env(**env: str) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return set_env


def test_the_launcher_picks_the_engine(launched_with):
    assert sharding.requested_backend() == "ddp"
    launched_with(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    assert sharding.requested_backend() == "fsdp"
    launched_with(ACCELERATE_USE_DEEPSPEED="true")
    assert sharding.requested_backend() == "deepspeed"


@pytest.mark.parametrize(
    "env, four_bit, message",
    [
        ({**FSDP, "FSDP_VERSION": "1"}, False, "set `fsdp_config: {fsdp_version: 2}`"),
        (FSDP, True, "FSDP cannot shard 4-bit"),
        (ZERO3, True, "ZeRO-3 cannot partition 4-bit"),
    ],
    ids=["fsdp1", "fsdp-4bit", "zero3-4bit"],
)
def test_launches_that_cannot_run_are_refused(tmp_path, launched_with, env, four_bit, message):
    launched_with(**env)
    backend = sharding.requested_backend()
    if backend == "deepspeed":  # its refusal comes after the install check
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed here")
    with pytest.raises(StageError, match=message) as caught:
        sharding.check_launch(backend, _recipe(tmp_path, four_bit=four_bit))
    assert "\n" not in str(caught.value)


def test_four_bit_under_zero2_and_ddp_is_allowed(tmp_path, launched_with):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed here")
    launched_with(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    sharding.check_launch("deepspeed", _recipe(tmp_path, four_bit=True))
    sharding.check_launch("ddp", _recipe(tmp_path, four_bit=True))


def test_deepspeed_not_installed_names_the_install_command(tmp_path, launched_with, monkeypatch):
    launched_with(ACCELERATE_USE_DEEPSPEED="true")
    real = sharding.importlib.util.find_spec
    monkeypatch.setattr(
        sharding.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "deepspeed" else real(name, *a),
    )
    with pytest.raises(StageError, match="DeepSpeed, which is not installed: `pip install"):
        sharding.check_launch("deepspeed", _recipe(tmp_path))


def test_accumulation_set_in_two_places_is_refused(tmp_path, launched_with):
    launched_with(ACCELERATE_GRADIENT_ACCUMULATION_STEPS="4")
    with pytest.raises(StageError, match="gradient_accumulation_steps: 4 but the recipe's .* is 2"):
        sharding.build_accelerator(_recipe(tmp_path, accumulation=2), True, "no")


def test_the_cli_gives_one_line_and_exit_2(make_recipe, launched_with):
    from rlhf_cli.cli import app

    launched_with(**FSDP)
    recipe = make_recipe({"model": {"quantization": {"load_in_4bit": True}}})
    result = CliRunner().invoke(app, ["ppo", "--recipe", str(recipe)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "FSDP cannot shard 4-bit" in errors[0]
    assert "Traceback" not in result.output


def test_a_checkpoint_resumes_only_under_the_layout_that_wrote_it(tmp_path):
    import json

    import torch
    from accelerate import Accelerator

    from rlhf_cli.ppo.checkpoint import TrainState, load_checkpoint
    from rlhf_cli.ppo.core import FixedKLController

    folder = tmp_path / "iter_00002"
    folder.mkdir()
    state = {"iteration": 2, "kl_controller": {"value": 0.1}, "engine": "fsdp", "processes": 2}
    (folder / "state.json").write_text(json.dumps(state))
    kl_ctl = FixedKLController(0.3)
    with pytest.raises(StageError, match="written by fsdp on 2 process.*this launch is ddp on 1"):
        load_checkpoint(
            folder,
            engine=sharding.Engine(Accelerator(cpu=True)),
            actor=None,
            state=TrainState(None, None, kl_ctl, torch.Generator(), None),
        )
    assert kl_ctl.value == 0.3  # nothing restored


def test_the_vllm_backend_is_refused_in_one_line_when_vllm_is_missing(monkeypatch):
    from rlhf_cli.errors import ModelLoadError
    from rlhf_cli.generation import require_engine
    from rlhf_cli.generation import vllm as vllm_engine
    from rlhf_cli.recipe import GenerationSection

    real = vllm_engine.importlib.util.find_spec
    monkeypatch.setattr(
        vllm_engine.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real(name, *a),
    )
    require_engine(GenerationSection(backend="hf"))  # nothing to check
    with pytest.raises(ModelLoadError, match=r"needs vLLM, which is not installed") as caught:
        require_engine(GenerationSection(backend="vllm"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("section", ["ppo", "audit"])
def test_a_4bit_policy_with_the_vllm_backend_is_refused_by_the_recipe(make_recipe, section):
    from rlhf_cli.errors import RecipeError
    from rlhf_cli.recipe import load_recipe

    updates = {
        "model": {"quantization": {"load_in_4bit": True}},
        section: {"generation": {"backend": "vllm"}},
    }
    with pytest.raises(
        RecipeError, match=f"{section}.generation.backend: vllm .*load_in_4bit: false"
    ):
        load_recipe(make_recipe(updates))


def test_the_vllm_engine_settings_follow_the_recipe_on_cuda_only():
    from rlhf_cli.generation.vllm import engine_settings
    from rlhf_cli.recipe import GenerationSection

    gen = GenerationSection(vllm={"gpu_memory_utilization": 0.45, "sleep": True})
    cpu = engine_settings(gen, on_gpu=False, dtype=torch.bfloat16, max_len=256, seed=3)
    assert cpu == {
        "dtype": "float32",
        "enforce_eager": True,
        "compilation_config": 0,  # no torch.compile: vLLM's CPU default builds with inductor
        "max_model_len": 256,
        "logprobs_mode": "processed_logprobs",
        "seed": 3,
        "tensor_parallel_size": 1,
    }
    gpu = engine_settings(gen, on_gpu=True, dtype=torch.bfloat16, max_len=256, seed=3)
    assert gpu["dtype"] == "bfloat16" and not gpu["enforce_eager"]
    assert "compilation_config" not in gpu  # vLLM's own compilation on CUDA
    assert (gpu["gpu_memory_utilization"], gpu["enable_sleep_mode"]) == (0.45, True)
    # under a launcher the engines join its processes, in groups of the tensor-parallel size
    tp = GenerationSection(vllm={"tensor_parallel_size": 2})
    launched = engine_settings(tp, True, torch.bfloat16, max_len=256, seed=3, world=4)
    assert launched["distributed_executor_backend"] == "external_launcher"
    assert launched["tensor_parallel_size"] == 2
    assert "distributed_executor_backend" not in gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_vllm_engine_computes_in_the_dtype_it_is_given_on_cuda(dtype):
    from rlhf_cli.generation.vllm import engine_settings
    from rlhf_cli.recipe import GenerationSection

    settings = engine_settings(GenerationSection(), True, dtype, max_len=64, seed=0)
    assert settings["dtype"] == str(dtype).removeprefix("torch.")
    assert getattr(torch, settings["dtype"]) is dtype  # a name vLLM reads as this dtype


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_is_refused():
    from rlhf_cli.errors import ModelLoadError
    from rlhf_cli.generation.vllm import tensor_parallel_group

    with pytest.raises(ModelLoadError, match="vllm.tensor_parallel_size: 2 does not divide the 3"):
        tensor_parallel_group(3, 2)
    assert tensor_parallel_group(1, 1) is None and tensor_parallel_group(4, 1) is None
