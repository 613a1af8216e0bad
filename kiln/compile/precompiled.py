"""Precompiled regions: a region's forward and backward compiled ahead of time, once per input
signature, saved in Kiln's cache folder, and loaded by later runs without any Dynamo trace.

Depends on torch and kiln.compile.cache / cache_key only; never on the facade, a strategy or
kiln.compile.regions (regions.py builds a `PrecompiledRegion` and asks it for a function per call).

Facts this rests on (torch 2.13, CPU): `torch.compile(fn, fullgraph=True).aot_compile(((args),
{kwargs}))` compiles forward and backward in one go; `load_compiled_function` gives it back in a
fresh process with 0 Dynamo graphs, and it runs on any instance of the block class (weights are
inputs). The loaded function keeps Dynamo's guards and raises "GuardManager check failed" before
running when they fail, but Kiln checks each call's signature itself first, so a guard failure
only means the signature missed something (then the call takes the JIT path). A function compiled
under autocast refuses every call under autocast (its dispatch key set differs), so autocast goes
inside the compiled function and the call is made with it switched off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import io
import os
import platform
import secrets
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kiln.compile.cache import (CorruptEntryError, KilnCacheWarning, pack_envelope, read_envelope,
                                write_atomically)
from kiln.compile.cache_key import canonical_json, cpu_model, device_name, triton_version

MAGIC = b"KILN-PRECOMPILED\n"
FORMAT_VERSION = 1
SUFFIX = ".kpc"
LOCK_SUFFIX = ".lock"
POLL_SECONDS = 0.05
FOREIGN_LOCK_SECONDS = 600.0  # a lock held on another machine (shared folder) is trusted this long
AUTOCAST_DEVICES = ("cpu", "cuda")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_GUARD_FAILURE = "GuardManager check failed"


class UnsupportedCall(Exception):
    """A call Kiln cannot describe by a signature (an argument of an unknown kind): JIT it."""


def unsupported_reason(compile_kwargs: dict[str, Any]) -> str | None:
    """Why these compile settings (or this torch) cannot use precompiled regions; None if they can."""
    # A module check, not a probe compile: torch.compile() alone imports for 0.36 s (torch 2.13).
    if not hasattr(torch.compiler, "load_compiled_function") or importlib.util.find_spec(
            "torch._dynamo.aot_compile") is None:
        return (f"torch {torch.__version__} has no ahead-of-time compile "
                "(torch.compile(...).aot_compile and torch.compiler.load_compiled_function)")
    if not compile_kwargs.get("fullgraph"):
        return "fullgraph=False: an ahead-of-time compile takes whole graphs only (set fullgraph=True)"
    if compile_kwargs.get("dynamic") is True:
        return "dynamic=True: precompiled artifacts are made per static input signature"
    backend = compile_kwargs.get("backend", "inductor")
    if not isinstance(backend, str):
        return "a backend given as a callable: Kiln cannot tell whether its output can be saved"
    options = compile_kwargs.get("options") or {}
    if compile_kwargs.get("mode") in CUDAGRAPH_MODES or options.get("triton.cudagraphs"):
        return "CUDA graphs (mode reduce-overhead/max-autotune) are not saved ahead of time"
    return None


# ---------------------------------------------------------------- signatures

def call_signature(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """Everything about one call that decides which compiled code fits it, as a hashable tuple:
    each argument (tensors by shape, dtype, device, strides when not contiguous, requires_grad;
    plain values by value), grad and inference mode, autocast, torch's thread count, the training
    flags of the block's modules, and its parameters' and buffers' shapes, dtypes and devices."""
    return (
        ("args", tuple(_describe(a) for a in args)),
        ("kwargs", tuple((k, _describe(v)) for k, v in sorted(kwargs.items()))),
        ("grad_enabled", torch.is_grad_enabled()),
        ("inference_mode", torch.is_inference_mode_enabled()),
        ("autocast", autocast_state()),
        # Loaded functions guard on the thread count (torch 2.13); torchrun sets 1 per process.
        ("num_threads", torch.get_num_threads()),
        ("training", tuple(m.training for m in module.modules())),
        ("parameters", tuple(_tensor_meta(p) for p in module.parameters())),
        ("buffers", tuple(_tensor_meta(b) for b in module.buffers())),
    )


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The autocast regions active now, as (device type, dtype) pairs."""
    state = []
    for device_type in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, str(torch.get_autocast_dtype(device_type))))
    return tuple(state)


def _tensor_meta(t: torch.Tensor) -> tuple:
    strides = None if t.is_contiguous() else tuple(t.stride())
    return ("tensor", tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad, strides)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            raise UnsupportedCall(f"an argument of tensor subclass {type(value).__name__}")
        return _tensor_meta(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v) for v in value))
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return ("dict", tuple((k, _describe(v)) for k, v in sorted(value.items())))
    if isinstance(value, (torch.dtype, torch.device)):
        return (type(value).__name__, str(value))
    raise UnsupportedCall(f"an argument of type {type(value).__qualname__}")


def signature_digest(signature: tuple) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()[:32]


def signature_fields(signature: tuple) -> dict[str, str]:
    """The signature as named readable fields (argument by argument), for headers and reasons."""
    fields: dict[str, str] = {}
    for name, value in signature:
        if name == "args":
            for i, item in enumerate(value):
                fields[f"argument {i}"] = _readable(item)
        elif name == "kwargs":
            for key, item in value:
                fields[f"argument {key}"] = _readable(item)
        else:
            fields[name] = _readable(value)
    return fields


def signature_difference(new: dict[str, str], saved: list[dict[str, str]]) -> str:
    """What differs between a call's signature and the closest saved one, in words."""
    if not saved:
        return "no artifact saved yet for this block and these settings"
    def differing(old: dict[str, str]) -> list[str]:
        return [k for k in sorted(set(new) | set(old)) if new.get(k) != old.get(k)]
    closest = min(saved, key=lambda old: len(differing(old)))
    parts = [f"{k}: {_mismatch(new.get(k, 'absent'), closest.get(k, 'absent'))}, now {new.get(k, 'absent')}, "
             f"saved {closest.get(k, 'absent')}" for k in differing(closest)[:3]]
    return "; ".join(parts) or "same signature"


