"""A training script as written for Hugging Face Accelerate's single-process API; only the two
imports below differ from the Accelerate version (`from accelerate import ...`)."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from kiln import Accelerator
from kiln.logging import get_logger
from kiln.utils import set_seed

logger = get_logger(__name__)


def main():
    set_seed(42)
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    first = last = None
    for epoch in range(5):
        model.train()
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            first = loss.item() if first is None else first
            last = loss.item()
        logger.info(f"epoch {epoch} loss {last:.4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        accelerator.save_model(unwrapped, "out/accelerate_style")
    accelerator.print(f"distributed_type={accelerator.distributed_type} processes={accelerator.num_processes} "
                      f"device={accelerator.device} first={first:.4f} last={last:.4f}")


if __name__ == "__main__":
    main()
