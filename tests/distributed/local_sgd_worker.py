"""Local SGD over two processes, for tests/distributed/test_local_sgd_processes.py: started by a launcher
(local_launch.py); each process writes what it saw to <out>.<rank>.pt.

From one initial model and per-process data it trains a tiny Llama five ways: Kiln's LocalSGD
(regional compile inside DDP), with and without gradient accumulation; the local SGD loop a user
writes with plain torch.distributed; Kiln's LocalSGD with enabled=False; and a plain torch DDP loop.
Each run records this process's loss and parameters after every step, and after the `with` block.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_models import tiny_llama  # noqa: E402

from kiln import Accelerator, TorchDynamoPlugin  # noqa: E402
from kiln.compile.regions import compiled_regions  # noqa: E402
from kiln.local_sgd import LocalSGD  # noqa: E402

MICRO_BATCHES = 8
LR = 1e-2


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def new_model(initial: dict) -> torch.nn.Module:
    model = tiny_llama(layers=2, width=64, init_std=0.08)
    model.load_state_dict(initial)
    return model


def loss_of(model, tokens):
    return model(input_ids=tokens, labels=tokens, use_cache=False)["loss"]


def kiln_run(initial, batches, local_sgd_steps, enabled, accumulation=1):
    """What an Accelerate script does with LocalSGD (by_feature/local_sgd.py), imports changed."""
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, dynamic=False, use_regional_compilation=True)
    acc = Accelerator(dynamo_plugin=plugin, gradient_accumulation_steps=accumulation)
    model = new_model(initial)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses, params = [], []
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=local_sgd_steps, enabled=enabled) as local_sgd:
        for tokens in batches:
            with acc.accumulate(model):
                loss = loss_of(model, tokens)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            losses.append(loss.item())
            params.append(flat(acc.unwrap_model(model)))
    calls = sum(region.calls for region in compiled_regions(acc.unwrap_model(model)))
    report = acc.compile_report().regions
    outside = ""
    try:  # step() where gradients are still all-reduced: refused
        LocalSGD(accelerator=acc, model=model, local_sgd_steps=local_sgd_steps, enabled=enabled).step()
    except RuntimeError as error:
        outside = str(error)
    return {"losses": losses, "params": torch.stack(params), "final": flat(acc.unwrap_model(model)),
            "compiled_calls": calls, "eager_calls": sum(r.eager_calls for r in report),
            "recompiles": sum(r.recompiles for r in report), "step_outside": outside}


def plain_local_sgd(initial, batches, local_sgd_steps, accumulation=1):
    """The local SGD loop written with torch.distributed alone: each process steps on its own
    gradients; every `local_sgd_steps` micro-batches, and at the end, parameters are averaged."""
    model = new_model(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    world = dist.get_world_size()

    def average():
        with torch.no_grad():
            for param in model.parameters():
                dist.all_reduce(param, op=dist.ReduceOp.SUM)
                param /= world

    losses, params = [], []
    for index, tokens in enumerate(batches, start=1):
        loss = loss_of(model, tokens)
        (loss / accumulation).backward()
        if index % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
        if index % local_sgd_steps == 0:
            average()
        losses.append(loss.item())
        params.append(flat(model))
    if len(batches) % local_sgd_steps:
        average()
    return {"losses": losses, "params": torch.stack(params), "final": flat(model)}


def plain_ddp(initial, batches):
    """Plain data parallel training: gradients all-reduced every step."""
    model = DistributedDataParallel(new_model(initial))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, params = [], []
    for tokens in batches:
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        params.append(flat(model.module))
    return {"losses": losses, "params": torch.stack(params), "final": flat(model.module)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # The plain loops need no Kiln: the group is torch's own, and Kiln's Accelerators join it.
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in tiny_llama(layers=2, width=64, init_std=0.08).state_dict().items()}
    every = torch.randint(0, 97, (dist.get_world_size(), MICRO_BATCHES, 2, 16),
                          generator=torch.Generator().manual_seed(1))
    batches = list(every[rank])  # each process its own data
    seen = {
        "kiln_local": kiln_run(initial, batches, local_sgd_steps=3, enabled=True),
        "plain_local": plain_local_sgd(initial, batches, local_sgd_steps=3),
        "kiln_local_accumulate": kiln_run(initial, batches, local_sgd_steps=4, enabled=True, accumulation=2),
        "plain_local_accumulate": plain_local_sgd(initial, batches, local_sgd_steps=4, accumulation=2),
        "kiln_disabled": kiln_run(initial, batches, local_sgd_steps=3, enabled=False),
        "plain_ddp": plain_ddp(initial, batches),
    }
    torch.save(seen, f"{args.out}.{rank}.pt")
    dist.barrier()
    time.sleep(0.2)  # let gloo's thread free the barrier's work first (kiln.state._leave_process_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
