"""Accelerate's API over two gloo processes: schedulers tick once per process, split and uneven
batches, DDP and process-group kwargs, object collectives, triggers, saving from one process, and
a profiler trace from each process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ports import free_port

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).resolve().parent


def run(tmp_path, mode):
    out = tmp_path / mode
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
    env["PYTHONPATH"] = str(HERE.parents[1])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                           str(HERE / "api_worker.py"), "--out", str(out), "--mode", mode],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]


def test_process_facts_kwargs_handlers_and_collectives(tmp_path):
    first, second = run(tmp_path, "plain")
    assert "Num processes: 2" in first["state"] and "Backend: gloo" in first["state"]
    assert "Process index: 1" in second["state"]
    # A prepared scheduler ticks once per process per optimizer step, as Accelerate's does.
    assert first["ticks"] == second["ticks"] == 6
    assert first["find_unused_parameters"] is True and first["comm_hooks"] == ["fp16_compress_hook"]
    assert first["objects"] == second["objects"] == [{"rank": 0}, {"rank": 1}]
    assert first["broadcast"] == second["broadcast"] == ["from 0", 0]
    assert first["trigger"] == second["trigger"] == [True, False]  # process 1 raised it; lowered after
    assert first["marker_existed"] is False and second["marker_existed"] is True  # rank 0 went first
    assert (tmp_path / "plain.saved.pt").is_file()
    assert first["group_after_end_training"] is False and second["group_after_end_training"] is False
    # Each process writes its own trace, named as Accelerate names it, before any leaves profile().
    assert first["traces_after_profile"] == second["traces_after_profile"] == ["profile_0.json", "profile_1.json"]
    for rank in range(2):
        trace = json.loads((tmp_path / f"plain.traces/profile_{rank}.json").read_text())
        assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])


def test_split_batches_divides_each_batch_and_ticks_once(tmp_path):
    first, second = run(tmp_path, "split")
    # Batches of 4 over 2 processes: each gets half of every batch; together, the batch.
    assert first["batches"] == [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]]
    # the short last batch (8, 9) is evened out with samples from the epoch's start
    assert second["batches"] == [[2.0, 3.0], [6.0, 7.0], [0.0, 1.0]]
    assert first["ticks"] == 3


def test_uneven_batches_train_through_join_and_evaluate_evened_out(tmp_path):
    first, second = run(tmp_path, "uneven")
    assert (first["length"], second["length"]) == (3, 2)
    assert first["batches"] == [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]] and second["batches"] == [[2.0, 3.0], [6.0, 7.0]]
    assert first["weights_equal"][0] == first["weights_equal"][1]  # the replicas stayed in step
    assert first["gathered"] == [float(i) for i in range(10)]  # every sample once
