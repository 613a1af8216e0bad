"""The local-processes suite of `kiln bench`: cold starts of 1 and 2 local processes. Does each region
compile once per machine?

Each row runs the start-up suite's training job (kiln.bench.startup) under torch.distributed.run on
`processes` local processes, from empty Kiln and Inductor folders, as its variant says:
    eager              no compile
    regional-cold      Kiln's regional compile, JIT: every process compiles
    precompiled-cold   precompile=True: the first local process compiles and writes, the others wait and load
Measured: the wall time and CPU-seconds of the whole process tree (the launcher, its workers and
their compiler subprocesses) and the first step's wall time (the slowest rank's). A variant's
compile CPU-seconds are its CPU-seconds minus the eager row's at the same process count.

Depends on the standard library, kiln.bench.plan (rows) and kiln.bench.child's result line (kiln.bench.run starts the
launch); never imports torch (the children do).
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

from kiln.bench.child import RESULT_PREFIX
from kiln.bench.plan import measured

# Issue 11's targets: precompiled-cold's compile CPU-seconds on 2 processes <= 1.3x on 1, and its
# 2-process first step no slower than regional-cold's.
CPU_RATIO = 1.3


def command(row: dict[str, Any]) -> list[str]:
    """The launch: torch.distributed.run on this machine, every process measuring the row."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={row['processes']}",
            "-m", "kiln.bench.child", json.dumps(row)]


def children_cpu_s() -> float:
    """CPU-seconds of this process's finished children (and theirs), user and system."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def combine(stdout: str, row: dict[str, Any]) -> dict[str, Any] | None:
    """One result from every rank's result line: the slowest rank's first step and time to 20 steps,
    each rank's traces and loaded artifacts. None when a rank's line is missing; a rank's error wins."""
    decoder = json.JSONDecoder()
    ranks = [decoder.raw_decode(chunk)[0] for chunk in stdout.split(RESULT_PREFIX)[1:]]  # two may share a line
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return dict(row, error=errors[0])
    if len(ranks) != row["processes"]:
        return None
    result = dict(ranks[0])
    result.update(first_s=max(r["first_s"] for r in ranks), t20_s=max(r.get("t20_s") or 0 for r in ranks),
                  traces=[r.get("traces") for r in ranks], loaded=[r.get("precompiled_loaded") for r in ranks])
    return result


def compile_cpu_s(rows: list[dict[str, Any]]) -> dict[int, float]:
    """id(row) -> its CPU-seconds minus the eager row's at the same model and process count."""
    eager = {(r["model"], r["processes"]): r["cpu_s"] for r in measured(rows) if r["variant"] == "eager"}
    return {id(r): r["cpu_s"] - eager[(r["model"], r["processes"])] for r in measured(rows)
            if r["variant"] != "eager" and (r["model"], r["processes"]) in eager}


def table(rows: list[dict[str, Any]]) -> str:
    extra = compile_cpu_s(rows)
    lines = ["| model | variant | processes | wall s | CPU s | compile CPU s | first step s | ran | traces per rank |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        head = f"| {r['model']} | {r['variant']} | {r['processes']} |"
        if r not in measured(rows):
            lines.append(f"{head} {(r.get('error') or r.get('skipped'))[:80]} |" + " |" * 5)
            continue
        compile_cell = f"{extra[id(r)]:.1f}" if id(r) in extra else "-"
        lines.append(f"{head} {r['process_s']:.1f} | {r['cpu_s']:.1f} | {compile_cell} | {r['first_s']:.2f} | "
                     f"{r.get('ran') or '-'} | {r['traces']} |")
    return "\n".join(lines)


def target_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target the rows allow checking, as ratios of rows of the same run."""
    extra, checks = compile_cpu_s(rows), []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {(r["variant"], r["processes"]): r for r in measured(rows) if r["model"] == model}
        for variant in ("regional-cold", "precompiled-cold"):
            one, two = by.get((variant, 1)), by.get((variant, 2))
            if one and two and extra.get(id(one)) and id(two) in extra:
                limit = CPU_RATIO if variant == "precompiled-cold" else None
                ratio = extra[id(two)] / extra[id(one)]
                checks.append({"target": f"{model}: {variant} compile CPU-seconds, 2 processes / 1 process"
                                         + (f" <= {limit}" if limit else ""),
                               "value": round(ratio, 3), "limit": limit,
                               "met": None if limit is None else ratio <= limit})
        pre, jit = by.get(("precompiled-cold", 2)), by.get(("regional-cold", 2))
        if pre and jit:
            checks.append({"target": f"{model}: 2 processes, precompiled-cold first step / regional-cold's <= 1.0",
                           "value": round(pre["first_s"] / jit["first_s"], 3), "limit": 1.0,
                           "met": pre["first_s"] <= jit["first_s"]})
    return checks


def render(rows: list[dict[str, Any]]) -> str:
    lines = []
    for c in target_checks(rows):
        verdict = "measured" if c["met"] is None else ("met" if c["met"] else "missed")
        lines.append(f"- {c['target']}: {c['value']} ({verdict})")
    return ("Cold starts of local processes (torch.distributed.run), the start-up suite's job, empty Kiln and "
            "Inductor folders; wall and CPU seconds of the whole process tree, the first step of the slowest "
            f"rank; compile CPU s = CPU s - the eager row's at the same process count.\n\n{table(rows)}\n\n"
            + "\n".join(lines) + "\n")


def progress(result: dict[str, Any]) -> str:
    return f"CPU {result['cpu_s']:.1f} s, first step {result['first_s']:.2f} s, ran {result.get('ran') or '-'}"
