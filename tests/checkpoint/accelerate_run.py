"""A small training run on the real Accelerate, started in a subprocess by test_accelerate_folders.py:
`save` trains STEPS steps and writes Accelerate checkpoints at step SAVE_AT; `resume` continues one.
With `--stateful` the loader is Accelerate's stateful one (torchdata), whose position the checkpoint
holds (dl_state_dict.bin): the resumed run iterates the loader itself, with no skip.

`build` is shared with the Kiln side of the tests; Accelerate is imported only when run as a script,
so that its global state never reaches the pytest process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 10  # 12 batches in an epoch: the save and the resumed steps fall in the first epoch
SAVE_AT = 4


class StepCounter:
    """A registered object (custom_checkpoint_0.pkl in an Accelerate folder)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, DataLoader]:
    """The same model, optimizer, scheduler and shuffled loader (its own seeded generator) for both libraries.
    Dropout makes the losses depend on the restored RNG state."""
    data_rng = torch.Generator().manual_seed(7)
    inputs = torch.randn(48, 8, generator=data_rng)
    targets = inputs[:, :2].sum(-1, keepdim=True) + 0.1 * torch.randn(48, 1, generator=data_rng)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(11))
    return model, optimizer, scheduler, loader


def train(backward, model, optimizer, scheduler, batches, counter: StepCounter, limit: int) -> list[float]:
    losses: list[float] = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.steps += 1
        losses.append(loss.item())
        if len(losses) == limit:  # checked after the step, so that no batch is drawn and dropped
            break
    return losses


def _save_by_hook(models: list, weights: list, folder: str) -> None:
    """As diffusers' scripts do: the model is written by the script itself, and Accelerate writes no weights for it."""
    (Path(folder) / "mlp").mkdir()
    torch.save(weights.pop(0), Path(folder) / "mlp" / "weights.pt")


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("losses", type=Path)
    parser.add_argument("--stateful", action="store_true")
    args = parser.parse_args()

    set_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=args.stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler, loader = accelerator.prepare(*build())
    if args.mode == "resume":
        accelerator.load_state(args.folder)
        batches = loader if args.stateful else accelerator.skip_first_batches(loader, SAVE_AT)
        losses = train(accelerator.backward, model, optimizer, scheduler, batches, counter, STEPS - SAVE_AT)
        args.losses.write_text(json.dumps({"losses": losses, "steps": counter.steps}))
        return
    batches = iter(loader)  # one pass: the uninterrupted run goes on with the same iterator
    if args.stateful:
        losses = train(accelerator.backward, model, optimizer, scheduler, batches, counter, SAVE_AT)
        accelerator.save_state(args.folder / "stateful")
        losses += train(accelerator.backward, model, optimizer, scheduler, batches, counter, STEPS - SAVE_AT)
        args.losses.write_text(json.dumps({"losses": losses, "steps": counter.steps}))
        return
    losses = train(accelerator.backward, model, optimizer, scheduler, batches, counter, SAVE_AT)
    accelerator.save_state(args.folder / "safetensors")
    accelerator.save_state(args.folder / "bin", safe_serialization=False)
    handle = accelerator.register_save_state_pre_hook(_save_by_hook)
    accelerator.save_state(args.folder / "hooked")
    handle.remove()
    losses += train(accelerator.backward, model, optimizer, scheduler, batches, counter, STEPS - SAVE_AT)
    # A second model prepared after training: a folder with two models' weights, for one that prepares one.
    accelerator.prepare(nn.Linear(8, 1))
    accelerator.save_state(args.folder / "two_models")
    args.losses.write_text(json.dumps({"losses": losses, "steps": counter.steps}))


if __name__ == "__main__":
    main()
