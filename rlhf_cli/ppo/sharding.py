"""How PPO spreads over processes: replicated (one process or DDP), DeepSpeed ZeRO-2/3, or FSDP2.

The launcher picks the engine (`accelerate launch --config_file recipes/accelerate/...` sets
`ACCELERATE_USE_DEEPSPEED` / `ACCELERATE_USE_FSDP`); the recipe supplies what the engine must
know (micro-batch per process, accumulation steps, clipping norm), so one recipe runs under any
of them. Each engine answers four questions the loop asks:

- `prepare`: wrap the actor and build its optimizer (FSDP2 shards first: the optimizer must see
  the sharded parameters);
- `gathered`: the full weights, once per rollout, for generation and the frozen forwards
  (ZeRO-3 gathers every parameter and lifts DeepSpeed's per-module hooks, as TRL's
  `unwrap_model_for_generation` does; FSDP2 unshards every unit and keeps it unsharded across
  forwards), freed on exit;
- `save_state` / `load_state`: the trainable weights and optimizer state of a checkpoint, sharded
  as the engine keeps them (DeepSpeed's own checkpoint, torch's distributed checkpoint for FSDP2,
  plain files when replicated).

accelerate's FSDP plugin does not shard on a CPU (it silently wraps DDP), so FSDP is torch's own
FSDP2 (`fully_shard`), applied here, on every device: one code path, the one the CPU tests run.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rlhf_cli.errors import StageError, checkpoint_mismatch
from rlhf_cli.modeling import trainable_state
from rlhf_cli.recipe import Recipe

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def requested_backend() -> str:
    """`deepspeed`, `fsdp` or `ddp` (one process or data-parallel), as the launcher asked."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    return "ddp"


def check_launch(backend: str, recipe: Recipe) -> None:
    """A launch this setup cannot run stops here, before any model loads, saying what to change."""
    four_bit = recipe.model.quantization.load_in_4bit
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise StageError(
            "the accelerate config asks for DeepSpeed, which is not installed: `pip install "
            "deepspeed` (CPU only: `DS_BUILD_OPS=0 pip install deepspeed --no-build-isolation`), "
            "or launch with another config"
        )
    if backend == "fsdp" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise StageError(
            "rlhf ppo shards with FSDP2: set `fsdp_config: {fsdp_version: 2}` in the accelerate "
            "config (recipes/accelerate/fsdp.yaml)"
        )
    if four_bit and backend == "fsdp":
        raise StageError(
            "FSDP cannot shard 4-bit (bitsandbytes) weights: set "
            "model.quantization.load_in_4bit: false, or launch with DDP or DeepSpeed ZeRO-2"
        )
    if four_bit and backend == "deepspeed" and _zero_stage() == 3:
        raise StageError(
            "DeepSpeed ZeRO-3 cannot partition 4-bit (bitsandbytes) weights: set "
            "model.quantization.load_in_4bit: false, or use ZeRO-2"
        )


def _zero_stage() -> int:
    return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))


def build_accelerator(
    recipe: Recipe, cpu: bool, mixed_precision: str, log_with: list[Any] | None = None
) -> Any:
    """The Accelerator for PPO: the recipe's accumulation steps and precision, the stage's
    trackers (`tracking.Trackers.for_accelerate`); under DeepSpeed
    its micro-batch per process, accumulation and clipping norm written into the engine's
    config (a launcher config that sets them differently is refused: the recipe is the one
    place for training settings)."""
    from accelerate import Accelerator

    backend = requested_backend()
    check_launch(backend, recipe)
    cfg = recipe.ppo
    steps = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if steps not in (None, "", "auto", str(cfg.gradient_accumulation_steps)):
        raise StageError(
            f"the accelerate config sets gradient_accumulation_steps: {steps} but the recipe's "
            f"ppo.gradient_accumulation_steps is {cfg.gradient_accumulation_steps}: remove it "
            "from the accelerate config (the recipe sets it)"
        )
    plugin = None
    if backend == "deepspeed":  # built here: Accelerator(cpu=True) would not read the env
        from accelerate import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            gradient_clipping=cfg.max_grad_norm,
        )
    handlers = []
    if plugin is not None and cpu:
        # accelerate runs DeepSpeed only with cpu=False, and then finds no CPU backend itself
        from accelerate.utils import InitProcessGroupKwargs

        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    acc = Accelerator(
        cpu=cpu and plugin is None,
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        deepspeed_plugin=plugin,
        kwargs_handlers=handlers,
        log_with=log_with or None,
    )
    world = acc.num_processes
    if cfg.batch_size % world or cfg.mini_batch_size % world:
        raise StageError(
            f"ppo.batch_size ({cfg.batch_size}) and ppo.mini_batch_size "
            f"({cfg.mini_batch_size}) must split evenly over {world} processes"
        )
    if plugin is not None:
        plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=cfg.mini_batch_size // world,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            gradient_clipping=cfg.max_grad_norm,
        )
    return acc


