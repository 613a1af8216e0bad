"""Train while compiling: helper processes compile regions ahead of time from the signatures of
their first calls, side by side, while the training process runs those regions eagerly; between
steps (or, with parallel_compile, after a wait at the end of step 1) the training process loads
what is ready and switches each region to compiled code.

Depends on torch, kiln.compile.isa_probe and compile_pool (the helper processes); never on the
facade or a strategy. A helper is `python -m kiln.compile.artifacts.background_helper` (not
multiprocessing's spawn, which would run the user's script again in the helper when it lacks a
main guard). It gets jobs as length-prefixed pickles on
its stdin and answers on its stdout. It dies with the training process: Linux's parent-death
signal, a watchdog on its parent's pid, and the end of its stdin.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kiln.compile import isa_probe
from kiln.compile.artifacts.compile_pool import CompilePool
from kiln.compile.cores import free_cores

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def weightless_copy(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A copy of `module` with its parameters and buffers on the meta device (shapes, dtypes and
    requires_grad kept, no data), without hooks or an instance forward, as class `cls` (default:
    its own). What the helper rebuilds a block from: FSDP2's and Kiln's additions are left out."""
    cls = cls or type(module)
    copy = cls.__new__(cls)
    state = {k: v for k, v in module.__dict__.items() if not _hook_handles(v)}
    state.pop("forward", None)
    for name in _HOOK_DICTS:
        if name in state:
            state[name] = type(state[name])()
    state["_parameters"] = {n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                   requires_grad=p.requires_grad)
                            for n, p in module._parameters.items()}
    state["_buffers"] = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
                         for n, b in module._buffers.items()}
    state["_modules"] = {n: None if c is None else weightless_copy(c) for n, c in module._modules.items()}
    copy.__dict__.update(state)
    return copy


def _hook_handles(value: Any) -> bool:
    """A hook's handle, or a list of them: each pickles the hook dictionary it points into, whose hooks
    may be defined in a function (transformers' gradient checkpointing keeps `_require_grads_hook`
    and `_require_grads_hooks` for the embedding's `make_inputs_require_grads`)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, RemovableHandle) for v in value)
    return isinstance(value, RemovableHandle)


@dataclass(frozen=True)
class Outcome:
    """The helper's answer for one job."""

    error: str | None = None  # the job failed: why
    jit_only: str | None = None  # not compiled ahead of time, only into the shared caches: why


@dataclass
class Job:
    """One signature of one region to compile ahead of time, everything the helper needs."""

    region: str
    label: str
    block_class: tuple[str, str]  # module, qualname
    forward: tuple[str, str]
    compile_kwargs: dict[str, Any]
    directory: str
    skeleton: bytes  # the pickled weightless copy
    device: str
    signature: tuple
    aot_off: str | None = None  # the settings rule out an ahead-of-time compile: fill the caches only
    # An outer graph's blocks (kiln/compile/tier_up.py): per group, the forward they share as one
    # nested compile region (module, qualname) and their module paths in the skeleton.
    shared_blocks: tuple[tuple[tuple[str, str], tuple[str, ...]], ...] = ()
    # Arguments that were one tensor (labels=input_ids): (argument, the earlier argument it is), each an
    # index into args or a keyword. Dynamo gives such a call one graph input, so the helper must too.
    same_tensors: tuple[tuple[int | str, int | str], ...] = ()


def _path_of(obj: Any) -> tuple[str, str]:
    if "<locals>" in obj.__qualname__ or obj.__module__ == "__main__":
        raise ValueError(f"{obj.__qualname__} cannot be imported by another process "
                         "(defined in a function or in the script run as __main__)")
    return obj.__module__, obj.__qualname__


def _import(path: tuple[str, str]) -> Any:
    import importlib
    obj = importlib.import_module(path[0])
    for part in path[1].split("."):
        obj = getattr(obj, part)
    return obj


def example_inputs(signature: tuple) -> tuple[tuple, dict]:
    """Random inputs that match a call signature (floats random, integers and booleans zero)."""
    fields = dict(signature)
    args = tuple(_example(d) for d in fields["args"])
    kwargs = {k: _example(d) for k, d in fields["kwargs"]}
    return args, kwargs


def same_tensors(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple[int | str, int | str], ...]:
    """The arguments of a call that are a tensor an earlier argument is too: (this one, that one)."""
    seen: dict[int, int | str] = {}
    same = []
    for name, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                same.append((name, seen[id(value)]))
            else:
                seen[id(value)] = name
    return tuple(same)


