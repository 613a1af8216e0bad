"""load_state on folders written by the real Accelerate's save_state: a run started on Accelerate
continues on Kiln with the losses of Accelerate's own resumed run, and what cannot be mapped is named."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import Accelerator, CheckpointMismatchError, DataLoaderConfiguration, KilnResumeWarning
from kiln.utils import set_seed

SCRIPT = Path(__file__).with_name("accelerate_run.py")
_spec = importlib.util.spec_from_file_location("accelerate_run", SCRIPT)
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _accelerate(*args: str) -> subprocess.Popen:
    """Accelerate in its own process, so that its global state never reaches this one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen) -> None:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Accelerate's folders (safetensors, bin, a hook-written model, two models) saved at step SAVE_AT
    of one run, and the losses of Accelerate's own runs resumed from the first two."""
    root = tmp_path_factory.mktemp("accelerate")
    _finish(_accelerate("save", str(root), str(root / "uninterrupted.json")))
    resumes = {fmt: _accelerate("resume", str(root / fmt), str(root / f"resumed_{fmt}.json"))
               for fmt in ("safetensors", "bin")}
    for process in resumes.values():
        _finish(process)
    losses = {name: json.loads((root / f"{name}.json").read_text())["losses"]
              for name in ("uninterrupted", "resumed_safetensors", "resumed_bin")}
    return root, losses


def _prepared(stateful: bool = False):
    set_seed(123)  # another state than the saved run's: everything must come from the folder
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    counter = run.StepCounter()
    acc.register_for_checkpointing(counter)
    return (acc, counter, *acc.prepare(*run.build()))


def _rest_of_run(acc, counter, model, optimizer, scheduler, batches) -> list[float]:
    return run.train(acc.backward, model, optimizer, scheduler, batches, counter, run.STEPS - run.SAVE_AT)


def _copy(saved, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[0] / name, tmp_path / name))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_accelerate_folder_resumes_with_accelerates_own_resumed_losses(saved, fmt):
    root, losses = saved
    acc, counter, model, optimizer, scheduler, loader = _prepared()
    report = acc.load_state(root / fmt)
    assert counter.steps == run.SAVE_AT  # custom_checkpoint_0.pkl, the registered object
    assert scheduler.scheduler.last_epoch == run.SAVE_AT
    assert report.saved_processes == 1 and report.rng_restored == [0]
    assert "Accelerate" in str(report)
    resumed = _rest_of_run(acc, counter, model, optimizer, scheduler, acc.skip_first_batches(loader, run.SAVE_AT))
    torch.testing.assert_close(resumed, losses[f"resumed_{fmt}"], rtol=0, atol=1e-5)
    # Accelerate's own resume is its uninterrupted run, so Kiln's continues that run too.
    torch.testing.assert_close(resumed, losses["uninterrupted"][run.SAVE_AT:], rtol=0, atol=1e-5)


def test_model_saved_by_a_hook_loads_through_the_load_hook(saved):
    root, losses = saved
    acc, counter, model, optimizer, scheduler, loader = _prepared()

    def load_mlp(models, folder):  # as diffusers' scripts do: load it, then pop it
        models.pop(0).load_state_dict(torch.load(Path(folder) / "mlp" / "weights.pt", weights_only=True))

    acc.register_load_state_pre_hook(load_mlp)
    acc.load_state(root / "hooked")
    resumed = _rest_of_run(acc, counter, model, optimizer, scheduler, acc.skip_first_batches(loader, run.SAVE_AT))
    torch.testing.assert_close(resumed, losses["resumed_safetensors"], rtol=0, atol=1e-5)


def test_hook_written_folder_without_a_load_hook_is_refused_by_name(saved):
    acc, *_ = _prepared()
    with pytest.raises(ValueError, match=r"hooked/mlp is not a file Accelerate's save_state writes.*"
                                         r"register_load_state_pre_hook"):
        acc.load_state(saved[0] / "hooked")


def test_two_saved_models_into_one_prepared_names_the_second_file(saved):
    acc, counter, model, *_ = _prepared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"two_models/model_1\.safetensors has no counterpart.*holds 2 models, "
                                         r"this run prepared 1"):
        acc.load_state(saved[0] / "two_models")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded
    assert counter.steps == 0


