"""A collective that fails because another process is gone becomes one line naming the newest
checkpoint (the two-machine run that loses a machine: tests/stages/test_two_machines.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_cli.errors import ProcessLostError
from rlhf_cli.ppo.distributed import lost_process_as_error

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[10.0.0.2]:51600. This is typically caused by a remote worker crashing. GLHF!"
)


def _raise(acc: SimpleNamespace, checkpoints: Path, exc: Exception) -> None:
    with lost_process_as_error(acc, checkpoints):
        raise exc


def test_a_lost_peer_is_one_line_naming_the_newest_checkpoint(tmp_path: Path) -> None:
    for name in ("iter_00002", "iter_00010", ".iter_00011.tmp"):
        (tmp_path / name).mkdir()
    with pytest.raises(ProcessLostError) as caught:
        _raise(SimpleNamespace(num_processes=2), tmp_path, RuntimeError(GLOO_CLOSED))
    message = str(caught.value)
    assert "\n" not in message and "gloo" not in message
    assert "gone or unreachable (Connection closed by peer [10.0.0.2]:51600)" in message
    assert "newest checkpoint is iter_00010" in message and "`rlhf ppo --resume`" in message


def test_without_a_checkpoint_the_line_says_start_again(tmp_path: Path) -> None:
    with pytest.raises(ProcessLostError, match="no checkpoint yet: .* launch again$"):
        _raise(SimpleNamespace(num_processes=2), tmp_path / "none", RuntimeError(GLOO_CLOSED))


@pytest.mark.parametrize(
    ("processes", "exc"),
    [(1, RuntimeError(GLOO_CLOSED)), (2, RuntimeError("mat1 and mat2 shapes differ"))],
)
def test_other_errors_keep_their_type(tmp_path: Path, processes: int, exc: Exception) -> None:
    with pytest.raises(RuntimeError) as caught:
        _raise(SimpleNamespace(num_processes=processes), tmp_path, exc)
    assert caught.value is exc
