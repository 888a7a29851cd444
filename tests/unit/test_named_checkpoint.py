"""`--checkpoint best | last | iter_N` (`resume.named_checkpoint`): the folder it names, and one
line (StageError, exit 2) for a name that is not there, a run with no best, and a best.json
that is damaged."""

from __future__ import annotations

import pytest

from rlhf_cli.errors import StageError
from rlhf_cli.resume import named_checkpoint


@pytest.fixture
def ppo_dir(tmp_path):
    for iteration in (5, 10):
        (tmp_path / "checkpoints" / f"iter_{iteration:05d}").mkdir(parents=True)
    return tmp_path


def test_names_resolve(ppo_dir):
    (ppo_dir / "checkpoints" / "best.json").write_text('{"checkpoint": "iter_00005"}')
    assert named_checkpoint(ppo_dir, "best") == ppo_dir / "checkpoints" / "iter_00005"
    assert named_checkpoint(ppo_dir, "iter_10") == ppo_dir / "checkpoints" / "iter_00010"
    assert named_checkpoint(ppo_dir, "10") == ppo_dir / "checkpoints" / "iter_00010"
    assert named_checkpoint(ppo_dir, "last") is None


@pytest.mark.parametrize(
    ("best", "name", "says"),
    [
        (None, "best", "names no best checkpoint: set ppo.eval_every"),
        ("{broken", "best", "best.json is damaged"),
        ('{"checkpoint": 5}', "best", "best.json is damaged"),
        ('["iter_00005"]', "best", "best.json is damaged"),
        (None, "iter_7", r"iter_00007 does not exist \(checkpoints: iter_00005, iter_00010\)"),
        (None, "newest", "--checkpoint must be best, last or iter_N"),
    ],
)
def test_a_missing_or_damaged_name_is_one_line(ppo_dir, best, name, says):
    if best is not None:
        (ppo_dir / "checkpoints" / "best.json").write_text(best)
    with pytest.raises(StageError, match=says) as error:
        named_checkpoint(ppo_dir, name)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("best", "kept"),
    [
        ('{"iteration": 5, "checkpoint": "iter_00005"}', True),
        ('{"iteration": 20, "checkpoint": "iter_00020"}', False),  # newer than the resume
        ("{broken", False),
        ('{"iteration": 5}', False),
    ],
)
def test_a_resume_takes_over_the_best_unless_newer_or_damaged(ppo_dir, best, kept):
    from rlhf_cli.stages.ppo import watch_from

    folder = ppo_dir / "checkpoints" / "iter_00010"
    (folder / "state.json").write_text('{"iteration": 10, "rollbacks": [{"iteration": 8}]}')
    (ppo_dir / "checkpoints" / "best.json").write_text(best)
    watch = watch_from(folder)
    assert watch["rollbacks"] == [{"iteration": 8}]
    assert ("best" in watch) is kept
