import json

import pytest

from kiln import Accelerator


def test_jsonl_tracker_writes_config_and_metrics(tmp_path):
    acc = Accelerator(log_with="jsonl", project_dir=tmp_path)
    acc.init_trackers("run1", config={"lr": 0.1})
    acc.log({"loss": 1.5}, step=1)
    acc.log({"loss": 1.25}, step=2)
    acc.end_training()
    assert json.loads((tmp_path / "run1/config.json").read_text()) == {"lr": 0.1}
    rows = [json.loads(line) for line in (tmp_path / "run1/metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.5), (2, 1.25)]


def test_log_without_trackers_is_a_no_op_like_accelerate():
    acc = Accelerator()
    acc.init_trackers("run")
    acc.log({"loss": 1.0})
    acc.end_training()


def test_unknown_tracker_and_missing_project_dir_are_errors():
    with pytest.raises(ValueError, match="unknown tracker"):
        Accelerator(log_with="wandbb")
    with pytest.raises(ValueError, match="needs project_dir"):
        Accelerator(log_with="jsonl").init_trackers("run")
