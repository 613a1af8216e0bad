"""Start a script on N local processes the way any launcher does (RANK, WORLD_SIZE, MASTER_ADDR, ...
in each process's environment), without torch.distributed.run's agent process: the strategy tests
start dozens of groups, and the agent costs each one a torch import. `kiln launch` (torchrun
underneath) keeps its own tests (tests/cli/test_launch.py, test_restarts.py) and
test_accelerate_api_processes.py starts its groups through torch.distributed.run itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

GRACE_S = 20.0  # after a process fails, the others get this long to fail too (a collective waits for it)


@dataclass
class Done:
    """What a launch left, in subprocess.run's words: every process's output, one after another."""

    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            out, err = (open(os.path.join(folder, f"{rank}.{kind}"), "w+") for kind in ("out", "err"))
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, stdout=out, stderr=err, text=True))
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > GRACE_S):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        outputs = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            outputs.append((out.read(), err.read()))
            out.close()
            err.close()
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    if time.monotonic() > deadline:
        code = code or -9
    return Done(code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))
