"""Two gloo processes whiten advantages and compute the logged statistics over the global batch:
the numbers equal one process's on the whole batch, and differ from each shard's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import free_port
from torch.testing import assert_close

from rlhf_cli.ppo import core

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys, torch
from accelerate import Accelerator
from rlhf_cli.ppo import core
from rlhf_cli.ppo.distributed import global_sum

acc = Accelerator(cpu=True)
x, values, mask = (torch.tensor(t) for t in json.loads(open(sys.argv[1]).read()))
mask = mask.bool()
rows = slice(acc.process_index, None, acc.num_processes)  # prompt_rows' strided share
reduce_sum = global_sum(acc)
out = {
    "processes": acc.num_processes,
    "whitened": acc.gather(core.masked_whiten(x[rows], mask[rows], reduce_sum=reduce_sum)),
    "local_whitened": acc.gather(core.masked_whiten(x[rows], mask[rows])),
    "kept_mean": acc.gather(
        core.masked_whiten(x[rows], mask[rows], shift_mean=False, reduce_sum=reduce_sum)
    ),
    "explained_variance": core.explained_variance(values[rows], x[rows], mask[rows], reduce_sum),
    "mean": core.masked_mean(x[rows], mask[rows], reduce_sum=reduce_sum),
}
if acc.is_main_process:
    out = {k: v.tolist() if torch.is_tensor(v) else v for k, v in out.items()}
    open(sys.argv[2], "w").write(json.dumps(out))
"""


def test_two_processes_compute_the_global_batch_statistics(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5) * 3 + torch.arange(6).unsqueeze(1)  # shards differ in mean
    values = torch.randn(6, 5)
    mask = torch.rand(6, 5) > 0.3
    mask[:, 0] = True
    inputs, result = tmp_path / "inputs.json", tmp_path / "result.json"
    inputs.write_text(json.dumps([x.tolist(), values.tolist(), mask.int().tolist()]))
    (tmp_path / "stats.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(tmp_path / "stats.py"), str(inputs),
           str(result)]  # fmt: skip
    for _attempt in range(2):  # torchrun rarely reports a failure after both ranks finished
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if result.is_file():
            break
    assert result.is_file(), done.stdout[-2000:] + done.stderr[-2000:]
    out = json.loads(result.read_text())
    assert out["processes"] == 2

    order = [0, 2, 4, 1, 3, 5]  # rank 0's rows, then rank 1's, as gathered
    x, values, mask = x[order], values[order], mask[order]
    whole = core.masked_whiten(x, mask)
    assert_close(torch.tensor(out["whitened"]), whole, atol=1e-5, rtol=1e-5)
    kept = core.masked_whiten(x, mask, shift_mean=False)
    assert_close(torch.tensor(out["kept_mean"]), kept, atol=1e-5, rtol=1e-5)
    ev = core.explained_variance(values, x, mask)
    assert_close(torch.tensor(out["explained_variance"]), ev, atol=1e-5, rtol=1e-5)
    assert_close(torch.tensor(out["mean"]), core.masked_mean(x, mask), atol=1e-5, rtol=1e-5)
    # each shard whitened alone is not the same thing: the test can tell the two apart
    local = torch.tensor(out["local_whitened"])
    assert (local - whole).abs().max() > 0.1
