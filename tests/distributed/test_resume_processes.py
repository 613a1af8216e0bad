"""Resuming on another number of processes than saved: 2 -> 1 and 1 -> 2, under DDP (whole
checkpoints) and FSDP2 (DCP shards, read as whole weights on one process and resharded from whole
weights on two), and DeepSpeed ZeRO-3 2 -> 3 (through DeepSpeed's universal checkpoint). The
remaining losses and the final weights equal the uninterrupted run's."""

import shutil

import pytest
import torch

from test_strategies import run_worker

pytestmark = pytest.mark.multiprocess


def resume_across(tmp_path, saved_on, resumed_on, common):
    """Train to step 1 on `saved_on` processes, save, and finish on `resumed_on` processes."""
    folder = tmp_path / f"save{saved_on}"
    folder.mkdir()
    run_worker(folder, saved_on, *common, "--save-at", "1")
    return run_worker(folder, resumed_on, *common, "--resume-from", str(folder / "ckpt"),
                      "--save-weights", str(folder / "resumed.pt"))


def assert_continues(whole, resumed, whole_weights, resumed_weights):
    assert len(resumed["losses"]) == len(whole["losses"]) - 1 == 3
    for a, b in zip(resumed["losses"], whole["losses"][1:]):
        assert abs(a - b) < 1e-5, (resumed["losses"], whole["losses"])
    final, expected = torch.load(resumed_weights), torch.load(whole_weights)
    assert final.keys() == expected.keys()
    assert max((final[k] - expected[k]).abs().max().item() for k in final) < 1e-5


# DDP: batches dealt per process (3 each on 2 processes, 6 on one: the same global batch of 6), a
# constant rate (a prepared scheduler's pace follows the number of processes; FSDP2 below covers
# schedules). FSDP2: split batches, whose scheduler ticks once per step on any number of processes.
STRATEGIES = {"ddp": ["--constant-lr"], "fsdp2": ["--fsdp", "--split-batches"]}


def common_args(strategy):
    return ["--epochs", "2", "--shuffle", "--stateful", *STRATEGIES[strategy]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per strategy: a 2-process run, uninterrupted but for a save after step 1 (which changes
    nothing), its folder holding that checkpoint (ckpt/) and the final weights (whole.pt); made once."""
    runs = {}

    def run(strategy):
        if strategy not in runs:
            folder = tmp_path_factory.mktemp(f"whole_{strategy}")
            result = run_worker(folder, 2, *common_args(strategy), "--save-at", "1", "--keep-training",
                                "--save-weights", str(folder / "whole.pt"))
            runs[strategy] = (result, folder)
        return runs[strategy]

    return run


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_resume_on_another_number_of_processes_continues_the_same_run(tmp_path, strategy, uninterrupted):
    common = common_args(strategy)
    whole, saved = uninterrupted(strategy)
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)  # the checkpoint the run on 1 process resumes
    assert len(whole["losses"]) == 4

    fewer = run_worker(tmp_path, 1, *common, "--resume-from", str(tmp_path / "ckpt"),
                       "--save-weights", str(tmp_path / "fewer.pt"))
    assert fewer["processes"] == 1
    assert fewer["load_report"]["saved_processes"] == 2
    assert fewer["load_report"]["rng_restored"] == [0] and fewer["load_report"]["rng_derived"] == []
    assert fewer["load_report"]["data"] == []  # the same global batch: positions carry over as saved
    assert_continues(whole, fewer, tmp_path / "whole.pt", tmp_path / "fewer.pt")

    more = resume_across(tmp_path, 1, 2, common)
    assert more["distributed_type"] == ("FSDP" if strategy == "fsdp2" else "MULTI_CPU")
    assert more["load_report"]["rng_restored"] == [0] and more["load_report"]["rng_derived"] == [1]
    assert more["checksums"][0] == more["checksums"][1]
    assert_continues(whole, more, tmp_path / "whole.pt", tmp_path / "save1/resumed.pt")
    if strategy == "fsdp2":  # two processes wrote shards, one read them whole; one wrote whole files, two sharded them
        assert (tmp_path / "ckpt/sharded_model_0/.metadata").is_file()
        assert (tmp_path / "save1/ckpt/model_0/model.safetensors").is_file()


def run_failing(tmp_path, processes, *args):
    """Start the worker as run_worker does, expecting it to fail; returns what it printed."""
    import os

    from test_strategies import ROOT, start

    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_COMPILE_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    done = start(processes, "--out", str(tmp_path / "never.json"), *args, env=env, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "never.json").exists()
    return done.stdout + done.stderr


def test_damaged_or_foreign_fsdp2_checkpoints_are_named_errors(tmp_path, uninterrupted):
    common = common_args("fsdp2")
    shutil.copytree(uninterrupted("fsdp2")[1] / "ckpt", tmp_path / "ckpt")  # a copy to damage
    shards = tmp_path / "ckpt/sharded_model_0"
    other = run_failing(tmp_path, 1, *common, "--model", "llama", "--resume-from", str(tmp_path / "ckpt"))
    assert "CheckpointMismatchError" in other and "missing from the checkpoint: model.embed_tokens.weight" in other
    assert "nothing was loaded" in other

    (shards / "__1_0.distcp").unlink()  # process 1's shard, lost with its machine
    missing = run_failing(tmp_path, 2, *common, "--resume-from", str(tmp_path / "ckpt"))
    assert "is damaged: sharded_model_0/__1_0.distcp is missing" in missing

    data = shards / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-64])
    truncated = run_failing(tmp_path, 1, *common, "--resume-from", str(tmp_path / "ckpt"))
    assert "is damaged: sharded_model_0/__0_0.distcp has" in truncated and "the save wrote" in truncated


@pytest.mark.long_launches
def test_deepspeed_zero3_resumes_on_more_processes_through_its_universal_checkpoint(tmp_path):
    # Saved by 2 processes, resumed by 3 (DeepSpeed needs two or more): Kiln converts the ZeRO-3
    # shards with DeepSpeed's own converter (AdamW: it reads Adam-family state only). The oracle is
    # the uninterrupted DeepSpeed run: after two AdamW steps the plain loop's weights differ from the
    # 2-process ZeRO-3 run's by up to 6e-4 (losses by 2e-6); Adam's normalised first steps can turn
    # reduction-order rounding of tiny gradients into differences of that size.
    common = ["--model", "llama", "--stateful", "--zero-stage", "3"]
    whole = run_worker(tmp_path, 2, *common, "--save-at", "1", "--keep-training",
                       "--save-weights", str(tmp_path / "whole.pt"))
    more = run_worker(tmp_path, 3, *common, "--resume-from", str(tmp_path / "ckpt"),
                      "--save-weights", str(tmp_path / "more.pt"))
    assert more["distributed_type"] == "DEEPSPEED" and more["processes"] == 3
    assert more["load_report"]["saved_processes"] == 2 and more["load_report"]["rng_derived"] == [2]
    assert len(whole["losses"]) == 2 and len(more["losses"]) == 1
    assert abs(more["losses"][0] - whole["losses"][1]) < 1e-5, (more["losses"], whole["losses"])
    final, expected = torch.load(tmp_path / "more.pt"), torch.load(tmp_path / "whole.pt")
    assert final.keys() == expected.keys()
    assert max((final[k] - expected[k]).abs().max().item() for k in final) < 1e-5
    assert not any(p.name.endswith(".universal") for p in tmp_path.iterdir())  # converted copy removed
