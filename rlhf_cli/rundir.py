"""The run directory: the only interface between stages.

```
runs/<run.name>/recipe.yaml          resolved recipe snapshot
runs/<run.name>/<stage>/manifest.json
runs/LATEST                          name of the last run touched
```
A stage reads only manifests and the paths they name. Manifests are written atomically (a temp
file in the same folder, fsync, rename), so a crash never leaves half a manifest behind.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import yaml

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe

STAGE_COMMANDS = {
    "sft": "rlhf sft",
    "rm": "rlhf train-rm",
    "ppo": "rlhf ppo",
    "audit": "rlhf audit",
    "merged": "rlhf merge",
    "push": "rlhf push",
}
RESUMABLE = {"sft", "rm", "ppo"}  # stages whose command takes --resume
INHERITED = ("sft", "rm")  # stages a run may take from its `run.base`
PPO_CHECKPOINT, TRAINER_CHECKPOINT = "iter_", "checkpoint-"  # + the iteration / step number
CHECKPOINT_PREFIXES = (PPO_CHECKPOINT, TRAINER_CHECKPOINT)
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


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


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

    def acquire(self, command: str) -> Path:
        """Take the run's lock file (`.lock`, holding the holder's pid), or raise StageError
        naming the holder. A lock left by a dead process is taken over."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / ".lock"
        for _ in range(3):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = lock_holder(lock)
                if holder is not None:
                    raise StageError(
                        f"run '{self.name}' is busy: pid {holder['pid']} "
                        f"({holder.get('command', '?')}, since "
                        f"{holder.get('since', '?')}) holds {lock}; wait for it "
                        "to finish or stop it"
                    ) from None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as handle:
                pid = os.getpid()
                holder = {"pid": pid, "started": _process_start(pid), "command": command}
                json.dump({**holder, "since": now_iso()}, handle)
            return lock
        raise StageError(f"run '{self.name}': could not take {lock}")

    def completed_stages(self) -> list[str]:
        """The stages of this run whose manifest says `completed`."""
        done = []
        for stage in STAGE_COMMANDS:
            with contextlib.suppress(StageError):
                if (self.read_manifest(stage) or {}).get("status") == "completed":
                    done.append(stage)
        return done

    def read_manifest(self, stage: str) -> dict[str, Any] | None:
        """The stage's manifest, None when there is none, StageError when it is unreadable."""
        path = self.manifest_path(stage)
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StageError(
                f"{path} is unreadable ({exc.__class__.__name__}): run "
                f"`{STAGE_COMMANDS.get(stage, 'the ' + stage + ' stage')}` "
                "again"
            ) from None
        if not isinstance(manifest, dict):
            raise StageError(f"{path} is not a manifest (a JSON object)")
        return manifest

    def require(self, stage: str, needed_by: str) -> dict[str, Any]:
        """The completed manifest of `stage`, or a StageError naming the command to run first."""
        manifest = self.read_manifest(stage)
        command = STAGE_COMMANDS[stage]
        if manifest is None:
            raise StageError(
                f"{needed_by} needs the {stage} stage of run '{self.name}', which is "
                f"missing ({self.stage_dir(stage)}): run `{command}` first{self._base_hint(stage)}"
            )
        state = stage_state(self, stage, manifest)
        if state.status == "completed":
            return manifest
        if state.holder is not None:
            raise StageError(
                f"{needed_by} needs the {stage} stage of run '{self.name}', which is still "
                f"running (pid {state.holder['pid']}, since {state.holder.get('since', '?')}): "
                "wait for it to finish"
            )
        if state.next != command:
            hint = f"resume it with `{state.next}`"
            if state.status == "failed":
                hint += f" (or start over with `{command}`)"
        else:
            hint = f"run `{command}` again first"
        shown = (
            "stopped (its process is gone)" if state.status == "stopped" else f"'{state.status}'"
        )
        raise StageError(
            f"{needed_by} needs the {stage} stage of run '{self.name}', whose status is "
            f"{shown}: {hint}"
        )

    def _base_hint(self, stage: str) -> str:
        """For a missing `sft` / `rm`: the other runs that completed it, as `run.base`."""
        if stage not in INHERITED or self.base is not None:
            return ""
        for path in sorted(self.output_dir.glob(f"*/{stage}/manifest.json")):
            other = RunDir(self.output_dir, path.parent.parent.name)
            with contextlib.suppress(StageError):
                done = (other.read_manifest(stage) or {}).get("status") == "completed"
                if other.name != self.name and done:
                    return f", or take it from run '{other.name}': --set run.base={other.name}"
        return ""

    def input_record(self, stage: str) -> dict[str, Any]:
        """How a consuming stage records an input (a completed stage): its folder, its
        manifest's hash and when it finished (which names the attempt that made its outputs: a
        `last_attempt` note added by a failed re-run changes the hash, not this)."""
        data = self.manifest_path(stage).read_bytes()
        return {
            "path": str(self.stage_dir(stage)),
            "manifest_sha256": hashlib.sha256(data).hexdigest(),
            "finished_at": json.loads(data).get("finished_at"),
        }

    def resolve_output(self, stage: str, manifest: dict[str, Any], name: str) -> Path:
        """Absolute path of output `name` declared in a stage's manifest."""
        try:
            return self.stage_dir(stage) / manifest["outputs"][name]
        except KeyError:
            raise StageError(
                f"the {stage} manifest of run '{self.name}' lists no output "
                f"'{name}': run `{STAGE_COMMANDS[stage]}` again"
            ) from None


