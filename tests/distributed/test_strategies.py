"""Two processes over gloo, started as a launcher starts them (local_launch.py): DDP, FSDP2 and
DeepSpeed ZeRO with regional compile, compared against one process on the same global batch, and
resumed from checkpoints."""

import json
import os
import shutil
from pathlib import Path

import pytest

from local_launch import launch, run_plain

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_worker(tmp_path, processes, *args, env=None):
    """The worker's result; `env` (default: this process's) less any KILN_ setting but the cache folder and
    the signing key."""
    out = tmp_path / f"result_{processes}.json"
    kept = ("KILN_COMPILE_CACHE_DIR", "KILN_COMPILE_SIGNING_KEY")
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("KILN_") or k in kept}
    env["PYTHONPATH"] = str(ROOT)
    done = start(processes, "--out", str(out), *args, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def start(processes, *args, env, timeout):
    """train_worker.py with `args`: one process, or a group of `processes` (local_launch.py)."""
    command = [str(HERE / "train_worker.py"), *args]
    if processes > 1:
        return launch(command, processes, env=env, timeout=timeout)
    return run_plain(command, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """run_worker for runs that write nothing but their result: the same arguments run once per
    module (the single-process baselines are shared by every strategy's comparison)."""
    results = {}

    def run(processes, *args):
        key = (processes, *args)
        if key not in results:
            results[key] = run_worker(tmp_path_factory.mktemp("run"), processes, *args)
        return json.loads(json.dumps(results[key]))  # a copy: no test changes another's

    return run


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_ddp_regional_compile_matches_one_process_on_the_same_global_batch(shared_run, precision):
    single = shared_run(1, "--precision", precision)
    double = shared_run(2, "--precision", precision)
    assert double["processes"] == 2 and double["distributed_type"] == "MULTI_CPU"
    assert len(double["losses"]) == len(single["losses"]) == 2
    tolerance = 1e-5 if precision == "no" else 2e-2
    for a, b in zip(single["losses"], double["losses"]):
        assert abs(a - b) <= tolerance * max(1.0, abs(a)), (single["losses"], double["losses"])
    assert all(calls > 0 for calls in double["calls"])  # compiled code ran on every rank
    first, second = double["checksums"]
    assert first == second  # DDP kept the replicas identical
    if precision == "no":  # bf16 rounding differs with the batch split; the losses above cover it
        assert abs(first - single["checksums"][0]) < 1e-3


@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "iterable"])
def test_gather_for_metrics_returns_exactly_the_dataset(shared_run, stream):
    # 10 samples, batches of 3, 2 processes: the last round is filled with 2 repeated samples.
    result = shared_run(2, "--precision", "no", *(["--eval-stream"] if stream else []))
    assert sorted(result["eval"]) == [float(i) for i in range(10)]


@pytest.mark.parametrize("stateful", [False, True])
def test_resume_in_a_fresh_launch_continues_the_same_losses(tmp_path, stateful):
    common = ["--epochs", "2", "--shuffle"] + (["--stateful"] if stateful else [])
    # Uninterrupted, but for a save after step 1 (which changes nothing), which a fresh launch resumes
    # (one launch fewer than stopping a second run at the save; test_restarts kills runs for real).
    whole = run_worker(tmp_path, 2, *common, "--save-at", "1", "--keep-training")
    assert len(whole["losses"]) == 4
    assert (tmp_path / "ckpt/kiln_checkpoint.json").is_file()
    resumed = run_worker(tmp_path, 2, *common, "--resume-from", str(tmp_path / "ckpt"))
    assert len(resumed["losses"]) == 3
    for a, b in zip(resumed["losses"], whole["losses"][1:]):
        assert abs(a - b) < 1e-5, (resumed["losses"], whole["losses"])
    assert resumed["checksums"][0] == resumed["checksums"][1]


