"""Start a script on N local processes the way any launcher does (RANK, WORLD_SIZE, MASTER_ADDR, ...
in each process's environment), without torch.distributed.run's agent process: the strategy tests
start dozens of groups, and the agent costs each one a torch import. `kiln launch` (torchrun
underneath) keeps its own tests (tests/cli/test_launch.py, test_restarts.py) and
test_accelerate_api_processes.py starts its groups through torch.distributed.run itself.

Each process is forked from a server that imported torch, transformers' Llama and Kiln once
(multiprocessing's forkserver, one per test process): a fresh interpreter pays 5-6 s of CPU for
those imports, and the strategy tests start about a hundred processes on 2 cores. The fork gets
the launch's whole environment and runs the script as __main__, as `python script` would.
torch's thread count is set from OMP_NUM_THREADS (OpenMP read it when the server imported torch)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
import tempfile
import time
from dataclasses import dataclass

from ports import free_port

GRACE_S = 20.0  # after a process fails, the others get this long to fail too (a collective waits for it)


@dataclass
class Done:
    """What a launch left, in subprocess.run's words: every process's output, one after another."""

    returncode: int
    stdout: str
    stderr: str


def launch(args: list[str], processes: int, env: dict[str, str], timeout: float) -> Done:
    """Run `python *args` on `processes` local processes of one group; the first non-zero exit code
    (or 0), after every process has ended. A failed process ends the others after GRACE_S, as
    torchrun ends a group; past `timeout` all are killed and the launch fails."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kiln-launch-") as folder:
        procs, files = [], []
        for rank in range(processes):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                            LOCAL_WORLD_SIZE=str(processes), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
            out, err = (os.path.join(folder, f"{rank}.{kind}") for kind in ("out", "err"))
            files.append((out, err))
            procs.append(_start(args, rank_env, out, err))
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > GRACE_S):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                        p.join()
            time.sleep(0.05)
        outputs = [(_read(out), _read(err)) for out, err in files]
    code = next((p.exitcode for p in procs if p.exitcode != 0), 0)
    if time.monotonic() > deadline:
        code = code or -9
    return Done(code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


def run_plain(args: list[str], env: dict[str, str], timeout: float) -> Done:
    """`python *args` as one plain process (no launcher variables), like subprocess.run; killed
    past `timeout` (code -9)."""
    with tempfile.TemporaryDirectory(prefix="kiln-run-") as folder:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        proc = _start(args, dict(env), out, err)
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()  # its exit code is then -9 (SIGKILL)
            proc.join()
        return Done(proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    with open(path, errors="replace") as handle:
        return handle.read()


_CONTEXT = None
PRELOAD = ["torch", "transformers.models.llama.modeling_llama", "kiln", "kiln.accelerator", "toy_models"]


def _start(args: list[str], env: dict[str, str], out: str, err: str):
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    proc = _CONTEXT.Process(target=_run_script, args=(list(args), env, out, err), name=f"kiln-test-{args[0]}")
    proc.start()
    return proc


def _run_script(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: the launch's environment, output files and argv, then the script."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    script = os.path.abspath(args[0])
    sys.argv = [script, *args[1:]]
    sys.path[0:0] = [os.path.dirname(script)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter would run at exit; multiprocessing's child skips it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