def _mismatch(new: str, old: str) -> str:
    if new.startswith("tensor[") and old.startswith("tensor["):
        if new.split("]")[0] != old.split("]")[0]:
            return "size mismatch"
        if new.split()[1] != old.split()[1]:
            return "dtype mismatch"
    return "differs"


def _readable(item: Any) -> str:
    if isinstance(item, tuple) and item and item[0] == "tensor":
        _, shape, dtype, device, requires_grad, strides = item
        text = f"tensor{list(shape)} {dtype.replace('torch.', '')} {device}"
        if requires_grad:
            text += " requires_grad"
        if strides is not None:
            text += f" strides {list(strides)}"
        return text
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0] in (
            "NoneType", "bool", "int", "float", "str", "dtype", "device"):
        return repr(item[1])
    if isinstance(item, tuple) and len(item) == 2 and item[0] in ("tuple", "list", "dict"):
        inner = item[1]
        if item[0] == "dict":
            return "{" + ", ".join(f"{k}: {_readable(v)}" for k, v in inner) + "}"
        return "(" + ", ".join(_readable(v) for v in inner) + ")"
    return repr(item)


# ---------------------------------------------------------------- the region's identity

def region_key(block_class: type, forward: Callable, compile_kwargs: dict[str, Any]) -> str:
    """A digest over what makes a saved artifact valid for a block class: torch, Triton and
    Python versions, the machine and accelerator, the compile settings, and the source of the
    files that define the block class and its forward (a changed block gives a new key).
    Raises UnsupportedCall when that source cannot be read."""
    sources = []
    for obj in (block_class, forward):
        try:
            sources.append(inspect.getsource(sys.modules[obj.__module__]))
        except (OSError, TypeError, KeyError):
            raise UnsupportedCall(f"the source of {getattr(obj, '__qualname__', obj)} cannot be read, "
                                  "so a changed block could not be told from an unchanged one") from None
    settings = {k: compile_kwargs.get(k) for k in ("backend", "mode", "options", "fullgraph", "dynamic")}
    identity = {
        "format": FORMAT_VERSION, "torch": torch.__version__, "triton": triton_version(),
        "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_model(),
        "cuda": device_name(torch.device("cuda")) if torch.cuda.is_available() else None,
        "settings": {k: (v if v is None or isinstance(v, (bool, str)) else repr(v)) for k, v in settings.items()},
        "class": f"{block_class.__module__}.{block_class.__qualname__}",
        "forward": f"{forward.__module__}.{forward.__qualname__}",
        "source_sha256": [hashlib.sha256(s.encode()).hexdigest() for s in sources],
    }
    return hashlib.sha256(canonical_json(identity).encode()).hexdigest()


