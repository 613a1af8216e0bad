"""Warm-start benchmark: the first training step of a regional-compiled LM, cold against warm caches.

Depends on torch, transformers, kiln.compile and compile_bench.py beside it (model, CPU-load probe);
never on the facade or a distributed strategy (matplotlib is optional: without it the plot is skipped).

Usage:
    python benchmarks/warm_start_bench.py                         # inductor, 4 rows, a few minutes on CPU
    python benchmarks/warm_start_bench.py --layers 12 --hidden 256

Every row is a fresh interpreter that does what a training job does with Kiln's compile cache:
CompileCache().activate(), key, load, compile_regions, first step (timed), steady steps, save.
The rows differ only in what lies in the cache folder when the process starts:
    cold                    nothing (empty Kiln folder, empty Inductor folder); it saves the entry
    warm-inductor-dir-only  a copy of cold's Inductor folder, no Kiln entry (so no artifact load)
    warm-artifacts-only     a copy of cold's Kiln entry, an empty Inductor folder
    warm                    both (Kiln's default set-up: the same folder as the previous run)
"first s" is load + first step: what a warm start saves; "compile s" is that minus the median
steady step. Results go to benchmarks/results/warm_start_bench_<device>.{jsonl,md,png}; the table
is printed last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Measure the kiln of this checkout, and reuse compile_bench's model and load probe.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from compile_bench import (build_model, machine_line, model_config, parent_device, peak_memory,  # noqa: E402
                           progress_error, pyplot, run_child, run_script_row, write_outputs)

ROWS = ("cold", "warm-inductor-dir-only", "warm-artifacts-only", "warm")
CHILD_TIMEOUT_S = 1800
TARGET_RATIO = 0.25
# Compilation-metrics fields summed over every compiled frame: where the warm path spends its time.
COUNT_FIELDS = ("aotautograd_local_cache_hit_count", "aotautograd_local_cache_miss_count",
                "inductor_fx_local_cache_hit_count", "inductor_fx_local_cache_miss_count")
TIME_FIELDS_US = ("dynamo_cumulative_compile_time_us", "aot_autograd_cumulative_compile_time_us",
                  "inductor_cumulative_compile_time_us", "backward_cumulative_compile_time_us")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2 x hidden")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="steady steps timed after the first one")
    p.add_argument("--repeats", type=int, default=1, help="run the four rows this many times; ratios use medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (only inductor saves artifacts)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for the result files")
    p.add_argument("--child", metavar="SPEC_JSON", help=argparse.SUPPRESS)  # one measurement, internal
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error(f"--steps and --repeats must be at least 1, got {args.steps} and {args.repeats}")
    return args


# ---------------------------------------------------------------- child: one measurement per process

def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One job start with whatever the cache folder holds: load, compile, first step, steady steps, save."""
    import torch
    from torch._dynamo.utils import get_compilation_metrics

    from kiln.compile.cache import CompileCache
    from kiln.compile.regions import compile_regions, compiled_regions

    config = spec["config"]
    device = config["device"]
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    model, ids = build_model(config, device)
    model.train()
    model.config.loss_type = model.loss_type = "ForCausalLM"  # see compile_bench.measure
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    cache = CompileCache()  # KILN_COMPILE_CACHE_DIR, set by the parent
    cache.activate()
    start = time.perf_counter()
    key = cache.key(model, {"backend": config["backend"]}, torch.device(device))
    hit = cache.load(key)
    load_s = time.perf_counter() - start
    compile_regions(model, backend=config["backend"])

    losses = []  # the same in every row if warm code computes what cold code did

    def step() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - begin
        losses.append(float(loss))
        return elapsed

    first_s = step()
    metrics = list(get_compilation_metrics())  # the first step's compiles only
    steady = [step() for _ in range(config["steps"])]
    start = time.perf_counter()
    saved = cache.save(key)
    save_s = time.perf_counter() - start
    median_s = statistics.median(steady)
    peak_mib, _, device_name = peak_memory(device)
    regions = compiled_regions(model)
    row = {
        "row": spec["row"], "hit": hit, "saved": saved, "load_s": round(load_s, 3),
        "first_step_s": round(first_s, 3), "first_s": round(load_s + first_s, 3),
        "compile_s": round(load_s + first_s - median_s, 3), "steady_ms": round(median_s * 1e3, 3),
        "step_ms": [round(s * 1e3, 3) for s in steady], "save_s": round(save_s, 3),
        "losses": [round(v, 6) for v in losses], "graphs": sum(r.graphs for r in regions),
        "compiled_calls": sum(r.calls for r in regions), "frames_compiled": len(metrics),
        "cache_stats": cache.stats.as_dict(), "inductor_dir_source": cache.inductor_dir_source,
        "peak_mib": round(peak_mib, 1),
        "torch": torch.__version__, "device": device, "device_name": device_name,
        "threads": torch.get_num_threads(), "config": config,
    }
    for name in COUNT_FIELDS:
        row[name] = sum(getattr(m, name, None) or 0 for m in metrics)
    for name in TIME_FIELDS_US:
        row[name.replace("_us", "_s")] = round(sum(getattr(m, name, None) or 0 for m in metrics) / 1e6, 3)
    if row["compiled_calls"] == 0:
        row["error"] = "compiled code never ran (0 compiled calls)"
    return row