def check_same_inputs(
    made: dict[str, Any], now: dict[str, Any], stages: tuple[str, ...], what: str, remedy: str
) -> None:
    """`made` (a manifest) records the input stages it was made from; `now` holds their input
    records as they are today. An input stage that finished again since (`rlhf sft` run anew,
    or `run.base` naming another run) is a StageError: what was made on it no longer fits."""
    recorded = made.get("inputs") or {}
    for stage in stages:
        was, current = recorded.get(stage) or {}, now.get(stage) or {}
        if was.get("finished_at") and current.get("finished_at") not in (None, was["finished_at"]):
            raise StageError(
                f"{what} was made from the {stage} stage that finished at {was['finished_at']} "
                f"({was.get('path')}); the one here now finished at {current['finished_at']} "
                f"({current.get('path')}): {remedy}"
            )


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux's /proc/<pid>/stat field
    22), so a reused pid is told from the process that took a lock; None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def lock_holder(lock: Path) -> dict[str, Any] | None:
    """The live holder of a lock file, or None when the lock is stale: its process is gone, or
    its pid now belongs to a process started later (another program)."""
    try:
        holder = json.loads(lock.read_text())
        pid = int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or half-written: treat as stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    started = holder.get("started")
    if started is not None and _process_start(pid) not in (None, started):
        return None  # the pid was reused
    return holder


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _restore(path: Path, data: bytes | None) -> None:
    """Put back what a file held (`None`: it did not exist)."""
    if data is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        atomic_write_bytes(path, data)


def newest_whole(
    root: Path, prefix: str, problem: Callable[[Path], str | None]
) -> tuple[Path | None, list[str]]:
    """The newest checkpoint folder `<root>/<prefix><N>` (by N) that `problem` finds whole
    (None), and a note for each newer one skipped."""
    notes = []
    found = [f for f in root.glob(f"{prefix}*") if f.is_dir() and f.name[len(prefix) :].isdigit()]
    for folder in sorted(found, key=lambda f: int(f.name[len(prefix) :]), reverse=True):
        why = problem(folder)
        if why is None:
            return folder, notes
        notes.append(f"checkpoint {folder.name} is corrupt ({why}); skipped")
    return None, notes


def resume_point(
    root: Path, prefix: str, problem: Callable[[Path], str | None], command: str
) -> tuple[Path, list[str]]:
    """`newest_whole`, or a StageError when there is none: `--resume` cannot continue."""
    folder, notes = newest_whole(root, prefix, problem)
    if folder is None:
        raise StageError(
            f"--resume: no usable checkpoint under {root}"
            + (f" ({len(notes)} damaged)" if notes else "")
            + f"; run `{command}` without --resume to start over"
        )
    return folder, notes


