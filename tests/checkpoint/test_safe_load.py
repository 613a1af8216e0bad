"""A checkpoint's pickled files are read without running code they carry (kiln/checkpoint/safe_load.py):
optimizer, scheduler and scaler states and RNG states hold tensors and plain containers only; a
registered object's state may hold anything and is read as Accelerate reads it."""

import json
import os
import pickle
import random

import numpy
import pytest
import torch

from kiln import Accelerator
from kiln.checkpoint.integrity import CheckpointCorruptError
from kiln.checkpoint.safe_load import load_rng_file


class Planted:
    """What a hostile file holds: unpickling it calls os.system-like code (here: writes a marker)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class Counter:
    """A registered object whose state is a custom class (allowed: registered objects may hold anything)."""

    def __init__(self):
        self.state = {"seen": Seen(0)}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class Seen:
    def __init__(self, n):
        self.n = n


def saved_job(tmp_path):
    acc = Accelerator()
    model = torch.nn.Linear(4, 4)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    counter = Counter()
    counter.state["seen"] = Seen(7)
    acc.register_for_checkpointing(counter)
    acc.save_state(tmp_path / "ckpt")
    return acc, tmp_path / "ckpt"


def fresh_job():
    acc = Accelerator()
    model = torch.nn.Linear(4, 4)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, counter


@pytest.mark.parametrize("name", ["optimizer_0.bin", "random_states_0.pkl"])
def test_a_planted_object_in_a_state_file_is_refused_naming_the_file_and_never_runs(tmp_path, name):
    _, checkpoint = saved_job(tmp_path)
    marker = tmp_path / "marker"
    if name.endswith(".pkl"):  # an earlier Kiln's plain pickle
        (checkpoint / name).write_bytes(pickle.dumps({"python": Planted(marker)}))
    else:
        torch.save({"state": {}, "param_groups": [], "x": Planted(marker)}, checkpoint / name)
    manifest = json.loads((checkpoint / "kiln_checkpoint.json").read_text())  # a forger fixes the sizes too
    manifest["sizes"][name] = (checkpoint / name).stat().st_size
    (checkpoint / "kiln_checkpoint.json").write_text(json.dumps(manifest))
    acc, _ = fresh_job()
    with pytest.raises(CheckpointCorruptError, match=rf"cannot read .*{name}"):
        acc.load_state(checkpoint)
    assert not marker.exists()


def test_rng_states_written_by_an_earlier_kiln_with_pickle_still_resume(tmp_path):
    random.seed(3)
    numpy.random.seed(4)
    torch.manual_seed(5)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": numpy.random.get_state()}
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(pickle.dumps(state))
    read = load_rng_file(path)
    assert read["python"] == state["python"] and torch.equal(read["torch"], state["torch"])
    assert numpy.array_equal(read["numpy"][1], state["numpy"][1]) and read["numpy"][0] == "MT19937"


def test_the_whole_state_resumes_and_a_registered_object_may_hold_any_object(tmp_path):
    saving, checkpoint = saved_job(tmp_path)
    expected = [random.random(), torch.rand(1).item(), numpy.random.rand()]
    acc, counter = fresh_job()
    acc.load_state(checkpoint)
    assert isinstance(counter.state["seen"], Seen) and counter.state["seen"].n == 7
    assert [random.random(), torch.rand(1).item(), numpy.random.rand()] == expected
