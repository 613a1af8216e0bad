"""One "machine" of a two-machine job on this host (test_compile_sharing.py): a tiny Llama under DDP with
regional compilation on the documented settings (aot_eager; precompiled regions are DDP's default), or
with --precompile-true precompile=True and fullgraph=True asked for, its own Kiln and Inductor folders; writes what it compiled, received and
ran, and its losses, to <out>.<rank>.json. With --reference, rank 0 also trains the plain PyTorch loop."""

import argparse
import json
import os
import resource
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_models import tiny_llama  # noqa: E402

from kiln import Accelerator, TorchDynamoPlugin  # noqa: E402
from kiln.compile.artifacts import sharing  # noqa: E402
from kiln.compile.regions import compiled_regions  # noqa: E402
from kiln.utils import set_seed  # noqa: E402

STEPS, BATCH, LENGTH, LR = 3, 4, 16, 1e-2


def batches() -> torch.Tensor:
    """The global batches, the same on every machine: (steps, batch, length) token ids."""
    return torch.randint(1, 97, (STEPS, BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def plain_losses() -> list[float]:
    """The plain PyTorch loop on one process over the whole global batch: the losses to match."""
    set_seed(0)
    model = tiny_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def pretend_other_torch() -> None:
    """This machine reports another torch version, as a machine with another install would."""
    real = sharing.bundle.machine_key
    sharing.bundle.machine_key = lambda device: dict(real(device), torch="2.99.0+fake")


def die_before_receiving() -> None:
    """This machine exits at the transfer, as a node that dies mid-transfer."""
    def exit_now(payload, source_rank, group):
        print("share_worker: exiting before the transfer", file=sys.stderr, flush=True)
        os._exit(3)
    sharing._broadcast = exit_now


def stall_before_sending() -> None:
    """This machine stops answering at the transfer (alive, but stuck) for longer than the time-out."""
    import time

    def stall(payload, source_rank, group):
        print("share_worker: stalling at the transfer", file=sys.stderr, flush=True)
        time.sleep(300)
    sharing._broadcast = stall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--other-torch", action="store_true", help="machine 1 reports another torch version")
    parser.add_argument("--die", action="store_true", help="machine 1 exits right before the transfer")
    parser.add_argument("--stall", action="store_true", help="machine 1 stalls at the transfer")
    parser.add_argument("--uneven", action="store_true", help="machine 1's sequences are 2 tokens shorter")
    parser.add_argument("--reference", action="store_true", help="rank 0 also runs the plain loop")
    parser.add_argument("--save-at", type=int, default=None, help="save_state to --checkpoint after this many steps")
    parser.add_argument("--resume", action="store_true", help="load_state from --checkpoint, then its later steps")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--precompile-true", action="store_true", help="precompile=True, fullgraph=True asked for")
    args = parser.parse_args()
    node = int(os.environ["GROUP_RANK"])
    if args.other_torch and node == 1:
        pretend_other_torch()
    if args.die and node == 1:
        die_before_receiving()
    if args.stall and node == 1:
        stall_before_sending()

    set_seed(0)
    if args.precompile_true:
        plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, dynamic=False,
                                   use_regional_compilation=True, precompile=True)
    else:  # the documented settings, nothing about precompiling or whole graphs
        plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    acc = Accelerator(dynamo_plugin=plugin)
    model = tiny_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = acc.prepare(model, optimizer)
    losses = []
    half = BATCH // acc.num_processes
    start = 0
    if args.resume:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.load_state(args.checkpoint)
        load_warnings = [f"{w.category.__name__}: {w.message}" for w in caught]
        start = args.save_at
    for step, ids in enumerate(batches()):
        if step < start:
            continue
        if step == args.save_at and not args.resume:
            acc.save_state(args.checkpoint)
        mine = ids[acc.process_index * half:(acc.process_index + 1) * half]
        if args.uneven and node == 1:
            mine = mine[:, :-2]
        loss = model(input_ids=mine, labels=mine, use_cache=False).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())

    regions = [r for r in compiled_regions(acc.unwrap_model(model)) if r.precompiled is not None]
    stats = [r.precompiled.stats for r in regions]
    record = {"node": node, "losses": losses, "compiled": sum(s.compiled for s in stats),
              "received": sum(s.received for s in stats), "loaded": sum(s.loaded for s in stats),
              "precompiled_calls": sum(s.calls for s in stats), "notes": [n for s in stats for n in s.notes],
              "jit_calls": sum(r.backend.calls for r in regions),
              "artifacts": [p.name for r in regions for p in sorted(r.precompiled.directory.glob("*.kpc"))],
              "share_seconds": sum(s.share_seconds for s in stats),
              "traces": torch._dynamo.utils.counters["stats"]["unique_graphs"],
              "precompile": plugin.precompile, "plugin_notes": list(plugin.notes)}
    if args.resume:
        record["load_warnings"] = load_warnings
    if acc.process_index == 0:  # evaluation on one process: a signature the other machine never meets
        with torch.no_grad():
            acc.unwrap_model(model)(input_ids=batches()[0][:1], use_cache=False)
    record["eval_compiled"] = sum(s.compiled for s in stats) - record["compiled"]
    record["eval_precompiled_calls"] = sum(s.calls for s in stats) - record["precompiled_calls"]
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    record["cpu_s"] = sum(u.ru_utime + u.ru_stime for u in usage)
    acc.end_training()
    if args.reference and acc.process_index == 0:
        record["plain_losses"] = plain_losses()
    with open(f"{args.out}.{acc.process_index}.json", "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main()
