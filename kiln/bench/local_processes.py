"""The local-processes suite of `kiln bench`: cold starts of 1 and 2 local processes. Does each region
compile once per machine?

Each row runs the start-up suite's training job (kiln.bench.startup) under torch.distributed.run on
`processes` local processes, from empty Kiln and Inductor folders, as its variant says:
    eager              no compile
    regional-cold      Kiln's regional compile, JIT (precompile=False): every process compiles
    precompiled-cold   precompile=True: the first local process compiles and writes, the others wait and load
    default-cold       the documented settings, TorchDynamoPlugin(backend, use_regional_compilation=True):
                       JIT on one process, precompile="auto" (Kiln's default under DDP) on several
    precompiled-two-machines  precompile=True on two simulated machines: two torch.distributed.run agents
                       (--nnodes 2 on localhost), each with `processes` processes and its own Kiln and
                       Inductor folders; one machine compiles each signature and sends it to the other
                       (kiln/compile/artifacts/sharing.py)
    default-two-machines  the same two machines on the documented settings
Measured: the wall time and CPU-seconds of the whole process tree (the launcher, its workers and
their compiler subprocesses) and the first step's wall time (the slowest rank's). A variant's
compile CPU-seconds are its CPU-seconds minus the eager row's at the same process count (all machines').

Depends on the standard library, kiln.bench.plan (rows) and kiln.bench.child's result line (kiln.bench.run starts the
launch); never imports torch (the children do).
"""

from __future__ import annotations

import json
import resource
import shlex
import socket
import sys
from typing import Any, Callable

from kiln.bench.child import RESULT_PREFIX
from kiln.bench.plan import measured

# Issue 11's targets: precompiled-cold's compile CPU-seconds on 2 processes <= 1.3x on 1, and its
# 2-process first step no slower than regional-cold's.
CPU_RATIO = 1.3
# Issue 28's target: the two-machine job's compile CPU-seconds <= 1.15x one process's.
TWO_MACHINES = "precompiled-two-machines"
JOB_CPU_RATIO = 1.15
# Issue 39's: the same on the documented settings, against one process on them.
DEFAULT_TWO_MACHINES = "default-two-machines"


def machines(row: dict[str, Any]) -> int:
    return 2 if row["variant"].endswith("-two-machines") else 1


def command(row: dict[str, Any]) -> list[str]:
    """The launch: torch.distributed.run on this machine, every process measuring the row; for two
    simulated machines, two agents started together, each with its own cache folders."""
    child = ["-m", "kiln.bench.child", json.dumps(row)]
    if machines(row) == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={row['processes']}", *child]
    port = _free_port()
    agents = []
    for node in range(machines(row)):
        folders = " ".join(f'{name}="${name}/machine{node}"' for name in
                           ("KILN_COMPILE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"))
        agent = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={machines(row)}",
                 f"--nproc-per-node={row['processes']}", f"--node-rank={node}", "--master-addr=127.0.0.1",
                 f"--master-port={port}", *child]
        agents.append(f'{folders} {shlex.join(agent)} & pids="$pids $!"')
    # The tree's CPU-seconds are counted when the shell reaps both agents (children_cpu_s).
    wait_all = "code=0; for p in $pids; do wait $p || code=$?; done; exit $code"
    return ["/bin/sh", "-c", "pids=; " + "; ".join(agents) + "; " + wait_all]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if len(ranks) != row["processes"] * machines(row):
        return None
    result = dict(ranks[0])
    result.update(first_s=max(r["first_s"] for r in ranks), t20_s=max(r.get("t20_s") or 0 for r in ranks),
                  traces=[r.get("traces") for r in ranks], loaded=[r.get("precompiled_loaded") for r in ranks],
                  ranks_cpu_two_s=[r.get("cpu_two_s") for r in ranks])
    return result


def compile_cpu_s(rows: list[dict[str, Any]]) -> dict[int, float]:
    """id(row) -> its CPU-seconds minus the eager row's at the same model and process count (in all)."""
    return _minus_eager(rows, lambda r: r["cpu_s"])


def ranks_compile_cpu_s(rows: list[dict[str, Any]]) -> dict[int, float]:
    """id(row) -> the CPU-seconds its processes (and their compiler processes) used until their second
    step, summed, minus the eager row's at the same process count: the launchers' agents left out,
    of which a two-machine job has one more."""
    def total(r: dict[str, Any]) -> float | None:
        values = r.get("ranks_cpu_two_s") or []
        return sum(values) if values and None not in values else None

    return _minus_eager(rows, total)


def _minus_eager(rows: list[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]) -> dict[int, float]:
    """id(row) -> `value(row)` minus the eager row's at the same model and process count (all machines'),
    for the measured rows where both are known."""
    eager = {(r["model"], r["processes"]): value(r) for r in measured(rows) if r["variant"] == "eager"}
    out = {}
    for r in measured(rows):
        base, mine = eager.get((r["model"], r["processes"] * machines(r))), value(r)
        if r["variant"] != "eager" and base is not None and mine is not None:
            out[id(r)] = mine - base
    return out


def table(rows: list[dict[str, Any]]) -> str:
    extra = compile_cpu_s(rows)
    lines = ["| model | variant | processes | wall s | CPU s | compile CPU s | first step s | ran | traces per rank |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        count = f"{machines(r)} x {r['processes']}" if machines(r) > 1 else r["processes"]
        head = f"| {r['model']} | {r['variant']} | {count} |"
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
        ranks = ranks_compile_cpu_s(rows)
        for alone, two in (("precompiled-cold", TWO_MACHINES), ("default-cold", DEFAULT_TWO_MACHINES)):
            one, job = by.get((alone, 1)), by.get((two, 1))
            if one and job and ranks.get(id(one)) and id(job) in ranks:
                ratio = ranks[id(job)] / ranks[id(one)]
                checks.append({"target": f"{model}: {two}' compile CPU-seconds / one process's {alone} (processes "
                                         f"and their compiler processes, to step 2) <= {JOB_CPU_RATIO}",
                               "value": round(ratio, 3), "limit": JOB_CPU_RATIO, "met": ratio <= JOB_CPU_RATIO})
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
            f"rank; compile CPU s = CPU s - the eager row's at the same process count; two-machine rows: machines x "
            f"processes per machine, on this one host.\n\n{table(rows)}\n\n"
            + "\n".join(lines) + "\n")


def progress(result: dict[str, Any]) -> str:
    return f"CPU {result['cpu_s']:.1f} s, first step {result['first_s']:.2f} s, ran {result.get('ran') or '-'}"
