"""Bucket benchmark: recompiles and time over one epoch of variable-length batches, with and without
shape buckets, under dynamic=False and dynamic=None; one fresh process per row.

Depends on torch, transformers, kiln.buckets and kiln.compile only; never on the facade or a
distributed strategy.

Usage:
    python benchmarks/bucket_bench.py                        # aot_eager, 4 rows, about a minute on CPU
    python benchmarks/bucket_bench.py --backend inductor     # real kernels; slow on CPU (one gcc build per graph)
    python benchmarks/bucket_bench.py --rows a,b --examples 128 --multiple-of 16

Rows: (a) dynamic=False, no buckets; (b) dynamic=False, buckets; (c) dynamic=None (torch's
default), no buckets; (d) dynamic=None, buckets. "No buckets" pads each batch to its longest
sequence; "buckets" pads it up to a multiple of --multiple-of. Each row trains a Llama-style LM
for one epoch (forward, backward, AdamW) with its decoder layers compiled by
`kiln.compile_regions`, in its own subprocess with an empty Inductor/Triton cache.

The default backend is aot_eager (Dynamo + AOTAutograd, no code generation): on a 2-core CPU
Inductor takes tens of seconds per graph, and row (a) builds up to 8 graphs. Graph and eager-call
counts do not depend on the backend; times do, and the results name the backend used.

Per row: graphs (sum over regions), recompiles (graphs minus one per region), eager calls (block
calls that ran without compiled code because the recompile limit was hit: block invocations,
counted with a forward pre-hook, minus compiled calls), the epoch's wall time, and that time
split into steps that compiled a graph, steps where some block ran eagerly, and the other
(steady) steps. Results go to benchmarks/results/bucket_bench_<device>.{jsonl,md}; the table is
printed last.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Measure the kiln of this checkout, not whichever kiln happens to be installed.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from compile_bench import (cpu_model, load_warning, machine_line, parent_device, progress_error,  # noqa: E402
                           run_child, run_script_row, write_outputs)

ROWS = {  # name: (dynamic, buckets)
    "a": (False, False),
    "b": (False, True),
    "c": (None, False),
    "d": (None, True),
}
CHILD_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; `--child` (hidden) runs one row from a JSON spec."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=64, help="examples in the epoch")
    p.add_argument("--min-len", type=int, default=8, help="shortest example, tokens")
    p.add_argument("--max-len", type=int, default=128, help="longest example, tokens (uniform in between)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--multiple-of", type=int, default=32, help="bucket size for the rows with buckets")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend: aot_eager (default), inductor, ...")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of a (dynamic=False), b (dynamic=False "
                   "+ buckets), c (dynamic=None), d (dynamic=None + buckets)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for the result files")
    p.add_argument("--child", metavar="SPEC_JSON", help=argparse.SUPPRESS)  # one row, internal
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not args.rows:
        p.error(f"--rows: {', '.join(unknown) or 'nothing'} given; choose from: {', '.join(ROWS)}")
    if not 1 <= args.min_len <= args.max_len:
        p.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    for flag in ("examples", "batch", "multiple_of"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


# ---------------------------------------------------------------- child: one row per process

def make_examples(config: dict[str, Any]) -> list[dict[str, list[int]]]:
    """Token-id examples with lengths uniform in [min_len, max_len]; labels are the inputs (an LM)."""
    rng = random.Random(config["seed"])
    examples = []
    for _ in range(config["examples"]):
        ids = [rng.randrange(1, config["vocab"]) for _ in range(rng.randint(config["min_len"], config["max_len"]))]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return examples


def build_model(config: dict[str, Any], device: str) -> Any:
    """A Llama-style causal LM with seeded random weights, as in compile_bench."""
    import torch
    import transformers

    torch.manual_seed(config["seed"])
    cfg = transformers.LlamaConfig(
        num_hidden_layers=config["layers"], hidden_size=config["hidden"],
        num_attention_heads=config["heads"], num_key_value_heads=config["kv_heads"],
        intermediate_size=2 * config["hidden"], vocab_size=config["vocab"],
        max_position_embeddings=max(2048, config["max_len"]), use_cache=False, pad_token_id=0,
    )
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    # transformers 5 picks the loss through a logger.warning_once unless told (DESIGN.md pitfalls).
    model.config.loss_type = "ForCausalLM"
    model.loss_type = "ForCausalLM"
    return model


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile, train one epoch, and count graphs, eager calls and per-step times for one row."""
    import torch
    import transformers
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from kiln.buckets import BucketCollator
    from kiln.compile.regions import compile_regions, compiled_regions

    config, name = spec["config"], spec["row"]
    dynamic, bucketed = ROWS[name]
    device = config["device"]
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    model = build_model(config, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compile_regions(model, backend=config["backend"], dynamic=dynamic)
    regions = compiled_regions(model)
    block_paths = {p for r in regions for p in r.paths}
    invocations = 0

    def count_invocation(module: Any, args: Any) -> None:
        nonlocal invocations
        invocations += 1

    for path, module in model.named_modules():
        if path in block_paths:
            module.register_forward_pre_hook(count_invocation)

    # multiple_of=1 is plain padding to the batch's longest sequence: the "no buckets" baseline.
    collate = BucketCollator(pad_token_id=0, multiple_of=config["multiple_of"] if bucketed else 1)
    loader = DataLoader(make_examples(config), batch_size=config["batch"], shuffle=True,
                        generator=torch.Generator().manual_seed(config["seed"]), collate_fn=collate)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def totals() -> tuple[int, int, int]:
        return sum(r.graphs for r in regions), sum(r.calls for r in regions), invocations

    steps, seen = [], set()
    real_tokens = padded_tokens = 0
    epoch_start = time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        length = batch["input_ids"].shape[1]
        real_tokens += int(batch["attention_mask"].sum())
        padded_tokens += batch["input_ids"].numel()
        graphs0, calls0, inv0 = totals()
        sync()
        start = time.perf_counter()
        # use_cache=False: transformers 5's cache object recompiles every layer (DESIGN.md pitfalls).
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        seconds = time.perf_counter() - start
        graphs1, calls1, inv1 = totals()
        steps.append({"length": length, "ms": round(seconds * 1e3, 3), "new_length": length not in seen,
                      "compiled": graphs1 > graphs0, "eager_calls": (inv1 - inv0) - (calls1 - calls0),
                      "loss": round(loss.item(), 4)})
        seen.add(length)
    epoch_s = time.perf_counter() - epoch_start

    graphs, calls, total_invocations = totals()
    compiling = [s for s in steps if s["compiled"]]
    eager = [s for s in steps if not s["compiled"] and s["eager_calls"] > 0]
    steady = [s for s in steps if not s["compiled"] and s["eager_calls"] == 0]
    row = {
        "row": name, "dynamic": dynamic, "buckets": f"multiple_of={config['multiple_of']}" if bucketed else "none",
        "backend": config["backend"], "steps": len(steps), "distinct_lengths": len(seen),
        "new_length_steps": sum(s["new_length"] for s in steps),
        "graphs": graphs, "recompiles": graphs - len(regions), "graphs_per_region": [r.graphs for r in regions],
        "eager_calls": total_invocations - calls, "block_invocations": total_invocations, "compiled_calls": calls,
        "recompile_limit": torch._dynamo.config.recompile_limit,
        "epoch_s": round(epoch_s, 3),
        "compile_steps": len(compiling), "compile_steps_s": round(sum(s["ms"] for s in compiling) / 1e3, 3),
        "eager_steps": len(eager), "eager_steps_s": round(sum(s["ms"] for s in eager) / 1e3, 3),
        "steady_steps": len(steady), "steady_steps_s": round(sum(s["ms"] for s in steady) / 1e3, 3),
        "steady_median_ms": round(statistics.median(s["ms"] for s in steady), 3) if steady else None,
        "eager_median_ms": round(statistics.median(s["ms"] for s in eager), 3) if eager else None,
        "pad_fraction": round(1 - real_tokens / padded_tokens, 4),
        "backend_s": round(sum(r.backend.backend_seconds for r in regions), 3),
        "graph_breaks": sum(counters["graph_break"].values()),
        "regions": len(regions), "instances": sum(r.instances for r in regions),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": device, "device_name": cpu_model() if device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(), "attn_implementation": model.config._attn_implementation,
        "config": config, "step_log": steps,
    }
    if calls == 0:
        row["error"] = f"compiled code never ran (0 compiled calls over {len(regions)} regions)"
    return row


def child_main(spec_json: str) -> int:
    """Run one row; print it as the last stdout line; non-zero exit on any error."""
    return run_child(spec_json, measure, ("row",))


# ---------------------------------------------------------------- parent: one subprocess per row

def run_row(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """Measure one row in a fresh interpreter with an empty compiler cache, deleted afterwards."""
    return run_script_row(Path(__file__), {"row": name, "config": config}, config["device"])


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table, one line per row."""
    lines = ["| row | dynamic | buckets | lengths | graphs | recompiles | eager calls | epoch s "
             "| compiling steps: n, s | eager steps: n, s | steady steps: n, s, median ms | padding |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:80]} | | | | | | | | | | |")
            continue
        median = "-" if r["steady_median_ms"] is None else f"{r['steady_median_ms']:.0f}"
        lines.append(
            f"| {r['row']} | {r['dynamic']} | {r['buckets']} | {r['distinct_lengths']} | {r['graphs']} | "
            f"{r['recompiles']} | {r['eager_calls']} / {r['block_invocations']} | {r['epoch_s']:.1f} | "
            f"{r['compile_steps']}, {r['compile_steps_s']:.1f} | {r['eager_steps']}, {r['eager_steps_s']:.1f} | "
            f"{r['steady_steps']}, {r['steady_steps_s']:.1f}, {median} | {100 * r['pad_fraction']:.0f}% |")
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], config: dict[str, Any], out: Path) -> str:
    """Write the run's JSON lines and markdown table; return the text to print last."""
    stem = out / f"bucket_bench_{config['device']}"
    text = (
        f"Llama-style LM, {config['layers']} layers x {config['hidden']} wide, regional compile, backend "
        f"{config['backend']}; one epoch of {config['examples']} examples (lengths uniform in "
        f"[{config['min_len']}, {config['max_len']}], seed {config['seed']}), batch {config['batch']}, "
        f"forward + backward + AdamW, float32; {machine_line(rows, config)}.\n\n"
        "lengths: distinct padded lengths seen. graphs: summed over regions; recompiles: graphs minus one "
        "per region. eager calls: block calls that ran without compiled code (recompile limit hit), of all "
        "block calls. Steps are split into those that compiled a graph, those where a block ran eagerly, "
        "and the rest (steady). padding: share of the epoch's tokens that were padding.\n\n"
        f"{results_table(rows)}\n"
    )
    for r in rows:
        if "error" not in r and r["eager_calls"]:
            text += (f"\nRow {r['row']} hit Dynamo's recompile limit ({r['recompile_limit']}): {r['eager_calls']} of "
                     f"{r['block_invocations']} block calls ran eagerly, without compiled code.\n")
    return write_outputs(stem, rows, text + load_warning(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    device = parent_device(args.backend)
    config = {
        "examples": args.examples, "min_len": args.min_len, "max_len": args.max_len, "batch": args.batch,
        "multiple_of": args.multiple_of, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
        "kv_heads": args.kv_heads, "vocab": args.vocab, "seed": args.seed, "threads": args.threads,
        "backend": args.backend, "device": device,
    }
    rows = []
    for i, name in enumerate(args.rows, 1):
        dynamic, bucketed = ROWS[name]
        print(f"[{i}/{len(args.rows)}] row {name}: dynamic={dynamic}, buckets={'yes' if bucketed else 'no'} "
              f"({args.backend}, {device}) ...", end=" ", flush=True)
        row = run_row(name, config)
        rows.append(row)
        if progress_error(row):
            print(progress_error(row), flush=True)
        else:
            print(f"{row['graphs']} graphs, {row['eager_calls']} eager calls, epoch {row['epoch_s']:.1f} s, "
                  f"process {row['process_s']} s", flush=True)
    print(write_results(rows, config, args.out))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
