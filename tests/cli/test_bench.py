"""Tests for `kiln bench` (kiln/cli/bench.py) and the benchmark package behind it (kiln/bench/):
planning, the target ratios and the report, on made-up rows. The rows that run for real (child
processes, backend aot_eager, the tiny model: a few seconds a row) are in test_bench_rows.py and
test_bench_warm_start.py, two modules so that parallel workers can take them side by side.
"""

import importlib.util

import pytest

from bench_helpers import HAVE_ACCELERATE
from kiln.bench.plan import PLANS, Row, build_rows
from kiln.bench.report import combine_repeats, results_table, target_checks, write_results
from kiln.bench.run import run_rows
from kiln.cli import main

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_bench_list_prints_the_default_cpu_plan_without_measuring(capsys):
    assert main(["bench", "--device", "cpu", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("[")]
    assert len(rows) == len(build_rows("cpu", device="cpu", with_accelerate=HAVE_ACCELERATE))
    assert rows[0].startswith("[1/") and "eager small infer b1" in rows[0]


@pytest.mark.parametrize("flags, message", [
    (["--methods", "regionl"], "unknown method 'regionl'; choose from: eager, full, regional"),
    (["--models", "70b"], "unknown model '70b'"),
    (["--backend", "indutor"], "unknown backend 'indutor'"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bench_rejects_bad_names_with_the_choices(flags, message, capsys):
    assert main(["bench", "--device", "cpu", "--list", *flags]) == 2
    assert message in capsys.readouterr().err


def test_plans_expand_to_rows_and_flags_replace_lists_in_every_group():
    rows = build_rows("gpu", device="cuda")
    assert rows[0] == Row(model="1b", workload="infer", batch=4, seq=256, method="eager", device="cuda",
                          dtype="bfloat16", steps=20)
    assert any(r.mode == "reduce-overhead" and r.batch == 1 for r in rows)
    assert not any(r.method == "eager" and r.mode != "default" for r in rows)
    assert {r.model for r in rows} == {"1b", "3b", "8b"}
    only = build_rows("cpu", device="cpu", batches=[4], methods=["full", "regional"], with_accelerate=False)
    assert {(r.method, r.batch) for r in only} == {("full", 4), ("regional", 4)}
    assert len(only) == len(set(only)) == 6  # small infer and train, medium infer; duplicates dropped
    assert not any(r.method.startswith("accelerate") for r in build_rows("tiny", device="cpu", with_accelerate=False))
    with pytest.raises(ValueError, match="unknown plan 'gpu9'; choose one of: cpu"):
        build_rows("gpu9", device="cpu")
    assert set(PLANS) >= {"cpu", "tiny", "gpu"}


def test_rows_past_the_budget_are_skipped_not_run():
    rows = build_rows("tiny", device="cpu", methods=["eager"])
    results = run_rows(rows, budget_s=0)
    assert all(r["skipped"].startswith("budget of 0 s") for r in results)


def fake_row(method, compile_s, steady_ms, peak, batch=4, workload="train", mode="default"):
    return dict(model="small", workload=workload, batch=batch, seq=64, method=method, mode=mode,
                compile_s=compile_s, steady_ms=steady_ms, peak_mib=peak, steady_peak_mib=peak - 10,
                compiled_frames_per_step=0 if method == "eager" else 4)


def test_target_checks_compare_rows_of_the_same_case_and_say_met_or_missed():
    rows = [fake_row("eager", 0.0, 40.0, 380), fake_row("full", 40.0, 30.0, 500),
            fake_row("regional", 20.0, 30.3, 520), fake_row("accelerate-regional", 50.0, 31.0, 510),
            fake_row("regional", 10.0, 9.0, 450, batch=1), fake_row("full", 30.0, 6.0, 460, batch=1)]
    checks = {(c["target"].split()[1], c["batch"]): c for c in target_checks(rows)
              if c["target"] != "regional compile / full compile"}
    assert checks[("compile", 4)]["ratio"] == 0.4 and checks[("compile", 4)]["verdict"] == "met"
    versus_full = {c["batch"]: c for c in target_checks(rows) if c["target"] == "regional compile / full compile"}
    assert versus_full[4]["ratio"] == 0.5 and versus_full[4]["verdict"] == "met"  # 20 s / 40 s <= 0.6
    assert versus_full[1]["ratio"] == 0.333 and versus_full[1]["verdict"] == "met"
    assert checks[("steady", 4)]["verdict"] == "met"  # 30.3 / 30.0 = 1.01
    assert checks[("peak", 4)]["ratio"] == 1.04 and checks[("peak", 4)]["verdict"] == "met"
    assert ("steady", 1) not in checks  # the step target starts at batch 4
    rows[2]["steady_ms"] = 33.0
    assert {c["verdict"] for c in target_checks(rows) if "steady" in c["target"]} == {"missed"}


def test_results_table_shows_speedup_errors_and_skipped_rows():
    rows = [fake_row("eager", 0.0, 40.0, 380), fake_row("regional", 20.0, 20.0, 400),
            dict(fake_row("full", 0, 0, 0), error="TimeoutExpired: child\nmore"),
            dict(model="small", workload="train", batch=16, seq=64, method="full", skipped="budget spent")]
    table = results_table(rows)
    assert "| small | train | 4 x 64 | regional | 20.0 | 20.00 | 2.00x | 400 | 390 | 4 |" in table
    assert "| full | error: TimeoutExpired: child |" in table and "more" not in table
    assert "| small | train | 16 x 64 | full | budget spent |" in table


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_write_results_draws_compile_and_speedup_plots(tmp_path):
    rows = [fake_row("eager", 0.0, 40.0, 380), fake_row("full", 40.0, 30.0, 500),
            fake_row("regional", 20.0, 30.3, 520), fake_row("regional", 9.0, 12.0, 450, batch=1, mode="reduce-overhead"),
            fake_row("eager", 0.0, 14.0, 440, batch=1)]
    text, files = write_results(rows, tmp_path, "demo")
    names = sorted(f.name for f in files)
    assert names == ["demo.jsonl", "demo.md", "demo_compile.png", "demo_speedup.png", "demo_targets.json"]
    assert (tmp_path / "demo_speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert "regional [reduce-overhead]" in text


def test_repeated_runs_combine_to_their_median_and_keep_the_spread():
    runs = [fake_row("regional", c, s, 400) for c, s in ((20.0, 30.0), (22.0, 25.0), (21.0, 40.0))]
    runs.append(dict(fake_row("full", 0, 0, 0), error="boom"))
    (regional, full) = combine_repeats(runs)
    assert regional["runs"] == 3 and regional["steady_ms"] == 30.0 and regional["compile_s"] == 21.0
    assert regional["steady_ms_runs"] == [30.0, 25.0, 40.0]
    assert "3: 25.00-40.00, 20.0-22.0 |" in results_table([regional, full])
    assert full["error"] == "boom"


def test_both_resume_rows_are_held_to_the_resume_target_against_the_cold_row():
    from kiln.bench.warm_start import target_checks

    rows = [dict(variant=variant, first_s=first_s, compile_s=first_s - 0.01, losses=[1.0])
            for variant, first_s in (("cold", 10.0), ("resume-fresh-machine", 1.5),
                                     ("resume-fresh-machine-precompiled", 2.5))]
    checks = {c["target"]: (c["value"], c["met"]) for c in target_checks(rows)}
    assert checks == {"warm start: resume-fresh-machine / cold <= 0.2": (0.15, True),
                      "warm start: resume-fresh-machine-precompiled / cold <= 0.2": (0.25, False)}


def test_a_warm_variant_without_its_cold_row_is_an_error_not_a_cold_start():
    (result,) = run_rows([Row(model="tiny", workload="train", batch=2, seq=32, method="regional",
                              suite="warm-start", variant="warm")])
    assert "no cold row of this case ran before it" in result["error"]


def _startup_row(variant, first_s, t400_s, steady_ms=20.0, **extra):
    return dict(model="small", variant=variant, first_s=first_s, overhead_s=round(first_s - steady_ms / 1e3, 3),
                first_from_start_s=first_s + 4, t20_s=5.0, t100_s=7.0, t400_s=t400_s, t500_s=t400_s + 2,
                steady_ms=steady_ms, backend="inductor", device="cpu", **extra)


def test_startup_targets_are_ratios_of_rows_in_the_same_run():
    from kiln.bench import startup

    rows = [_startup_row("eager", 0.04, 15.0), _startup_row("regional-cold", 18.02, 30.0, ran="jit", traces=1),
            _startup_row("precompiled-warm", 1.82, 15.0, ran="precompiled", traces=0),
            _startup_row("background-cold", 0.10, 24.0, ran="precompiled+eager", traces=0, switch_step=900,
                         t2000_s=60.0)]
    checks = {c["target"]: (c["value"], c["met"]) for c in startup.target_checks(rows)}
    assert checks == {"small: precompiled-warm overhead / regional-cold overhead <= 0.1": (0.1, True),
                      "small: background-cold first step / eager first step <= 2.0": (2.5, False),
                      "small: background-cold time to 400 steps / regional-cold's <= 0.85": (0.8, True)}
    table = startup.table(rows)
    assert "| small | background-cold | 0.10 | 0.08 | 5.00 | 7.00 | 24.00 | 26.00 | 60.00 | 20.0 | precompiled+eager | 0 | 900 |" in table
    assert "| small | eager | 0.04 | 0.02 | 5.00 | 7.00 | 15.00 | 17.00 | - | 20.0 | - | - | - |" in table


def test_side_by_side_targets_set_each_parallel_row_beside_its_serial_row():
    from kiln.bench import startup

    def row(model, variant, overhead, cpu):
        return dict(model=model, variant=variant, two_overhead_s=overhead, cpu_two_s=cpu, first_s=overhead,
                    overhead_s=overhead, steady_ms=80.0, backend="inductor", device="cpu")

    rows = [row("unet2d", "full-cold", 100.0, 150.0), row("unet2d", "default-cold", 80.0, 110.0),
            row("unet2d", "parallel-default-cold", 58.0, 110.0), row("small6", "accelerate-regional", 20.0, 30.0),
            row("small6", "regional-cold", 14.0, 28.0), row("small6", "parallel-cold", 14.5, 35.0)]
    checks = {c["target"]: (c["value"], c["met"]) for c in startup.target_checks(rows)}
    assert checks == {
        "unet2d: default-cold compile to step 2 / full-cold's <= 0.6": (0.8, False),
        "unet2d: parallel-default-cold compile to step 2 / full-cold's <= 0.6": (0.58, True),
        "unet2d: parallel-default-cold CPU seconds to step 2 / default-cold's <= 1.15": (1.0, True),
        "small6: regional-cold compile to step 2 / accelerate-regional's <= 0.55": (0.7, False),
        "small6: parallel-cold compile to step 2 / accelerate-regional's <= 0.55": (0.725, False),
        "small6: parallel-cold CPU seconds to step 2 / regional-cold's <= 1.15": (1.25, False)}
    assert "| unet2d | parallel-default-cold | 58.00 | 110.0 | - | - |" in startup.side_by_side_table(rows)
    # Repeated (kiln bench --repeat 3), a variant's ratio is that of its runs' medians.
    repeated = rows + [row("unet2d", "parallel-default-cold", 70.0, 120.0), row("unet2d", "parallel-default-cold", 40.0, 90.0)]
    checks = {c["target"]: c["value"] for c in startup.target_checks(repeated)}
    assert checks["unet2d: parallel-default-cold compile to step 2 / full-cold's <= 0.6"] == 0.58
    assert checks["unet2d: parallel-default-cold CPU seconds to step 2 / default-cold's <= 1.15"] == 1.0


def test_busy_machine_targets_compare_background_with_blocking_at_2000_steps():
    from kiln.bench import startup

    rows = [_startup_row("busy-regional-cold", 30.0, 60.0, ran="jit", traces=1, t2000_s=200.0),
            _startup_row("busy-background-cold", 0.2, 70.0, ran="jit+eager", traces=2, switch_step=150,
                         t2000_s=190.0)]
    checks = {c["target"]: (c["value"], c["met"]) for c in startup.target_checks(rows)}
    assert checks == {"small: busy-background-cold time to 2000 steps / busy-regional-cold's <= 1.0": (0.95, True),
                      "small: busy-background-cold runs compiled code before step 2000": (150, True)}
    never = [rows[0], {**rows[1], "switch_step": None, "ran": "eager"}]
    checks = {c["target"]: c["met"] for c in startup.target_checks(never)}
    assert checks["small: busy-background-cold runs compiled code before step 2000"] is False


def test_busy_rows_run_beside_a_process_that_takes_a_core(monkeypatch):
    import subprocess

    from kiln.bench import startup

    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, args, **kwargs):
            started.append(args)
            super().__init__(args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    seen = {}
    monkeypatch.setattr(startup, "_measure", lambda row, start, variant: seen.update(variant=variant) or {"ok": 1})
    assert startup.measure({"variant": "busy-background-cold"}) == {"ok": 1}
    assert seen["variant"] == "background-cold" and started[0][1:] == ["-c", "while True: pass"]


def test_local_processes_targets_subtract_the_eager_rows_cpu_at_the_same_process_count():
    from kiln.bench import local_processes

    def row(variant, processes, cpu_s, first_s):
        return dict(model="small", variant=variant, processes=processes, cpu_s=cpu_s, first_s=first_s,
                    process_s=cpu_s / 2, ran=None if variant == "eager" else "jit", traces=[1] * processes)

    rows = [row("eager", 1, 9.0, 0.04), row("regional-cold", 1, 39.0, 17.0), row("precompiled-cold", 1, 39.0, 17.0),
            row("eager", 2, 15.0, 0.06), row("regional-cold", 2, 54.0, 20.0), row("precompiled-cold", 2, 60.0, 21.0)]
    checks = {c["target"]: (c["value"], c["met"]) for c in local_processes.target_checks(rows)}
    assert checks == {
        "small: regional-cold compile CPU-seconds, 2 processes / 1 process": (1.3, None),
        "small: precompiled-cold compile CPU-seconds, 2 processes / 1 process <= 1.3": (1.5, False),
        "small: 2 processes, precompiled-cold first step / regional-cold's <= 1.0": (1.05, False)}
    assert "| small | precompiled-cold | 2 | 30.0 | 60.0 | 45.0 | 21.00 | jit | [1, 1] |" in local_processes.table(rows)


def test_processes_is_refused_outside_the_local_processes_plan(capsys):
    assert main(["bench", "--device", "cpu", "--plan", "tiny", "--processes", "2", "--list"]) == 2
    assert "--processes applies to the local-processes plan" in capsys.readouterr().err


def test_a_suite_report_names_each_kind_of_model_it_measured():
    from kiln.bench.report import describe_suite_run

    rows = [dict(model="unet2d", workload="train", batch=2, dtype="float32", backend="inductor", torch="2.13.0",
                 device="cpu", threads=2, variant="full-cold"),
            dict(model="small6", workload="train", batch=4, dtype="float32", backend="inductor", torch="2.13.0",
                 device="cpu", threads=2, variant="regional-cold")]
    text = describe_suite_run(rows)
    assert text.startswith("Llama-style causal LM `small6` and diffusers UNet `unet2d` with random weights")
    assert describe_suite_run(rows[1:]).startswith("Llama-style causal LM `small6` with random weights")