def engine_for(acc: Any) -> Engine:
    """The engine the launcher asked for, on `acc`."""
    backend = requested_backend()
    if backend == "deepspeed":
        return DeepSpeedEngine(acc)
    if backend == "fsdp":
        return Fsdp2Engine(acc)
    return Engine(acc)


def load_pt(path: Path) -> Any:
    """A checkpoint's `torch.save`d file (optimizer, scheduler, random states), its tensors on
    the CPU whichever device wrote them: where they are loaded into moves them to its own
    device (an optimizer state to its parameter's), so no process fills the writer's GPU."""
    return torch.load(path, map_location="cpu", weights_only=False)


class Engine:
    """Replicated weights (one process, or DDP through accelerate)."""

    name = "ddp"

    def __init__(self, acc: Any):
        self.acc = acc

    def prepare(self, actor: torch.nn.Module, make_optimizer: MakeOptimizer) -> tuple[Any, Any]:
        """The wrapped actor and its (accelerate-wrapped) optimizer."""
        return self.acc.prepare(actor, make_optimizer(actor))

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Models loaded inside come whole onto every process (the engine shards the actor
        when it wraps it; the frozen reward model and reference stay whole)."""
        yield

    @contextmanager
    def gathered(self, actor: Any) -> Iterator[Any]:
        """The unwrapped actor with every weight whole on this process."""
        yield self.acc.unwrap_model(actor)

    def save_state(self, actor: Any, optimizer: Any, folder: Path) -> None:
        """Write the optimizer state into `folder` (every process calls; the trained weights
        are already there, gathered: `checkpoint.save_checkpoint`)."""
        if self.acc.is_main_process:
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")

    def load_state(self, actor: Any, optimizer: Any, folder: Path) -> None:
        """Restore the trained weights and the optimizer state of a checkpoint (every process)."""
        unwrapped = self.acc.unwrap_model(actor)
        weights = load_file(folder / "policy.safetensors")
        expected = set(trainable_state(unwrapped.policy))
        if set(weights) != expected:
            raise checkpoint_mismatch(folder, f"{len(set(weights) ^ expected)} names differ")
        params = dict(unwrapped.policy.named_parameters())
        reshaped = [n for n, t in weights.items() if t.shape != params[n].shape]
        if reshaped:  # copy_ would broadcast a rank-1 LoRA into any rank without a word
            raise checkpoint_mismatch(folder, f"{len(reshaped)} shapes differ, e.g. {reshaped[0]}")
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor.to(params[name].device))
        unwrapped.load_value_state_dict(load_file(folder / "value.safetensors"))
        optimizer.load_state_dict(load_pt(folder / "optimizer.pt"))


class DeepSpeedEngine(Engine):
    """ZeRO-2 (optimizer state and gradients sharded) or ZeRO-3 (parameters too)."""

    name = "deepspeed"

    @contextmanager
    def loading(self) -> Iterator[None]:
        # accelerate registers its ZeRO-3 config with transformers, whose from_pretrained
        # would then partition every model at load (deepspeed.zero.Init), frozen ones too
        from transformers.integrations import deepspeed as hf_deepspeed

        registered = hf_deepspeed._hf_deepspeed_config_weak_ref
        hf_deepspeed.unset_hf_deepspeed_config()
        try:
            yield
        finally:
            hf_deepspeed._hf_deepspeed_config_weak_ref = registered

    @contextmanager
    def gathered(self, actor: Any) -> Iterator[Any]:
        if _zero_stage() != 3:  # ZeRO-2 keeps whole weights on every process
            yield self.acc.unwrap_model(actor)
            return
        import deepspeed
        from trl.models.utils import add_hooks, remove_hooks

        with deepspeed.zero.GatheredParameters(list(actor.parameters())):
            remove_hooks(actor)  # or every forward re-partitions what was just gathered
            try:
                yield self.acc.unwrap_model(actor)
            finally:
                add_hooks(actor)

    def save_state(self, actor: Any, optimizer: Any, folder: Path) -> None:
        actor.save_checkpoint(
            str(folder / "engine"), tag="state", exclude_frozen_parameters=True, save_latest=False
        )

    def load_state(self, actor: Any, optimizer: Any, folder: Path) -> None:
        try:
            path, _ = actor.load_checkpoint(
                str(folder / "engine"),
                tag="state",
                load_module_strict=False,  # frozen weights are not in the checkpoint
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        except (RuntimeError, KeyError, ValueError) as exc:
            raise checkpoint_mismatch(folder, str(exc).splitlines()[0][:200]) from None
        if path is None:
            raise checkpoint_mismatch(folder, "DeepSpeed found no state in it")


class Fsdp2Engine(Engine):
    """torch's FSDP2: every decoder layer and then the whole actor sharded over the processes
    (parameters, gradients and optimizer state); gradients reduce-scatter in the backward."""

    name = "fsdp"

    @contextmanager
    def loading(self) -> Iterator[None]:
        # `fsdp_cpu_ram_efficient_loading` would load real weights on rank 0 only and expect a
        # broadcast; `fully_shard` shards each process's own copy, so every process loads them
        saved = os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved

    def prepare(self, actor: torch.nn.Module, make_optimizer: MakeOptimizer) -> tuple[Any, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.acc.device.type, (self.acc.num_processes,))
        for module in list(actor.modules()):
            if _is_decoder_layer(module):
                fully_shard(module, mesh=mesh)
        fully_shard(actor, mesh=mesh)
        # The root initialises on its first forward; generation enters through the policy
        # instead (a non-root unit), so initialise it now.
        fully_shard.state(actor)._lazy_init()
        # accelerate would wrap the sharded actor in DDP: only the optimizer goes through it
        return actor, self.acc.prepare(make_optimizer(actor))

    @contextmanager
    def gathered(self, actor: Any) -> Iterator[Any]:
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in actor.modules() if isinstance(m, FSDPModule)]
        for unit in units:  # one all-gather per unit for the whole rollout, not per forward
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield actor
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)

    def _options(self, strict: bool = True) -> Any:
        """Trained weights only (the frozen base is not written); loading them back is not
        strict about the frozen ones (dcp.load has already checked every trained one)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=strict)

    def save_state(self, actor: Any, optimizer: Any, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(actor, optimizer.optimizer, options=self._options())
        dcp.save({"model": model, "optim": optim}, checkpoint_id=folder / "engine")

    def load_state(self, actor: Any, optimizer: Any, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optim = get_state_dict(actor, optimizer.optimizer, options=self._options())
        state = {"model": model, "optim": optim}
        try:
            dcp.load(state, checkpoint_id=folder / "engine")
        except (RuntimeError, KeyError, ValueError) as exc:
            raise checkpoint_mismatch(folder, str(exc).splitlines()[0][:200]) from None
        set_state_dict(
            actor,
            optimizer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._options(strict=False),
        )


def _is_decoder_layer(module: torch.nn.Module) -> bool:
    """A transformer block: what FSDP's TRANSFORMER_BASED_WRAP wraps (the model's
    `_no_split_modules` classes, which hold the attention and the MLP)."""
    return type(module).__name__.endswith(("DecoderLayer", "Block", "EncoderLayer"))
