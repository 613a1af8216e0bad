"""The background compiler's helper processes: a pool of `python -m kiln.compile.artifacts.background_helper`
workers, jobs handed to idle workers as they come, and per job who compiled it and when (the timeline).

Depends on the standard library only (torch is not imported here); the job format and the policy
(threads, starvation, switching) are kiln/compile/artifacts/background.py's.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class JobTiming:
    """One job of the pool's timeline: seconds are relative to the pool's first job."""

    region: str
    signature: str  # a short text of the call signature
    digest: str
    worker: int
    start: float
    end: float
    outcome: str  # "compiled", "caches only", or "failed: why"

    def as_dict(self) -> dict[str, Any]:
        return {"region": self.region, "signature": self.signature, "digest": self.digest[:12],
                "worker": self.worker, "start": round(self.start, 3), "end": round(self.end, 3),
                "outcome": self.outcome}


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    reader: threading.Thread | None = None
    ready: bool = False  # it has imported torch's compiler and waits for jobs
    busy: tuple[str, str] | None = None  # (region, digest) of the job it compiles


@dataclass
class CompilePool:
    """Helper processes that compile jobs side by side: `submit` queues a job, an idle worker takes
    it; `on_result(region, digest, error, jit_only)` runs on a reader thread when one finishes."""

    size: int
    log_dir: Path
    on_result: Any  # Callable[[str, str, str | None, str | None], None]
    nice: int = 10  # the workers' scheduling priority (background_helper.main applies it)
    workers: list[_Worker] = field(default_factory=list)
    timeline: list[JobTiming] = field(default_factory=list)
    _queue: deque = field(default_factory=deque)
    _labels: dict[tuple[str, str], str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _origin: float | None = None  # wall-clock time of the first job (the helpers' clock is time.time())
    closed: bool = False

    def start(self) -> None:
        """Start every worker (at `prepare`: their imports overlap the model's first steps)."""
        if self.workers or self.closed:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # The helper imports the block classes the training process imported: same search path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["KILN_BACKGROUND_PARENT"] = str(os.getpid())
        # One thread and one Inductor compile process per worker: the pool holds one process per
        # core it was given, and OpenMP threads or compile workers beyond that would fight over
        # cores (DESIGN.md section 7). A job runs at the training process's thread count (its
        # artifact is made for that count); the worker goes back to one thread after it.
        env["OMP_NUM_THREADS"] = "1"
        env["KILN_COMPILE_NICE"] = str(self.nice)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        for index in range(self.size):
            env["KILN_COMPILE_WORKER"] = str(index)
            with open(self.log_path, "ab") as log:
                process = subprocess.Popen([sys.executable, "-m", "kiln.compile.artifacts.background_helper"],
                                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            worker = _Worker(index, process)
            self.workers.append(worker)
            worker.reader = threading.Thread(target=self._read, args=(worker,), name=f"kiln-compile-worker-{index}",
                                             daemon=True)
            worker.reader.start()

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"background-compiler-{os.getpid()}.log"

    def submit(self, region: str, digest: str, label: str, payload: bytes) -> None:
        """Queue one job (`payload`: the pickled (digest, job)); it goes to the first idle worker."""
        self.start()
        with self._lock:
            if self._origin is None:
                self._origin = time.time()
            self._labels[(region, digest)] = label
            self._queue.append((region, digest, payload))
            self._dispatch()

    def _dispatch(self) -> None:  # under the lock
        for worker in self.workers:
            if not self._queue:
                return
            # Only to a worker that said it is ready: a job sent to one still importing torch
            # (seconds) would wait there while another worker sits idle.
            if worker.ready and worker.busy is None and worker.process.poll() is None:
                region, digest, payload = self._queue.popleft()
                worker.busy = (region, digest)
                _write_frame(worker.process.stdin, payload)

    def _send_waiting(self) -> None:  # under the lock, on a reader thread
        try:
            self._dispatch()
        except OSError:  # a worker's pipe closed: its death is seen by `dead`, then the pool fails
            pass

    def _read(self, worker: _Worker) -> None:
        stream = worker.process.stdout
        while True:
            frame = _read_frame(stream)
            if frame is None:
                return
            try:
                answer = pickle.loads(frame)
                if answer == READY:
                    with self._lock:
                        worker.ready = True
                        self._send_waiting()
                    continue
                region, digest, error, jit_only, began, ended = answer
            except Exception as exc:  # a helper of another Kiln version: stop trusting it
                self.on_result(None, None, f"the background compiler sent an answer this process cannot read "
                                           f"({exc})", None)
                return
            with self._lock:
                origin = self._origin or began
                outcome = (f"failed: {error}" if error else "caches only" if jit_only else "compiled")
                self.timeline.append(JobTiming(region, self._labels.get((region, digest), ""), digest, worker.index,
                                               began - origin, ended - origin, outcome))
                worker.busy = None
                self._send_waiting()
            self.on_result(region, digest, error, jit_only)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every worker has started (imported torch's compiler); False on timeout."""
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self.workers):
            if time.monotonic() > deadline or any(w.process.poll() is not None for w in self.workers):
                return False
            time.sleep(0.05)
        return True

    def dead(self) -> _Worker | None:
        """A worker that exited while the pool ran (its reader has read all it sent), if any."""
        for worker in self.workers:
            if worker.process.poll() is not None:
                if worker.reader is not None:
                    worker.reader.join(timeout=1)
                return worker
        return None

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def kill(self) -> None:
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()

    def close(self) -> None:
        """Stop every worker: end of stdin, then a kill after 5 s (`workers` stays, for inspection)."""
        self.closed = True
        workers = self.workers
        for worker in workers:
            try:
                worker.process.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for worker in workers:
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()

    def timeline_dicts(self) -> list[dict[str, Any]]:
        with self._lock:
            return [t.as_dict() for t in sorted(self.timeline, key=lambda t: t.start)]


READY = ("ready",)  # a worker's first answer: it waits for jobs


def _write_frame(stream, data: bytes) -> None:
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack(">Q", head)
    data = stream.read(size)
    return data if len(data) == size else None
