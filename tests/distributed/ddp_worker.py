"""One training run for the multi-process tests; started by torch.distributed.run (or alone).

Writes, from the main process, a JSON file with the global loss of every optimizer step, the
compiled calls of every rank, a checksum of the parameters on every rank and the gathered
evaluation targets.
"""

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_models import Regressor  # noqa: E402

from kiln import Accelerator, TorchDynamoPlugin  # noqa: E402
from kiln.compile.regions import compiled_regions  # noqa: E402
from kiln.utils import set_seed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=6)
    parser.add_argument("--precision", default="no")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--eval-samples", type=int, default=10)
    args = parser.parse_args()

    set_seed(0)
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, dynamic=False,
                               use_regional_compilation=True)
    acc = Accelerator(dynamo_plugin=plugin, mixed_precision=args.precision,
                      gradient_accumulation_steps=args.grad_accum)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.samples, 3, 8, generator=generator), torch.randn(args.samples, 3, generator=generator)
    per_process = args.global_batch // acc.num_processes
    loader = DataLoader(TensorDataset(x, y), batch_size=per_process, shuffle=False, drop_last=True)
    eval_data = TensorDataset(torch.arange(args.eval_samples, dtype=torch.float32))
    eval_loader = DataLoader(eval_data, batch_size=3)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader, eval_loader = acc.prepare(model, optimizer, loader, eval_loader)

    losses, window = [], 0.0
    for inputs, targets in loader:
        with acc.accumulate(model):
            loss = model(inputs, targets)["loss"]
            acc.backward(loss)
            window += acc.reduce(loss.detach(), "mean").item() / args.grad_accum
            optimizer.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            losses.append(window)
            window = 0.0

    seen = []
    for (values,) in eval_loader:
        seen.append(acc.gather_for_metrics(values))
    calls = sum(r.calls for r in compiled_regions(acc.unwrap_model(model)))
    checksum = sum(p.double().sum().item() for p in acc.unwrap_model(model).parameters())
    all_calls = acc.gather(torch.tensor([calls])).tolist()
    all_checksums = acc.gather(torch.tensor([checksum], dtype=torch.float64)).tolist()
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "calls": all_calls, "checksums": all_checksums,
                       "eval": torch.cat(seen).tolist(), "processes": acc.num_processes,
                       "distributed_type": str(acc.distributed_type.value)}, handle)
    acc.end_training()


if __name__ == "__main__":
    main()