def with_same_tensors(args: tuple, kwargs: dict[str, Any], same: tuple) -> tuple[tuple, dict[str, Any]]:
    """Example inputs with the call's repeated tensors made one again (`same_tensors`)."""
    if not same:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)

    def slot(name):
        return args[name] if isinstance(name, int) else kwargs[name]

    for name, earlier in same:
        if isinstance(name, int):
            args[name] = slot(earlier)
        else:
            kwargs[name] = slot(earlier)
    return tuple(args), kwargs


def _example(desc: Any) -> Any:
    kind = desc[0]
    if kind == "tensor":
        _, shape, dtype, device, requires_grad, strides = desc
        dtype = getattr(torch, dtype.replace("torch.", ""))
        # A non-contiguous argument (a UNet's channels-last or transposed activations) is rebuilt
        # with its strides, which the compiled code's guards check: a view of a flat tensor just
        # large enough, so that overlapping strides (an expanded tensor) need no in-place fill.
        # (An empty tensor counts as contiguous: it has no strides here.)
        flat = shape if strides is None else (1 + sum((n - 1) * s for n, s in zip(shape, strides)),)
        if dtype.is_floating_point or dtype.is_complex:
            value = torch.randn(flat, dtype=dtype, device=device)
        else:
            value = torch.zeros(flat, dtype=dtype, device=device)
        if strides is not None:
            value = value.as_strided(shape, strides).detach()
        return value.requires_grad_(requires_grad)
    if kind in ("tuple", "list"):
        items = [_example(d) for d in desc[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _example(d) for k, d in desc[1]}
    if kind == "dtype":
        return getattr(torch, desc[1].replace("torch.", ""))
    if kind == "device":
        return torch.device(desc[1])
    return desc[1]


# ---------------------------------------------------------------- the training process's side

class BackgroundCompiler:
    """The training process's handle on its helper processes (kiln/compile/artifacts/compile_pool.py):
    submit jobs, see which are done, and (`wait_for_all`) block until all are."""

    def __init__(self, log_dir: str | os.PathLike, workers: int | None = None, blocking: bool = False,
                 on_failure: str | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.on_failure = on_failure  # what the warning says happens when the helpers fail, if not the default
        # blocking: training waits for the pool after its first step (parallel_compile), so the pool
        # may take every core; else it takes the cores training leaves it (`default_workers`).
        self.blocking = blocking
        self.size = workers if workers is not None else default_workers(blocking)
        # Waited for, the helpers are the step's critical path: they run at the training process's
        # priority (nice 0), not below it (nice 10) as helpers beside eager steps do.
        self.pool = CompilePool(self.size, self.log_dir, self._on_result, nice=0 if blocking else 10)
        self.done: dict[tuple[str, str], Outcome] = {}  # (region, digest) -> the helper's answer
        self.failure: str | None = None  # why the helpers are gone, once they are
        self._lock = threading.Lock()
        self._warned = False
        self._importing = False
        self.submitted: set[tuple[str, str]] = set()
        # The thread count training had before it made room for the helpers, while it runs on one
        # thread fewer (`_make_room`); None otherwise. Signatures record this count, not the lower one.
        self.own_threads: int | None = None
        self._made_room = False
        self._cpu_inductor = False  # a job compiles Inductor CPU code: loading it needs isa_probe's answers
        self._watch: tuple[float, float] | None = None  # (when, helper CPU seconds) a watch window began
        self.abandoned: str | None = None  # why the helpers were given up for a foreground compile
        self._looked = float("-inf")  # when check_progress last read the helpers' CPU time
        self.wait_seconds: float | None = None  # how long `wait_for_all` blocked training

    def submit_signature(self, region: Any, module: nn.Module, signature: tuple, digest: str) -> bool:
        """Build the job for one signature of a `PrecompiledRegion` met at `module`, and send it."""
        try:
            device = next((str(t.device) for t in [*module.parameters(), *module.buffers()]), "cpu")
            job = Job(region.name, region.label, _path_of(region.block_class), _path_of(region.forward),
                      dict(region.compile_kwargs), str(region.root),
                      pickle.dumps(weightless_copy(module, region.block_class)), device, signature,
                      region.aot_off)
        except Exception as exc:  # an attribute that does not pickle, a class defined in a function
            return self._refuse(region.name, digest, f"the block cannot be sent to the helper "
                                                     f"({type(exc).__name__}: {exc})")
        return self.submit(job, digest)

    def _refuse(self, region: str, digest: str, why: str) -> bool:
        with self._lock:
            self.done[(region, digest)] = Outcome(error=why)
        return False

    def submit(self, job: Job, digest: str) -> bool:
        """Queue a job for the first idle helper; False when the helpers cannot take it (they failed or died)."""
        if self.failure is not None:
            return False
        try:
            self.pool.submit(job.region, digest, signature_text(job.signature), pickle.dumps((digest, job)))
        except (OSError, pickle.PicklingError, AttributeError, TypeError) as exc:
            self._fail(f"a job could not be sent ({type(exc).__name__}: {exc})")
            return False
        self.submitted.add((job.region, digest))
        self._cpu_inductor |= _cpu_inductor(job)
        self._make_room()
        return True

    def _on_result(self, region: str | None, digest: str | None, error: str | None, jit_only: str | None) -> None:
        if region is None:  # an answer this process cannot read
            self.failure = error
            return
        with self._lock:
            self.done[(region, digest)] = Outcome(error, jit_only)

    def _make_room(self) -> None:
        """Before the first switch, training runs on one thread fewer when its threads fill every
        core: on 2 cores (torch 2.13, OpenMP) a helper beside 2 training threads made each eager
        step 10x slower (its threads wait for the one the helper displaced) and the compile 8x
        slower; with one thread the steps keep their pace and the helper has a core."""
        if self._made_room:
            return
        self._made_room = True
        threads = torch.get_num_threads()
        cores = free_cores()
        if threads > 1 and threads >= cores:
            self.own_threads = threads
            torch.set_num_threads(threads - 1)
            print(f"[kiln] compiling in the background: training runs on {threads - 1} of its {threads} threads "
                  "until the first compiled regions are ready", file=sys.stderr, flush=True)

    # A pool that gets less than this share of one core while jobs wait is starved: the machine
    # is busy (another job, dataloader workers, a shared VM). Measured on 2 cores beside a busy
    # process: the helper at nice 10 got about 17% of a core and built 3 kernels in 3 minutes, and
    # the run never switched (2000 eager steps). An idle core gives it 90-100%.
    STARVED_SHARE = 0.5
    WATCH_SECONDS = 5.0  # how long a window the share is measured over

    def check_progress(self) -> bool:
        """Between steps: watch the CPU the helpers (with their compiler processes) get while jobs
        wait; when they are starved, give them up (`abandon`) and return True: their regions are
        then JIT-compiled in the foreground at this step boundary, which on a busy machine finishes
        far sooner than helpers at nice 10 would. Not when training waits for them (`blocking`):
        they then run at its own priority, and a foreground compile would get no larger share of
        the busy machine, only lose what they finished."""
        if not self.pool.workers or self.failure is not None or self.blocking:
            return False
        with self._lock:
            outstanding = bool(self.submitted - set(self.done))
        if not outstanding:
            self._watch = None  # nothing to compile: no window runs
            return False
        now = time.monotonic()
        if now - self._looked < 0.5:  # reading /proc costs a few ms: not at every short step
            return False
        self._looked = now
        used = [tree_cpu_seconds(pid) for pid in self.pool.pids()]
        if any(cpu is None for cpu in used):  # no /proc (not Linux), or a helper just ended
            return False
        cpu = sum(used)
        if self._watch is None:
            self._watch = (now, cpu)
            return False
        began, cpu_then = self._watch
        if now - began < self.WATCH_SECONDS:
            return False
        share = (cpu - cpu_then) / (now - began)
        if share >= self.STARVED_SHARE:
            self._watch = (now, cpu)
            return False
        self.abandon(f"the background compiler got {share:.0%} of a core over the last {now - began:.0f} s "
                     "(the machine is busy)")
        return True

    def abandon(self, why: str) -> None:
        """Stop the helpers and JIT-compile their outstanding regions here: said once, as a warning."""
        self.abandoned = why
        self._fail(why, then=self.on_failure or ("compiling in the foreground instead: the regions it had not "
                                                 "compiled yet are JIT-compiled at this step boundary, reusing "
                                                 "what it finished"))
        self.pool.kill()

    def wait_for_all(self, poll_seconds: float = 0.05) -> float:
        """Block until every submitted job is answered, a helper died, or the pool was given up as
        starved (the blocking flavour, `parallel_compile`); the seconds it blocked."""
        began = time.perf_counter()
        self._start_import()
        while self.failure is None:
            with self._lock:
                if not self.submitted - set(self.done):
                    break
            self._check_alive()
            if self.check_progress():
                break
            time.sleep(poll_seconds)
        self.wait_seconds = round((self.wait_seconds or 0.0) + time.perf_counter() - began, 3)
        return self.wait_seconds

    def settle(self) -> None:
        """Between steps: give training its threads back once no job is outstanding (then the
        regions switch: the artifacts were made for that thread count)."""
        if self.own_threads is None:
            return
        with self._lock:
            outstanding = self.submitted - set(self.done)
        if outstanding and self.failure is None and self._check_alive():
            return
        self._restore_threads()

    def _restore_threads(self) -> None:
        own, self.own_threads = self.own_threads, None
        if own is not None and torch.get_num_threads() == own - 1:  # unless the script changed it meanwhile
            torch.set_num_threads(own)

    def _start_import(self) -> None:
        if not self._importing:
            # Inductor's runtime is what loading an artifact imports (1-2 s here). Imported on a
            # thread from the first poll or wait on (after step 1, which it would slow down: the
            # import holds the GIL), beside the eager steps, so the switch does not wait for it.
            self._importing = True
            threading.Thread(target=_import_runtime, args=(self._cpu_inductor,), name="kiln-import-inductor",
                             daemon=True).start()

    def _check_alive(self) -> bool:
        """False, and the pool failed with the cause, once a helper has exited while running."""
        if self.failure is not None:
            return False
        dead = None if self.pool.closed else self.pool.dead()
        if dead is None:
            return bool(self.pool.workers)
        self._fail(f"the background compiler (pid {dead.process.pid}) exited with code "
                   f"{dead.process.returncode}; see {self.log_path}")
        return False

    def status(self, region: str, digest: str) -> tuple[bool, Outcome | None]:
        """(finished, outcome) of a job; a dead helper finishes every job with its cause."""
        self._start_import()
        with self._lock:
            if (region, digest) in self.done:
                return True, self.done[(region, digest)]
        if not self._check_alive():
            with self._lock:
                if (region, digest) in self.done:
                    return True, self.done[(region, digest)]
        if self.failure is not None:
            return True, Outcome(error=self.failure)
        return False, None

    @property
    def process(self) -> subprocess.Popen | None:
        """The first helper (the only one with compile_workers=1)."""
        return self.pool.workers[0].process if self.pool.workers else None

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [w.process for w in self.pool.workers]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def log_path(self) -> Path:
        return self.pool.log_path

    def timeline(self) -> list[dict[str, Any]]:
        """Per job, in start order: region, signature, worker, start and end seconds after the first job."""
        return self.pool.timeline_dicts()

    def close(self) -> None:
        """Stop the helpers (they are also stopped when this process ends, however it ends)."""
        self._restore_threads()
        self.pool.close()

    def start(self) -> None:
        """Start the helpers now (at `prepare`), so that their interpreters and torch's compiler are
        imported by the time the first signature arrives; a no-op once they run or failed."""
        if self.pool.workers or self.failure is not None:
            return
        try:
            self.pool.start()
        except OSError as exc:
            self._fail(f"the background compiler could not be started ({type(exc).__name__}: {exc})")

    def _fail(self, why: str, then: str | None = None) -> None:
        then = then or self.on_failure or ("the regions it had not compiled yet are JIT-compiled in the "
                                           "training process at the next step boundary")
        self.failure = why
        self._restore_threads()
        if not self._warned:
            self._warned = True
            from kiln.compile.messages import KilnFallbackWarning
            warnings.warn(f"{why}: {then}", KilnFallbackWarning, stacklevel=4)


def default_workers(blocking: bool) -> int:
    """How many helpers: every free core when training waits for them (`blocking`), else the
    cores training leaves free once it made room (`_make_room`), at least one."""
    cores = free_cores()
    if blocking:
        return cores
    threads = torch.get_num_threads()
    training = threads - 1 if threads > 1 and threads >= cores else threads
    return max(1, cores - training)


def signature_text(signature: tuple) -> str:
    """A short text of a call signature for the timeline: tensor shapes, e.g. "(2x16x64, 2x16)"."""
    fields = dict(signature)
    return "(" + ", ".join(_describe(d) for d in fields.get("args", ())) + ")"


def _describe(desc: Any) -> str:
    if desc[0] == "tensor":
        return "x".join(str(n) for n in desc[1]) or "scalar"
    if desc[0] in ("tuple", "list"):
        return "[" + ", ".join(_describe(d) for d in desc[1]) + "]"
    return str(desc[-1])[:16]


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds used by process `root` and all its descendants, living or finished (Linux's
    /proc: a process's own time plus that of the children it reaped); None without /proc or root.
    The helper's compile runs partly in gcc processes, which its own times miss while they run."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    used: dict[int, int] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    for name in entries:
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (command) "
        pid, parent = int(name), int(fields[1])
        children.setdefault(parent, []).append(pid)
        used[pid] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    if root not in used:
        return None
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += used.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total / ticks


def _import_runtime(cpu_inductor: bool = False) -> None:
    try:
        import torch._dynamo.aot_compile  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    except Exception:  # an import that fails here fails again, visibly, where it is needed
        return
    if cpu_inductor:
        isa_probe.start()  # its threads run on; the Inductor compile or load waits for them


def _cpu_inductor(job: Job) -> bool:
    return job.compile_kwargs.get("backend", "inductor") == "inductor" and job.device.startswith("cpu")
