"""Compiling side by side (kiln/compile/artifacts/compile_pool.py): a pool of helper processes
compiles distinct region groups at once, step 1 runs eagerly, training waits for the pool at its
end (parallel_compile) and runs compiled code from step 2, with a timeline of who compiled what when."""

import copy
import os

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.artifacts.background import BackgroundCompiler, default_workers
from toy_models import EncoderDecoder, train_step
from torch_features import PRECOMPILE_BACKEND

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One training run of EncoderDecoder (two region groups) with two compile workers, shared by
    the tests below: (accelerator, losses, report after each step, helper processes, plain losses)."""
    torch.manual_seed(0)
    model = EncoderDecoder()
    reference = copy.deepcopy(model)
    plugin = TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, use_regional_compilation=True,
                               cache_dir=str(tmp_path_factory.mktemp("cache")), parallel_compile=True,
                               compile_workers=2)
    acc = Accelerator(dynamo_plugin=plugin)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # These toy compiles take about a second, less than a worker's start (importing torch's
    # compiler: several seconds on a loaded 2-core machine), which a real run spends loading its
    # model and data: started first, the two jobs meet two ready workers.
    assert acc.compiler.background.pool.wait_ready(timeout=180)
    losses, reports = [], []
    for step in range(STEPS):
        losses.append(train_step(model, optimizer, step, acc))
        reports.append(acc.compile_report())
    processes = list(acc.compiler.background.processes)
    threads = torch.get_num_threads()
    acc.end_training()
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = [train_step(reference, plain_optimizer, step) for step in range(STEPS)]
    return acc, losses, reports, processes, expected, threads


def test_two_workers_each_compile_a_region_group(run):
    _, _, reports, processes, _, _ = run
    timeline = reports[-1].timeline
    assert len(processes) == 2
    assert {job["region"] for job in timeline} == {r.name for r in reports[-1].regions}
    assert len(reports[-1].regions) == 2  # EncoderBlock and DecoderBlock
    assert {job["worker"] for job in timeline} == {0, 1}, reports[-1].table()
    assert all(job["outcome"] == "compiled" and job["end"] > job["start"] >= 0 for job in timeline)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="side by side needs 2 cores")
def test_the_timeline_shows_the_groups_compiling_at_the_same_time(run):
    first, second = run[2][-1].timeline
    assert first["worker"] != second["worker"]
    assert first["start"] < second["end"] and second["start"] < first["end"], run[2][-1].table()


def test_losses_equal_the_plain_loop(run):
    _, losses, _, _, expected, _ = run
    assert losses[0] == expected[0]  # step 1 ran the blocks eagerly: the plain loop's numbers exactly
    # aot_eager from step 2: the same kernels; equal on torch 2.13, within float rounding on 2.11
    # (there the helper only fills the caches and the training process JIT-compiles: 2.4e-7 apart).
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_training_waits_after_step_1_and_runs_compiled_from_step_2(run):
    acc, _, reports, _, _, threads = run
    after_first = reports[0]
    assert after_first.compile_wait_seconds is not None and after_first.compile_wait_seconds >= 0
    for region in reports[-1].regions:
        assert region.switch_step == 1, reports[-1].table()
        # Step 1's calls (3 instances) ran eagerly; every later call ran the precompiled code.
        assert region.background_eager_calls == 3 and region.eager_calls == 3
        assert region.precompiled_calls == 3 * (STEPS - 1) and region.jit_calls == 0
        assert region.traces == 0  # the training process traced nothing: the helpers did
    assert torch.get_num_threads() == threads  # the threads it gave the helpers during step 1 came back


def test_the_report_shows_the_timeline(run):
    report = run[2][-1]
    table = report.table()
    assert "compile timeline: 2 job(s) on 2 helper process(es)" in table
    assert "training waited" in table
    assert report.side_by_side is None and "side by side:" not in table  # two groups ran at once: nothing to explain
    as_dict = report.as_dict()
    assert [job["region"] for job in as_dict["timeline"]] == [job["region"] for job in report.timeline]
    assert set(as_dict["timeline"][0]) == {"region", "signature", "digest", "worker", "start", "end", "outcome"}
    signatures = {job["region"]: job["signature"] for job in as_dict["timeline"]}
    assert signatures == {"EncoderBlock": "(4x6x16)", "DecoderBlock": "(4x6x16, 4x6x16)"}  # x, then (x, memory)


def test_the_workers_are_gone_after_end_training(run):
    processes = run[3]
    assert all(process.poll() is not None for process in processes)


# ---------------------------------------------------------------- the knob

def test_one_worker_keeps_a_single_helper(tmp_path):
    plugin = TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, use_regional_compilation=True, cache_dir=str(tmp_path),
                               compile_in_background=True, compile_workers=1)
    acc = Accelerator(dynamo_plugin=plugin)
    model = EncoderDecoder()
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    background = acc.compiler.background
    try:
        assert background.size == 1 and len(background.processes) == 1
        assert background.process is background.processes[0]
    finally:
        acc.end_training()
    assert background.processes[0].poll() is not None


def test_the_default_pool_fills_the_cores_training_leaves(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    assert default_workers(blocking=True) == cores  # training waits: every core compiles
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert default_workers(blocking=False) == 1  # training keeps all but the one core it makes room on
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert default_workers(blocking=False) == max(1, cores - 1)
    assert BackgroundCompiler("unused", workers=3).size == 3


def test_the_environment_sets_the_workers_and_parallel_compile():
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True,
                               environ={"KILN_COMPILE_WORKERS": "3", "KILN_DYNAMO_PARALLEL_COMPILE": "1"})
    assert plugin.compile_workers == 3 and plugin.parallel_compile and plugin.compile_in_background
    assert "compile_in_background=True, implied by parallel_compile=True" in plugin.notes
    assert TorchDynamoPlugin(environ={"KILN_COMPILE_WORKERS": "auto"}).compile_workers is None


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, r"compile_workers must be >= 1 .*got 0"),
    (-2, ValueError, r"compile_workers must be >= 1 .*got -2"),
    (True, TypeError, r"compile_workers must be an int >= 1 or None.*got True"),
    (1.5, TypeError, r"compile_workers must be an int >= 1 or None.*got 1.5"),
])
def test_a_bad_worker_count_is_a_clear_error(value, error, match):
    with pytest.raises(error, match=match):
        TorchDynamoPlugin(backend="aot_eager", compile_in_background=True, compile_workers=value)


def test_a_bad_worker_count_in_the_environment_names_the_variable():
    with pytest.raises(ValueError, match=r"KILN_COMPILE_WORKERS must be a whole number >= 1 or 'auto', got 'two'"):
        TorchDynamoPlugin(environ={"KILN_COMPILE_WORKERS": "two"})


def test_workers_without_a_background_compile_are_an_error():
    with pytest.raises(ValueError, match=r"compile_workers=2 .*set compile_in_background=True or parallel_compile"):
        TorchDynamoPlugin(backend="aot_eager", compile_workers=2)


def test_parallel_compile_must_be_a_bool():
    with pytest.raises(TypeError, match=r"parallel_compile must be a bool, got 'yes'"):
        TorchDynamoPlugin(backend="aot_eager", parallel_compile="yes")