def resumable(run: RunDir, stage: str) -> bool:
    """`stage` of `run` has checkpoints its command's `--resume` can start from: folders named
    as `newest_whole` looks for them (a prefix of `CHECKPOINT_PREFIXES`, then the number)."""
    checkpoints = run.stage_dir(stage) / "checkpoints"
    return (
        stage in RESUMABLE
        and checkpoints.is_dir()
        and any(
            p.is_dir() and p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()
            for p in checkpoints.iterdir()
            for prefix in CHECKPOINT_PREFIXES
        )
    )


class StageState(NamedTuple):
    """What a stage's manifest means now: its status ('stopped' for a 'running' one whose
    process is gone), the lock's holder while it runs, and the command to type next (None when
    it completed or still runs)."""

    status: str
    holder: dict[str, Any] | None
    next: str | None


def stage_state(run: RunDir, stage: str, manifest: dict[str, Any]) -> StageState:
    status = manifest.get("status", "?")
    if status == "completed":
        return StageState(status, None, None)
    if status == "running":
        holder = lock_holder(run.path / ".lock")
        if holder is not None:
            return StageState(status, holder, None)
        status = "stopped"
    command = STAGE_COMMANDS[stage]
    if resumable(run, stage):  # stopped, killed, or failed after a checkpoint
        return StageState(status, None, f"{command} --resume")
    return StageState(status, None, command)


class StageRecord:
    """Context manager that keeps a stage's manifest true while it runs.

    Enter: take the run's lock, snapshot the recipe, point LATEST here, status `running`.
    Normal exit: `completed`. KeyboardInterrupt: `interrupted`. Any other exception: `failed`
    with the error's one-line summary. Each write is atomic; the lock is released on exit.
    Only the process that writes (the main one under several processes) takes the lock.

    Nothing is lost by a re-run that fails or is stopped before the stage starts replacing its
    outputs (`replacing()`, which each stage calls just before its first write over them): the
    stage's previous manifest comes back (a completed result stays usable, with a
    `last_attempt` note of what went wrong), and so do the run's recipe snapshot and LATEST; a
    run folder this attempt created is removed. LATEST never moves to a run with no completed
    stage, unless a stopped stage left a checkpoint to `--resume` from.
    """

    def __init__(
        self, run: RunDir, stage: str, recipe: Recipe, inputs: dict[str, Any], write: bool = True
    ):
        self.run, self.stage, self.write, self.recipe = run, stage, write, recipe
        self.dir = run.stage_dir(stage)
        self._lock: Path | None = None
        self._before: dict[str, Any] = {}
        self._replacing = False
        self.manifest: dict[str, Any] = {
            "stage": stage,
            "status": "running",
            "run": run.name,
            "started_at": now_iso(),
            "finished_at": None,
            "recipe_sha256": recipe.sha256(),
            "inputs": inputs,
            "outputs": {},
            "metrics": {},
            "warnings": [],
            "versions": package_versions(),
        }

    def save(self) -> None:
        if self.write:
            atomic_write_json(self.run.manifest_path(self.stage), self.manifest)

    def warn(self, message: str) -> None:
        if message not in self.manifest["warnings"]:
            self.manifest["warnings"].append(message)

    def previous_manifest(self) -> dict[str, Any]:
        """The stage's manifest as it was when this attempt took the lock ({}: none, or
        unreadable)."""
        try:
            earlier = json.loads(self._before.get("manifest") or b"{}")
        except ValueError:
            return {}
        return earlier if isinstance(earlier, dict) else {}

    def replacing(self) -> None:
        """From here on the stage writes over its earlier outputs: a failure is recorded as
        this stage's result."""
        self._replacing = True

    def __enter__(self) -> StageRecord:
        if self.write:
            existed = self.run.path.is_dir()
            self._lock = self.run.acquire(STAGE_COMMANDS.get(self.stage, self.stage))
            self._before = {
                "run_existed": existed,
                "manifest": _read_bytes(self.run.manifest_path(self.stage)),
                "recipe": _read_bytes(self.run.recipe_path()),
                "latest": _read_bytes(self.run.output_dir / "LATEST"),
            }
            self.run.prepare(self.recipe)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.save()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.manifest["status"] = "completed"
        elif issubclass(exc_type, KeyboardInterrupt):
            self.manifest["status"] = "interrupted"
        else:
            self.manifest["status"] = "failed"
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.manifest["error"] = f"{exc_type.__name__}: {first}"
        self.manifest["finished_at"] = now_iso()
        try:
            if exc_type is None or self._replacing or not self.write:
                self.save()
                note = f"the manifest says '{self.manifest['status']}'"
                failed = exc_type is not None and self.write
                if failed and not (self.run.completed_stages() or resumable(self.run, self.stage)):
                    _restore(self.run.output_dir / "LATEST", self._before.get("latest"))
            else:
                note = self._undo()
            if exc is not None and self.write:  # the one-line report says what became of it
                exc.manifest_note = note  # type: ignore[union-attr]
        finally:
            if self._lock is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._lock)

    def _undo(self) -> str:
        """A failed or stopped attempt that replaced nothing: the state before it comes back;
        what became of the manifest, for the one-line report."""
        before = self._before
        _restore(self.run.output_dir / "LATEST", before["latest"])
        if not before["run_existed"]:
            import shutil

            shutil.rmtree(self.run.path, ignore_errors=True)
            return "no run was changed"
        _restore(self.run.recipe_path(), before["recipe"])
        if before["manifest"] is None:
            self.save()  # no earlier result: the attempt's own failure is what there is
            return f"the manifest says '{self.manifest['status']}'"
        try:
            previous = json.loads(before["manifest"])
            previous["last_attempt"] = {
                k: self.manifest.get(k) for k in ("status", "error", "started_at", "finished_at")
            }
            atomic_write_json(self.run.manifest_path(self.stage), previous)
        except (ValueError, AttributeError, TypeError):
            _restore(self.run.manifest_path(self.stage), before["manifest"])
        return "the stage's earlier state is kept"


