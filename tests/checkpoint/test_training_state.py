"""save_state / load_state: a resumed run continues exactly where the saved one stopped."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from kiln import Accelerator, TorchDynamoPlugin
from kiln.plugins import DataLoaderConfiguration
from kiln.utils import set_seed
from toy_models import Regressor

STEPS_PER_EPOCH = 6


def build(stateful=False, precision="no", width=16):
    """Everything a run prepares; the model starts from a fresh random init each time."""
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True),
                      mixed_precision=precision,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(24, 3, 8, generator=generator), torch.randn(24, 3, generator=generator))
    model = Regressor(width=width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    counter = StepCounter()
    acc.register_for_checkpointing(counter)
    return (acc, counter, *acc.prepare(model, optimizer, scheduler, loader))


class StepCounter:
    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def train(acc, counter, model, optimizer, scheduler, batches, limit):
    losses = []
    for x, y in batches:
        loss = model(x, y)["loss"]
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.steps += 1
        losses.append(loss.item())
        if len(losses) == limit:
            break
    return losses


def uninterrupted(stateful=False, precision="no"):
    set_seed(0)
    acc, counter, model, optimizer, scheduler, loader = build(stateful, precision)
    return train(acc, counter, model, optimizer, scheduler, loader, STEPS_PER_EPOCH) + \
        train(acc, counter, model, optimizer, scheduler, loader, STEPS_PER_EPOCH)


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_resume_mid_epoch_continues_the_same_losses(tmp_path, stateful, precision):
    expected = uninterrupted(stateful, precision)

    set_seed(0)
    acc, counter, model, optimizer, scheduler, loader = build(stateful, precision)
    first = train(acc, counter, model, optimizer, scheduler, loader, 4)
    acc.save_state(tmp_path / "ckpt")

    set_seed(123)  # a different process state: everything must come from the checkpoint
    acc, counter, model, optimizer, scheduler, loader = build(stateful, precision)
    acc.load_state(tmp_path / "ckpt")
    assert counter.steps == 4
    rest_of_epoch = loader if stateful else acc.skip_first_batches(loader, 4)
    resumed = train(acc, counter, model, optimizer, scheduler, rest_of_epoch, STEPS_PER_EPOCH)
    resumed += train(acc, counter, model, optimizer, scheduler, loader, STEPS_PER_EPOCH)
    assert first == expected[:4]
    torch.testing.assert_close(resumed, expected[4:], rtol=1e-5, atol=1e-6)


def test_stateful_position_and_skip_together_are_refused(tmp_path):
    set_seed(0)
    acc, counter, model, optimizer, scheduler, loader = build(stateful=True)
    train(acc, counter, model, optimizer, scheduler, loader, 2)
    acc.save_state(tmp_path / "ckpt")
    acc, counter, model, optimizer, scheduler, loader = build(stateful=True)
    acc.load_state(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="skipped twice"):
        next(iter(acc.skip_first_batches(loader, 2)))


def test_missing_file_is_named(tmp_path):
    acc, counter, model, optimizer, scheduler, loader = build()
    acc.save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt/optimizer_0.bin").unlink()
    with pytest.raises(FileNotFoundError, match="optimizer_0.bin is missing"):
        acc.load_state(tmp_path / "ckpt")


def test_folder_without_manifest_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    acc = build()[0]
    with pytest.raises(FileNotFoundError, match="not a complete Kiln checkpoint"):
        acc.load_state(tmp_path / "half")


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    acc, counter, model, optimizer, scheduler, loader = build()
    train(acc, counter, model, optimizer, scheduler, loader, 1)
    acc.save_state(tmp_path / "ckpt")
    train(acc, counter, model, optimizer, scheduler, loader, 1)

    real_save = torch.save

    def crash_on_scheduler(obj, f, *args, **kwargs):
        if str(f).endswith("scheduler_0.bin"):
            raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crash_on_scheduler)
    with pytest.raises(OSError, match="disk full"):
        acc.save_state(tmp_path / "ckpt")
    monkeypatch.undo()
    acc2, counter2, *_ = build()
    acc2.load_state(tmp_path / "ckpt")  # the first, complete checkpoint
    assert counter2.steps == 1
    acc.save_state(tmp_path / "ckpt")  # a later save cleans up after the crashed one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_register_for_checkpointing_rejects_objects_without_state():
    with pytest.raises(TypeError, match="needs state_dict"):
        Accelerator().register_for_checkpointing(object())


def test_mismatched_objects_are_a_clear_error(tmp_path):
    acc = build()[0]
    acc.save_state(tmp_path / "ckpt")
    other = Accelerator()
    other.prepare(Regressor())
    with pytest.raises(ValueError, match=r"holds 1 \w+\(s\), this run prepared 0"):
        other.load_state(tmp_path / "ckpt")


def load_into_zero_shards(folder, manifest, num_processes=1):
    """load_training_state of a hand-written manifest, into a strategy that calls itself DeepSpeed."""
    import json

    from kiln.parallel.base import Strategy
    from kiln.checkpoint.training_state import MANIFEST, load_training_state

    class ZeroShards(Strategy):
        name = "deepspeed"
        sharded_checkpoints = True

    (folder / "sharded_model_0").mkdir()
    (folder / MANIFEST).write_text(json.dumps({"files": ["sharded_model_0"], **manifest}))
    load_training_state(folder, models=[], strategy=ZeroShards(), optimizers=[], schedulers=[], dataloaders=[],
                        custom=[], scaler=None, process_index=0, num_processes=num_processes)


def test_shards_of_another_strategy_are_refused(tmp_path):
    with pytest.raises(ValueError, match="as FSDP2 shards by the fsdp strategy, which a DeepSpeed engine cannot read"):
        load_into_zero_shards(tmp_path, {"format": 1, "num_processes": 1, "strategy": "fsdp"})


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(before, model):
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_checkpoint_of_another_model_names_names_and_shapes_and_loads_nothing(tmp_path):
    from kiln.checkpoint.integrity import CheckpointMismatchError

    build(width=24)[0].save_state(tmp_path / "wide")
    acc, counter, model, optimizer, scheduler, loader = build()
    counter.steps = 7
    before = _weights(model)
    with pytest.raises(CheckpointMismatchError) as caught:
        acc.load_state(tmp_path / "wide")
    message = str(caught.value)
    # The first mismatched parameter is named with both shapes; the count of the rest is given.
    first = next(k for k, v in before.items() if v.dim() == 2)
    assert f"{first}: checkpoint [24, " in message and "shapes differ" in message and "more" in message
    assert "nothing was loaded" in message
    assert _unchanged(before, model) and counter.steps == 7


def test_truncated_file_is_named_and_nothing_loads(tmp_path):
    from kiln.checkpoint.integrity import CheckpointCorruptError

    acc, counter, model, optimizer, scheduler, loader = build()
    acc.save_state(tmp_path / "ckpt")
    weights = tmp_path / "ckpt/model_0/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    train(acc, counter, model, optimizer, scheduler, loader, 1)
    before = _weights(model)
    with pytest.raises(CheckpointCorruptError, match=r"model_0/model.safetensors has \d+ bytes, the save wrote"):
        acc.load_state(tmp_path / "ckpt")
    assert _unchanged(before, model) and counter.steps == 1


def test_unreadable_file_is_named_and_nothing_loads(tmp_path):
    from kiln.checkpoint.integrity import CheckpointCorruptError

    acc, counter, model, optimizer, scheduler, loader = build()
    acc.save_state(tmp_path / "ckpt")
    target = tmp_path / "ckpt/scheduler_0.bin"
    target.write_bytes(b"\0" * target.stat().st_size)  # the right size, the wrong bytes
    train(acc, counter, model, optimizer, scheduler, loader, 1)
    before, lr = _weights(model), scheduler.get_last_lr()
    with pytest.raises(CheckpointCorruptError, match="cannot read .*scheduler_0.bin"):
        acc.load_state(tmp_path / "ckpt")
    assert _unchanged(before, model) and counter.steps == 1 and scheduler.get_last_lr() == lr
    assert optimizer.state_dict()["state"]  # the optimizer kept its own state too


def test_optimizer_of_another_shape_is_refused_before_loading(tmp_path):
    from kiln.checkpoint.integrity import CheckpointMismatchError

    acc, model = Accelerator(), Regressor()
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_state(tmp_path / "ckpt")
    other = Accelerator()
    twin = Regressor()
    groups = [{"params": list(twin.parameters())[:2]}, {"params": list(twin.parameters())[2:]}]
    other.prepare(twin, torch.optim.SGD(groups, lr=0.1))
    before = _weights(twin)
    with pytest.raises(CheckpointMismatchError, match="parameter groups of"):
        other.load_state(tmp_path / "ckpt")
    assert _unchanged(before, twin)


def test_a_schedule_stepped_at_another_pace_than_saved_is_one_warning(tmp_path):
    import json

    from kiln import KilnResumeWarning
    from kiln.checkpoint.training_state import MANIFEST

    acc, counter, model, optimizer, scheduler, loader = build()
    acc.save_state(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["scheduler_ticks_per_step"] == [1]
    manifest["scheduler_ticks_per_step"] = [2]  # as two processes, one tick each, save it
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(KilnResumeWarning, match=r"scheduler 0 was stepped 2 time\(s\) per optimizer step when saved "
                                              r"and is stepped 1 time\(s\) now") as caught:
        build()[0].load_state(tmp_path / "ckpt")
    assert len([w for w in caught if issubclass(w.category, KilnResumeWarning)]) == 1


def test_a_deepspeed_checkpoint_that_cannot_be_converted_says_what_to_do(tmp_path):
    from kiln.parallel.deepspeed import convert_to_universal

    (tmp_path / "shards").mkdir()  # no engine checkpoint in it
    with pytest.raises(RuntimeError, match="written by 2 processes, and DeepSpeed's converter to its universal "
                                           "checkpoint, which loads on another number, failed: .*Resume on 2 processes"):
        convert_to_universal(tmp_path / "shards", tmp_path / "universal", 2)
    assert not (tmp_path / "universal").exists()


def test_a_save_hook_that_draws_random_numbers_does_not_shift_the_resumed_run(tmp_path):
    # diffusers' EMAModel.save_pretrained builds a UNet in its save hook, drawing from torch's RNG:
    # the RNG states saved must be those the unbroken run goes on with, as in Accelerate.
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: torch.nn.Linear(64, 64))
    accelerator.save_state(tmp_path / "checkpoint")
    unbroken = torch.rand(4)
    accelerator.load_state(tmp_path / "checkpoint")
    torch.testing.assert_close(torch.rand(4), unbroken, atol=0, rtol=0)
    assert model.weight.shape == (2, 2)