# ---------------------------------------------------------------- one region's artifacts

@dataclass
class PrecompileStats:
    """What one region's precompiled artifacts did in this process, for the compile report."""

    background_eager_calls: int = 0  # calls run eagerly while the helper compiled their signature
    switch_step: int | None = None  # the optimizer step after which the region first switched
    switch_seconds: float | None = None  # from the first job sent to that switch
    loaded: int = 0  # artifacts read from disk and used
    compiled: int = 0  # signatures compiled ahead of time here (and saved)
    saved: int = 0
    calls: int = 0  # calls that ran precompiled code
    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    wait_seconds: float = 0.0  # waiting for another local process to write an artifact
    notes: list[str] = field(default_factory=list)  # why a signature was not loaded from disk


_MISSING = object()
EAGER = object()  # what `function_for` gives for a call that runs eagerly (train while compiling)


class PrecompiledRegion:
    """The precompiled functions of one region, by call signature, backed by one folder.

    `function_for(module, args, kwargs)` gives the function for this call's signature: from memory,
    else loaded from disk, else compiled ahead of time now (and saved). None means "take the JIT
    path" (the call cannot be described, or the ahead-of-time compile failed); each such cause is
    a note in the report. `on_compile(reason, first)` is called after each ahead-of-time compile
    (`first`: no other signature had code in this process yet). Local processes sharing the folder compile each signature once: the
    first claims a lock file, the others wait for its artifact and load it.
    """

    def __init__(self, directory: str | os.PathLike, name: str, label: str, entry: Callable,
                 block_class: type, forward: Callable, compile_kwargs: dict[str, Any],
                 on_compile: Callable[[str, bool], None] | None = None) -> None:
        self.name = name
        self.label = label
        self.entry = entry
        self.forward = forward
        self.block_class = block_class
        self.compile_kwargs = {k: v for k, v in compile_kwargs.items() if k != "recompile"}
        self.key = region_key(block_class, forward, compile_kwargs)
        self.root = Path(directory).expanduser().absolute()
        self.directory = self.root / f"{_safe(name)}-{self.key[:16]}"
        self.stats = PrecompileStats()
        self.on_compile = on_compile
        self._functions: dict[tuple, Callable | None] = {}
        self._entries: dict[tuple[str, ...], Callable] = {}  # autocast state -> entry with it inside
        self._failed = False  # an ahead-of-time compile failed: the rest of the run is JIT
        # Train while compiling (kiln/compile/background.py): `background` compiles in a helper
        # process (the local main process has one); `background_wait` waits for another local
        # process's helper. Meanwhile the signature runs eagerly; `poll` switches between steps.
        self.background: Any = None
        self.background_wait = False
        self._pending: dict[tuple, tuple[str, float]] = {}  # signature -> (digest, when sent)
        self._ready: set[tuple] = set()
        self._first_sent: float | None = None
        if self.compile_kwargs.get("dynamic") is None:
            self.compile_kwargs["dynamic"] = False  # one static artifact per signature

    # ----- per call --------------------------------------------------------------------------
    def function_for(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable | None, tuple]:
        try:
            signature = call_signature(module, args, kwargs)
        except UnsupportedCall as exc:
            self._note(f"a call took the JIT path: {exc}")
            return None, ()
        fn = self._functions.get(signature, _MISSING)
        if fn is _MISSING and (self.background is not None or self.background_wait):
            fn = self._in_background(signature, module)
            if fn is EAGER:
                return EAGER, signature
        if fn is _MISSING:
            # Loading rebuilds the guards, compiling records them, saving records them again, each
            # under the dispatch state of its moment (torch 2.13): all must see the calls' state,
            # where autocast is off (it runs inside the function).
            with _autocast_off(dict(signature)["autocast"]):
                fn = self._load_or_compile(signature, module, args, kwargs)
            self._functions[signature] = fn
        return fn, signature

    NOT_RUN = _MISSING  # what `call` returns when torch refused the call before running it

    # ----- train while compiling -------------------------------------------------------------
    @property
    def waiting(self) -> bool:
        """Signatures are still being compiled in the background (their calls run eagerly)."""
        return bool(self._pending)

    def _in_background(self, signature: tuple, module: nn.Module):
        """EAGER while the signature's artifact is not ready; _MISSING to load (or compile) it now."""
        if signature in self._ready:
            self._ready.discard(signature)
            self._pending.pop(signature, None)
            return _MISSING  # ready: loaded now, at the first call after the poll that saw it
        if signature in self._pending:
            return EAGER
        path = self._path(signature)
        if path.exists():
            return _MISSING  # an earlier run's artifact: load it as usual
        digest = signature_digest(signature)
        if self.background is not None and not self.background.submit_signature(self, module, signature, digest):
            _, error = self.background.status(self.name, digest)
            self._note(f"{self._signature_text(signature)}: not compiled in the background ({error}); eager")
            self._functions[signature] = EAGER
            return EAGER
        self._pending[signature] = (digest, time.perf_counter())
        if self._first_sent is None:
            self._first_sent = time.perf_counter()
        return EAGER

    def poll(self, step: int) -> None:
        """Between steps: mark the signatures whose artifacts are ready, to be loaded at their next
        call; a job that failed (or a helper that died) leaves its signature eager, with a note."""
        for signature, (digest, _) in list(self._pending.items()):
            if signature in self._ready:
                continue
            if self.background is not None:
                finished, error = self.background.status(self.name, digest)
            else:
                finished, error = self._path(signature).exists(), None
            if not finished:
                continue
            if error is not None:
                del self._pending[signature]
                self._functions[signature] = EAGER
                self._note(f"{self._signature_text(signature)}: the background compile failed ({error}); "
                           "it keeps running eagerly")
                continue
            self._ready.add(signature)
            if self.stats.switch_step is None:
                self.stats.switch_step = step
                self.stats.switch_seconds = round(time.perf_counter() - self._first_sent, 3)

    def call(self, fn: Callable, signature: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        """Run a precompiled function with autocast switched off around it (it is inside)."""
        state = dict(signature)["autocast"]
        try:
            with _as_class(module, self.block_class):
                output = self._run(fn, state, module, args, kwargs)
        except RuntimeError as exc:
            if _GUARD_FAILURE not in str(exc):
                raise
            # Raised before anything ran: Kiln's signature missed something torch guards on.
            self._functions[signature] = None
            self._note(f"a loaded artifact refused a call ({_guard_reason(str(exc))}): JIT path")
            return _MISSING
        self.stats.calls += 1
        return output

    @staticmethod
    def _run(fn: Callable, state: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        with _autocast_off(state):
            return fn(module, *args, **kwargs)

    # ----- load, compile, save -------------------------------------------------------------
    def _path(self, signature: tuple) -> Path:
        return self.directory / f"{signature_digest(signature)}{SUFFIX}"

    def _load_or_compile(self, signature: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        path = self._path(signature)
        fn = self._load(path)
        if fn is not None:
            return fn
        if self._failed:
            return None
        reason = self._why_missing(signature)
        while True:
            lock = self._claim(path)
            if lock is not None:
                try:
                    return self._compile_and_save(signature, module, args, kwargs, path, reason)
                finally:
                    lock.unlink(missing_ok=True)
            if self._wait_for(path):
                fn = self._load(path)
                if fn is not None:
                    return fn
            if not path.with_suffix(LOCK_SUFFIX).exists():
                if path.exists():
                    continue
                self._note(f"{self._signature_text(signature)}: the local process that was compiling it "
                           "stopped without writing it; JIT path")
                return None

    def _load(self, path: Path) -> Callable | None:
        start = time.perf_counter()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._reject(path, f"it cannot be read ({exc})")
            return None
        try:
            header, payload = read_envelope(data, MAGIC, FORMAT_VERSION, "Kiln precompiled artifact",
                                            ("region_key", "torch", "signature"))
            if header["torch"] != torch.__version__:
                raise CorruptEntryError(f"it was written by torch {header['torch']}, this is torch {torch.__version__}")
            if header["region_key"] != self.key:
                raise CorruptEntryError("it belongs to another block source or other compile settings")
            try:
                fn = torch.compiler.load_compiled_function(io.BytesIO(payload))
            except Exception as exc:  # torch's deserializer failing must not stop the job
                raise CorruptEntryError(f"torch.compiler.load_compiled_function raised "
                                        f"{type(exc).__name__}: {_first_line(str(exc))}") from None
        except CorruptEntryError as exc:
            self._reject(path, str(exc))
            return None
        self.stats.loaded += 1
        self.stats.load_seconds += time.perf_counter() - start
        return fn

    def _reject(self, path: Path, problem: str) -> None:
        warnings.warn(f"precompiled artifact {path} not used: {problem}; compiling it again "
                      "(`kiln cache clear` removes bad entries)", KilnCacheWarning, stacklevel=5)
        self._note(f"artifact {path.name} rejected: {problem}")

    def _compile_and_save(self, signature, module, args, kwargs, path: Path, reason: str):
        start = time.perf_counter()
        state = dict(signature)["autocast"]
        entry = self._entry_for(state)
        kw = dict(self.compile_kwargs)
        examples = (module, *_detached(args)), _detached(kwargs)
        grads = [(p, p.grad) for p in module.parameters()]
        try:
            # Gradients on the example's parameters break the artifact (torch 2.13 pickles them
            # into its guards and cannot read them back), so they are set aside while compiling.
            for p, _ in grads:
                p.grad = None
            hits = _autograd_cache_hits()
            private = _private_autograd_cache(self.directory / ".aotautograd" / signature_digest(signature))
            with _as_class(module, self.block_class), private:
                compiled = torch.compile(entry, **kw).aot_compile(examples)
            if not private.active and _autograd_cache_hits() != hits:
                raise _ServedFromCache()
            payload = _serialize(compiled)
        except _ServedFromCache:
            # Neither saved nor used: the JIT path compiles this signature; later ones still try.
            self._note(f"{self._signature_text(signature)}: AOTAutograd's disk cache answered the "
                       "ahead-of-time compile, and such answers cannot be trusted (torch 2.13); JIT path")
            return None
        except Exception as exc:
            self._failed = True
            self._note(f"ahead-of-time compile failed ({type(exc).__name__}: {_first_line(str(exc))}); "
                       "the rest of this run takes the JIT path")
            warnings.warn(f"region {self.name}: ahead-of-time compile failed ({type(exc).__name__}: "
                          f"{_first_line(str(exc))}); it is JIT-compiled instead and nothing is precompiled",
                          KilnCacheWarning, stacklevel=5)
            return None
        finally:
            for p, grad in grads:
                p.grad = grad
        seconds = time.perf_counter() - start
        self.stats.compiled += 1
        self.stats.compile_seconds += seconds
        self._note(f"{self._signature_text(signature)}: compiled ahead of time and saved ({reason})")
        header = {"format": FORMAT_VERSION, "region": self.name, "region_key": self.key,
                  "torch": torch.__version__, "triton": triton_version(), "created": time.time(),
                  "signature": signature_fields(signature), "compile_seconds": round(seconds, 3)}
        try:
            write_atomically(path, pack_envelope(MAGIC, header, payload))
            self.stats.saved += 1
        except OSError as exc:
            warnings.warn(f"precompiled artifact {path} not written: {exc}", KilnCacheWarning, stacklevel=5)
        if self.on_compile is not None:
            first = not any(f is not None for f in self._functions.values())
            self.on_compile(f"new input signature: {reason}", first)
        return compiled

    def _entry_for(self, state: tuple) -> Callable:
        """The region's entry, with the caller's autocast moved inside it."""
        if not state:
            return self.entry
        if state not in self._entries:
            # It calls the block's forward itself: a function in its closure is saved by name, and
            # the region's entry has none that can be imported (PicklingError, torch 2.13).
            self._entries[state] = _with_autocast(self.forward, state, self.label)
        return self._entries[state]

    def _why_missing(self, signature: tuple) -> str:
        saved = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")) if self.directory.is_dir() else ():
            try:
                header, _ = read_envelope(path.read_bytes(), MAGIC, FORMAT_VERSION, "artifact", ("signature",))
            except (CorruptEntryError, OSError):
                continue
            saved.append(header["signature"])
        if not saved:
            others = [p.name for p in self.root.glob(f"{_safe(self.name)}-*") if p != self.directory]
            if others:
                return ("artifacts exist only for another version of this block "
                        "(its source, the compile settings or torch changed)")
        return signature_difference(signature_fields(signature), saved)

    # ----- one compiler per signature among local processes ---------------------------------
    def _claim(self, path: Path) -> Path | None:
        """Create the signature's lock file; None when another live process holds it."""
        lock = path.with_suffix(LOCK_SUFFIX)
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            if _lock_is_stale(lock):
                lock.unlink(missing_ok=True)
                return self._claim(path)
            return None
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{socket.gethostname()} {os.getpid()} {time.time()} {secrets.token_hex(4)}\n")
        return lock

    def _wait_for(self, path: Path) -> bool:
        """Wait while another process holds the lock; True when the artifact appeared."""
        lock = path.with_suffix(LOCK_SUFFIX)
        start = time.perf_counter()
        told = start
        while lock.exists() and not path.exists() and not _lock_is_stale(lock):
            time.sleep(POLL_SECONDS)
            if time.perf_counter() - told > 30:
                told = time.perf_counter()
                print(f"[kiln] waiting {told - start:.0f} s for another process to precompile region "
                      f"{self.name} ({lock})", file=sys.stderr, flush=True)
        self.stats.wait_seconds += time.perf_counter() - start
        return path.exists()

    # ----- notes -------------------------------------------------------------------------------
    def _signature_text(self, signature: tuple) -> str:
        return f"signature {signature_digest(signature)[:8]}"

    def _note(self, text: str) -> None:
        if text not in self.stats.notes:
            self.stats.notes.append(text)


def _lock_is_stale(lock: Path) -> bool:
    """A lock whose process is gone (same machine), or an old one from another machine."""
    try:
        host, pid, created = lock.read_text().split()[:3]
    except (OSError, ValueError):
        return False  # being written, or just removed
    if host != socket.gethostname():
        return time.time() - float(created) > FOREIGN_LOCK_SECONDS
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _ServedFromCache(Exception):
    """AOTAutograd's shared disk cache answered an ahead-of-time compile. With torch 2.13 (bf16,
    aot_eager), a compile at batch 3 in a run that followed one at batch 6 of the same block was
    answered with batch-6 code under batch-3 guards ("shape '[18, 16]' is invalid for input of
    size 144" at its first call); with the Inductor folder emptied between the runs it was not.
    Switching the cache off is no way out (the result can then not be saved: "does not implement
    SerializableCallable"), nor is `torch.compiler.config.cache_key_tag`. So each signature gets a
    cache folder of its own (`_private_autograd_cache`), and where that cannot be done, a compile
    the shared cache answered is not used."""


class _private_autograd_cache:
    """AOTAutograd's disk cache in a folder of one signature's own while it is compiled ahead of
    time (`_ServedFromCache` says why a shared one cannot be trusted). It stays on, as saving needs
    it. Patches a private classmethod (AOTAutogradCache._get_tmp_dir, torch 2.13); where that is
    missing, `active` stays False and a compile the cache answered is not used instead."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.active, self._saved = folder, False, None
        try:
            from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        except ImportError:
            self.cache = None
        else:
            self.cache = AOTAutogradCache if "_get_tmp_dir" in vars(AOTAutogradCache) else None

    def __enter__(self):
        if self.cache is not None:
            self._saved = vars(self.cache)["_get_tmp_dir"]
            folder = str(self.folder)
            self.cache._get_tmp_dir = classmethod(lambda cls: folder)
            self.active = True
        return self

    def __exit__(self, *exc):
        if self.cache is not None:
            self.cache._get_tmp_dir = self._saved
        return False


def _autograd_cache_hits() -> int:
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


def _serialize(compiled: Any) -> bytes:
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    temp = folder / f"kiln-precompiled-{os.getpid()}-{secrets.token_hex(4)}.bin"
    try:
        result = compiled.save_compiled_function(str(temp))
        if getattr(result, "external_data", None):
            raise RuntimeError("the compiled function needs external data, which Kiln does not save")
        return temp.read_bytes()
    finally:
        temp.unlink(missing_ok=True)


def _detached(value: Any) -> Any:
    """Example inputs for the ahead-of-time compile: the call's values, tensors detached from
    their graph (autograd history and .grad do not belong in the artifact)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _as_class:
    """The module seen as its block class while precompiled code is compiled or runs. FSDP2 gives
    each sharded module a class made at run time (FSDP<Block>), which another process cannot
    name: a loaded artifact's guard on the module's type then refused every call (torch 2.13)."""

    def __init__(self, module: nn.Module, cls: type) -> None:
        self.module, self.cls, self.saved = module, cls, type(module)

    def __enter__(self):
        if self.saved is not self.cls:
            self.module.__class__ = self.cls

    def __exit__(self, *exc):
        if self.saved is not self.cls:
            self.module.__class__ = self.saved
        return False


class _autocast_off:
    """Switch off the given autocast regions (at most one per device type)."""

    def __init__(self, state: tuple) -> None:
        self.contexts = [torch.autocast(device_type, enabled=False) for device_type, _ in state]

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        return False


def _with_autocast(forward: Callable, state: tuple, label: str) -> Callable:
    dtypes = [(device_type, getattr(torch, dtype.replace("torch.", ""))) for device_type, dtype in state]
    if len(dtypes) == 1:
        (device_type, dtype), = dtypes

        def with_autocast(module, *args, **kwargs):
            with torch.autocast(device_type, dtype=dtype):
                return forward(module, *args, **kwargs)
    else:
        (first, first_dtype), (second, second_dtype) = dtypes

        def with_autocast(module, *args, **kwargs):
            with torch.autocast(first, dtype=first_dtype), torch.autocast(second, dtype=second_dtype):
                return forward(module, *args, **kwargs)

    return _renamed(with_autocast, label)


def _renamed(fn: Callable, label: str) -> Callable:
    """`fn` with the region's label as its code name: Dynamo's records name the region by it."""
    changes = {"co_name": label}
    if hasattr(fn.__code__, "co_qualname"):
        changes["co_qualname"] = label
    code = fn.__code__.replace(**changes)
    return type(fn)(code, fn.__globals__, label, fn.__defaults__, fn.__closure__)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _guard_reason(text: str) -> str:
    """The failing guard out of torch's "GuardManager check failed, reason: GuardDebugInfo(...)"."""
    marker = "verbose_code_parts=["
    if marker in text:
        return text.split(marker, 1)[1].rsplit("]", 1)[0].strip()[:300]
    return _first_line(text)