@pytest.mark.parametrize("precision, checkpointing", [("no", False), ("bf16", True)])
def test_fsdp2_regional_compile_matches_one_process(tmp_path, shared_run, precision, checkpointing):
    single = shared_run(1, "--precision", precision)
    extra = ["--activation-checkpointing"] if checkpointing else []
    sharded = run_worker(tmp_path, 2, "--precision", precision, "--fsdp", "--save-model", str(tmp_path / "weights"),
                         *extra)
    assert sharded["distributed_type"] == "FSDP"
    tolerance = 1e-5 if precision == "no" else 2e-2  # bf16: as DDP's (the batch split changes roundings)
    for a, b in zip(single["losses"], sharded["losses"]):
        assert abs(a - b) <= tolerance * max(1.0, abs(a)), (single["losses"], sharded["losses"])
    assert all(calls > 0 for calls in sharded["calls"])
    assert sharded["checksums"][0] == sharded["checksums"][1]
    assert sharded["keys"] == single["keys"]  # consolidated weights under the plain model's names
    from kiln import load_model
    from toy_models import Regressor
    load_model(Regressor(), tmp_path / "weights")  # strict: every key present, shapes right
    if precision == "no":
        assert abs(sharded["checksums"][0] - single["checksums"][0]) < 1e-3


@pytest.fixture(scope="module")
def precompiled_by_one_process(tmp_path_factory):
    """A cache folder in which one process wrote its precompiled artifacts (bf16, batch 6)."""
    folder = tmp_path_factory.mktemp("precompiled")
    env = dict(os.environ, KILN_COMPILE_CACHE_DIR=str(folder / "cache"))
    run_worker(folder, 1, "--precision", "bf16", "--precompile", env=env)
    return folder / "cache"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_precompiled_regions_in_bf16_train_like_jit_under_ddp_and_fsdp2(tmp_path, shared_run, strategy,
                                                                         precompiled_by_one_process):
    # One process writes artifacts (batch 6), then two processes start from (a copy of) that folder:
    # their batch of 3 is a new signature, compiled by one of them and loaded by the other, beside the
    # Inductor caches of the first run (which once served batch-6 code: precompiled.py). The hooks
    # of DDP and FSDP2 run around the precompiled forward.
    shutil.copytree(precompiled_by_one_process, tmp_path / "cache", symlinks=True)
    flags = ["--precision", "bf16", *(["--fsdp"] if strategy == "fsdp2" else [])]
    single = shared_run(1, "--precision", "bf16")
    env = dict(os.environ, KILN_COMPILE_CACHE_DIR=str(tmp_path / "cache"))
    double = run_worker(tmp_path, 2, *flags, "--precompile", env=env)
    for a, b in zip(single["losses"], double["losses"]):
        assert abs(a - b) <= 2e-2 * max(1.0, abs(a)), (single["losses"], double["losses"])
    assert all(n > 0 for n in double["precompiled_calls"]), double["precompile_notes"]  # ran on every rank
    assert double["precompiled_calls"] == double["calls"]
    assert double["checksums"][0] == double["checksums"][1]


def test_fsdp2_sharded_checkpoint_resumes_in_a_fresh_launch(tmp_path):
    common = ["--epochs", "2", "--shuffle", "--fsdp"]
    whole = run_worker(tmp_path, 2, *common, "--save-at", "1", "--keep-training")  # saves, trains on
    shards = sorted(p.name for p in (tmp_path / "ckpt/sharded_model_0").iterdir())
    assert any(name.endswith(".distcp") for name in shards), shards
    resumed = run_worker(tmp_path, 2, *common, "--resume-from", str(tmp_path / "ckpt"))
    for a, b in zip(resumed["losses"], whole["losses"][1:]):
        assert abs(a - b) < 1e-5, (resumed["losses"], whole["losses"])


