"""save_state / load_state: a resumed run continues exactly where the saved one stopped."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from kiln import Accelerator, TorchDynamoPlugin
from kiln.plugins import DataLoaderConfiguration
from kiln.utils import set_seed
from toy_models import Regressor

STEPS_PER_EPOCH = 6


def build(stateful=False, precision="no"):
    """Everything a run prepares; the model starts from a fresh random init each time."""
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True),
                      mixed_precision=precision,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(24, 3, 8, generator=generator), torch.randn(24, 3, generator=generator))
    model = Regressor()
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


def test_shards_of_another_strategy_are_refused(tmp_path):
    import json

    from kiln.parallel.base import Strategy
    from kiln.resume import MANIFEST, load_training_state

    class ZeroShards(Strategy):
        name = "deepspeed"
        sharded_checkpoints = True

    (tmp_path / "sharded_model_0").mkdir()
    (tmp_path / MANIFEST).write_text(json.dumps({"format": 1, "num_processes": 1, "files": ["sharded_model_0"],
                                                 "strategy": "fsdp"}))
    with pytest.raises(ValueError, match="holds fsdp shards, which the deepspeed strategy"):
        load_training_state(tmp_path, models=[], strategy=ZeroShards(), optimizers=[], schedulers=[],
                            dataloaders=[], custom=[], scaler=None, process_index=0, num_processes=1)
