"""The run directory: the only interface between stages.

```
runs/<run.name>/recipe.yaml          resolved recipe snapshot
runs/<run.name>/<stage>/manifest.json
runs/LATEST                          name of the last run touched
```
A stage reads only manifests (`Manifest`) and the paths they name. Manifests are written
atomically (a temp file in the same folder, fsync, rename), so a crash never leaves half a
manifest behind. Who writes them and the run's lock: `record.py`; checkpoints and `--resume`:
`resume.py`; Ctrl-C: `stopping.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

import yaml

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe

STAGE_COMMANDS = {
    "sft": "rlhf sft",
    "rm": "rlhf train-rm",
    "ppo": "rlhf ppo",
    "dpo": "rlhf dpo",
    "kto": "rlhf kto",
    "orpo": "rlhf orpo",
    "simpo": "rlhf simpo",
    "audit": "rlhf audit",
    "eval": "rlhf eval",
    "merged": "rlhf merge",
    "push": "rlhf push",
}
INHERITED = ("sft", "rm")  # stages a run may take from its `run.base`
# the offline preference methods: each trains a policy from the SFT model on `data.preferences`
# (instead of train-rm and ppo) into `<stage>/` with `adapter/` or `model/`, `tokenizer/` and a
# manifest whose `method` names it; status, merge, push, audit, compare and eval take any of them
OFFLINE_STAGES = ("dpo", "kto", "orpo", "simpo")
VERSIONED_PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "rlhf-cli",
)


class InputRecord(TypedDict):
    """An input stage as a manifest records it (`RunDir.input_record`)."""

    path: str  # the stage's folder
    manifest_sha256: str
    finished_at: str | None  # names the attempt that made its outputs


class LastAttempt(TypedDict, total=False):
    """A later attempt that failed or was stopped before it wrote over the result."""

    status: str
    error: str | None
    started_at: str | None
    finished_at: str | None


class ResumedFrom(TypedDict):
    checkpoint: str  # the folder's name, `checkpoint-N`
    step: int


class MergedFrom(TypedDict):
    stage: str  # "ppo", "sft" or one of OFFLINE_STAGES
    adapter: str
    base: str


class PromptCounts(TypedDict):
    train: int
    heldout: int


class Manifest(TypedDict, total=False):
    """A stage's `manifest.json`, as docs/run-directory.md describes it. `StageRecord` writes
    the common keys from the start; `error` comes with a failure, `last_attempt` with a later
    attempt that changed nothing, and the rest are the stages' own."""

    stage: str  # sft, rm, ppo, audit, merged, push
    status: str  # running, completed, interrupted, failed
    run: str
    started_at: str
    finished_at: str | None
    recipe_sha256: str
    inputs: dict[str, InputRecord]  # by stage
    outputs: dict[str, str]  # name -> path relative to the stage folder (push: `repo`, a URL)
    metrics: dict[str, Any]  # the stage's summary numbers
    warnings: list[str]
    versions: dict[str, str]  # package -> version
    error: str  # "<ExceptionType>: <first line>", when failed
    last_attempt: LastAttempt
    resumed_from: ResumedFrom  # sft, rm after --resume
    base_model: str  # sft, ppo, OFFLINE_STAGES
    method: dict[str, Any]  # OFFLINE_STAGES: the method's name and settings
    template: str  # rm
    max_length: int  # rm
    reward_model: str | None  # ppo
    prompts: PromptCounts  # ppo
    best: dict[str, Any] | None  # ppo: the best evaluated iteration's checkpoint
    rollbacks: list[dict[str, Any]]  # ppo: `audit.on_hacking: rollback`
    reports: dict[str, dict[str, Any]]  # audit: each label's numbers
    last: str  # audit: the newest report's label
    merged_from: MergedFrom  # merged


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a mix;
    with the permissions the umask gives a new file (the kernel applies it at `os.open`, so
    no thread ever sees the umask changed, as reading it through `os.umask` would)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class RunDir:
    """Paths of one run, its stages' manifests, and the `LATEST` pointer."""

    def __init__(self, output_dir: str | Path, name: str, base: str | None = None):
        self.output_dir = Path(output_dir)
        self.name, self.base = name, base
        self.path = self.output_dir / name

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> RunDir:
        return cls(recipe.run.output_dir, recipe.run.name, recipe.run.base)

    def owner(self, stage: str) -> RunDir:
        """The run whose `stage` this one uses: its own, else `run.base`'s (`sft`, `rm`)."""
        if self.base is None or stage not in INHERITED or self.manifest_path(stage).is_file():
            return self
        return RunDir(self.output_dir, self.base)

    @classmethod
    def latest(cls, output_dir: str | Path = "runs") -> RunDir | None:
        pointer = Path(output_dir) / "LATEST"
        if not pointer.is_file():
            return None
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise StageError(
                f"{pointer} is damaged (not a run name): pass --recipe, or delete it"
            ) from None
        return cls(output_dir, name) if name and (Path(output_dir) / name).is_dir() else None

    @classmethod
    def named_or_latest(cls, output_dir: str | Path, name: str | None) -> RunDir:
        """Run `name` under `output_dir` (default: the latest), or a StageError saying so."""
        run = cls(output_dir, name) if name else cls.latest(output_dir)
        if run is None or not run.path.is_dir():
            raise StageError(
                f"no run {'named ' + repr(name) if name else 'yet'} under "
                f"{output_dir}: run `rlhf sft` first"
            )
        run.base = run.snapshot_base()
        return run

    def snapshot_base(self) -> str | None:
        """`run.base` of the run's recipe snapshot (None when it has none or cannot be read)."""
        try:
            snapshot = yaml.safe_load(self.recipe_path().read_text(encoding="utf-8"))
            return snapshot["run"].get("base")
        except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, AttributeError):
            return None

    @classmethod
    def of_stage_dir(cls, folder: Path) -> tuple[RunDir, str]:
        """The run and stage of a stage folder (`<output_dir>/<name>/<stage>`)."""
        folder = folder.resolve()
        return cls(folder.parent.parent, folder.parent.name), folder.name

    def stage_dir(self, stage: str) -> Path:
        return self.path / stage

    def manifest_path(self, stage: str) -> Path:
        return self.stage_dir(stage) / "manifest.json"

    def recipe_path(self) -> Path:
        return self.path / "recipe.yaml"

    def prepare(self, recipe: Recipe) -> None:
        """Create the run folder, snapshot the resolved recipe, point LATEST here."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.recipe_path(), recipe.to_yaml().encode())
        atomic_write_bytes(self.output_dir / "LATEST", (self.name + "\n").encode())

    def completed_stages(self) -> list[str]:
        """The stages of this run whose manifest says `completed`."""
        done = []
        for stage in STAGE_COMMANDS:
            with contextlib.suppress(StageError):
                if (self.read_manifest(stage) or {}).get("status") == "completed":
                    done.append(stage)
        return done

    def read_manifest(self, stage: str) -> Manifest | None:
        """The stage's manifest, None when there is none, StageError when it is unreadable."""
        path = self.manifest_path(stage)
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            command = STAGE_COMMANDS.get(stage)
            hint = f"run `{command}` again" if command else "move it aside or write it again"
            raise StageError(f"{path} is unreadable ({exc.__class__.__name__}): {hint}") from None
        if not isinstance(manifest, dict):
            raise StageError(f"{path} is not a manifest (a JSON object)")
        return manifest

    def input_record(self, stage: str) -> InputRecord:
        """How a consuming stage records an input (a completed stage): its folder, its
        manifest's hash and when it finished (which names the attempt that made its outputs: a
        `last_attempt` note added by a failed re-run changes the hash, not this)."""
        data = self.manifest_path(stage).read_bytes()
        return {
            "path": str(self.stage_dir(stage)),
            "manifest_sha256": hashlib.sha256(data).hexdigest(),
            "finished_at": json.loads(data).get("finished_at"),
        }

    def resolve_output(self, stage: str, manifest: Manifest, name: str) -> Path:
        """Absolute path of output `name` declared in a stage's manifest; StageError when it is
        gone or its safetensors weights are cut short or garbled (their headers are read)."""
        try:
            path = self.stage_dir(stage) / manifest["outputs"][name]
        except KeyError:
            raise StageError(
                f"the {stage} manifest of run '{self.name}' lists no output "
                f"'{name}': run `{STAGE_COMMANDS[stage]}` again"
            ) from None
        problem = output_problem(path)
        if problem is not None:
            raise StageError(f"{problem}: run `{STAGE_COMMANDS[stage]}` again")
        return path


def output_problem(path: Path) -> str | None:
    """What is wrong with a stage output (None: nothing seen): missing, or a safetensors file
    in it whose header does not parse or does not cover the file (a cut-short write)."""
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        return f"{path} is missing"
    weights = [path] if path.suffix == ".safetensors" else sorted(path.glob("*.safetensors"))
    for file in weights:
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError) as exc:
            return f"{file} is damaged ({exc})"
    return None


def recipe_near(path: Path | None) -> Path | None:
    """The recipe snapshot of the run a checkpoint or file lives in (`<run>/recipe.yaml`, beside
    which `<output_dir>/LATEST` exists), or None."""
    if path is None:
        return None
    for folder in [path.resolve(), *path.resolve().parents]:
        if (folder / "recipe.yaml").is_file() and folder.parent.joinpath("LATEST").exists():
            return folder / "recipe.yaml"
    return None
