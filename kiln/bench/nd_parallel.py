"""The nd-parallel suite of `kiln bench`: one training job on local processes in each parallel
layout, with regional compile: what each layout costs in speed and in memory per process.

Each row starts `processes` processes under torch.distributed.run (empty Kiln and Inductor
folders); every process builds the same Llama, prepares it through `Accelerator(parallelism_config=
...)` with the variant's layout and trains on one global batch, its share of it per data-parallel
rank:
    ddp        dp_replicate = processes (every process holds the whole model)
    fsdp2      dp_shard = processes
    hsdp       dp_replicate 2 x dp_shard processes/2
    tp-fsdp2   dp_shard processes/2 x tp 2 (each block's projections split over 2)
    cp-fsdp2   dp_shard processes/2 x cp 2 (each sequence split over 2, ring attention; labels
               shifted ahead and positions given, as context parallelism needs them)
Measured on each process: the first step (compile included), the median of the steady steps, the
bytes of model state it holds (its shards of the parameters, their gradients and AdamW's state)
and its peak resident memory. Tokens per second are the job's: the global batch over the slowest
process's median step.

Depends on the standard library, kiln.bench.plan and kiln.bench.child's result line; the measuring
side (`measure`) imports torch and Kiln in the children.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from typing import Any

from kiln.bench.child import RESULT_PREFIX
from kiln.bench.plan import MODEL_SIZES, measured

VARIANTS = ("ddp", "fsdp2", "hsdp", "tp-fsdp2", "cp-fsdp2")


def layout(variant: str, processes: int) -> dict[str, int]:
    """The ParallelismConfig sizes of a variant on `processes` processes."""
    half = max(1, processes // 2)
    return {"ddp": {"dp_replicate_size": processes}, "fsdp2": {"dp_shard_size": processes},
            "hsdp": {"dp_replicate_size": 2, "dp_shard_size": half},
            "tp-fsdp2": {"dp_shard_size": half, "tp_size": 2},
            "cp-fsdp2": {"dp_shard_size": half, "cp_size": 2}}[variant]


def command(row: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={row['processes']}",
            "-m", "kiln.bench.child", json.dumps(row)]


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """One process's share of the row (run under torch.distributed.run)."""
    import torch
    import transformers

    from kiln import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, TorchDynamoPlugin
    from kiln.parallel.parallelism_config import data_shard

    torch.set_num_threads(row.get("threads") or 1)
    sizes = layout(row["variant"], row["processes"])
    config = ParallelismConfig(**sizes)
    plugin = TorchDynamoPlugin(backend=row["backend"], use_regional_compilation=True)
    acc = Accelerator(parallelism_config=config, dynamo_plugin=plugin,
                      fsdp_plugin=FullyShardedDataParallelPlugin() if config.dp_shard_enabled or config.cp_enabled else None)
    torch.manual_seed(row["seed"])
    llama = transformers.LlamaConfig(**MODEL_SIZES[row["model"]], use_cache=False,
                                     max_position_embeddings=max(2048, row["seq"]))
    model = transformers.LlamaForCausalLM(llama)
    model.loss_type = "ForCausalLM"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    readers, reader = data_shard(acc.parallelism_config, acc.torch_device_mesh, acc.num_processes, acc.process_index)
    ids = torch.randint(0, llama.vocab_size, (row["batch"], row["seq"]), generator=torch.Generator().manual_seed(1))
    share = row["batch"] // readers
    local = ids[reader * share:(reader + 1) * share]

    shifted = torch.cat([local[:, 1:], torch.full_like(local[:, :1], -100)], dim=1)
    positions = torch.arange(row["seq"]).expand_as(local)

    def step() -> None:
        if not config.cp_enabled:
            loss = model(input_ids=local, labels=local).loss
            acc.backward(loss)
        else:  # each process keeps its slice of the step's own copies
            sliced = [local.clone(), shifted.clone(), positions.clone()]
            with acc.maybe_context_parallel(buffers=sliced, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(sliced)):
                ids_, labels_, positions_ = sliced
                loss = model(input_ids=ids_, labels=labels_, shift_labels=labels_, position_ids=positions_).loss
                acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    for _ in range(row["warmup"]):
        step()
    times = []
    for _ in range(row["steps"]):
        acc.wait_for_everyone()  # each step starts together: the median is the job's, not one process's
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(row, rank=acc.process_index, first_s=round(first_s, 2),
                step_ms=round(1000 * statistics.median(times), 2), state_mib=round(state_bytes(model, optimizer) / 2**20, 3),
                rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), layout=sizes,
                torch=torch.__version__, threads=torch.get_num_threads())


def state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of the parameters, gradients and optimizer state this process holds (its shards)."""
    import torch

    def local(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return total + sum(local(v) for state in optimizer.state.values() for v in state.values())


def combine(stdout: str, row: dict[str, Any]) -> dict[str, Any] | None:
    """The row from every process's result line: the slowest step, the largest state and memory."""
    decoder = json.JSONDecoder()
    ranks = [decoder.raw_decode(chunk)[0] for chunk in stdout.split(RESULT_PREFIX)[1:]]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return dict(row, error=errors[0])
    if len(ranks) != row["processes"]:
        return None
    ranks.sort(key=lambda r: r["rank"])
    result = dict(ranks[0])
    step_ms = max(r["step_ms"] for r in ranks)
    result.update(first_s=max(r["first_s"] for r in ranks), step_ms=step_ms,
                  tokens_per_s=round(row["batch"] * row["seq"] / (step_ms / 1000), 1),
                  state_mib=max(r["state_mib"] for r in ranks), rss_mib=max(r["rss_mib"] for r in ranks),
                  ranks_state_mib=[r["state_mib"] for r in ranks])
    return result


def table(rows: list[dict[str, Any]]) -> str:
    base = {(r["model"], r["processes"]): r for r in measured(rows) if r["variant"] == "fsdp2"}
    lines = ["| model | variant | layout | processes | first step s | step ms | tokens/s (x fsdp2) | "
             "model state MiB per process (x fsdp2) | peak RSS MiB per process |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        head = f"| {r['model']} | {r['variant']} |"
        if r not in measured(rows):
            lines.append(f"{head} {(r.get('error') or r.get('skipped'))[:80]} |" + " |" * 6)
            continue
        ref = base.get((r["model"], r["processes"]))
        speed = f" ({r['tokens_per_s'] / ref['tokens_per_s']:.2f}x)" if ref else ""
        state = f" ({r['state_mib'] / ref['state_mib']:.2f}x)" if ref else ""
        shape = " x ".join(f"{k.removesuffix('_size')} {v}" for k, v in r["layout"].items())
        lines.append(f"{head} {shape} | {r['processes']} | {r['first_s']:.1f} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f}{speed} | {r['state_mib']:.2f}{state} | {r['rss_mib']:.0f} |")
    return "\n".join(lines)


def render(rows: list[dict[str, Any]]) -> str:
    return ("Parallel layouts (torch.distributed.run on this machine, gloo, one thread a process, regional "
            "compile, a training step with AdamW on one global batch): the first step (compile included) and "
            "the median steady step of the slowest process; model state = the parameters, gradients and "
            "optimizer state a process holds (the largest).\n\n" + table(rows) + "\n")


def target_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return []  # the issue asks for these numbers beside one another, not for limits


def progress(result: dict[str, Any]) -> str:
    return (f"first step {result['first_s']:.1f} s, step {result['step_ms']:.1f} ms, "
            f"{result['tokens_per_s']:.0f} tokens/s, state {result['state_mib']:.2f} MiB a process")