def test_fsdp2_fp16_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    single = run_worker(tmp_path, 1, "--precision", "fp16", "--poison-step", "1")
    sharded = run_worker(tmp_path, 2, "--precision", "fp16", "--fsdp", "--poison-step", "1")
    # Only rank 0's shard held the inf; the scaler's check is reduced over the shards (DTensor),
    # so both ranks skip the same step and stay identical.
    assert single["skipped"] == [[True, False]] and sharded["skipped"] == [[True, False], [True, False]]
    assert sharded["checksums"][0] == sharded["checksums"][1]
    for a, b in zip(single["losses"], sharded["losses"]):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), (single["losses"], sharded["losses"])


LLAMA_SGD = ("--model", "llama", "--optimizer", "sgd", "--lr", "0.05")
# Accelerate's FSDP2 plugin as its docs write it (plus rank 0's weights broadcast to the others).
ACCELERATE_FSDP2 = {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap",
                    "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "FULL_STATE_DICT",
                    "cpu_ram_efficient_loading": True, "reshard_after_forward": True}


# Twenty optimizer steps of AdamW on the tiny Llama (160 samples, two epochs, two micro-batches a step).
# At lr 0.005 every layout stays within 1e-5 of the plain loop; at 0.05 two-process DDP itself drifts
# 1e-4 by step 11 and 1e-2 by step 18: Adam's update at that rate magnifies any change of summation
# order, so a longer run at that rate compares rounding, not layouts.
TWENTY_STEPS = ("--model", "llama", "--global-batch", "8", "--samples", "160", "--epochs", "2", "--constant-lr",
                "--lr", "0.005")


def assert_close(expected, got, tolerance=1e-4):
    assert len(got) == len(expected), (expected, got)
    assert all(abs(a - b) <= tolerance * max(1.0, abs(a)) for a, b in zip(expected, got)), (expected, got)


def test_ddp_with_an_outer_graph_matches_the_plain_loop(shared_run):
    """TorchDynamoPlugin(outer_graph=True) under DDP: the whole model one graph (the blocks one
    shared subgraph) inside DDP's wrapper, 20 steps of the plain single-process loop's losses."""
    plain = shared_run(1, "--plain", *TWENTY_STEPS)
    run = shared_run(2, *TWENTY_STEPS, "--outer-graph")
    assert run["distributed_type"] == "MULTI_CPU" and run["kinds"] == ["outer"]
    assert run["calls"] == [20 * 2, 20 * 2]  # one compiled call a micro-batch (two a step) on each rank
    assert_close(plain["losses"], run["losses"])


@pytest.mark.long_launches
def test_fp8_under_fsdp2_gives_ddps_numbers_with_every_block_compiled(shared_run):
    """torchao's Float8Linear sharded with FSDP2 (weights gathered, then cast to float8 inside each
    compiled block), 20 steps. DDP's numbers exactly while both round alike; after that a one-ulp
    difference of summation order (all-reduce against reduce-scatter) moves a value across an fp8
    step now and then (1e-3, like any two fp8 runs). When depends on the CPU's vector width: from
    step 7 on the machine this was written on, from step 4 on an AMD EPYC with AVX2 only (2026-12-07:
    4.7936 against 4.7912). One process differs by fp8's rounding only: the dynamic scales of the
    activations are taken over each process's own batch."""
    pytest.importorskip("torchao")
    common = (*TWENTY_STEPS, "--precision", "fp8")
    single, ddp, sharded = shared_run(1, *common), shared_run(2, *common), shared_run(2, *common, "--fsdp")
    assert sharded["distributed_type"] == "FSDP" and len(sharded["fsdp_units"]) == 4  # 3 blocks and the root
    assert all(calls > 0 for calls in sharded["calls"])
    assert_close(ddp["losses"][:3], sharded["losses"][:3], 1e-6)
    assert_close(ddp["losses"], sharded["losses"], 2e-2)
    assert_close(single["losses"], sharded["losses"], 2e-2)


