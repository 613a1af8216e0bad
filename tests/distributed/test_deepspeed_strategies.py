"""DeepSpeed ZeRO over two processes started as a launcher starts them (local_launch.py), with
regional compile: compared with one process and with the plain PyTorch loop, and resumed from its
checkpoints. A module of its own, so parallel test workers can run it beside test_strategies.py."""

import json

import pytest

from test_strategies import LLAMA_SGD, run_worker, shared_run  # noqa: F401 (shared_run: a fixture)

pytestmark = pytest.mark.multiprocess


DEEPSPEED_BF16 = ("--ds-config", json.dumps({"bf16": {"enabled": True}}))


# ZeRO-1 in fp32 is compared with the plain loop below (test_deepspeed_zero_fp32_equals_the_plain_pytorch_loop).
@pytest.mark.parametrize("stage, precision, teacher", [(2, "no", True), (3, "bf16", False)])
def test_deepspeed_zero_regional_compile_matches_one_process(tmp_path, shared_run, stage, precision, teacher):
    pytest.importorskip("deepspeed")
    extra = ["--teacher"] if teacher else []  # a frozen second model is prepared beside the engine
    single = shared_run(1, "--precision", precision, *extra)
    # bf16 here is DeepSpeed's own, asked for in its config: bf16 weights with fp32 master copies in
    # the optimizer, where Kiln's single process autocasts fp32 weights; the second step differs by ~2%.
    own_bf16 = DEEPSPEED_BF16 if precision == "bf16" else ()
    zero = run_worker(tmp_path, 2, "--precision", precision, "--zero-stage", str(stage),
                      "--save-model", str(tmp_path / "weights"), *extra, *own_bf16)
    assert zero["distributed_type"] == "DEEPSPEED"
    tolerance = 1e-5 if precision == "no" else 3e-2
    assert len(zero["losses"]) == len(single["losses"]) == 2
    for a, b in zip(single["losses"], zero["losses"]):
        assert abs(a - b) <= tolerance * max(1.0, abs(a)), (single["losses"], zero["losses"])
    assert all(calls > 0 for calls in zero["calls"])  # compiled blocks ran inside the engine on every rank
    assert zero["checksums"][0] == zero["checksums"][1]
    assert zero["keys"] == single["keys"]  # the engine's module saved under the plain names, fp32
    from kiln import load_model
    from toy_models import Regressor
    load_model(Regressor(), tmp_path / "weights")
    if precision == "no":
        assert abs(zero["checksums"][0] - single["checksums"][0]) < 1e-3


def test_deepspeed_zero3_checkpoint_resumes_in_a_fresh_launch(tmp_path):
    pytest.importorskip("deepspeed")
    common = ["--epochs", "2", "--shuffle", "--zero-stage", "3", "--teacher"]
    whole = run_worker(tmp_path, 2, *common, "--save-at", "1", "--keep-training")  # saves, trains on
    parts = sorted(p.name for p in (tmp_path / "ckpt/sharded_model_0").iterdir())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in parts, parts  # each rank wrote its optimizer shard
    assert (tmp_path / "ckpt/sharded_model_1/model.safetensors").is_file()  # the frozen teacher, whole
    resumed = run_worker(tmp_path, 2, *common, "--resume-from", str(tmp_path / "ckpt"))
    assert len(resumed["losses"]) == 3
    for a, b in zip(resumed["losses"], whole["losses"][1:]):
        assert abs(a - b) < 1e-5, (resumed["losses"], whole["losses"])


def max_weight_difference(first, second):
    import torch

    a, b = torch.load(first), torch.load(second)
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory):
    """The plain PyTorch loop's run (one process, no Kiln) and its final weights, once per clip setting."""
    runs = {}

    def run(clip):
        if clip not in runs:
            folder = tmp_path_factory.mktemp("plain")
            result = run_worker(folder, 1, "--plain", *LLAMA_SGD, "--clip", clip,
                                "--save-weights", str(folder / "plain.pt"))
            runs[clip] = (result, folder / "plain.pt")
        return runs[clip]

    return run


# Every stage, and both clip settings (DeepSpeed's default clips at 1.0 unless told not to); stages
# 1 and 2 share their clipping path, so each meets one setting (the suite's time: 20 s per launch).
@pytest.mark.parametrize("stage, clip", [(1, "none"), (2, "1.0"), (3, "none"), (3, "1.0")],
                         ids=["1-no-clipping", "2-clip-1.0", "3-no-clipping", "3-clip-1.0"])
