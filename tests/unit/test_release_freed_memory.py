"""`release_freed_memory` hands freed heap pages back to the OS: after glibc's mmap threshold has
risen (a 16 MB block freed), 300 freed 1 MB tensors behind a live one stay resident until it
is called."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhf_cli.tensor_peak import release_freed_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc_trim, read from /proc"
)


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def test_freed_heap_blocks_go_back_to_the_os() -> None:
    big = torch.ones(4 * 2**20)  # 16 MB, mmapped; freeing it raises the threshold
    del big
    blocks = [torch.ones(2**18) for _ in range(300)]  # 300 x 1 MB, now on the heap
    last = blocks[-1]  # keeps the heap's top: free() alone cannot shrink it
    del blocks
    held = resident_mib()
    release_freed_memory(every=0.0)
    assert resident_mib() < held - 200
    assert last.sum().item() == 2**18


def test_it_trims_at_most_once_every_so_many_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlhf_cli.tensor_peak as tensor_peak

    calls: list[int] = []
    monkeypatch.setattr(tensor_peak, "_libc_trim", lambda: calls.append)
    monkeypatch.setattr(tensor_peak, "_trimmed", [0.0])
    release_freed_memory(every=60.0)  # the first: long after "0"
    release_freed_memory(every=60.0)  # a moment later: skipped
    release_freed_memory(every=0.0)
    assert calls == [0, 0]