def child_main(spec_json: str) -> int:
    """Run one row; print it as the last stdout line; non-zero exit on any error."""
    return run_child(spec_json, measure, ("row",))


# ---------------------------------------------------------------- parent: one subprocess per row

def prepare_folder(row: str, cold: Path, target: Path) -> None:
    """Fill `target` (a Kiln cache folder) with the part of cold's folder this row keeps."""
    target.mkdir(parents=True)
    if row in ("warm-inductor-dir-only", "warm"):
        shutil.copytree(cold / "inductor", target / "inductor", symlinks=True)
    if row in ("warm-artifacts-only", "warm"):
        for entry in cold.glob("*.kiln"):
            shutil.copy2(entry, target / entry.name)


def run_row(row: str, config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run one row in a fresh interpreter with KILN_COMPILE_CACHE_DIR=folder and no other cache setting."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") and not k.startswith("KILN_")}
    env["KILN_COMPILE_CACHE_DIR"] = str(folder)
    start = time.perf_counter()
    cpu_before = _cpu_seconds()
    result = run_script_row(Path(__file__), {"row": row, "config": config}, config["device"], env=env)
    result["other_cores_during"] = _other_cores(cpu_before, _cpu_seconds(), time.perf_counter() - start)
    return result


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine was busy, CPU seconds of this process's finished children);
    None where /proc/stat is missing."""
    import resource

    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(fields) - fields[3] - fields[4]) / ticks, children.ru_utime + children.ru_stime


def _other_cores(before: tuple[float, float] | None, after: tuple[float, float] | None, wall: float) -> float | None:
    """Cores kept busy by other processes while a row ran: all busy time minus the row's own.

    Why: `busy_cores` samples only before a row; other jobs on this shared 2-core machine start
    and stop during one (seen as 2.6 s steps among 27 ms ones), and that is what spoils a row.
    """
    if before is None or after is None or wall <= 0:
        return None
    busy = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(0.0, busy) / wall, 2)


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table; "vs cold" is the row's load + first step over the same run's cold row."""
    colds = {r.get("run", 1): r["first_s"] for r in rows if r["row"] == "cold" and "error" not in r}
    lines = ["| row | run | entry loaded | first s (load + step) | vs cold | compile s | steady ms | "
             "AOT cache hit/miss | FX cache hit/miss | dynamo s | AOT s | backward s | process s | other cores |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r.get('run', 1)} | error: {r['error'][:70]} |" + " |" * 11)
            continue
        cold = colds.get(r.get("run", 1))
        ratio = f"{r['first_s'] / cold:.3f}" if cold else "-"
        lines.append(
            f"| {r['row']} | {r.get('run', 1)} | {'yes' if r['hit'] else 'no'} | {r['first_s']:.2f} | {ratio} | {r['compile_s']:.2f} | "
            f"{r['steady_ms']:.1f} | {r['aotautograd_local_cache_hit_count']}/{r['aotautograd_local_cache_miss_count']} | "
            f"{r['inductor_fx_local_cache_hit_count']}/{r['inductor_fx_local_cache_miss_count']} | "
            f"{r['dynamo_cumulative_compile_time_s']:.2f} | {r['aot_autograd_cumulative_compile_time_s']:.2f} | "
            f"{r['backward_cumulative_compile_time_s']:.2f} | {r['process_s']:.1f} | {r.get('other_cores_during')} |")
    return "\n".join(lines)


