"""`kiln bench`: every benchmark Kiln publishes, as plans: the compile benchmark (eager, full, regional;
Kiln's and Accelerate's) by model and batch, warm starts (`--plan warm-start`), start-up of whole jobs
(`--plan startup`), cold starts of local processes (`--plan local-processes`), shape buckets
(`--plan buckets`) and gradient checkpointing's memory (`--plan checkpointing`).

Depends on kiln.bench only; never on the facade.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from kiln.bench.plan import (ACCELERATE_METHODS, ALL_MODELS, METHODS, MODES, PLANS, SUITE_VARIANTS, WORKLOADS,
                             build_rows, check_choices)
from kiln.bench.report import load_rows, write_results
from kiln.bench.run import progress_head, progress_tail, run_rows

DEFAULT_OUT = Path("kiln_bench_results")


def add_parser(commands: Any) -> None:
    """Register `bench` on the top-level subparsers."""
    parser = commands.add_parser(
        "bench", help="measure eager, full and regional compile (Kiln's and Accelerate's)",
        description="Compile time, steady step time, peak memory and speedup over eager for Llama-style "
                    "models with random weights, one fresh process with an empty compiler cache per row. "
                    "The default plan on a CPU (`cpu`: 19 rows; a 4-layer model for inference at batch 1, "
                    "4 and 16 and a training step at batch 4, a 12-layer one for inference at batch 4) "
                    "takes about 8 minutes on 2 cores; on a GPU the "
                    "default is `gpu` (1B, 3B, 8B; budget it with --budget). `--plan warm-start`: the first "
                    "training step of fresh processes whose Kiln cache folder holds nothing, part or all of "
                    "a cold run's (about 2 minutes); `--plan buckets`: recompiles and time over one epoch of "
                    "variable-length batches with and without shape buckets (about a minute, aot_eager); "
                    "`--plan host-overhead`: every variant of a thin model in one process, stepped in turn, "
                    "with step-time ratios to a full compile (about 12 minutes); "
                    "`--plan checkpointing`: activation memory and step time with transformers' gradient "
                    "checkpointing, eager and regionally compiled (about 2 minutes); "
                    "`--plan local-processes`: cold starts of 1 and 2 local processes, CPU-seconds of the "
                    "whole process tree (about 3 minutes); `--plan nd-parallel`: DDP, FSDP2, HSDP, and tensor "
                    "and context parallel inside FSDP2 on 4 local processes, tokens per second and model state "
                    "per process (about 4 minutes).")
    parser.add_argument("--plan", choices=list(PLANS), default=None,
                        help="what to measure (default: gpu on a CUDA device, else cpu)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default: the plan's, inductor but for buckets' aot_eager; "
                             "aot_eager checks logic fast)")
    parser.add_argument("--variants", type=_list, default=None,
                        help="comma list replacing a suite plan's variants: "
                             + "; ".join(f"{suite}: {', '.join(v)}" for suite, v in SUITE_VARIANTS.items() if suite != "compile"))
    parser.add_argument("--models", type=_list, default=None,
                        help=f"comma list replacing the plan's models: {', '.join(ALL_MODELS)}")
    parser.add_argument("--workloads", type=_list, default=None, help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--batch-sizes", type=_int_list, default=None, help="comma list, e.g. 1,4,16")
    parser.add_argument("--methods", type=_list, default=None, help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--modes", type=_list, default=None, help=f"compile modes, comma list of {', '.join(MODES)}")
    parser.add_argument("--seq", type=int, default=None, help="sequence length for every row")
    parser.add_argument("--steps", type=int, default=None, help="steady steps timed per row (the median is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--processes", type=_int_list, default=None,
                        help="comma list of local process counts replacing the local-processes plan's (1,2)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every row N times, round-robin, each in a fresh process; the table "
                             "shows the median and the spread (the noise between processes)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run; rows that would start later are skipped")
    parser.add_argument("--row-timeout", type=float, default=1800, help="seconds before one row is stopped")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default: ./{DEFAULT_OUT})")
    parser.add_argument("--name", default=None, help="file name stem (default: kiln_bench_<plan>)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--list", action="store_true", help="print the rows the plan would measure and exit")
    parser.add_argument("--render", type=Path, default=None, metavar="JSONL",
                        help="write the table and plots of an earlier run's .jsonl without measuring")
    parser.set_defaults(run=run)


def _list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _int_list(value: str) -> list[int]:
    try:
        return [int(v) for v in _list(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {value!r}") from None


def resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    return choice


def plan_rows(args: argparse.Namespace, device: str, with_accelerate: bool) -> list:
    """The rows to measure, after checking every name given on the command line."""
    import torch

    if args.models:
        check_choices(args.models, ALL_MODELS, "model")
    if args.workloads:
        check_choices(args.workloads, WORKLOADS, "workload")
    if args.methods:
        check_choices(args.methods, METHODS, "method")
        wanted = [m for m in args.methods if m in ACCELERATE_METHODS]
        if wanted and not with_accelerate:
            raise ValueError(f"{', '.join(wanted)} asked for, but accelerate is not installed "
                             "(pip install accelerate, or the 'bench' extra)")
    if args.modes:
        check_choices(args.modes, MODES, "mode")
    if args.variants:
        suites = {group.suite for group in PLANS[args.plan]}
        check_choices(args.variants, [v for suite in suites for v in SUITE_VARIANTS[suite] if v], f"variant of plan {args.plan}")
    if args.backend is not None and args.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"unknown backend {args.backend!r}; choose one of: "
                         f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}")
    for flag, value in (("--steps", args.steps), ("--seq", args.seq), ("--threads", args.threads),
                        ("--repeat", args.repeat)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.batch_sizes and min(args.batch_sizes) < 1:
        raise ValueError(f"batch sizes must be at least 1, got {args.batch_sizes}")
    if args.processes:
        if "local-processes" not in {group.suite for group in PLANS[args.plan]}:
            raise ValueError(f"--processes applies to the local-processes plan, not to plan {args.plan}")
        if min(args.processes) < 1:
            raise ValueError(f"process counts must be at least 1, got {args.processes}")
    return build_rows(args.plan, device=device, backend=args.backend, models=args.models,
                      workloads=args.workloads, batches=args.batch_sizes, methods=args.methods,
                      modes=args.modes, seq=args.seq, steps=args.steps, threads=args.threads,
                      variants=args.variants, processes=args.processes, with_accelerate=with_accelerate)


def run(args: argparse.Namespace) -> int:
    want_plots = not args.no_plots
    if want_plots and importlib.util.find_spec("matplotlib") is None:
        print("note: matplotlib is not installed, so no plots (pip install matplotlib, or the 'bench' extra)")
        want_plots = False
    if args.render:
        text, files = write_results(load_rows(args.render), args.out, args.name or args.render.stem, want_plots)
        print(f"wrote {', '.join(map(str, files))}\n\n{text}")
        return 0
    with_accelerate = importlib.util.find_spec("accelerate") is not None
    try:
        device = resolve_device(args.device)
        args.plan = args.plan or ("gpu" if device == "cuda" else "cpu")
        rows = plan_rows(args, device, with_accelerate)
    except ValueError as error:
        print(f"kiln bench: {error}", file=sys.stderr)
        return 2
    if not with_accelerate and not args.methods:
        print("note: accelerate is not installed, so its methods are left out (pip install accelerate)")
    if args.list:
        for index, row in enumerate(rows):
            print(f"[{index + 1}/{len(rows)}] {row.label} (seq {row.seq}, {row.backend}, {row.device})")
        return 0
    distinct = len(rows)
    rows = [row for _ in range(args.repeat) for row in rows]  # round-robin: slow drifts hit every row alike
    backends = ", ".join(dict.fromkeys(row.backend for row in rows))
    caches = ("its cache folder as its variant says" if {row.suite for row in rows} == {"warm-start"}
              else "an empty compiler cache")
    print(f"kiln bench: plan {args.plan}, {len(rows)} rows on {device}, backend {backends}; "
          f"each row is a fresh process with {caches}", flush=True)

    def head(index: int, row: Any) -> str:
        run_note = f" (run {index // distinct + 1}/{args.repeat})" if args.repeat > 1 else ""
        return progress_head(index, len(rows), row, run_note)

    def on_start(index: int, row: Any) -> None:
        print(head(index, row), end=" ", flush=True)

    def on_row(index: int, row: Any, result: dict[str, Any]) -> None:
        if "skipped" in result:
            print(head(index, row), end=" ")
        print(progress_tail(result), flush=True)
        if "stderr_tail" in result:
            print(result["stderr_tail"][-1500:], flush=True)

    results = run_rows(rows, row_timeout_s=args.row_timeout, budget_s=args.budget,
                       on_start=on_start, on_row=on_row)
    text, files = write_results(results, args.out, args.name or f"kiln_bench_{args.plan}", want_plots)
    print(f"\nwrote {', '.join(map(str, files))}\n\n{text}", flush=True)
    return 1 if any("error" in r for r in results) else 0
