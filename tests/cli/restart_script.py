"""A training script written the usual way for restarts: resume from the latest checkpoint if there
is one, let the stateful dataloader skip what was seen, save every few steps. Started by
`kiln launch --max_restarts N` in the tests, which kill one of its processes on the first attempt.

Arguments: PROJECT_DIR OUT [--kill-at-step S --kill-rank R] [--kill-in-save K]
  --kill-at-step: process R SIGKILLs itself right after optimizer step S.
  --kill-in-save: process 0 SIGKILLs itself in the middle of writing the K-th checkpoint.
Only the first attempt (TORCHELASTIC_RESTART_COUNT 0) kills. OUT receives, from the main process,
the losses of every optimizer step of the whole run and the final weights.
"""

import argparse
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_models import Regressor  # noqa: E402

from kiln import Accelerator, DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin  # noqa: E402
from kiln.utils import set_seed  # noqa: E402

STEPS_PER_SAVE = 2


class Progress:
    """Every loss so far, saved with each checkpoint (the stateful dataloader keeps its own place)."""

    def __init__(self):
        self.losses = []

    def state_dict(self):
        return {"losses": list(self.losses)}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])


def kill_while_writing(path_suffix):
    """Make torch.save write half of the file ending in `path_suffix`, then die, as a machine lost mid-save."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if str(f).endswith(path_suffix):
            with open(f, "r+b") as handle:
                handle.truncate(os.path.getsize(f) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at-step", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-in-save", type=int, default=0)
    args = parser.parse_args()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    set_seed(0)
    acc = Accelerator(
        dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True),
        gradient_accumulation_steps=2,
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True,
                                            total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 3, 8, generator=generator), torch.randn(48, 3, generator=generator))
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=acc.num_processes * 3, gamma=0.5)
    loader = DataLoader(data, batch_size=8 // acc.num_processes, shuffle=True, drop_last=True)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    try:
        acc.load_state()  # the latest complete checkpoint
        acc.print(f"resumed at step {len(progress.losses)}")
    except FileNotFoundError:
        acc.print("no checkpoint yet: starting")

    total_steps = args.epochs * len(loader) // 2
    window = 0.0
    while len(progress.losses) < total_steps:
        for x, y in loader:
            with acc.accumulate(model):
                loss = model(x, y)["loss"]
                acc.backward(loss)
                window += acc.reduce(loss.detach(), "mean").item() / 2
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not acc.sync_gradients:
                continue
            progress.losses.append(window)
            window = 0.0
            step = len(progress.losses)
            if first_attempt and step == args.kill_at_step and acc.process_index == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if step % STEPS_PER_SAVE == 0:
                if first_attempt and step == STEPS_PER_SAVE * args.kill_in_save and acc.process_index == 0:
                    kill_while_writing("optimizer_0.bin")
                acc.save_state()
            if step == total_steps:
                break

    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        torch.save({"losses": progress.losses, "weights": weights}, args.out)
    acc.end_training()


if __name__ == "__main__":
    main()
