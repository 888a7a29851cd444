"""Reading back what the trackers stored: TensorBoard event files and trackio's local database
(TRACKIO_DIR is the session's temp folder, set in tests/conftest.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

TRACKER_PROJECT = "rlhf-cli-tests"


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file under `folder`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue
                number = float(tensor_util.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, {})[event.step] = number
    return scalars


def trackio_logs(run_name: str) -> list[dict[str, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    assert run_name in SQLiteStorage.get_runs(TRACKER_PROJECT)
    return SQLiteStorage.get_logs(TRACKER_PROJECT, run_name)


def _same(a: float, b: float | None) -> bool:
    return b is None and math.isnan(a) or b is not None and math.isclose(a, b, rel_tol=1e-6)


def assert_trackers_hold(rows: list[dict[str, Any]], stage_dir: Path, run_name: str) -> None:
    """TensorBoard (`<stage>/tensorboard/`) and trackio hold every number of metrics.jsonl's
    rows, at the rows' steps."""
    import trackio

    assert trackio.context_vars.current_run.get() is None  # no exit hook left to print
    scalars = tensorboard_scalars(stage_dir / "tensorboard")
    logged = {row["step"]: row for row in trackio_logs(run_name)}
    for row in rows:
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, str):
                continue
            assert _same(scalars[key][row["step"]], value), (key, row["step"])
            assert _same(logged[row["step"]][key], value), (key, row["step"])
