"""`kiln bench` rows that start processes with what an earlier row left: warm starts, a resume
from a precompiled checkpoint, local processes sharing one cache folder."""

import json

import pytest

from bench_helpers import read_jsonl
from kiln.cli import main

pytestmark = pytest.mark.bench_runs  # make test-bench runs them (after make test, in .ci/run)


@pytest.mark.inductor
def test_warm_start_plan_loads_the_cold_runs_entry_in_a_fresh_process(tmp_path, capsys):
    status = main(["bench", "--device", "cpu", "--plan", "warm-start", "--models", "tiny", "--variants",
                   "cold,warm", "--steps", "1", "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    cold, warm = read_jsonl(tmp_path / "kiln_bench_warm-start.jsonl")
    assert (cold["hit"], cold["saved"], warm["hit"]) == (False, True, True)
    assert warm["aotautograd_local_cache_hit_count"] > 0 and cold["aotautograd_local_cache_hit_count"] == 0
    assert warm["losses"] == cold["losses"]  # the warm code computes what the cold code did
    targets = json.loads((tmp_path / "kiln_bench_warm-start_targets.json").read_text())
    assert [t["target"] for t in targets] == ["warm start: warm / cold <= 0.25"]


def test_resume_from_a_precompiled_checkpoint_loads_every_region_with_no_trace(tmp_path, capsys):
    # cold-precompile packs what save_state would put in a checkpoint, its precompiled regions with
    # it; the resume row starts with empty caches and installs it, as load_state does.
    from torch_features import PRECOMPILE_BACKEND

    status = main(["bench", "--device", "cpu", "--plan", "warm-start", "--models", "tiny", "--backend",
                   PRECOMPILE_BACKEND, "--variants", "cold-precompile,resume-fresh-machine-precompiled",
                   "--steps", "1", "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    precompiled, resumed = read_jsonl(tmp_path / "kiln_bench_warm-start.jsonl")
    assert "error" not in resumed, resumed
    assert precompiled["bundle_bytes"] > 0 and resumed["installed_files"] > 0
    assert resumed["precompiled_loaded"] >= 1 and resumed["traces"] == 0 and resumed["compiled_calls"] > 0
    assert resumed["losses"] == precompiled["losses"]


@pytest.mark.multiprocess
def test_local_processes_plan_launches_every_process_counts_the_whole_trees_cpu_and_precompiles_by_default(tmp_path, capsys):
    status = main(["bench", "--device", "cpu", "--plan", "local-processes", "--models", "tiny", "--backend",
                   "aot_eager", "--steps", "2", "--processes", "2", "--variants", "default-cold", "--no-plots",
                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    (row,) = read_jsonl(tmp_path / "kiln_bench_local-processes.jsonl")
    # The documented settings: under DDP the regions are precompiled by default, one process compiles.
    assert (row["processes"], row["variant"], row["ran"]) == (2, "default-cold", "precompiled")
    assert sorted(row["traces"]) == [0, 1] and sorted(row["loaded"]) == [0, 1]  # one compiled, one loaded
    assert row["cpu_s"] > row["first_s"] > 0  # the launcher's and both workers' CPU time
    assert "| tiny | default-cold | 2 |" in (tmp_path / "kiln_bench_local-processes.md").read_text()
