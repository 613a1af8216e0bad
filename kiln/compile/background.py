"""Train while compiling: a helper process compiles regions ahead of time from the signatures of
their first calls, while the training process runs those regions eagerly; between steps the
training process loads what is ready and switches each region to compiled code.

Depends on torch, kiln.compile.precompiled and kiln.compile.regions' entry builder; never on the
facade or a strategy. The helper is `python -m kiln.compile.background` (not multiprocessing's
spawn, which would run the user's script again in the helper when it lacks a main guard). It gets
jobs as length-prefixed pickles on its stdin and answers on its stdout. It dies with the training
process: Linux's parent-death signal, a watchdog on its parent's pid, and the end of its stdin.
"""

from __future__ import annotations

import os
import pickle
import struct
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

from kiln.compile import isa_probe
from kiln.compile.messages import first_line

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
    state = dict(module.__dict__)
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


def _example(desc: Any) -> Any:
    kind = desc[0]
    if kind == "tensor":
        _, shape, dtype, device, requires_grad, strides = desc
        if strides is not None:
            raise ValueError("a non-contiguous tensor argument cannot be rebuilt from its signature")
        dtype = getattr(torch, dtype.replace("torch.", ""))
        if dtype.is_floating_point or dtype.is_complex:
            value = torch.randn(shape, dtype=dtype, device=device)
        else:
            value = torch.zeros(shape, dtype=dtype, device=device)
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
    """The training process's handle on its helper process: submit jobs, see which are done."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self.process: subprocess.Popen | None = None
        self.done: dict[tuple[str, str], Outcome] = {}  # (region, digest) -> the helper's answer
        self.failure: str | None = None  # why the helper is gone, once it is
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._warned = False
        self._importing = False
        self.submitted: set[tuple[str, str]] = set()
        # The thread count training had before it made room for the helper, while it runs on one
        # thread fewer (`_make_room`); None otherwise. Signatures record this count, not the lower one.
        self.own_threads: int | None = None
        self._made_room = False
        self._cpu_inductor = False  # a job compiles Inductor CPU code: loading it needs isa_probe's answers

    def submit_signature(self, region: Any, module: nn.Module, signature: tuple, digest: str) -> bool:
        """Build the job for one signature of a `PrecompiledRegion` met at `module`, and send it."""
        try:
            device = next((str(t.device) for t in [*module.parameters(), *module.buffers()]), "cpu")
            job = Job(region.name, region.label, _path_of(region.block_class), _path_of(region.forward),
                      dict(region.compile_kwargs), str(region.root),
                      pickle.dumps(weightless_copy(module, region.block_class)), device, signature)
        except Exception as exc:  # an attribute that does not pickle, a class defined in a function
            return self._refuse(region.name, digest, f"the block cannot be sent to the helper "
                                                     f"({type(exc).__name__}: {exc})")
        return self.submit(job, digest)

    def _refuse(self, region: str, digest: str, why: str) -> bool:
        with self._lock:
            self.done[(region, digest)] = Outcome(error=why)
        return False

    def submit(self, job: Job, digest: str) -> bool:
        """Send a job; False when the helper cannot take it (it failed or died)."""
        if self.failure is not None:
            return False
        try:
            self._start()
            _write_frame(self.process.stdin, pickle.dumps((digest, job)))
        except (OSError, pickle.PicklingError, AttributeError, TypeError) as exc:
            self._fail(f"a job could not be sent ({type(exc).__name__}: {exc})")
            return False
        self.submitted.add((job.region, digest))
        self._cpu_inductor |= _cpu_inductor(job)
        self._make_room()
        return True

    def _make_room(self) -> None:
        """Before the first switch, training runs on one thread fewer when its threads fill every
        core: on 2 cores (torch 2.13, OpenMP) a helper beside 2 training threads made each eager
        step 10x slower (its threads wait for the one the helper displaced) and the compile 8x
        slower; with one thread the steps keep their pace and the helper has a core."""
        if self._made_room:
            return
        self._made_room = True
        threads = torch.get_num_threads()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or threads
        if threads > 1 and threads >= cores:
            self.own_threads = threads
            torch.set_num_threads(threads - 1)
            print(f"[kiln] compiling in the background: training runs on {threads - 1} of its {threads} threads "
                  "until the first compiled regions are ready", file=sys.stderr, flush=True)

    def settle(self) -> None:
        """Between steps: give training its threads back once no job is outstanding (then the
        regions switch: the artifacts were made for that thread count)."""
        if self.own_threads is None:
            return
        with self._lock:
            outstanding = self.submitted - set(self.done)
        if outstanding and self.failure is None and self.process is not None and self.process.poll() is None:
            return
        self._restore_threads()

    def _restore_threads(self) -> None:
        own, self.own_threads = self.own_threads, None
        if own is not None and torch.get_num_threads() == own - 1:  # unless the script changed it meanwhile
            torch.set_num_threads(own)

    def status(self, region: str, digest: str) -> tuple[bool, Outcome | None]:
        """(finished, outcome) of a job; a dead helper finishes every job with its cause."""
        if not self._importing:
            # Inductor's runtime is what loading an artifact imports (1-2 s here). Imported on a
            # thread from the first poll on (after step 1, which it would slow down: the import
            # holds the GIL), beside the eager steps, so the switch does not wait for it.
            self._importing = True
            threading.Thread(target=_import_runtime, args=(self._cpu_inductor,), name="kiln-import-inductor",
                             daemon=True).start()
        with self._lock:
            if (region, digest) in self.done:
                return True, self.done[(region, digest)]
        if self.process is not None and self.process.poll() is not None and self.failure is None:
            self._reader.join(timeout=1)
            with self._lock:
                if (region, digest) in self.done:
                    return True, self.done[(region, digest)]
            self._fail(f"the background compiler (pid {self.process.pid}) exited with code "
                       f"{self.process.returncode}; see {self.log_path}")
        if self.failure is not None:
            return True, Outcome(error=self.failure)
        return False, None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"background-compiler-{os.getpid()}.log"

    def close(self) -> None:
        """Stop the helper (it is also stopped when this process ends, however it ends)."""
        self._restore_threads()
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def start(self) -> None:
        """Start the helper now (at `prepare`), so that its interpreter and torch's compiler are
        imported by the time the first signature arrives; a no-op once it runs or failed."""
        if self.process is not None or self.failure is not None:
            return
        try:
            self._start()
        except OSError as exc:
            self._fail(f"the background compiler could not be started ({type(exc).__name__}: {exc})")

    def _start(self) -> None:
        if self.process is not None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # The helper imports the block classes the training process imported: same search path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["KILN_BACKGROUND_PARENT"] = str(os.getpid())
        # One compiler process, not a pool per core: the helper is meant to use the core training left it.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "kiln.compile.background"], env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._reader = threading.Thread(target=self._read, name="kiln-background-results", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stream = self.process.stdout
        while True:
            frame = _read_frame(stream)
            if frame is None:
                return
            try:
                region, digest, error, jit_only = pickle.loads(frame)
            except Exception as exc:  # a helper of another Kiln version: stop trusting it
                self.failure = f"the background compiler sent an answer this process cannot read ({exc})"
                return
            with self._lock:
                self.done[(region, digest)] = Outcome(error, jit_only)

    def _fail(self, why: str) -> None:
        self.failure = why
        self._restore_threads()
        if not self._warned:
            self._warned = True
            from kiln.compile.monitor import KilnFallbackWarning
            warnings.warn(f"{why}: the regions it had not compiled yet are JIT-compiled in the training "
                          "process at the next step boundary", KilnFallbackWarning, stacklevel=4)


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


# ---------------------------------------------------------------- the helper's side

def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def compile_job(job: Job, aot_refused: dict[str, str] | None = None) -> str | None:
    """Compile one job's signature ahead of time into its folder (the helper's work). Where torch
    cannot compile or save it ahead of time (torch 2.11 saves Inductor output only: "expected
    OutputCode, got function" with aot_eager), JIT-compile it instead, forward and backward, into
    the compile caches the training process shares; return why, for the training process to
    JIT-compile it there (a warm compile with Inductor). `aot_refused` remembers, per region, that
    ahead of time failed, so later signatures go straight to the JIT fill."""
    from kiln.compile.aot_workarounds import autocast_off
    from kiln.compile.precompiled import PrecompiledRegion
    from kiln.compile.regions import _region_entry

    aot_refused = {} if aot_refused is None else aot_refused

    if _cpu_inductor(job):
        isa_probe.start()  # once per helper; the compile waits for it
    cls, forward = _import(job.block_class), _import(job.forward)
    module = pickle.loads(job.skeleton).to_empty(device=job.device)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.normal_() if tensor.dtype.is_floating_point else tensor.zero_()
    fields = dict(job.signature)
    torch.set_num_threads(fields["num_threads"])  # loaded code guards on it: the training process's count
    for flag, submodule in zip(fields["training"], module.modules()):
        submodule.training = flag
    args, kwargs = example_inputs(job.signature)
    entry = _region_entry(forward, job.label)
    region = PrecompiledRegion(job.directory, job.region, job.label, entry, cls, forward, job.compile_kwargs)
    if job.region not in aot_refused:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failure is reported to the training process instead
            with torch.set_grad_enabled(fields["grad_enabled"]), autocast_off(fields["autocast"]):
                compiled = region._load_or_compile(job.signature, module, args, kwargs)
        if compiled is not None:
            return None
        aot_refused[job.region] = "; ".join(region.stats.notes) or "the ahead-of-time compile gave nothing"
    fill_compile_caches(entry, job.compile_kwargs, module, args, kwargs, fields)
    # For the other local processes, which watch the folder rather than the helper's answers.
    region.mark_jit_only(job.signature, aot_refused[job.region])
    return aot_refused[job.region]


def fill_compile_caches(entry, compile_kwargs: dict[str, Any], module: nn.Module, args: tuple,
                        kwargs: dict[str, Any], fields: dict[str, Any]) -> None:
    """JIT-compile one call as the training process's JIT path will (same entry, backend and
    settings; the caller's autocast around it) and run its backward, so that Inductor's FX graph
    and AOTAutograd caches hold both graphs when the training process compiles them."""
    from kiln.compile.aot_workarounds import autocast_on
    from kiln.compile.backend import resolve_backend

    kw = dict(compile_kwargs)
    backend = resolve_backend(kw.pop("backend", "inductor"), kw.pop("mode", None), kw.pop("options", None),
                              kw.get("dynamic"))
    compiled = torch.compile(entry, backend=backend, **kw)
    with torch.set_grad_enabled(fields["grad_enabled"]), autocast_on(fields["autocast"]):
        output = compiled(module, *args, **kwargs)
    leaves = [t for t in _tensors(output) if t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def main() -> None:
    parent = int(os.environ.get("KILN_BACKGROUND_PARENT", os.getppid()))
    _die_with_parent()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # Below the training process in the scheduler. Training leaves the helper a core where its
    # threads would fill them all (BackgroundCompiler._make_room); where they still cannot (one
    # thread per process, as many processes as cores), the eager steps keep their speed and the
    # compile (gcc included, which inherits this) takes what is left.
    try:
        os.nice(10)
    except OSError:
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to the log, not into the result stream
    _import_runtime()  # while the training process builds its first step, before any job comes
    aot_refused: dict[str, str] = {}
    while True:
        frame = _read_frame(stdin)
        if frame is None:
            return
        digest, job = pickle.loads(frame)
        error = jit_only = None
        start = time.perf_counter()
        try:
            jit_only = compile_job(job, aot_refused)
        except Exception as exc:  # reported to the training process, which warns once
            error = f"{type(exc).__name__}: {first_line(str(exc))}"
        done = "compiled" if jit_only is None else f"compiled into the shared caches only ({jit_only})"
        print(f"[kiln background] {job.region} {digest[:8]}: {error or done} in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        # Plain values: run as `python -m`, this module is __main__ here, so its classes would not unpickle there.
        _write_frame(stdout, pickle.dumps((job.region, digest, error, jit_only)))


if __name__ == "__main__":
    main()
