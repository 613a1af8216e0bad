"""ProjectConfiguration as Accelerate scripts use it: automatic checkpoint names, total_limit, the
latest complete checkpoint, and save/load hooks that save models their own way."""

import json
import os

import pytest
import torch

from kiln import Accelerator, ProjectConfiguration
from toy_models import Regressor


def prepared(tmp_path, **config):
    torch.manual_seed(0)
    acc = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path), **config))
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return (acc, *acc.prepare(model, optimizer))


def step(acc, model, optimizer):
    loss = model(torch.randn(2, 3, 8), torch.randn(2, 3))["loss"]
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_automatic_names_keep_total_limit_and_load_the_latest(tmp_path):
    acc, model, optimizer = prepared(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    saved = []
    for _ in range(4):
        step(acc, model, optimizer)
        saved.append(acc.save_state())
        last = weights(model)
    assert saved == [str(tmp_path / f"checkpoints/checkpoint_{i}") for i in range(4)]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    assert acc.save_iteration == 4

    fresh, model2, optimizer2 = prepared(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    fresh.load_state()  # the latest complete one
    assert all(torch.equal(last[k], v) for k, v in model2.state_dict().items())
    assert fresh.save_iteration == 4  # the next save does not collide with checkpoint_3
    assert fresh.save_state().endswith("checkpoint_4")


def test_a_save_that_crashes_leaves_the_previous_checkpoint_as_the_latest(tmp_path, monkeypatch):
    acc, model, optimizer = prepared(tmp_path, automatic_checkpoint_naming=True, total_limit=1)
    step(acc, model, optimizer)
    acc.save_state()
    kept = weights(model)
    step(acc, model, optimizer)
    import kiln.checkpoint.training_state

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(kiln.checkpoint.training_state, "save_state_dict", crash)
    with pytest.raises(OSError, match="disk full"):
        acc.save_state()
    monkeypatch.undo()
    folder = tmp_path / "checkpoints"
    # total_limit=1, yet checkpoint_0 is still there: pruning waits for a complete new checkpoint.
    assert sorted(os.listdir(folder)) == [".checkpoint_1.kiln-staging", "checkpoint_0"]
    fresh, model2, _ = prepared(tmp_path, automatic_checkpoint_naming=True, total_limit=1)
    fresh.load_state()
    assert all(torch.equal(kept[k], v) for k, v in model2.state_dict().items())
    fresh.save_state()  # complete: prunes the old checkpoint and the crashed save's leftovers
    assert os.listdir(folder) == ["checkpoint_1"]


def test_save_state_without_a_folder_needs_automatic_naming(tmp_path):
    acc, _, _ = prepared(tmp_path)
    with pytest.raises(ValueError, match="automatic checkpoint naming is off"):
        acc.save_state()
    with pytest.raises(ValueError, match="automatic checkpoint naming is off"):
        acc.load_state()
    empty, _, _ = prepared(tmp_path / "other", automatic_checkpoint_naming=True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        empty.load_state()


def test_hooks_save_and_load_models_their_own_way(tmp_path):
    acc, model, optimizer = prepared(tmp_path)
    calls = []

    def save_hook(models, weights_, output_dir):
        calls.append(("save", len(models), len(weights_)))
        torch.save(weights_.pop(), os.path.join(output_dir, "my_model.pt"))  # Kiln must not write it again

    def load_hook(models, input_dir):
        calls.append(("load", len(models)))
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "my_model.pt")))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    step(acc, model, optimizer)
    expected = weights(model)
    folder = acc.save_state(tmp_path / "ckpt")
    assert "my_model.pt" in os.listdir(folder) and "model_0" not in os.listdir(folder)
    manifest = json.loads((tmp_path / "ckpt/kiln_checkpoint.json").read_text())
    assert not any(name.startswith("model_") for name in manifest["files"])

    fresh, model2, _ = prepared(tmp_path)
    fresh.register_load_state_pre_hook(load_hook)
    fresh.load_state(folder)
    assert all(torch.equal(expected[k], v) for k, v in model2.state_dict().items())
    assert calls == [("save", 1, 1), ("load", 1)]


def test_a_removed_hook_no_longer_runs(tmp_path):
    acc, model, optimizer = prepared(tmp_path)
    ran = []
    handle = acc.register_save_state_pre_hook(lambda models, weights_, folder: ran.append(folder))
    handle.remove()
    acc.save_state(tmp_path / "ckpt")
    assert ran == [] and "model_0" in os.listdir(tmp_path / "ckpt")


def test_load_state_strict_false_accepts_a_changed_model(tmp_path):
    acc, model, optimizer = prepared(tmp_path)
    folder = acc.save_state(tmp_path / "ckpt")
    torch.manual_seed(0)
    bigger = Regressor()
    bigger.register_buffer("extra", torch.zeros(2))  # a key the checkpoint does not hold
    other = Accelerator()
    other.prepare(bigger, torch.optim.SGD(bigger.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="1 missing from the checkpoint: extra"):
        other.load_state(folder)
    other.load_state(folder, strict=False)


def test_project_dir_and_logging_dir(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), logging_dir=str(tmp_path / "logs"))
    acc = Accelerator(project_config=config, log_with="jsonl")
    assert (acc.project_dir, acc.logging_dir) == (str(tmp_path), str(tmp_path / "logs"))
    acc.init_trackers("run")
    acc.log({"loss": 1.0})
    acc.end_training()
    assert (tmp_path / "logs/run/metrics.jsonl").is_file()
    assert Accelerator(project_dir=tmp_path).logging_dir == str(tmp_path)  # defaults to the project's
    with pytest.raises(ValueError, match="set it in one place"):
        Accelerator(project_dir=tmp_path / "a", project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    for bad in ({"total_limit": 0}, {"iteration": -1}):
        with pytest.raises(ValueError):
            ProjectConfiguration(**bad)
    with pytest.raises(NotImplementedError, match="save_on_each_node"):
        ProjectConfiguration(save_on_each_node=True)
