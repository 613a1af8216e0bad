"""Precompiled regions: a region's forward and backward compiled ahead of time, once per input
signature, saved in Kiln's cache folder, and loaded by later runs without any Dynamo trace.

Depends on torch, kiln.compile.artifacts.cache and the modules it is made of (signatures: what a
call is; aot_workarounds: torch behaviours worked around; local_classes: a failure explained;
messages; progress: the live compile line); never on the facade, a strategy or
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

import importlib.util
import io
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kiln.compile import isa_probe
from kiln.compile.artifacts.aot_workarounds import (ServedFromCache, as_class, autocast_off, autograd_cache_hits,
                                          compile_ahead_of_time, detached, private_autograd_cache, serialized,
                                          with_autocast)
from kiln.compile.artifacts.artifact_lock import LOCK_SUFFIX, claim, wait_for
from kiln.compile.artifacts.cache import (CorruptEntryError, KilnCacheWarning, pack_envelope, read_envelope,
                                write_atomically)
from kiln.compile.artifacts.cache_key import triton_version
from kiln.compile.artifacts.local_classes import explain_failure
from kiln.compile.messages import first_line, guard_reason
from kiln.compile.progress import PROGRESS
from kiln.compile.artifacts.signatures import (AUTOCAST_FIELD, FORMAT_VERSION, UnsupportedCall, arguments_key,
                                               call_signature, holds_distributed, module_keys, region_key,
                                               signature_difference, signature_digest, signature_fields)

MAGIC = b"KILN-PRECOMPILED\n"
SUFFIX = ".kpc"
JIT_ONLY_SUFFIX = ".jit"  # beside where an artifact would be: why this signature is JIT-compiled
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_GUARD_FAILURE = "GuardManager check failed"


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
    received: int = 0  # artifacts another machine compiled and sent here (sharing.py)
    share_seconds: float = 0.0  # in exchanges with other machines, their compiles included
    notes: list[str] = field(default_factory=list)  # why a signature was not loaded from disk


_MISSING = object()
_AMBIGUOUS = object()  # arguments met with several signatures: looked up with the module's facts too
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
                 on_compile: Callable[[str, bool], None] | None = None, aot_off: str | None = None,
                 jit_on_failure: bool = False) -> None:
        self.name = name
        # fullgraph left unset by the user: a failed ahead-of-time compile (a graph break) is the JIT
        # path for this region, said in the report, not a warning.
        self.jit_on_failure = jit_on_failure
        # Why these settings rule an ahead-of-time compile out (fullgraph=False), for a region whose
        # helpers only fill the compile caches: every signature is then JIT-compiled here, warm.
        self.aot_off = aot_off
        self.label = label
        self.entry = entry
        self.forward = forward
        self.block_class = block_class
        self.compile_kwargs = {k: v for k, v in compile_kwargs.items() if k != "recompile"}
        if self.compile_kwargs.get("dynamic") is None:
            self.compile_kwargs["dynamic"] = False  # one static artifact per signature
        # From the settings as compiled: the helper, which gets them, then names the same folder.
        self.key = region_key(block_class, forward, self.compile_kwargs)
        self.root = Path(directory).expanduser().absolute()
        self.directory = self.root / f"{_safe(name)}-{self.key[:16]}"
        self.stats = PrecompileStats()
        self.on_compile = on_compile
        self._functions: dict[tuple, Callable | None] = {}
        # The per-call lookup, for signatures settled for good (loaded, compiled, or the JIT path)
        # while nothing compiles in the background, without the signature's text. By the call's
        # arguments alone (`arguments_key`): one signature met with them runs, and the loaded
        # function's own guards, checked before it runs, vouch for the module (its parameters' dtypes,
        # requires_grad, the training flags its code reads); where they refuse, the module changed
        # (`call` looks again). Arguments met with several signatures, or with DTensor parameters
        # (whose process groups torch's guards do not see), are _AMBIGUOUS: looked up by the full
        # key (`call_key`), with a walk of the module. Emptied whenever a signature's function changes.
        self._settled: dict[tuple, Any] = {}
        self._settled_full: dict[tuple, tuple[Callable | None, tuple]] = {}
        self._entries: dict[tuple[str, ...], Callable] = {}  # autocast state -> entry with it inside
        self._failed = False  # an ahead-of-time compile failed: the rest of the run is JIT
        # Train while compiling (kiln/compile/artifacts/background.py): `background` compiles in a helper
        # process (the local main process has one); `background_wait` waits for another local
        # process's helper. Meanwhile the signature runs eagerly; `poll` switches between steps.
        self.background: Any = None
        self.background_wait = False
        self._pending: dict[tuple, tuple[str, float]] = {}  # signature -> (digest, when sent)
        self._ready: set[tuple] = set()
        self._handed_back: set[tuple] = set()  # switched to the JIT path by poll, not JIT-compiled yet
        self._first_sent: float | None = None
        # Jobs on several machines (kiln/compile/artifacts/sharing.py): one machine compiles each
        # signature and the others receive it. None on one machine, where the folder is shared.
        self.sharing: Any = None

    # ----- per call --------------------------------------------------------------------------
    def function_for(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable | None, tuple]:
        if self.background is not None or self.background_wait:
            return self._function_for(module, args, kwargs)
        try:
            key = arguments_key(args, kwargs)
        except UnsupportedCall:
            return self._function_for(module, args, kwargs)  # the signature says why, in the report
        settled = self._settled.get(key)
        if settled is not None and settled is not _AMBIGUOUS:
            return settled
        if settled is _AMBIGUOUS:
            settled = self._settled_full.get((*key, *module_keys(module)))
            if settled is not None:
                return settled
        fn, signature = self._function_for(module, args, kwargs)
        if fn is not EAGER and signature in self._functions:
            self._settle(key, module, fn, signature)
        return fn, signature

    def _settle(self, key: tuple, module: nn.Module, fn: Callable | None, signature: tuple) -> None:
        keys = module_keys(module)
        if key not in self._settled and not holds_distributed(keys):
            self._settled[key] = (fn, signature)
        else:
            self._settled[key] = _AMBIGUOUS
            self._settled_full[(*key, *keys)] = (fn, signature)

    def _forget_settled(self) -> None:
        self._settled.clear()
        self._settled_full.clear()

    def _function_for(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable | None, tuple]:
        try:
            threads = self.background.own_threads if self.background is not None else None
            signature = call_signature(module, args, kwargs, threads)
        except UnsupportedCall as exc:
            self._note(f"a call took the JIT path: {exc}")
            return None, ()
        fn = self._functions.get(signature, _MISSING)
        if fn is _MISSING and (self.background is not None or self.background_wait):
            fn = self._in_background(signature, module)
            if fn is EAGER:
                return EAGER, signature
        if fn is _MISSING and self.aot_off is not None:
            fn = None  # nothing ahead of time to load or compile: the JIT path
            self._functions[signature] = None
        if fn is _MISSING:
            # Loading rebuilds the guards, compiling records them, saving records them again, each
            # under the dispatch state of its moment (torch 2.13): all must see the calls' state,
            # where autocast is off (it runs inside the function).
            with autocast_off(dict(signature)["autocast"]):
                # Training calls only: every process of a DDP or FSDP job makes them together, while
                # evaluation may run on one process alone, which would wait for the others.
                if self.sharing is not None and dict(signature)["grad_enabled"]:
                    fn = self._shared(signature, module, args, kwargs)
                if fn is _MISSING:
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
        why = self._jit_only_reason(signature)
        if why is not None:  # an earlier run found it cannot be precompiled; its caches are warm
            self._note(f"{self._signature_text(signature)}: JIT-compiled, as an earlier run found it cannot be "
                       f"compiled ahead of time ({why})")
            self._functions[signature] = None
            return None
        digest = signature_digest(signature)
        if self.background is not None and not self.background.submit_signature(self, module, signature, digest):
            _, outcome = self.background.status(self.name, digest)
            self._note(f"{self._signature_text(signature)}: not compiled in the background "
                       f"({outcome.error if outcome else 'the helper is gone'}); JIT-compiled here")
            self._functions[signature] = None
            return None
        self._pending[signature] = (digest, time.perf_counter())
        if self._first_sent is None:
            self._first_sent = time.perf_counter()
        return EAGER

    def poll(self, step: int) -> None:
        """Between steps: mark the signatures whose artifacts are ready, to be loaded at their next
        call. A signature the helper could only compile into the shared caches, a job that failed
        and a helper that died all end the same way: the signature is JIT-compiled at its next
        call (warm where the helper filled the caches), with a note. Background mode ends on
        compiled code, never on eager calls."""
        if self.background is not None and self.background.own_threads is not None:
            return  # the process still runs on fewer threads than the artifacts were made for
        for signature, (digest, _) in list(self._pending.items()):
            if signature in self._ready:
                continue
            if self.background is not None:
                finished, outcome = self.background.status(self.name, digest)
                error, jit_only = (outcome.error, outcome.jit_only) if outcome is not None else (None, None)
            else:  # another local process's helper compiles it: watch the folder
                error, jit_only = None, self._jit_only_reason(signature)
                finished = jit_only is not None or self._path(signature).exists()
            if not finished:
                continue
            why_jit = None
            if error is not None:
                abandoned = self.background.abandoned
                why_jit = (f"compiled in the foreground instead ({abandoned})" if error == abandoned
                           else f"the background compile failed ({error})")
            elif jit_only is not None and self.aot_off is not None:
                why_jit = (f"the helper JIT-compiled it into the shared compile caches ({self.aot_off.split(':')[0]} "
                           "rules an ahead-of-time compile out)")
            elif jit_only is not None:
                why_jit = (f"it cannot be compiled ahead of time here ({jit_only}); the helper compiled it "
                           "into the shared compile caches")
            if self.stats.switch_step is None:
                self.stats.switch_step = step
                self.stats.switch_seconds = round(time.perf_counter() - self._first_sent, 3)
            if why_jit is not None:
                del self._pending[signature]
                self._functions[signature] = None  # the JIT path, from its next call
                self._forget_settled()
                self._handed_back.add(signature)
                self._note(f"{self._signature_text(signature)}: {why_jit}; JIT-compiled after step {step}")
                continue
            self._ready.add(signature)

    def take_handback(self, signature: tuple) -> bool:
        """True once for a signature `poll` handed to the JIT path: its first JIT compile was owed
        since before warm-up, and is no recompile after it."""
        if signature in self._handed_back:
            self._handed_back.discard(signature)
            return True
        return False

    def mark_jit_only(self, signature: tuple, why: str) -> None:
        """Record in the folder that this signature cannot be precompiled on this torch (the helper
        filled the shared caches instead): local processes that wait on the folder, and later
        runs, then JIT-compile it rather than wait for an artifact that will not come."""
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self._path(signature).with_suffix(JIT_ONLY_SUFFIX), why.encode())

    def _jit_only_reason(self, signature: tuple) -> str | None:
        try:
            return self._path(signature).with_suffix(JIT_ONLY_SUFFIX).read_text()
        except OSError:
            return None

    def call(self, fn: Callable, signature: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        """Run a precompiled function with autocast switched off around it (it is inside)."""
        state = signature[AUTOCAST_FIELD][1]
        try:
            if not state and type(module) is self.block_class:
                output = fn(module, *args, **kwargs)  # nothing to switch: no context to enter
            else:
                with as_class(module, self.block_class):
                    output = self._run(fn, state, module, args, kwargs)
        except RuntimeError as exc:
            if _GUARD_FAILURE not in str(exc):
                raise
            # Raised before anything ran. Either the function was found by the call's arguments alone
            # and the module has changed since (another signature: look it up by the full key from
            # now on), or Kiln's signature missed something torch guards on (the JIT path).
            if self._changed_since_settled(signature, module, args, kwargs):
                fn, signature = self.function_for(module, args, kwargs)
                return self.NOT_RUN if fn is None else self.call(fn, signature, module, args, kwargs)
            self._functions[signature] = None
            self._forget_settled()
            self._note(f"a loaded artifact refused a call ({guard_reason(str(exc))}): JIT path")
            return _MISSING
        self.stats.calls += 1
        return output

    def _changed_since_settled(self, signature: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
        """After a refused call: True where this call's signature is not the one its arguments were
        settled with, whose arguments are then marked ambiguous (`function_for`)."""
        if self.background is not None or self.background_wait:
            return False  # the full signature chose the function
        try:
            if call_signature(module, args, kwargs) == signature:
                return False
            self._settled[arguments_key(args, kwargs)] = _AMBIGUOUS
        except UnsupportedCall:
            return False
        return True

    @staticmethod
    def _run(fn: Callable, state: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        with autocast_off(state):
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

    def _shared(self, signature: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        """Across machines: one machine loads or compiles the signature, the others receive its
        artifact into their folders. The function if this machine made it; _MISSING to load it (or
        compile it, when not shared) from the folder; None for the JIT path."""
        path = self._path(signature)

        def compile_here() -> tuple[Callable | None, Path | None]:
            fn = self._load_or_compile(signature, module, args, kwargs)
            return fn, (path if fn is not None and path.exists() else None)

        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        shared = self.sharing.exchange(self.name, signature_digest(signature), path.exists(), device, compile_here)
        self.stats.share_seconds += shared.seconds
        if shared.mismatch is not None:
            self.sharing = None  # every process learnt it in the same exchange: none waits for another
            self._note(f"{shared.mismatch}: not shared between machines, each compiles its own")
            return _MISSING
        if shared.here:
            return shared.result
        if shared.payload_missing:
            self._note(f"{self._signature_text(signature)}: machine {shared.source} could not compile it "
                       "ahead of time; JIT path")
            return None
        self.stats.received += 1
        self._note(f"{self._signature_text(signature)}: received from machine {shared.source}")
        return _MISSING

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
                self._wait_for_isa_probe()  # the load builds CPU kernels' bindings, which ask for its answers
                fn = torch.compiler.load_compiled_function(io.BytesIO(payload))
            except Exception as exc:  # torch's deserializer failing must not stop the job
                raise CorruptEntryError(f"torch.compiler.load_compiled_function raised "
                                        f"{type(exc).__name__}: {first_line(str(exc))}") from None
        except CorruptEntryError as exc:
            self._reject(path, str(exc))
            return None
        self.stats.loaded += 1
        self.stats.load_seconds += time.perf_counter() - start
        return fn

    def _wait_for_isa_probe(self, compiling: bool = False) -> None:
        """Inductor code, loaded or compiled, needs the CPU probe's answers (isa_probe.py): started
        here, not at the region's first call, so that on a machine that receives its code from
        another (sharing.py) it starts after the other machine's probe builds were installed. A
        compile waits where Inductor asks (its trace and lowering run beside the probe's builds);
        a load, which has little else to do, waits now. Other backends neither start nor wait for it."""
        if self.compile_kwargs.get("backend", "inductor") == "inductor":
            isa_probe.start_if_armed()
            if compiling:
                isa_probe.wait_before_compile()
            else:
                isa_probe.wait()

    def _reject(self, path: Path, problem: str) -> None:
        warnings.warn(f"precompiled artifact {path} not used: {problem}; compiling it again "
                      "(`kiln cache clear` removes bad entries)", KilnCacheWarning, stacklevel=5)
        self._note(f"artifact {path.name} rejected: {problem}")

    def _compile_and_save(self, signature, module, args, kwargs, path: Path, reason: str):
        start = time.perf_counter()
        state = dict(signature)["autocast"]
        entry = self._entry_for(state)
        kw = dict(self.compile_kwargs)
        examples = (module, *detached(args)), detached(kwargs)
        grads = [(p, p.grad) for p in module.parameters()]
        try:
            # Gradients on the example's parameters break the artifact (torch 2.13 pickles them
            # into its guards and cannot read them back), so they are set aside while compiling.
            for p, _ in grads:
                p.grad = None
            hits = autograd_cache_hits()
            private = private_autograd_cache(self.directory / ".aotautograd" / signature_digest(signature))
            self._wait_for_isa_probe(compiling=True)
            # torch 2.13's ahead-of-time compile runs no Dynamo compile callbacks: name it for the live line.
            with as_class(module, self.block_class), private, PROGRESS.backend_compile(self.name, phase="forward and backward"):
                compiled = compile_ahead_of_time(entry, examples, **kw)
            if not private.active and autograd_cache_hits() != hits:
                raise ServedFromCache()
            payload = serialized(compiled)
        except ServedFromCache:
            # Neither saved nor used: the JIT path compiles this signature; later ones still try.
            self._note(f"{self._signature_text(signature)}: AOTAutograd's disk cache answered the "
                       "ahead-of-time compile, and such answers cannot be trusted (torch 2.13); JIT path")
            return None
        except Exception as exc:
            self._failed = True
            cause = f"{type(exc).__name__}: {first_line(str(exc))}"
            if self.jit_on_failure:
                self._note(f"not one whole graph ahead of time ({cause}); JIT-compiled as torch.compile would, "
                           "graph breaks allowed (fullgraph was left unset)")
                return None
            way_out = explain_failure(exc, module)
            self._note(f"ahead-of-time compile failed ({cause}); the rest of this run takes the JIT path; "
                       f"{way_out}")
            warnings.warn(f"region {self.name}: ahead-of-time compile failed ({cause}); it is JIT-compiled "
                          f"instead and nothing is precompiled; {way_out}", KilnCacheWarning, stacklevel=5)
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
            self._entries[state] = with_autocast(self.forward, state, self.label)
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

    # ----- one compiler per signature among local processes (artifact_lock.py) -------------
    def _claim(self, path: Path) -> Path | None:
        """Create the signature's lock file; None when another live process holds it."""
        return claim(path)

    def _wait_for(self, path: Path) -> bool:
        """Wait while another process holds the lock; True when the artifact appeared."""
        def tell(seconds: float, lock: Path) -> None:
            print(f"[kiln] waiting {seconds:.0f} s for another process to precompile region {self.name} ({lock})",
                  file=sys.stderr, flush=True)

        appeared, seconds = wait_for(path, tell)
        self.stats.wait_seconds += seconds
        return appeared

    # ----- notes -------------------------------------------------------------------------------
    def _signature_text(self, signature: tuple) -> str:
        return f"signature {signature_digest(signature)[:8]}"

    def _note(self, text: str) -> None:
        if text not in self.stats.notes:
            self.stats.notes.append(text)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
