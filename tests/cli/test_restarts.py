"""`kiln launch --max_restarts N`: a process SIGKILLed in the middle of training, or while a
checkpoint is being written, makes the launcher restart the group; the script resumes from the
latest complete checkpoint and ends with the losses and weights of a run that was never interrupted."""

from pathlib import Path

import pytest
import torch

from ports import free_port
from test_launch import kiln

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).resolve().parent / "restart_script.py"


def launch(tmp_path, name, *script_args, restarts=1):
    project, out = tmp_path / name, tmp_path / f"{name}.pt"
    done = kiln("launch", "--num_processes", "2", "--main_process_port", str(free_port()),
                "--max_restarts", str(restarts), "--process_group_timeout", "60",
                str(SCRIPT), str(project), str(out), *script_args, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out), project, done.stdout + done.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    result, _, log = launch(tmp_path_factory.mktemp("whole"), "whole", restarts=0)
    assert "resumed" not in log
    return result


def assert_same_run(result, uninterrupted):
    assert len(result["losses"]) == len(uninterrupted["losses"]) == 9
    for a, b in zip(result["losses"], uninterrupted["losses"]):
        assert abs(a - b) < 1e-5, (result["losses"], uninterrupted["losses"])
    weights, expected = result["weights"], uninterrupted["weights"]
    assert weights.keys() == expected.keys()
    assert max((weights[k] - expected[k]).abs().max().item() for k in weights) < 1e-5


def test_a_process_killed_mid_training_is_restarted_and_resumes_the_same_run(tmp_path, uninterrupted):
    result, project, log = launch(tmp_path, "killed", "--kill-at-step", "5", "--kill-rank", "1")
    assert "resumed at step 4" in log  # checkpoint_1, written after step 4, mid-epoch
    assert_same_run(result, uninterrupted)
    checkpoints = sorted(p.name for p in (project / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint_2", "checkpoint_3"]  # total_limit=2 kept the newest


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_to_resume_from(tmp_path, uninterrupted):
    result, project, log = launch(tmp_path, "killed_in_save", "--kill-in-save", "2")
    # The second checkpoint (after step 4) was half written: the restart resumed from the first.
    assert "resumed at step 2" in log
    assert_same_run(result, uninterrupted)
    # The partial folder was never taken for a checkpoint and is gone after the next complete save.
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]