def test_missing_optimizer_file_is_named(saved, tmp_path):
    folder = _copy(saved, "safetensors", tmp_path)
    (folder / "optimizer.bin").unlink()
    acc, *_ = _prepared()
    with pytest.raises(FileNotFoundError, match=r"has no optimizer\.bin, and this run prepared 1 optimizers"):
        acc.load_state(folder)


@pytest.mark.parametrize("entry, says", [("pytorch_model_fsdp_0", "accelerate merge-weights"),
                                         ("pytorch_model", "zero_to_fp32.py")])
def test_sharded_accelerate_folder_is_refused_naming_the_shards(saved, tmp_path, entry, says):
    folder = _copy(saved, "safetensors", tmp_path)
    (folder / entry).mkdir()
    acc, counter, *_ = _prepared()
    with pytest.raises(ValueError, match=rf"{entry} was written by Accelerate's .*{says}"):
        acc.load_state(folder)
    assert counter.steps == 0


def test_compiled_and_ddp_weight_names_are_stripped_and_said(saved, tmp_path):
    folder = _copy(saved, "safetensors", tmp_path)
    plain = load_file(str(folder / "model.safetensors"))
    save_file({f"module._orig_mod.{k}": v for k, v in plain.items()}, str(folder / "model.safetensors"))
    acc, counter, model, *_ = _prepared()
    report = acc.load_state(folder)
    assert all(torch.equal(plain[k], v) for k, v in model.state_dict().items())
    assert "'_orig_mod.'" in str(report) and "'module.'" in str(report)


def test_weights_of_another_model_name_the_first_mismatch_and_load_nothing(saved):
    set_seed(0)
    acc = Accelerator()
    loader = run.build()[3]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    counter = run.StepCounter()
    acc.register_for_checkpointing(counter)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"model\.safetensors does not fit.*0\.weight: checkpoint "
                                                      r"\[32, 8\], model \[16, 8\]"):
        acc.load_state(saved[0] / "safetensors")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert counter.steps == 0


def test_folder_with_neither_manifest_nor_accelerate_files_keeps_kilns_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    acc, *_ = _prepared()
    with pytest.raises(FileNotFoundError, match="not a complete Kiln checkpoint"):
        acc.load_state(tmp_path)


@pytest.fixture(scope="module")
def saved_stateful(tmp_path_factory):
    """A folder Accelerate saved with its stateful dataloader (torchdata): dl_state_dict.bin holds the
    position; and the losses of Accelerate's uninterrupted run."""
    pytest.importorskip("torchdata", reason="Accelerate's stateful dataloader needs torchdata")
    root = tmp_path_factory.mktemp("accelerate_stateful")
    _finish(_accelerate("save", str(root), str(root / "uninterrupted.json"), "--stateful"))
    assert (root / "stateful" / "dl_state_dict.bin").is_file()
    return root / "stateful", {"uninterrupted": json.loads((root / "uninterrupted.json").read_text())["losses"]}


def test_stateful_dataloader_state_resumes_a_stateful_loader_mid_epoch(saved_stateful):
    folder, losses = saved_stateful
    acc, counter, model, optimizer, scheduler, loader = _prepared(stateful=True)
    acc.load_state(folder)
    resumed = _rest_of_run(acc, counter, model, optimizer, scheduler, loader)  # the loader itself: no skip
    # Kiln continues the uninterrupted run. Accelerate's own resume does not here (measured with
    # Accelerate 1.15 and torchdata 0.11): its dl_state_dict.bin holds no sampler state, and its
    # resumed loader draws the rest of the epoch from a new permutation.
    torch.testing.assert_close(resumed, losses["uninterrupted"][run.SAVE_AT:], rtol=0, atol=1e-5)


def test_stateful_dataloader_state_into_a_plain_loader_says_how_many_batches_to_skip(saved_stateful):
    acc, *_ = _prepared()
    with pytest.warns(KilnResumeWarning, match=rf"skip_first_batches\(loader, {run.SAVE_AT}\)"):
        report = acc.load_state(saved_stateful[0])
    assert any("not stateful" in line for line in report.data)