@pytest.mark.long_launches
def test_fp8_under_tensor_parallel_trains_like_fp8_on_one_process_with_every_block_compiled(shared_run):
    """torchao's float8 layers split by its float8-aware styles (tp_size=2): the scales are taken
    over whole DTensors, as one process takes them; the one difference is autocast's bf16 rounding of
    the row-wise partial sums before they are added across the group (as any bf16 tensor parallel)."""
    pytest.importorskip("torchao")
    common = (*TWENTY_STEPS, "--precision", "fp8")
    single = shared_run(1, *common)
    split = shared_run(2, *common, "--parallelism", json.dumps({"tp_size": 2}))
    assert split["mesh"] == ["tp"] and all(calls > 0 for calls in split["calls"])
    assert_close(single["losses"][:1], split["losses"][:1], 1e-3)  # the same weights: bf16's rounding only
    assert_close(single["losses"], split["losses"], 3e-2)


def test_hsdp_on_four_processes_matches_the_plain_loop_and_resumes_under_tensor_parallel(tmp_path, shared_run):
    """ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): two copies, each sharded over two
    processes (FSDP2 on a 2-D mesh), every block compiled, 20 steps of the plain loop's losses; its
    shards resume on another mesh, tensor parallel on two processes, with the unbroken run's losses."""
    plain = shared_run(1, "--plain", *TWENTY_STEPS)
    hsdp = run_worker(tmp_path, 4, *TWENTY_STEPS, "--fsdp", "--parallelism",
                      json.dumps({"dp_replicate_size": 2, "dp_shard_size": 2}), "--save-at", "1", "--keep-training")
    assert hsdp["mesh"] == ["dp_replicate", "dp_shard"] and hsdp["placements"] == ["R", "S(0)"]
    assert hsdp["dp_ranks"] == [[0, 0], [0, 1], [1, 0], [1, 1]]  # (data_parallel_rank, data_parallel_shard_rank)
    assert_close(plain["losses"], hsdp["losses"])
    assert all(calls > 0 for calls in hsdp["calls"]) and len(set(hsdp["checksums"])) == 1
    resumed = run_worker(tmp_path, 2, *TWENTY_STEPS, "--parallelism", json.dumps({"tp_size": 2}),
                         "--resume-from", str(tmp_path / "ckpt"))
    assert resumed["mesh"] == ["tp"]
    assert_close(hsdp["losses"][1:], resumed["losses"], 1e-5)


@pytest.mark.long_launches
def test_tensor_parallel_alone_and_inside_fsdp2_match_the_plain_loop_and_resume_on_other_meshes(tmp_path, shared_run):
    """tp_size=2 on two processes (each block's projections split, every block compiled), and
    dp_shard_size=2 x tp_size=2 on four (FSDP2 over the shard groups of tensor-parallel blocks):
    20 steps of the plain loop's losses, clipping included; evaluation gathers each sample once; the
    2-D shards resume under FSDP2 alone on four processes (dp_shard_size=4), and on one process."""
    plain = shared_run(1, "--plain", *TWENTY_STEPS)
    tp = run_worker(tmp_path, 2, *TWENTY_STEPS, "--parallelism", json.dumps({"tp_size": 2}))
    assert tp["mesh"] == ["tp"] and tp["distributed_type"] == "MULTI_CPU" and tp["fsdp_units"] == []
    # transformers' own split (from_pretrained(tp_plan="auto", device_mesh=mesh["tp"])), taken as it is
    (tmp_path / "hf").mkdir()
    by_transformers = run_worker(tmp_path / "hf", 2, *TWENTY_STEPS, "--parallelism", json.dumps({"tp_size": 2}),
                                 "--hf-tp-plan")
    both = run_worker(tmp_path, 4, *TWENTY_STEPS, "--fsdp", "--parallelism",
                      json.dumps({"dp_shard_size": 2, "tp_size": 2}), "--save-at", "1", "--keep-training")
    assert both["mesh"] == ["dp_shard", "tp"] and both["distributed_type"] == "FSDP"
    assert both["dp_ranks"] == [[0, 0], [0, 0], [0, 1], [0, 1]]  # ranks 0-1 read one shard, 2-3 the other
    for run in (tp, by_transformers, both):
        assert_close(plain["losses"], run["losses"])
        assert all(calls > 0 for calls in run["calls"]) and len(set(run["checksums"])) == 1
        assert sorted(run["eval"]) == [float(i) for i in range(10)]
        assert run["keys"] == plain["keys"]  # get_state_dict: one whole model under the plain names
        assert abs(run["checksums"][0] - plain["checksum"]) < 1e-4 * abs(plain["checksum"])
    four = run_worker(tmp_path, 4, *TWENTY_STEPS, "--fsdp", "--parallelism", json.dumps({"dp_shard_size": 4}),
                      "--resume-from", str(tmp_path / "ckpt"))
    assert four["mesh"] == ["dp_shard"] and four["placements"] == ["S(0)"]
    assert_close(both["losses"][1:], four["losses"], 1e-5)
    alone = run_worker(tmp_path, 1, *TWENTY_STEPS, "--resume-from", str(tmp_path / "ckpt"))  # one process, no mesh
    assert_close(both["losses"][1:], alone["losses"], 1e-5)


