"""Accelerate's API across processes, for tests/distributed/test_accelerate_api_processes.py: started
by torch.distributed.run with 2 processes; each process writes what it saw to <out>.<rank>.json."""

import argparse
import datetime
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kiln import (Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs,  # noqa: E402
                  InitProcessGroupKwargs, ProfileKwargs)
from kiln.utils import broadcast_object_list, gather_object  # noqa: E402


def scheduler_ticks(acc: Accelerator, steps: int) -> int:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: 1.0)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    for _ in range(steps):
        acc.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return scheduler.scheduler.last_epoch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["plain", "split", "uneven"], required=True)
    args = parser.parse_args()
    seen: dict = {}
    data = TensorDataset(torch.arange(10.0).unsqueeze(1))

    if args.mode == "plain":
        handlers = [DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16"),
                    InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=321))]
        acc = Accelerator(kwargs_handlers=handlers)
        seen["state"] = repr(acc.state)
        seen["ticks"] = scheduler_ticks(acc, steps=3)
        ddp = acc._models[0]
        seen["find_unused_parameters"] = ddp.find_unused_parameters
        seen["comm_hooks"] = [hook.__name__ for hook, _ in ddp._comm_hooks]
        seen["objects"] = gather_object({"rank": acc.process_index})
        boxed = [f"from {acc.process_index}", acc.process_index]
        seen["broadcast"] = broadcast_object_list(boxed)
        if acc.process_index == 1:
            acc.set_trigger()
        seen["trigger"] = [acc.check_trigger(), acc.check_trigger()]
        marker = args.out + ".first"
        with acc.local_main_process_first():
            seen["marker_existed"] = os.path.exists(marker)
            if acc.is_local_main_process:
                open(marker, "w").close()
        if acc.is_main_process:  # only the main process calls it: it must not wait for the others
            acc.save({"x": torch.ones(2)}, args.out + ".saved.pt")
        acc.wait_for_everyone()
        traces = args.out + ".traces"
        with acc.profile(ProfileKwargs(output_trace_dir=traces)):
            torch.randn(32, 32) @ torch.randn(32, 32)
        seen["traces_after_profile"] = sorted(os.listdir(traces))  # every process has written by now

    elif args.mode == "split":
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
        loader = acc.prepare(DataLoader(data, batch_size=4))
        seen["batches"] = [batch[0].squeeze(1).tolist() for batch in loader]
        seen["ticks"] = scheduler_ticks(acc, steps=3)

    else:  # uneven: 5 batches of 2 over 2 processes, not evened out; DDP trains through join
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=2))
        seen["length"] = len(loader)
        seen["batches"] = []
        with acc.join_uneven_inputs([model]):
            for (x,) in loader:
                seen["batches"].append(x.squeeze(1).tolist())
                acc.backward(model(x).sum())
                optimizer.step()
                optimizer.zero_grad()
        seen["weights_equal"] = gather_object(model.module.weight.item())
        with acc.join_uneven_inputs([], even_batches=True):  # collectives need every process: even out
            evaluated = [acc.gather_for_metrics(x) for (x,) in loader]
        seen["gathered"] = sorted(torch.cat(evaluated).squeeze(1).tolist())
    acc.end_training()  # as Accelerate's: leaves the process group Kiln started
    seen["group_after_end_training"] = torch.distributed.is_initialized()
    with open(f"{args.out}.{acc.process_index}.json", "w") as handle:
        json.dump(seen, handle)


if __name__ == "__main__":
    main()