def recipe_near(path: Path | None) -> Path | None:
    """The recipe snapshot of the run a checkpoint or file lives in (`<run>/recipe.yaml`, beside
    which `<output_dir>/LATEST` exists), or None."""
    if path is None:
        return None
    for folder in [path.resolve(), *path.resolve().parents]:
        if (folder / "recipe.yaml").is_file() and folder.parent.joinpath("LATEST").exists():
            return folder / "recipe.yaml"
    return None


REPEAT_S = 2.0  # a second signal sooner than this after the first is the same Ctrl-C


@dataclass
class StopRequest:
    """A Ctrl-C / SIGTERM seen by `graceful_stop`, and the newest checkpoint since."""

    requested: bool = False
    saved: str | None = None  # "checkpoint-4 (step 4)", for the last message
    at: float = 0.0  # time.monotonic() of the signal


@contextlib.contextmanager
def graceful_stop(console: Any, unit: str) -> Iterator[StopRequest]:
    """The first SIGINT / SIGTERM asks the training loop to stop after this `unit` (iteration,
    step) and its checkpoint; a second stops at once. A signal within `REPEAT_S` seconds of the
    first counts as the same one: a launcher (torchrun, `accelerate launch`) forwards the
    terminal's Ctrl-C to workers that got it already. The loop sets `saved` to the newest
    checkpoint it wrote, so the KeyboardInterrupt can say what was saved."""
    flag = StopRequest()

    def handler(signum: int, frame: Any) -> None:
        if flag.requested and time.monotonic() - flag.at < REPEAT_S:
            return
        if flag.requested:
            newest = flag.saved or "none from this session"
            raise KeyboardInterrupt(f"stopped at once; the newest checkpoint is {newest}")
        flag.requested, flag.at = True, time.monotonic()
        console.print(
            f"\n[yellow]stopping[/]: finishing this {unit} and writing a checkpoint "
            "(press Ctrl-C again to stop at once)"
        )

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)