# The same twenty steps on sequences whose labels come shifted and whose positions are given, as
# context parallelism needs them (a slice of a sequence then holds its own labels and positions).
CONTEXT_STEPS = ("--model", "llama-next", *TWENTY_STEPS[2:])


def test_context_parallel_inside_fsdp2_matches_the_plain_loop_and_resumes_on_one_process(tmp_path, shared_run):
    """dp_shard_size=2 x cp_size=2 on four processes: each pair of a cp group reads one batch and
    keeps half of every sequence (the head and tail quarters, or the middle ones), attention runs as
    ring attention over the pair inside every compiled block, and FSDP2 shards over all four (the
    flattened dp_shard_cp). 20 steps of the plain loop's losses, clipping included; evaluation
    gathers each sample once; the shards resume on one process with the unbroken run's losses."""
    plain = shared_run(1, "--plain", *CONTEXT_STEPS)
    run = run_worker(tmp_path, 4, *CONTEXT_STEPS, "--fsdp", "--parallelism",
                     json.dumps({"dp_shard_size": 2, "cp_size": 2}), "--save-at", "1", "--keep-training")
    assert run["mesh"] == ["dp_shard", "cp"] and run["distributed_type"] == "FSDP"
    assert run["dp_ranks"] == [[0, 0], [0, 0], [0, 1], [0, 1]]  # ranks 0-1 read one shard, 2-3 the other
    assert run["calls"] == [3 * 40] * 4  # every call of the 3 blocks compiled, 40 micro-batches
    assert_close(plain["losses"], run["losses"])
    assert sorted(run["eval"]) == [float(i) for i in range(10)]
    assert run["keys"] == plain["keys"] and len(set(run["checksums"])) == 1
    assert abs(run["checksums"][0] - plain["checksum"]) < 1e-4 * abs(plain["checksum"])
    alone = run_worker(tmp_path, 1, *CONTEXT_STEPS, "--resume-from", str(tmp_path / "ckpt"))
    assert_close(run["losses"][1:], alone["losses"], 1e-5)


def test_precompiled_tensor_parallel_regions_are_compiled_once_per_tensor_parallel_group(tmp_path, shared_run):
    """dp_shard_size=2 x tp_size=2 with precompiled regions: the compiled collectives call this
    process's tensor-parallel group by name, so ranks 0-1 and 2-3 cannot share code; each group
    compiles each signature once and its other member loads it, and training keeps the plain loop's
    numbers."""
    common = ["--model", "llama", "--global-batch", "8", "--samples", "32", "--constant-lr", "--lr", "0.005"]
    plain = shared_run(1, "--plain", *common)
    env = dict(os.environ, KILN_COMPILE_CACHE_DIR=str(tmp_path / "cache"))
    run = run_worker(tmp_path, 4, *common, "--fsdp", "--precompile", "--parallelism",
                     json.dumps({"dp_shard_size": 2, "tp_size": 2}), env=env)
    assert run["precompiled_calls"] == run["calls"] and all(n > 0 for n in run["calls"]), run["precompile_notes"]
    ahead = run["compiled_ahead"]
    assert ahead[0] + ahead[1] == ahead[2] + ahead[3] > 0, ahead  # the same signatures, once in each group
    assert_close(plain["losses"], run["losses"])


