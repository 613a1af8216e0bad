"""The benchmark's parent process: one fresh interpreter per row, an empty compiler cache for each.

Depends on the standard library, kiln.bench.plan and kiln.bench.child's result line, and on the
suite modules for their parent-side steps; never imports torch (the children do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln.bench.child import RESULT_PREFIX
from kiln.bench.plan import Row

# Below this many seconds of budget a row is not started: process start alone takes 5-15 s.
MIN_ROW_S = 20.0
KILN_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the kiln package


def run_rows(
    rows: list[Row],
    *,
    row_timeout_s: float = 1800,
    budget_s: float | None = None,
    on_row: Callable[[int, Row, dict[str, Any]], None] | None = None,
    on_start: Callable[[int, Row], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure each row in order; rows past `budget_s` are returned as skipped, not run. A
    warm-start row starts from the cache folder of the latest cold row of its case."""
    results = []
    begin = time.perf_counter()
    # Warm-start rows' cache folders; made only when the plan has such rows.
    warm = any(row.suite in ("warm-start", "startup") for row in rows)
    workspace = Path(tempfile.mkdtemp(prefix="kiln_bench_warm_")) if warm else None
    colds: dict[tuple, Path] = {}  # a warm-start case -> the folder its latest cold row wrote
    try:
        for index, row in enumerate(rows):
            left = None if budget_s is None else budget_s - (time.perf_counter() - begin)
            if left is not None and left < MIN_ROW_S:
                result = dict(row.as_dict(), skipped=f"budget of {budget_s:.0f} s spent")
            else:
                if on_start:
                    on_start(index, row)
                timeout_s = row_timeout_s if left is None else min(row_timeout_s, left)
                if row.suite in ("warm-start", "startup"):
                    result = _run_warm_start_row(row, index, workspace, colds, timeout_s)
                elif row.suite in ("local-processes", "nd-parallel"):
                    result = _run_local_processes_row(row, timeout_s)
                else:
                    result = run_row(row, timeout_s=timeout_s)
            results.append(result)
            if on_row:
                on_row(index, row, result)
    finally:
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)
    return results


def run_row(row: Row, timeout_s: float = 1800) -> dict[str, Any]:
    """Measure one row in a fresh interpreter with empty Inductor and Triton caches, deleted after."""
    with empty_compiler_caches() as caches:
        return _run_child(row, caches, timeout_s)


