"""CUDA: context parallelism through torch's own ring attention (its flash, efficient and cuDNN
handlers; Kiln adds only the CPU's), two processes over NCCL, one GPU each, regionally compiled.

Needs two CUDA GPUs (NCCL refuses two processes on one device); skipped otherwise. The oracle is
the plain single-process loop on the CPU (tests/distributed/train_worker.py --plain), as for the
CPU layouts in tests/distributed/test_strategies.py, which check the same run over gloo.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_strategies import CONTEXT_STEPS, assert_close, run_worker  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.mark.parametrize("comm_strategy", ["allgather", "alltoall"])
def test_context_parallel_on_two_gpus_matches_the_plain_loop(tmp_path, comm_strategy):
    """cp_size=2 under FSDP2 on two GPUs: fp32, so SDPA takes the efficient kernel, which torch's
    ring attention handles; 20 steps within fp32's device-to-device rounding of the CPU's loop."""
    (tmp_path / "plain").mkdir()
    plain = run_worker(tmp_path / "plain", 1, "--plain", *CONTEXT_STEPS)
    run = run_worker(tmp_path, 2, *CONTEXT_STEPS, "--fsdp", "--parallelism", '{"cp_size": 2}',
                     env=dict(os.environ, PARALLELISM_CONFIG_CP_COMM_STRATEGY=comm_strategy))
    assert run["mesh"] == ["cp"] and run["calls"] == [3 * 40] * 2
    assert_close(plain["losses"], run["losses"], 1e-3)
