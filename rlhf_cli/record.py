"""A stage's record while it runs: its manifest kept true (`StageRecord`), the run's lock, and
what a manifest means now (`stage_state`: completed, running, stopped, what to type next;
`require`: an input stage's completed manifest, or the error that says what to run first).

`runs/<name>/.lock` holds the pid, start time, host and command of the process running a stage;
a lock whose process is gone (or whose pid now names a later process) is stale and taken over. A
lock taken on another host (a run directory on a shared filesystem) cannot be checked from here:
it counts as held.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from rlhf_cli.errors import StageError
from rlhf_cli.recipe import Recipe
from rlhf_cli.resume import resumable
from rlhf_cli.rundir import (
    INHERITED,
    OFFLINE_STAGES,
    STAGE_COMMANDS,
    InputRecord,
    Manifest,
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    package_versions,
)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


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
    its pid now belongs to a process started later (another program). A holder on another host
    counts as live: its pid means nothing here."""
    try:
        holder = json.loads(lock.read_text())
        pid = int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or half-written: treat as stale
    if holder.get("host", socket.gethostname()) != socket.gethostname():
        return holder
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


def acquire(run: RunDir, command: str) -> Path:
    """Take `run`'s lock file (`.lock`, holding the holder's pid), or raise StageError
    naming the holder. A lock left by a dead process is taken over."""
    run.path.mkdir(parents=True, exist_ok=True)
    lock = run.path / ".lock"
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock_holder(lock)
            if holder is not None:
                host = holder.get("host", socket.gethostname())
                elsewhere = host != socket.gethostname()
                raise StageError(
                    f"run '{run.name}' is busy: pid {holder['pid']}"
                    f"{f' on {host}' if elsewhere else ''} ({holder.get('command', '?')}, since "
                    f"{holder.get('since', '?')}) holds {lock}; wait for it to finish or stop it"
                    f"{f' (if {host} is gone, delete {lock})' if elsewhere else ''}"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as handle:
            pid = os.getpid()
            holder = {
                "pid": pid,
                "started": _process_start(pid),
                "host": socket.gethostname(),
                "command": command,
            }
            json.dump({**holder, "since": now_iso()}, handle)
        return lock
    raise StageError(f"run '{run.name}': could not take {lock}")


def require(run: RunDir, stage: str, needed_by: str) -> Manifest:
    """The completed manifest of `run`'s `stage`, or a StageError naming what to run first."""
    manifest = run.read_manifest(stage)
    command = STAGE_COMMANDS[stage]
    if manifest is None:
        raise StageError(
            f"{needed_by} needs the {stage} stage of run '{run.name}', which is "
            f"missing ({run.stage_dir(stage)}): run `{command}` first{_base_hint(run, stage)}"
        )
    state = stage_state(run, stage, manifest)
    if state.status == "completed":
        return manifest
    if state.holder is not None:
        raise StageError(
            f"{needed_by} needs the {stage} stage of run '{run.name}', which is still "
            f"running (pid {state.holder['pid']}, since {state.holder.get('since', '?')}): "
            "wait for it to finish"
        )
    if state.next != command:
        hint = f"resume it with `{state.next}`"
        if state.status == "failed":
            hint += f" (or start over with `{command}`)"
    else:
        hint = f"run `{command}` again first"
    shown = "stopped (its process is gone)" if state.status == "stopped" else f"'{state.status}'"
    raise StageError(
        f"{needed_by} needs the {stage} stage of run '{run.name}', whose status is {shown}: {hint}"
    )


def _base_hint(run: RunDir, stage: str) -> str:
    """For a missing `sft` / `rm`: the other runs that completed it, as `run.base`."""
    if stage not in INHERITED or run.base is not None:
        return ""
    for path in sorted(run.output_dir.glob(f"*/{stage}/manifest.json")):
        other = RunDir(run.output_dir, path.parent.parent.name)
        with contextlib.suppress(StageError):
            done = (other.read_manifest(stage) or {}).get("status") == "completed"
            if other.name != run.name and done:
                return f", or take it from run '{other.name}': --set run.base={other.name}"
    return ""


def policy_stage(run: RunDir) -> str:
    """The stage whose policy a run's commands take when none is named: `ppo` when the run has
    one (or no offline stage), else its offline stage (`OFFLINE_STAGES`), the newest completed
    one first: a DPO run is audited, compared and merged as a PPO run is."""
    if run.manifest_path("ppo").is_file():
        return "ppo"
    found = [(_finished(run, s), s) for s in OFFLINE_STAGES if run.manifest_path(s).is_file()]
    return max(found)[1] if found else "ppo"


def _finished(run: RunDir, stage: str) -> str:
    """When `stage` completed ('' when it did not, or its manifest is damaged)."""
    with contextlib.suppress(StageError):
        manifest = run.read_manifest(stage) or {}
        if manifest.get("status") == "completed":
            return manifest.get("finished_at") or ""
    return ""


class StageState(NamedTuple):
    """What a stage's manifest means now: its status ('stopped' for a 'running' one whose
    process is gone), the lock's holder while it runs, and the command to type next (None when
    it completed or still runs)."""

    status: str
    holder: dict[str, Any] | None
    next: str | None


def stage_state(run: RunDir, stage: str, manifest: Manifest) -> StageState:
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

    Enter: take the run's lock, snapshot the recipe, point LATEST here, status `running`, the
    crash logs of earlier attempts gone (`drop_crash_logs`).
    Normal exit: `completed`. KeyboardInterrupt: `interrupted`. Any other exception: `failed`
    with the error's one-line summary, and the stage's folder, when it is still there, as the
    exception's `log_dir` (where the CLI writes a bug's traceback). Each write is atomic; the
    lock is released on exit.
    Only the process that writes (the main one under several processes) takes the lock.

    Nothing is lost by a re-run that fails or is stopped before the stage starts replacing its
    outputs (`replacing()`, which each stage calls just before its first write over them): the
    stage's previous manifest comes back (a completed result stays usable, with a
    `last_attempt` note of what went wrong), and so do the run's recipe snapshot and LATEST; a
    run folder this attempt created is removed. LATEST never moves to a run with no completed
    stage, unless a stopped stage left a checkpoint to `--resume` from.
    """

    def __init__(
        self,
        run: RunDir,
        stage: str,
        recipe: Recipe,
        inputs: dict[str, InputRecord],
        write: bool = True,
    ):
        self.run, self.stage, self.write, self.recipe = run, stage, write, recipe
        self.dir = run.stage_dir(stage)
        self._lock: Path | None = None
        self._before: dict[str, Any] = {}
        self._replacing = False
        self._tensors: Any = None
        self.manifest: Manifest = {
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

    def previous_manifest(self) -> Manifest:
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
            self._lock = acquire(self.run, STAGE_COMMANDS.get(self.stage, self.stage))
            self._before = {
                "run_existed": existed,
                "manifest": _read_bytes(self.run.manifest_path(self.stage)),
                "recipe": _read_bytes(self.run.recipe_path()),
                "latest": _read_bytes(self.run.output_dir / "LATEST"),
            }
            self.run.prepare(self.recipe)
            self.dir.mkdir(parents=True, exist_ok=True)
            drop_crash_logs(self.run, self.stage)
        reset_peak_memory()
        self._tensors = count_tensor_bytes(self.recipe, self.stage)
        self.save()
        return self

    def _memory(self) -> dict[str, Any]:
        """This process's measured peak beside the plan's estimate for the stage (None when
        the plan cannot read a model's config offline, or fails). The estimate only annotates
        the stage's result: whatever goes wrong in it (an architecture the meta device cannot
        build, a config without a field the plan reads) becomes a manifest warning, and never
        fails the stage, masks its own error or leaves its lock behind."""
        from rlhf_cli.plan import planned_stage_peak

        try:
            planned = planned_stage_peak(self.recipe, PLANNED.get(self.stage))
        except Exception as error:  # noqa: BLE001 - any failure of an estimate, as above
            self.warn(f"no planned peak memory: {type(error).__name__}: {error}")
            planned = None
        measured = measured_peak()
        if self._tensors is not None:  # like beside like: the RSS keeps a row of its own
            measured = {
                "peak_memory_bytes": self._tensors.peak,
                "peak_memory_kind": "cpu_tensors",
                "peak_memory_rss_bytes": measured["peak_memory_bytes"],
            }
        return {**measured, "planned_peak_bytes": planned}

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._tensors is not None:
            from rlhf_cli.tensor_peak import close_window

            close_window()
        self.manifest["metrics"] = {**self.manifest["metrics"], **self._memory()}
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
            if exc is not None and self.dir.is_dir():  # where a bug's traceback goes (cli.py)
                exc.log_dir = self.dir  # type: ignore[union-attr]
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


CRASH_LOGS = ("error.log", "error.rank*.log")  # the names `errors.crash_log_name` gives


def drop_crash_logs(run: RunDir, stage: str) -> None:
    """The tracebacks of a stage's earlier attempts, removed as it starts again: every crash log
    in its folder, and those in the run's folder (a bug before its record opened) whose first
    line names its command. A log then stays only beside the attempt that wrote it, never
    beside a later result."""
    command = STAGE_COMMANDS.get(stage, stage)
    for folder, every in ((run.stage_dir(stage), True), (run.path, False)):
        for pattern in CRASH_LOGS:
            for log in folder.glob(pattern):
                if every or _written_by(log, command):
                    log.unlink(missing_ok=True)


def _written_by(log: Path, command: str) -> bool:
    """Whether a crash log's first line (`<time> rlhf <command>: <argv>`, `write_crash_log`)
    names `command` (`rlhf sft`)."""
    first = (_read_bytes(log) or b"").split(b"\n", 1)[0].decode(errors="replace")
    return first.split(" ", 1)[-1].startswith(f"{command}:")


PLANNED = {
    "sft": "sft",
    "rm": "train-rm",
    "ppo": "ppo",
    "dpo": "dpo",
    "kto": "kto",
    "orpo": "orpo",
    "simpo": "simpo",
    "audit": "audit",
    "merged": "merge",
}


def reset_peak_memory() -> None:
    """Start CUDA's peak counters at this stage (the CPU's peak RSS is the process's)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def count_tensor_bytes(recipe: Recipe, stage: str) -> Any:
    """A stage the plan sizes, on the CPU, in one process, with no vLLM engine in it: the
    live-tensor counter (`tensor_peak`, counting from now), whose peak is what the plan models;
    else None (CUDA counts its own; a vLLM engine's ops and the shards of several processes are
    not counted, so those runs keep the RSS alone)."""
    import torch

    if stage not in PLANNED or torch.cuda.is_available():
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    if "vllm" in (recipe.ppo.generation.backend, recipe.audit.generation.backend):
        return None
    from rlhf_cli.tensor_peak import open_window

    return open_window()


def measured_peak() -> dict[str, Any]:
    """`peak_memory_bytes`: torch's `max_memory_allocated` on CUDA (with `reserved` beside),
    else the process's peak resident set (`resource.getrusage`, Linux's kilobytes)."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(),
            "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
            "peak_memory_kind": "cuda_allocated",
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_memory_bytes": rss, "peak_memory_kind": "cpu_rss"}


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
