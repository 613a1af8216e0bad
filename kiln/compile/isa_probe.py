"""Inductor's CPU vector-instruction probe, asked side by side on threads instead of one by one.

Depends on torch and kiln.compile.cores only. A fresh process's first Inductor compile or load for
the CPU asks which vector instruction sets (AMX, AVX512-VNNI, AVX512, AVX2, ...) this CPU and its
C++ compiler both support: for each one Inductor builds a probe library and loads it in a new Python
process, one after another (torch 2.13, 2 cores: 2.4 s, most of a 2.9 s precompiled warm start's
first step; side by side 1.3 s). `start()` asks Inductor the same questions on threads; `wait()` is
called before Kiln's first compile or load (and imports what the generated code needs meanwhile), so
Inductor finds its own answers cached instead of asking again. Nothing is changed: the answers are
Inductor's, computed by Inductor's code.

Where the wait happens: Inductor asks its question in `cpu_vec_isa.valid_vec_isa_list` (through
`pick_vec_isa`), late in a compile, after Dynamo's trace, AOTAutograd's joint graph and partition
and the first lowering. While the probe runs, that function waits for it first (`_wait_when_asked`)
and then puts Inductor's own function back, so that work overlaps the probe's builds instead of
waiting ahead of it (a 6-layer Llama's cold first step, torch 2.13, 2 cores: the wait fell from
4.2 s to 0.5-1.0 s and the step from 14.1 s to 13.5 s, five runs each). `wait_before_compile`
waits at the start of Kiln's Inductor compile instead (the stable path) where that function is
missing, and on one core, where nothing is idle to overlap (the same step, `taskset -c 0`: 23.3 s
overlapped against 22.6 s waiting first, six runs each).

Each question ends in a new Python process that loads the probe library against libtorch (about
0.3 s of CPU each, ten of them here), and a warm start pays them again beside its load. Where
Inductor's probe has its load step as a method (`VecISA._probe_load`, torch 2.13 and later), the
probe remembers a load that succeeded in a small record beside the library, `<library>.kiln-load`,
holding what the load depended on: the library's bytes, the Python and libtorch it loaded against,
the loader's environment and the CPU. A later process whose record matches takes the answer
without the process; anything else (no record, another library, torch or CPU, a failed load) asks
as Inductor does. Only Kiln's own probe threads use the record, and only while they ask. Where
Inductor remembers a load itself (torch 2.14 writes `<library>.load_ok` after one succeeded), Kiln
leaves it to Inductor and writes no record.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import platform
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.compile.cores import free_cores

_thread: threading.Thread | None = None
_lock = threading.Lock()
_armed = False
_asked_late = False  # Inductor's question waits for the probe (_wait_when_asked)


def arm() -> None:
    """Have the probe start at the first compiled call (`start_if_armed`), not now. Between a model's
    compile and its first step, load_state may install a checkpoint's compile artifacts, the probe's
    libraries among them; a probe started earlier finds them missing and builds them with gcc (a
    fresh-machine resume, torch 2.13: 5 s of its 6.4 s first step)."""
    global _armed
    _armed = True


def start_if_armed() -> None:
    """`start()` if `arm()` was called (a compiled region's first call); at once otherwise."""
    if _armed:
        start()


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
            thread = threading.Thread(target=lambda: None)  # nothing to ask: later calls return at once
        else:
            thread = threading.Thread(target=_ask, args=(candidates,), name="kiln-cpu-isa-probe", daemon=True)
        # Published only once started: `wait()` reads it without the lock, from another thread (a
        # precompiled load on the background path), and joining a thread not yet started raises
        # "cannot join thread before it is started" (seen once in the torch 2.11 matrix).
        thread.start()
        _thread = thread
        if candidates and free_cores() > 1:  # on one core nothing is idle to overlap
            _wait_when_asked()


def wait() -> None:
    """Block until a started probe has its answers (at once when none was started). While it
    runs, import what Inductor's generated code imports, which the caller needs next anyway."""
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return
    if thread.is_alive():
        _import_generated_code_runtime()
    thread.join()


def wait_before_compile() -> None:
    """Called as an Inductor compile starts: `wait()`, unless Inductor's own question waits later,
    where the answers are needed (module docstring)."""
    if not _asked_late:
        wait()


def _wait_when_asked() -> None:
    """Have Inductor's `valid_vec_isa_list` wait for the probe before it asks (once; it is put back
    at its first call). Its callers look it up in its module at each call (torch 2.7-2.14), so the
    waiting function is the one they call."""
    global _asked_late
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return
    inductors = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if not callable(inductors):
        return  # wait_before_compile waits

    @functools.wraps(inductors)
    def valid_vec_isa_list(*args, **kwargs):
        wait()
        if cpu_vec_isa.valid_vec_isa_list is valid_vec_isa_list:
            cpu_vec_isa.valid_vec_isa_list = inductors
        return inductors(*args, **kwargs)

    for name in ("cache_clear", "cache_info"):  # functools.cache's own, which tests call
        if hasattr(inductors, name):
            setattr(valid_vec_isa_list, name, getattr(inductors, name))
    cpu_vec_isa.valid_vec_isa_list = valid_vec_isa_list
    _asked_late = True


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
    remembering = [isa for isa in candidates if _remember_loads(isa)]
    try:
        with ThreadPoolExecutor(max_workers=len(candidates), thread_name_prefix="kiln-cpu-isa") as pool:
            list(pool.map(bool, candidates))  # VecISA.__bool__ runs and caches the probe
    except Exception:  # Inductor asks again itself at its first compile, and reports its own errors
        pass
    finally:
        for isa in remembering:
            isa.__dict__.pop("_probe_load", None)  # Inductor's own method again, for any later question


RECORD_SUFFIX = ".kiln-load"


def _remember_loads(isa) -> bool:
    """Give `isa` (one of Inductor's VecISA objects) a load step that consults and keeps the record
    (module docstring), for as long as Kiln's probe asks; False where Inductor has no such step."""
    inductors = getattr(type(isa), "_probe_load", None)
    if not callable(inductors) or _inductor_remembers_loads(type(isa)):
        return False

    def probe_load(output_path: str) -> bool:
        record = Path(str(output_path) + RECORD_SUFFIX)
        expected = load_fingerprint(Path(output_path))
        if expected is not None and _read(record) == expected:
            return True
        loaded = inductors(isa, output_path)
        if loaded and expected is not None:
            _write(record, expected)
        return loaded

    isa._probe_load = probe_load  # on this object only; _ask removes it
    return True


@functools.cache
def _inductor_remembers_loads(isa_type: type) -> bool:
    """Whether Inductor's own probe skips a load it saw succeed before (torch 2.14: a `.load_ok`
    marker beside the library, checked in `check_build` before the load step)."""
    try:
        source = inspect.getsource(isa_type.check_build)
    except (AttributeError, OSError, TypeError):
        return False  # no source to read: Kiln's record stays (it only adds a check before the load)
    return ".load_ok" in source


def load_fingerprint(library: Path) -> str | None:
    """What loading `library` in a new process depends on, as text (None where it cannot be read):
    the library's bytes, the interpreter, torch and its shared libraries, the loader's environment,
    and the CPU's flags."""
    environment = _load_environment()
    try:
        digest = hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError:
        return None
    return None if environment is None else f"library {digest}\n{environment}"


@functools.cache
def _load_environment() -> str | None:
    try:
        import torch
        from torch._inductor import cpu_vec_isa

        lib_dir = Path(torch.__file__).parent / "lib"
        parts = [
            "python " + os.path.realpath(sys.executable) + " " + sys.version,
            "torch " + torch.__version__ + " " + os.path.realpath(lib_dir),
        ]
        for shared in sorted(lib_dir.glob("*.so*")):
            stat = shared.stat()
            parts.append(f"{shared.name} {stat.st_size} {stat.st_mtime_ns}")
        for name in ("LD_LIBRARY_PATH", "LD_PRELOAD"):
            parts.append(f"{name}={os.environ.get(name, '')}")
        parts.append("libc " + " ".join(platform.libc_ver()))
        parts.append("cpu " + " ".join(sorted(cpu_vec_isa.x86_isa_checker())))
    except (OSError, ImportError, AttributeError):
        return None
    return "\n".join(parts) + "\n"


def _read(record: Path) -> str | None:
    try:
        return record.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _write(record: Path, text: str) -> None:
    """Write the record whole or not at all (a record that fails to write only costs the process again)."""
    temporary = record.with_name(f"{record.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, record)
    except OSError:
        try:
            temporary.unlink()
        except OSError:
            pass
