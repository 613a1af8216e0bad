"""kiln bench --plan host-overhead: every variant of one model in one process, stepped in turn, with
ratios to the full compile and a breakdown of a regional block call (kiln/bench/host_overhead.py)."""

import pytest

from kiln.bench import PLANS, build_rows
from kiln.bench.host_overhead import VARIANTS, measure, render, target_checks


def test_the_plan_is_one_row_per_model_workload_and_batch_with_its_threads():
    rows = build_rows("host-overhead", device="cpu")
    assert {(r.model, r.workload, r.batch, r.threads) for r in rows} == {
        ("host8", "infer", 1, 1), ("host8", "train", 1, 1), ("host24", "infer", 1, 1), ("host24", "train", 1, 1),
        ("host8", "infer", 4, 2), ("host8", "train", 4, 2)}
    assert all(r.suite == "host-overhead" for r in rows)
    assert len(PLANS["host-overhead"]) == 2


@pytest.mark.bench_runs
@pytest.mark.parametrize("workload", ["infer", "train"])
@pytest.mark.filterwarnings("ignore:outer_graph='background' with backend 'aot_eager'")
def test_one_row_steps_every_variant_in_one_process_with_eagers_outputs(workload, monkeypatch):
    # The default settings' variants (regional, accelerator) switch to their outer graph before the
    # timed rounds; with aot_eager "auto" keeps per-block regions, so "background" stands in for it.
    monkeypatch.setenv("KILN_DYNAMO_OUTER_GRAPH", "background")
    row = dict(model="tiny", workload=workload, batch=1, seq=16, method="regional", mode="default",
               backend="aot_eager", device="cpu", dtype="float32", steps=4, warmup=0, seed=0, threads=1,
               suite="host-overhead", variant="", processes=1)
    result = measure(row)
    variants = [v for v in VARIANTS if v != "accelerate-regional"]
    assert set(variants) <= set(result["variants"])
    assert set(result["median_ms"]) == set(result["variants"]) == set(result["ratio_to_full"])
    assert result["ratio_to_full"]["full"] == 1.0
    assert all(diff < 1e-4 for diff in result["max_abs_diff_vs_eager"].values()), result["max_abs_diff_vs_eager"]
    # Each was stepped until its outer graph ran, before the timed rounds; per-block has none.
    assert set(result["outer_graph_switch"]) == {"regional", "accelerator"}
    assert all(s["seconds"] > 0 and s["steps"] > 0 for s in result["outer_graph_switch"].values())
    assert set(result["ratio_to_per_block"]) == {"precompiled"}
    if workload == "infer":
        b = result["breakdown"]
        assert b["blocks"] == 4 and b["block_call_us"] > 0 and b["entry_call_us"] > 0
        assert 0 < b["eager_glue_us"] < b["step_us"] and b["block_in_step_us"] > 0
        assert b["compiled_region_us"] > 0 and b["guards_us"] >= 0  # the profiler saw Dynamo's events
        assert "a regional block call" in render([result])
    else:
        assert "breakdown" not in result


def test_the_targets_are_checked_from_each_rows_own_ratios():
    row = dict(model="host8", workload="infer", batch=1, seq=16, threads=1,
               ratio_to_full={"full": 1.0, "regional": 1.47, "accelerator": 1.12, "per-block": 1.5},
               ratio_to_per_block={"precompiled": 0.96})
    checks = {c["target"].split(": ", 1)[1]: (c["value"], c["met"]) for c in target_checks([row])}
    assert checks == {"regional step / full compile's <= 1.15": (1.47, False),
                      "accelerator step / full compile's <= 1.15": (1.12, True),
                      "precompiled step / per-block (JIT) step's <= 1.0": (0.96, True)}
    assert all(c["target"].startswith("host8 infer 1x16, 1 thread(s): ") for c in target_checks([row]))
    assert target_checks([{**row, "error": "boom"}]) == []  # a failed row checks nothing


def test_the_outer_graph_plan_starts_each_way_cold_beside_regions_and_the_full_compile():
    rows = build_rows("outer-graph", device="cpu")
    assert {(r.model, r.variant) for r in rows} == {(m, v) for m in ("host8", "small6")
                                                     for v in ("full-cold", "regional-cold", "outer-cold",
                                                               "outer-background-cold")}
    assert all(r.suite == "startup" and r.workload == "train" for r in rows)
    assert {(r.model, r.batch, r.seq, r.threads) for r in rows} == {("host8", 1, 16, 1), ("small6", 4, 64, None)}
