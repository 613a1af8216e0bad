"""kiln.local_sgd.LocalSGD over two gloo processes (one launch, local_sgd_worker.py): it matches
the local SGD loop written with torch.distributed alone, averages only every few steps, and with
enabled=False trains as plain DDP."""

import os
from pathlib import Path

import pytest
import torch

from local_launch import launch

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run's record per process: [rank 0's, rank 1's]."""
    out = tmp_path_factory.mktemp("local_sgd") / "seen"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    done = launch([str(HERE / "local_sgd_worker.py"), "--out", str(out)], 2, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    seen = [torch.load(f"{out}.{rank}.pt") for rank in range(2)]
    return {name: [seen[0][name], seen[1][name]] for name in seen[0]}


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


# After which of the 8 micro-batches the processes hold the same parameters: local_sgd_steps=3
# averages after 3 and 6; with accumulation over 2, the optimizer steps after even micro-batches
# and local_sgd_steps=4 averages after 4 and 8 (1 and 5 follow no step: still equal).
@pytest.mark.parametrize("run, equal_after", [("kiln_local", {3, 6}), ("kiln_local_accumulate", {1, 4, 5, 8})])
def test_processes_agree_right_after_each_average_and_differ_between(runs, run, equal_after):
    first, second = runs[run]
    for step in range(1, 9):
        same = torch.equal(first["params"][step - 1], second["params"][step - 1])
        # Between averages each process stepped on its own gradients: none were all-reduced.
        assert same == (step in equal_after), (run, step)
    assert torch.equal(first["final"], second["final"])  # leaving the block averages once more
    assert not torch.equal(first["final"], first["params"][0])


@pytest.mark.parametrize("kiln, plain", [("kiln_local", "plain_local"),
                                         ("kiln_local_accumulate", "plain_local_accumulate")])
def test_local_sgd_matches_the_plain_torch_distributed_loop(runs, kiln, plain):
    for rank in range(2):
        ours, theirs = runs[kiln][rank], runs[plain][rank]
        assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]))
        assert_close(ours["params"], theirs["params"])
        assert_close(ours["final"], theirs["final"])


def test_disabled_local_sgd_trains_as_plain_ddp(runs):
    for rank in range(2):
        ours, theirs = runs["kiln_disabled"][rank], runs["plain_ddp"][rank]
        assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]))
        assert_close(ours["params"], theirs["params"])
    first, second = runs["kiln_disabled"]
    assert torch.equal(first["params"], second["params"])  # gradients all-reduced every step
    assert first["step_outside"] == ""  # disabled: step() anywhere only counts


def test_compiled_regions_ran_inside_ddp_under_local_sgd_without_recompiles(runs):
    for run in ("kiln_local", "kiln_local_accumulate", "kiln_disabled"):
        for record in runs[run]:
            assert record["compiled_calls"] > 0 and record["eager_calls"] == 0, run
            # Neither no_sync nor averaging the parameters in place changed what the graphs guard on.
            assert record["recompiles"] == 0, run


def test_step_outside_the_with_block_is_refused(runs):
    for record in runs["kiln_local"]:
        assert "outside its `with` block" in record["step_outside"]
