"""Trackers as training scripts use them: nested metrics, tensors and numpy scalars, values that cannot
be logged, log_with="all", and each tracker read back from what it wrote."""

import json
import warnings

import numpy as np
import pytest
import torch

from kiln import Accelerator
from kiln.tracking import KilnTrackingWarning, LoggerType, check_log_with, flatten_metrics

# What Transformers' and Accelerate's example scripts log: nested metric dicts, tensors, numpy values.
METRICS = {"glue": {"accuracy": 0.81, "f1": np.float32(0.75)}, "train_loss": torch.tensor(0.5), "epoch": 1}
LEAVES = {"glue/accuracy": 0.81, "glue/f1": 0.75, "train_loss": 0.5, "epoch": 1}


def test_nested_metrics_become_one_scalar_per_leaf():
    flat = flatten_metrics({"a": {"b": {"c": torch.tensor(2.0)}, "d": np.int64(3)}, "e": 1.5})
    assert flat == {"a/b/c": 2.0, "a/d": 3, "e": 1.5}
    assert all(type(v) in (int, float) for v in flat.values())


def test_jsonl_tracker_writes_config_and_flattened_metrics(tmp_path):
    acc = Accelerator(log_with="jsonl", project_dir=tmp_path)
    acc.init_trackers("run1", config={"lr": 0.1})
    acc.log(METRICS, step=1)
    acc.log({"loss": 1.25}, step=2)
    acc.end_training()
    assert json.loads((tmp_path / "run1/config.json").read_text()) == {"lr": 0.1}
    rows = [json.loads(line) for line in (tmp_path / "run1/metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in rows] == [
        {"step": 1, **{k: pytest.approx(v) for k, v in LEAVES.items()}}, {"step": 2, "loss": 1.25}]


def test_tensorboard_gets_every_nested_value(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("run", config={"lr": 0.1})
    acc.log(METRICS, step=3)
    acc.end_training()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(LEAVES)
    for key, value in LEAVES.items():
        (point,) = events.Scalars(key)
        assert point.step == 3 and point.value == pytest.approx(value)


def test_a_value_that_cannot_be_logged_is_skipped_with_one_warning_naming_it(tmp_path):
    acc = Accelerator(log_with="jsonl", project_dir=tmp_path)
    acc.init_trackers("run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            acc.log({"loss": 1.0, "sample": "a generated sentence", "per_class": [0.1, 0.2]}, step=step)
    messages = [str(w.message) for w in caught if issubclass(w.category, KilnTrackingWarning)]
    assert len(messages) == 2, messages  # once per key, not once per step
    assert "'sample'" in messages[0] and "str" in messages[0] and "'per_class'" in messages[1]
    acc.end_training()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["loss", "step", "time"]] * 3  # the scalars still arrived


def test_log_with_all_starts_every_installed_tracker(tmp_path, monkeypatch):
    for package in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(package)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert check_log_with("all") == ["jsonl", "tensorboard", "wandb", "mlflow"]
    acc = Accelerator(log_with=LoggerType.ALL, project_dir=tmp_path)
    acc.init_trackers("glue_run", config={"lr": 0.1, "model": {"layers": 2}})
    assert [t.name for t in acc.trackers] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    acc.log(METRICS, step=1)
    acc.log({"glue": {"accuracy": 0.9}}, step=2)
    wandb_run = acc.get_tracker("wandb", unwrap=True)
    summary = dict(wandb_run.summary)  # wandb commits step 1's row when step 2 arrives
    assert {key: summary[key] for key in LEAVES} == pytest.approx(LEAVES) and summary["_step"] == 1
    assert wandb_run.config["model"] == {"layers": 2}
    mlflow_run = acc.get_tracker("mlflow").tracker
    acc.end_training()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # written offline, under project_dir

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(mlflow_run.info.run_id, "glue/accuracy")
    assert [(m.step, m.value) for m in history] == [(1, pytest.approx(0.81)), (2, pytest.approx(0.9))]
    assert client.get_run(mlflow_run.info.run_id).data.params == {"lr": "0.1", "model/layers": "2"}
    assert client.get_experiment(mlflow_run.info.experiment_id).name == "glue_run"


def test_init_kwargs_reach_their_tracker_and_stray_ones_are_errors(tmp_path):
    pytest.importorskip("tensorboard")
    acc = Accelerator(log_with=["tensorboard"], project_dir=tmp_path)
    with pytest.raises(ValueError, match=r"\['wandb'\] that log_with did not ask for"):
        acc.init_trackers("run", init_kwargs={"wandb": {"mode": "offline"}})
    acc.init_trackers("run", init_kwargs={"tensorboard": {"flush_secs": 7}})
    writer = acc.get_tracker("tensorboard", unwrap=True)
    assert writer is acc.get_tracker("tensorboard").writer
    assert writer.flush_secs == 7
    acc.end_training()


def test_log_without_trackers_is_a_no_op_like_accelerate():
    acc = Accelerator()
    acc.init_trackers("run")
    acc.log({"loss": 1.0})
    acc.end_training()


def test_unknown_tracker_and_missing_project_dir_are_errors():
    with pytest.raises(ValueError, match=r"unknown tracker 'wandbb'; choose from: jsonl, tensorboard, wandb, mlflow, all"):
        Accelerator(log_with="wandbb")
    with pytest.raises(ValueError, match="jsonl tracker.*pass project_dir="):
        Accelerator(log_with="jsonl").init_trackers("run")
    with pytest.raises(ValueError, match="no tracker 'wandb' was started"):
        Accelerator().get_tracker("wandb")