def test_fsdp2_as_accelerate_writes_it_trains_like_one_process_and_resumes_from_whole_files(tmp_path, shared_run):
    """Accelerate's FSDP2 fields, with regional compile: each LlamaDecoderLayer its own unit; the
    second process builds its model empty (meta) and gets the first's weights at prepare; save_state
    writes whole files (FULL_STATE_DICT), the optimizer's in the plain loop's format, and a fresh
    launch resumes from them with the unbroken run's losses."""
    common = ["--model", "llama", "--epochs", "2", "--clip", "none", "--constant-lr"]
    single = shared_run(1, *common)
    flags = [*common, "--fsdp", "--fsdp-plugin", json.dumps(ACCELERATE_FSDP2), "--empty-off-main"]
    whole = run_worker(tmp_path, 2, *flags, "--save-at", "1", "--keep-training")
    assert whole["distributed_type"] == "FSDP"
    assert whole["fsdp_units"] == ["", "model.layers.0", "model.layers.1", "model.layers.2"]
    for a, b in zip(single["losses"], whole["losses"]):  # the meta process trained on the main one's weights
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (single["losses"], whole["losses"])
    assert all(calls > 0 for calls in whole["calls"])
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "optimizer_0.bin" in files and "model_0" in files and not any(f.startswith("sharded_") for f in files)
    import torch
    saved = torch.load(tmp_path / "ckpt/optimizer_0.bin", weights_only=True)
    assert sorted(saved["state"]) == list(range(len(whole["keys"])))  # by position, one entry a parameter
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    resumed = run_worker(tmp_path, 2, *flags, "--resume-from", str(tmp_path / "ckpt"))
    for a, b in zip(resumed["losses"], whole["losses"][1:]):
        assert abs(a - b) < 1e-5, (resumed["losses"], whole["losses"])


def test_bf16_gives_the_same_numbers_under_ddp_fsdp2_and_deepspeed(shared_run):
    """mixed_precision="bf16" is autocast around fp32 weights under every strategy, the plain loop's
    arithmetic: no strategy swaps in bf16 weights or bf16 reductions that the user did not ask for."""
    pytest.importorskip("deepspeed")
    common = (*LLAMA_SGD, "--clip", "none", "--precision", "bf16")
    single, ddp = shared_run(1, *common), shared_run(2, *common)
    assert abs(single["losses"][0] - ddp["losses"][0]) <= 1e-6  # the same weights and batch at step 1
    for strategy in (("--fsdp",), ("--zero-stage", "3")):
        other = shared_run(2, *common, *strategy)
        assert all(abs(a - b) <= 1e-6 for a, b in zip(ddp["losses"], other["losses"])), (strategy, ddp, other)


def test_fsdp2_bf16_parameters_are_an_opt_in_that_changes_the_numbers(shared_run):
    """(DeepSpeed's own bf16, the other opt-in, is compared with one process above.)"""
    common = (*LLAMA_SGD, "--clip", "none", "--precision", "bf16")
    ddp, half = shared_run(2, *common), shared_run(2, *common, "--fsdp", "--fsdp-mixed-precision", "bf16")
    # bf16 weights already change the first forward; close to autocast's numbers, but not the same.
    assert half["losses"][0] != ddp["losses"][0]
    assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(ddp["losses"], half["losses"])), (ddp, half)