def median_first_s(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per row name, the median of load + first step over the runs that did not fail."""
    by_row: dict[str, list[float]] = {}
    for r in rows:
        if "error" not in r:
            by_row.setdefault(r["row"], []).append(r["first_s"])
    return {name: statistics.median(values) for name, values in by_row.items()}


def ratios_text(rows: list[dict[str, Any]]) -> str:
    medians = median_first_s(rows)
    cold = medians.get("cold")
    if cold is None:
        return "no cold row: no ratios"
    runs = max(r.get("run", 1) for r in rows)
    colds = {r.get("run", 1): r["first_s"] for r in rows if r["row"] == "cold" and "error" not in r}
    parts = [f"Ratios of load + first step, {'medians of ' + str(runs) + ' runs' if runs > 1 else 'one run'}:"]
    for name, value in medians.items():
        if name == "cold":
            continue
        verdict = "meets" if value / cold <= TARGET_RATIO else "misses"
        line = f"- {name}/cold = {value:.2f} / {cold:.2f} = {value / cold:.3f} ({verdict} the {TARGET_RATIO} target)"
        per_run = [r["first_s"] / colds[r["run"]] for r in rows
                   if r["row"] == name and "error" not in r and r.get("run", 1) in colds]
        if len(per_run) > 1:
            line += f"; within each run: {', '.join(f'{x:.3f}' for x in per_run)}"
        parts.append(line)
    return "\n".join(parts)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Bars of load + first step per row; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["row"] for r in ok], [r["first_s"] for r in ok])
    ax.set_ylabel("load + first training step (s)")
    ax.set_title("warm start, regional compile")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(rows: list[dict[str, Any]], config: dict[str, Any], out: Path) -> str:
    """Write the run's JSON lines, markdown table and plot; return the text to print last."""
    text = (f"Warm start of a regional-compiled training step (AdamW, eager optimizer): Llama-style LM, "
            f"{config['layers']} layers x {config['hidden']} wide, batch {config['batch']} x {config['seq']}, "
            f"{config['dtype']}, backend {config['backend']}; {machine_line(rows, config)}. "
            f"Each row is a fresh process.\n\n{results_table(rows)}\n\n{ratios_text(rows)}\n")
    losses = {r["row"]: tuple(r["losses"]) for r in rows if "error" not in r}
    text += ("\nEvery row computed the same losses over its steps.\n" if len(set(losses.values())) == 1
             else f"\nNote: the rows' losses differ: {losses}\n")
    busy = max(max(r.get("busy_cores_before") or 0, r.get("other_cores_during") or 0) for r in rows)
    text += (f"\nLoad: other processes kept up to {busy} of {os.cpu_count()} cores busy before or during a row"
             f"{'; timings are unreliable' if busy > 0.25 else ''}.\n")
    return write_outputs(out / f"warm_start_bench_{config['device']}", rows, text, plot)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    device = parent_device(args.backend)
    config = model_config(args, device)
    base = Path(tempfile.mkdtemp(prefix="kiln_warm_bench_"))
    plan = [(run, row) for run in range(1, args.repeats + 1) for row in ROWS]
    rows = []
    try:
        for i, (run, row) in enumerate(plan, 1):
            folder = base / f"run{run}" / row
            if row == "cold":
                folder.mkdir(parents=True)
            elif not (base / f"run{run}" / "cold" / "inductor").is_dir():
                continue  # this run's cold row failed: nothing to start warm from
            else:
                prepare_folder(row, base / f"run{run}" / "cold", folder)
            print(f"[{i}/{len(plan)}] {row} ({args.backend}, {device}) ...", end=" ", flush=True)
            result = run_row(row, config, folder)
            result["run"] = run
            rows.append(result)
            if progress_error(result):
                print(progress_error(result))
                continue
            print(f"entry loaded: {result['hit']}, load + first step {result['first_s']:.2f} s, "
                  f"process {result['process_s']} s, other cores busy {result['busy_cores_before']} before, "
                  f"{result['other_cores_during']} during", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(write_results(rows, config, args.out))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
