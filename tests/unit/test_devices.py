"""GPUs the recipe names that this machine lacks are refused when a stage starts, before any
model loads (#50 item 13): `model.device_map: cuda:N` past the GPUs present, and a colocated
vLLM engine's `tensor_parallel_size` above their number. The GPU count is faked."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from rlhf_cli.cli import app
from rlhf_cli.errors import ModelLoadError
from rlhf_cli.recipe import load_recipe


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """`gpus(n)`: torch sees `n` CUDA GPUs from now on."""

    def fake(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return fake


def _refusal(recipe, *generating: str) -> str | None:
    from rlhf_cli.modeling import check_devices

    try:
        check_devices(recipe, *generating)
    except ModelLoadError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "count, device_map, refused",
    [
        (1, "cuda:0", None),
        (1, "cuda:1", "model.device_map is cuda:1 but this process sees 1 GPU (cuda:0): name "
         "one of them, or auto"),
        (2, "cuda:1", None),
        (4, "cuda:4", "model.device_map is cuda:4 but this process sees 4 GPUs (cuda:0 to "
         "cuda:3): name one of them, or auto"),
        (0, "cuda", "model.device_map is cuda but this process sees no CUDA GPU: set it to auto "
         "or cpu"),
        (0, "auto", None),
        (0, "cpu", None),
    ],
    ids=["cuda:0 of 1", "cuda:1 of 1", "cuda:1 of 2", "cuda:4 of 4", "cuda of 0", "auto", "cpu"],
)  # fmt: skip
def test_a_device_map_past_the_gpus_present_is_refused(
    make_recipe, gpus, count: int, device_map: str, refused: str | None
) -> None:
    gpus(count)
    recipe = load_recipe(make_recipe({"model": {"device_map": device_map}}))
    assert _refusal(recipe) == refused


def _generating(make_recipe, section: str, backend: str, size: int, device: str = "auto"):
    gen = {"backend": backend, "vllm": {"tensor_parallel_size": size}}
    if backend == "vllm_server":
        gen["server"] = {"urls": ["http://127.0.0.1:8000"]}
    return load_recipe(make_recipe({"run": {"device": device}, section: {"generation": gen}}))


@pytest.mark.parametrize("section", ["ppo", "audit"])
def test_a_vllm_tensor_parallel_size_above_the_gpus_is_refused(
    make_recipe, gpus, section: str
) -> None:
    gpus(2)
    too_many = _generating(make_recipe, section, "vllm", 4)
    assert _refusal(too_many, section) == (
        f"{section}.generation.vllm.tensor_parallel_size is 4 but this process sees 2 GPUs "
        "(cuda:0 to cuda:1): make it at most 2"
    )
    assert _refusal(too_many) is None  # a stage that does not generate with it: sft, merge
    assert _refusal(_generating(make_recipe, section, "vllm", 2), section) is None
    # servers run on their own machines; on the CPU the size counts processes, not GPUs
    assert _refusal(_generating(make_recipe, section, "vllm_server", 4), section) is None
    assert _refusal(_generating(make_recipe, section, "vllm", 4, "cpu"), section) is None
    gpus(0)
    assert _refusal(too_many, section) is None


def test_sft_refuses_a_missing_gpu_before_any_model_loads(
    make_recipe, gpus, tmp_path, monkeypatch
) -> None:
    from rlhf_cli.stages import sft  # imported while torch sees no GPU

    gpus(1)
    loads: list[str] = []
    monkeypatch.setattr(sft, "load_causal_lm", lambda *a, **k: loads.append("x"))
    path = make_recipe({"model": {"device_map": "cuda:1"}})
    result = CliRunner().invoke(app, ["sft", "--recipe", str(path)])
    assert result.exit_code == 2, result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .endswith(
            "model.device_map is cuda:1 but this process sees 1 GPU (cuda:0): name one of them, "
            "or auto"
        )
    )
    assert loads == [] and not (tmp_path / "runs" / "tiny" / "sft").exists()
