"""kiln bench --plan nd-parallel: one training job per parallel layout on local processes, tokens per
second and model state per process (kiln/bench/nd_parallel.py)."""

import pytest

from kiln.bench import build_rows
from kiln.bench.nd_parallel import VARIANTS, combine, layout, render
from kiln.bench.run import run_rows


def test_the_plan_is_each_layout_on_four_processes():
    rows = build_rows("nd-parallel", device="cpu")
    assert [r.variant for r in rows] == list(VARIANTS)
    assert {(r.model, r.workload, r.batch, r.processes, r.threads) for r in rows} == {("small", "train", 8, 4, 1)}
    assert layout("hsdp", 4) == {"dp_replicate_size": 2, "dp_shard_size": 2}
    assert layout("tp-fsdp2", 4) == {"dp_shard_size": 2, "tp_size": 2}
    assert layout("cp-fsdp2", 4) == {"dp_shard_size": 2, "cp_size": 2}


def test_the_job_is_as_slow_as_its_slowest_process_and_as_big_as_its_biggest():
    row = dict(model="small", variant="fsdp2", processes=2, batch=8, seq=64, suite="nd-parallel")
    lines = "".join(f"noise KILN_BENCH_RESULT " + str(dict(row, rank=rank, first_s=3.0 + rank, step_ms=10.0 * (rank + 1),
                                                           state_mib=1.0 + rank, rss_mib=300.0, layout={"dp_shard_size": 2}))
                    .replace("'", '"') + "\n" for rank in (1, 0))
    result = combine(lines, row)
    assert (result["step_ms"], result["first_s"], result["state_mib"]) == (20.0, 4.0, 2.0)
    assert result["tokens_per_s"] == 8 * 64 / 0.02 and result["ranks_state_mib"] == [1.0, 2.0]
    assert combine(lines.splitlines()[0], row) is None  # a process's line missing
    assert "| small | fsdp2 | dp_shard 2 | 2 |" in render([result])


@pytest.mark.bench_runs
def test_every_layout_trains_on_four_processes_and_sharding_shrinks_the_state():
    rows = build_rows("nd-parallel", device="cpu", backend="aot_eager", models=["tiny"], steps=2)
    results = {r["variant"]: r for r in run_rows(rows)}
    assert all("error" not in r for r in results.values()), {v: r.get("error") for v, r in results.items()}
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in results.values())
    # Every process of DDP holds the whole model; FSDP2 over 4 holds about a quarter of it.
    assert results["fsdp2"]["state_mib"] < 0.3 * results["ddp"]["state_mib"]
    assert results["fsdp2"]["state_mib"] < results["hsdp"]["state_mib"] < results["ddp"]["state_mib"]
    # Context parallel inside FSDP2 shards over dp_shard x cp, all four: FSDP2's state.
    assert results["cp-fsdp2"]["state_mib"] == pytest.approx(results["fsdp2"]["state_mib"], rel=0.05)
