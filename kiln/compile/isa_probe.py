"""Inductor's CPU vector-instruction probe, asked side by side on threads instead of one by one.

Depends on torch only. A fresh process's first Inductor compile or load for the CPU asks which
vector instruction sets (AMX, AVX512-VNNI, AVX512, AVX2, ...) this CPU and its C++ compiler both
support: for each one Inductor builds a probe library and loads it in a new Python process, one
after another (torch 2.13, 2 cores: 2.4 s, most of a 2.9 s precompiled warm start's first step;
side by side 1.3 s). `start()` asks Inductor the same questions on threads; `wait()` is called
before Kiln's first compile or load (and imports what the generated code needs meanwhile), so
Inductor finds its own answers cached instead of asking again. Nothing is changed: the answers
are Inductor's, computed by Inductor's code.
"""

from __future__ import annotations

import importlib
import platform
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_thread: threading.Thread | None = None
_lock = threading.Lock()


def start() -> None:
    """Start the probe on a thread (once per process; a no-op where Inductor has no such probe).
    Imports what the probe needs on the calling thread first (the first CPU compile or load would
    import it anyway), so no two threads import it at once."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        candidates = _candidates()
        if not candidates:
            _thread = threading.Thread(target=lambda: None)  # nothing to ask: later calls return at once
        else:
            _thread = threading.Thread(target=_ask, args=(candidates,), name="kiln-cpu-isa-probe", daemon=True)
        _thread.start()


def wait() -> None:
    """Block until a started probe has its answers (at once when none was started). While it
    runs, import what Inductor's generated code imports, which the caller needs next anyway."""
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return
    if thread.is_alive():
        _import_generated_code_runtime()
    thread.join()


def _import_generated_code_runtime() -> None:
    # The imports at the head of Inductor's generated CPU code (torch 2.13): 1.6 s here, half of it
    # select_algorithm's templates. The probe's processes run meanwhile (they wait without the GIL).
    for name in ("torch._inductor.async_compile", "torch._inductor.select_algorithm",
                 "torch._inductor.codegen.memory_planning"):
        try:
            importlib.import_module(name)
        except Exception:  # the generated code imports it again, and fails visibly there
            pass


def _candidates() -> list:
    """The instruction sets Inductor would probe here, as its own objects; [] where it would not."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        import torch._inductor.codecache  # noqa: F401  (what each probe imports, loaded here)
        import torch._inductor.cpp_builder  # noqa: F401
        from torch._inductor import config, cpu_vec_isa
    except ImportError:
        return []
    if not all(hasattr(cpu_vec_isa, name) for name in ("supported_vec_isa_list", "x86_isa_checker")):
        return []
    if config.cpp.vec_isa_ok is not None or config.is_fbcode():
        return []  # Inductor answers these without probing
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def _ask(candidates: list) -> None:
    try:
        with ThreadPoolExecutor(max_workers=len(candidates), thread_name_prefix="kiln-cpu-isa") as pool:
            list(pool.map(bool, candidates))  # VecISA.__bool__ runs and caches the probe
    except Exception:  # Inductor asks again itself at its first compile, and reports its own errors
        pass