def test_deepspeed_zero_fp32_equals_the_plain_pytorch_loop(tmp_path, plain_llama, stage, clip):
    """No DeepSpeed default may change the step: no clipping unless asked (DeepSpeed's default clips at
    1.0), and clipping at 1.0 when asked, exactly as clip_grad_norm_ in a plain loop does."""
    pytest.importorskip("deepspeed")
    plain, plain_weights = plain_llama(clip)
    assert min(plain["grad_norms"]) > 1.5, plain  # realistic gradients: clipping at 1.0 would change them
    zero = run_worker(tmp_path, 2, *LLAMA_SGD, "--clip", clip, "--zero-stage", str(stage),
                      "--save-weights", str(tmp_path / "zero.pt"))
    assert zero["distributed_type"] == "DEEPSPEED" and all(calls > 0 for calls in zero["calls"])
    for a, b in zip(plain["losses"], zero["losses"]):
        assert abs(a - b) <= 1e-5, (plain["losses"], zero["losses"])
    assert max_weight_difference(plain_weights, tmp_path / "zero.pt") <= 1e-5


# The config's own optimizer and scheduler, which the engine builds for DummyOptim / DummyScheduler;
# torch_adam: DeepSpeed's torch.optim.AdamW (without it, its FusedAdam, which this CPU build compiles
# with g++ at the first use, minutes).
CONFIG_OPTIMIZER = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_config_optimizer_and_scheduler_equal_deepspeeds_own_engine(tmp_path, stage):
    """DummyOptim(lr=0.01, weight_decay=0.1) and DummyScheduler(total_num_steps=10 ticks, warmup_num_steps=2)
    on 2 processes train as DeepSpeed's own loop (one process, the global batch) over the config those
    values fill in; under ZeRO-2 the run is also resumed from a checkpoint saved after step 3."""
    pytest.importorskip("deepspeed")
    common = ("--model", "llama", "--lr", "0.01", "--samples", "60", "--clip", "none")
    dummies = (*common, "--zero-stage", str(stage), "--config-optimizer", "--ds-config", json.dumps(CONFIG_OPTIMIZER))
    save = ("--save-at", "3", "--keep-training") if stage == 2 else ()  # a save changes nothing in the run
    kiln = run_worker(tmp_path, 2, *dummies, *save, "--save-weights", str(tmp_path / "kiln.pt"))
    filled = json.loads(json.dumps(CONFIG_OPTIMIZER))
    filled["optimizer"]["params"].update(lr=0.01, weight_decay=0.1)
    # 10 ticks are 5 optimizer steps on 2 processes, the engine stepping its scheduler once per step.
    filled["scheduler"]["params"].update(warmup_min_lr=0, warmup_max_lr=0.01, warmup_num_steps=2, total_num_steps=5)
    # The global batch of 6 on one process; no clipping (DeepSpeed's default clips at 1.0), as Kiln's default.
    filled.update(train_micro_batch_size_per_gpu=6, gradient_accumulation_steps=2, gradient_clipping=0.0,
                  zero_optimization={"stage": stage})
    own = run_worker(tmp_path, 1, *common, "--plain-deepspeed", "--ds-config", json.dumps(filled),
                     "--save-weights", str(tmp_path / "own.pt"))
    assert kiln["distributed_type"] == "DEEPSPEED" and all(calls > 0 for calls in kiln["calls"])
    assert len(kiln["losses"]) == len(own["losses"]) == 5
    # The rates the prepared scheduler reports are the engine's: warm-up from 0, then the decay.
    assert kiln["lrs"] == pytest.approx(own["lrs"], abs=1e-12) and max(own["lrs"]) == pytest.approx(0.01)
    for a, b in zip(own["losses"], kiln["losses"]):
        assert abs(a - b) <= 1e-5, (own["losses"], kiln["losses"])
    assert max_weight_difference(tmp_path / "own.pt", tmp_path / "kiln.pt") <= 1e-5
    if save:  # the engine's optimizer state and its scheduler's position come back
        resumed = run_worker(tmp_path, 2, *dummies, "--resume-from", str(tmp_path / "ckpt"))
        assert len(resumed["losses"]) == 2 and resumed["lrs"] == kiln["lrs"][3:]
        for a, b in zip(resumed["losses"], kiln["losses"][3:]):
            assert abs(a - b) <= 1e-5, (resumed["losses"], kiln["losses"])
