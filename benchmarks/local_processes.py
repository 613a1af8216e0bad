"""Cold starts of several local processes: does each region compile once per machine?

Runs the start-up suite's training job (kiln.bench.startup) under torch.distributed.run with 1 and
2 processes, each run from empty Kiln and Inductor folders, for three variants: eager, regional-cold
(JIT: every process compiles) and precompiled-cold (precompile=True: the first local process
compiles and writes, the others wait and load). Measures the wall time and the CPU-seconds of the
whole process tree (the launcher, its workers and their compiler subprocesses), and the first
step's wall time (the slowest rank's). A variant's compile CPU-seconds are its CPU-seconds minus
the eager run's at the same process count.

Target (issue 11): precompiled-cold's compile CPU-seconds with 2 processes <= 1.3x with 1, and its
2-process first step no slower than regional-cold's.

    .venv/bin/python benchmarks/local_processes.py --out benchmarks/results/kiln_local_processes_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "KILN_BENCH_RESULT "
VARIANTS = ("eager", "regional-cold", "precompiled-cold")
CPU_RATIO = 1.3


def run(variant: str, nproc: int, steps: int, model: str) -> dict:
    row = dict(model=model, workload="train", batch=4, seq=64, method="regional", suite="startup",
               variant=variant, steps=steps, backend="inductor", device="cpu", dtype="float32", seed=0,
               mode="default", threads=None)
    folder = Path(tempfile.mkdtemp(prefix="kiln_local_processes_"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KILN_") and k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(KILN_COMPILE_CACHE_DIR=str(folder / "kiln"), TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "kiln.bench.measure", json.dumps(row)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    ranks = _results(proc.stdout)
    result = dict(variant=variant, nproc=nproc, steps=steps, model=model, wall_s=round(wall, 2),
                  cpu_s=round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2))
    errors = [r["error"] for r in ranks if "error" in r]
    if proc.returncode or errors or len(ranks) != nproc:
        result["error"] = (errors[0] if errors else f"exit {proc.returncode}, {len(ranks)} result lines")[:300]
        result["stderr_tail"] = proc.stderr[-2000:]
        return result
    result.update(first_s=max(r["first_s"] for r in ranks), t20_s=max(r.get("t20_s") or 0 for r in ranks),
                  ran=ranks[0].get("ran"), traces=[r.get("traces") for r in ranks],
                  loaded=[r.get("precompiled_loaded") for r in ranks])
    return result


def _results(stdout: str) -> list[dict]:
    """Every rank's result object; the ranks share one stdout, so two may share a line."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in stdout.split(PREFIX)[1:]]


def summary(results: list[dict]) -> str:
    by = {(r["variant"], r["nproc"]): r for r in results if "error" not in r}
    lines = ["| variant | processes | wall s | CPU s | compile CPU s | first step s | ran | traces per rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    compile_cpu = {}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['nproc']} | error: {r['error'][:80]} | | | | | |")
            continue
        eager = by.get(("eager", r["nproc"]))
        extra = round(r["cpu_s"] - eager["cpu_s"], 2) if eager and r["variant"] != "eager" else None
        compile_cpu[(r["variant"], r["nproc"])] = extra
        lines.append(f"| {r['variant']} | {r['nproc']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                     f"{'-' if extra is None else f'{extra:.1f}'} | {r['first_s']:.2f} | {r.get('ran') or '-'} | "
                     f"{r['traces']} |")
    checks = []
    for variant in ("regional-cold", "precompiled-cold"):
        one, two = compile_cpu.get((variant, 1)), compile_cpu.get((variant, 2))
        if one and two:
            ratio = two / one
            limit = f" (target <= {CPU_RATIO}: {'met' if ratio <= CPU_RATIO else 'missed'})" if variant == "precompiled-cold" else ""
            checks.append(f"- {variant}: compile CPU-seconds, 2 processes / 1 process: {ratio:.2f}{limit}")
    pre, jit = by.get(("precompiled-cold", 2)), by.get(("regional-cold", 2))
    if pre and jit:
        checks.append(f"- 2 processes: precompiled-cold first step {pre['first_s']:.2f} s vs regional-cold "
                      f"{jit['first_s']:.2f} s ({'no worse' if pre['first_s'] <= jit['first_s'] else 'worse'})")
    return "\n".join(lines + [""] + checks) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results stem: <out>.jsonl and <out>.md")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="small")
    args = parser.parse_args()
    results = []
    for nproc in (1, 2):
        for variant in VARIANTS:
            print(f"[local processes] {variant}, {nproc} process(es) ...", file=sys.stderr, flush=True)
            results.append(run(variant, nproc, args.steps, args.model))
            r = results[-1]
            print(f"[local processes]   wall {r['wall_s']} s, CPU {r['cpu_s']} s, "
                  f"{r.get('error') or 'first step %.2f s' % r['first_s']}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    import torch

    text = (f"Cold starts of local processes, model `{args.model}`, {args.steps} AdamW steps, backend inductor, "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs. Command: `.venv/bin/python "
            f"benchmarks/local_processes.py --out {args.out}`.\n\n{summary(results)}")
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