def _run_warm_start_row(row: Row, index: int, workspace: Path, colds: dict[tuple, Path],
                        timeout_s: float) -> dict[str, Any]:
    """A warm-start row: a fresh interpreter whose KILN_COMPILE_CACHE_DIR holds what its variant keeps
    of the case's cold folder (Kiln points Inductor into that folder; nothing else is set)."""
    if row.suite == "startup":
        from kiln.bench.startup import SAME_FOLDER, base_variant, prepare_folder
    else:
        from kiln.bench.warm_start import base_variant, prepare_folder
        SAME_FOLDER = ("warm-precompiled",)

    base = base_variant(row.variant)
    case = (dataclasses.astuple(dataclasses.replace(row, variant="")), base)
    folder = workspace / f"row{index}"
    if row.variant == base:
        folder.mkdir()
        colds[case] = folder
    elif case not in colds:
        return dict(row.as_dict(), error=f"no {base} row of this case ran before it: nothing to start warm from")
    elif row.variant in SAME_FOLDER:
        folder = colds[case]  # the same folder: the next run of the same job
    else:
        prepare_folder(row.variant, colds[case], folder)
    caches = {"KILN_COMPILE_CACHE_DIR": str(folder)}
    if row.variant in ("eager", "busy-eager", "accelerate-regional"):  # no Kiln cache: Inductor's own, empty, in the folder
        caches["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    if row.variant == "resume-fresh-machine-user-inductor-dir":  # the user's own Inductor folder, empty
        caches["TORCHINDUCTOR_CACHE_DIR"] = str(folder.with_name(folder.name + "-user-inductor"))
        Path(caches["TORCHINDUCTOR_CACHE_DIR"]).mkdir()
    return _run_child(row, caches, timeout_s)


def _run_local_processes_row(row: Row, timeout_s: float) -> dict[str, Any]:
    """A local-processes or nd-parallel row: its processes under torch.distributed.run, from empty
    Kiln and Inductor folders, with the CPU-seconds the whole process tree used."""
    from kiln.bench import local_processes, nd_parallel

    suite = nd_parallel if row.suite == "nd-parallel" else local_processes
    with empty_compiler_caches("kiln_bench_local_processes_") as caches:
        caches["KILN_COMPILE_CACHE_DIR"] = str(Path(caches["TORCHINDUCTOR_CACHE_DIR"]).parent / "kiln")
        before = local_processes.children_cpu_s()
        result = _run_child(row, caches, timeout_s, command=suite.command(row.as_dict()),
                            parse=lambda stdout: suite.combine(stdout, row.as_dict()))
        result["cpu_s"] = round(local_processes.children_cpu_s() - before, 2)
    return result


def _run_child(row: Row, caches: dict[str, str], timeout_s: float, command: list[str] | None = None,
               parse: Callable[[str], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The row measured by `command` (by default one child process) with `caches` in its environment."""
    command = command or [sys.executable, "-m", "kiln.bench.child", json.dumps(row.as_dict())]
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") and not k.startswith("KILN_")}
    env.update(caches)
    # The child measures the kiln this process runs, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(KILN_ROOT), os.environ.get("PYTHONPATH")) if p)
    return run_measuring_process(command, row.as_dict(), env=env, timeout_s=timeout_s, device=row.device,
                                 parse=parse)


@contextlib.contextmanager
def empty_compiler_caches(prefix: str = "kiln_bench_cache_") -> Iterator[dict[str, str]]:
    """Environment entries pointing Inductor and Triton at fresh folders, deleted afterwards, so no
    on-disk cache fakes a warm start."""
    cache = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_measuring_process(command: list[str], fallback: dict[str, Any], *, env: dict[str, str], timeout_s: float,
                          device: str, parse: Callable[[str], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """Run one measuring child: its result row (read from stdout by `parse`), or `fallback` with
    the reason there is none; adds the process's wall seconds and the load other processes put on
    the CPU just before."""
    busy = busy_cores() if device == "cpu" else None
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        result = (parse or parse_result)(proc.stdout) or dict(fallback, error=f"no result line (exit {proc.returncode})")
        if proc.returncode != 0:
            result.setdefault("error", f"child exited with {proc.returncode}")
            result["stderr_tail"] = proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        result = dict(fallback, error=f"timed out after {timeout_s:.0f} s")
    result["process_s"] = round(time.perf_counter() - start, 1)
    result["busy_cores_before"] = busy
    return result


def parse_result(stdout: str) -> dict[str, Any] | None:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    try:
        return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None
    except json.JSONDecodeError:
        return None


def busy_cores(seconds: float = 0.5) -> float | None:
    """Cores kept busy by other processes over a short sample (Linux; None elsewhere).

    Why: with torch's one OpenMP thread per core, one core busy elsewhere made a 2-thread matmul
    about 60x slower on a 2-core machine (torch 2.13); no median hides that.
    """
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    busy = 1 - (idle1 - idle0) / max(1, total1 - total0)
    return round(busy * (os.cpu_count() or 1), 2)


def progress_head(index: int, total: int, row: Row, note: str = "") -> str:
    """'[3/18] regional small train b4 ...', printed before the row runs."""
    return f"[{index + 1}/{total}] {row.label}{note} ..."


def progress_tail(result: dict[str, Any]) -> str:
    """'21.3 s  compile 18.2 s, steady 30.41 ms, peak 465 MiB', printed when the row is done."""
    if "skipped" in result:
        return f"skipped ({result['skipped']})"
    if "error" in result:  # a row that never started a process (its cold row missing) has no time
        head = f"{result['process_s']:.1f} s  " if "process_s" in result else ""
        return f"{head}ERROR: {result['error'][:300]}"
    head = f"{result['process_s']:.1f} s"
    busy = result.get("busy_cores_before") or 0
    note = f"  [other processes kept {busy} cores busy]" if busy > 0.25 else ""
    suite = result.get("suite", "compile")
    if suite != "compile":
        from kiln.bench import buckets, checkpointing, host_overhead, local_processes, nd_parallel, startup, warm_start

        modules = {"warm-start": warm_start, "startup": startup, "local-processes": local_processes,
                   "checkpointing": checkpointing, "host-overhead": host_overhead, "nd-parallel": nd_parallel}
        module = modules.get(suite, buckets)
        return f"{head}  {module.progress(result)}{note}"
    return (f"{head}  compile {result['compile_s']:.1f} s, steady {result['steady_ms']:.2f} ms, "
            f"peak {result['peak_mib']:.0f} MiB{note}")
