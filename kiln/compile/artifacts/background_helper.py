"""The background compiler's own process (`python -m kiln.compile.artifacts.background_helper`): it reads
jobs from its stdin, compiles each ahead of time (or, where torch cannot, JIT-compiles it into the
shared compile caches), and answers on its stdout. kiln/compile/artifacts/background.py is the training
process's side.

Depends on torch, kiln.compile.artifacts.background (the job format and the frames),
kiln.compile.artifacts.precompiled and aot_workarounds (the region entry builder); never on
kiln.compile.regions, the facade or a strategy.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn

from kiln.compile import isa_probe
from kiln.compile.artifacts.background import (Job, _cpu_inductor, _import, _import_runtime, example_inputs,
                                               with_same_tensors)
from kiln.compile.artifacts.compile_pool import READY, _read_frame, _write_frame
from kiln.compile.artifacts.eager_check import output_tensors
from kiln.compile.messages import first_line

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
    JIT-compile it there (a warm compile with Inductor); for an outer graph (tier_up.py), the
    reason and the eager check's line (eager_check.py). `aot_refused` remembers, per region, that
    ahead of time failed, so later signatures go straight to the JIT fill; a job whose settings rule
    an ahead-of-time compile out (`aot_off`) goes there at once."""
    from kiln.compile.artifacts.aot_workarounds import autocast_off, autocast_on, region_entry
    from kiln.compile.artifacts.eager_check import check_against_eager, checkable_weights
    from kiln.compile.artifacts.precompiled import PrecompiledRegion

    aot_refused = {} if aot_refused is None else aot_refused
    if job.aot_off is not None:  # fullgraph=False: nothing to compile ahead of time, only the caches to fill
        aot_refused.setdefault(job.region, job.aot_off)

    if _cpu_inductor(job):
        isa_probe.start()  # once per helper; the compile waits for it
    cls, forward = _import(job.block_class), _import(job.forward)
    module = pickle.loads(job.skeleton).to_empty(device=job.device)
    checkable_weights(module)
    fields = dict(job.signature)
    torch.set_num_threads(fields["num_threads"])  # loaded code guards on it: the training process's count
    for flag, submodule in zip(fields["training"], module.modules()):
        submodule.training = flag
    if job.shared_blocks:  # an outer graph (tier_up.py): its blocks one nested region each, as in training
        from kiln.compile.outer_graph import share_block_code
        modules = dict(module.named_modules())
        for forward_path, paths in job.shared_blocks:
            block_forward = _import(forward_path)
            # The same instance forward as the training process's (outside=...), so Dynamo traces the same code.
            share_block_code(block_forward, [modules[p] for p in paths], outside=block_forward)
    args, kwargs = with_same_tensors(*example_inputs(job.signature), job.same_tensors)
    entry = region_entry(forward, job.label)
    region = PrecompiledRegion(job.directory, job.region, job.label, entry, cls, forward, job.compile_kwargs)
    if job.region not in aot_refused:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failure is reported to the training process instead
            with torch.set_grad_enabled(fields["grad_enabled"]), autocast_off(fields["autocast"]):
                compiled = region._load_or_compile(job.signature, module, args, kwargs)
        if compiled is not None:
            return None
        aot_refused[job.region] = "; ".join(region.stats.notes) or "the ahead-of-time compile gave nothing"
    with _as_training_traces(job, module, fields):
        compiled = fill_compile_caches(entry, job.compile_kwargs, module, args, kwargs, fields)
        if job.shared_blocks:  # an outer graph: compared with eager before training may switch to it
            with autocast_on(fields["autocast"]):
                checked = check_against_eager(compiled, forward, module, args, kwargs, fields["grad_enabled"],
                                              low_precision=_low_precision(module, fields))
    # For the other local processes, which watch the folder rather than the helper's answers.
    region.mark_jit_only(job.signature, aot_refused[job.region])
    return aot_refused[job.region] if not job.shared_blocks else f"{aot_refused[job.region]}; {checked}"


def _low_precision(module: nn.Module, fields: dict[str, Any]) -> bool:
    """Whether the call computes in a 16-bit float (autocast, or such parameters)."""
    return bool(fields["autocast"]) or any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters())


def _as_training_traces(job: Job, module: nn.Module, fields: dict[str, Any]):
    """The Dynamo setting the training process traces an outer graph under when its blocks
    checkpoint themselves (regions._under_checkpointing): side effects inside a checkpoint traced,
    not replayed. Elsewhere nothing."""
    import contextlib

    first = next((m for m in module.modules() if getattr(type(m), "gradient_checkpointing", None) is not None),
                 None) if job.shared_blocks else None
    if (first is not None and first.gradient_checkpointing is True and first.training and fields["grad_enabled"]
            and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")):
        return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    return contextlib.nullcontext()


def fill_compile_caches(entry, compile_kwargs: dict[str, Any], module: nn.Module, args: tuple,
                        kwargs: dict[str, Any], fields: dict[str, Any]) -> Callable:
    """JIT-compile one call as the training process's JIT path will (same entry, backend and
    settings; the caller's autocast around it) and run its backward, so that Inductor's FX graph
    and AOTAutograd caches hold both graphs when the training process compiles them. Returns the
    compiled function."""
    from kiln.compile.artifacts.aot_workarounds import autocast_on
    from kiln.compile.backend import resolve_backend

    kw = dict(compile_kwargs)
    backend = resolve_backend(kw.pop("backend", "inductor"), kw.pop("mode", None), kw.pop("options", None),
                              kw.get("dynamic"))
    compiled = torch.compile(entry, backend=backend, **kw)
    with torch.set_grad_enabled(fields["grad_enabled"]), autocast_on(fields["autocast"]):
        output = compiled(module, *args, **kwargs)
    leaves = [t for t in output_tensors(output) if t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    return compiled


def main() -> None:
    parent = int(os.environ.get("KILN_BACKGROUND_PARENT", os.getppid()))
    _die_with_parent()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # Below the training process in the scheduler. Training leaves the helper a core where its
    # threads would fill them all (BackgroundCompiler._make_room); where they still cannot (one
    # thread per process, as many processes as cores), the eager steps keep their speed and the
    # compile (gcc included, which inherits this) takes what is left. At the training process's
    # own priority (0) when it waits for the helpers (parallel_compile).
    nice = int(os.environ.get("KILN_COMPILE_NICE", "10"))
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to the log, not into the result stream
    _import_runtime()  # while the training process builds its first step, before any job comes
    _write_frame(stdout, pickle.dumps(READY))  # the pool sends jobs to ready workers only
    aot_refused: dict[str, str] = {}
    worker = os.environ.get("KILN_COMPILE_WORKER", "0")
    while True:
        frame = _read_frame(stdin)
        if frame is None:
            return
        digest, job = pickle.loads(frame)
        error = jit_only = None
        began, start = time.time(), time.perf_counter()  # wall clock: the training process's timeline
        try:
            jit_only = compile_job(job, aot_refused)
        except Exception as exc:  # reported to the training process, which warns once
            error = f"{type(exc).__name__}: {first_line(str(exc))}"
        # Back to one thread between jobs: the pool holds one helper per core (compile_pool.py), and
        # a job's count (the training process's, which its code is made for) is for that job only.
        torch.set_num_threads(1)
        done = "compiled" if jit_only is None else f"compiled into the shared caches only ({jit_only})"
        print(f"[kiln background {worker}] {job.region} {digest[:8]}: {error or done} in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        # Plain values: the training process reads them without importing this module.
        _write_frame(stdout, pickle.dumps((job.region, digest, error, jit_only, began, time.time())))


if __name__ == "__main__":
    main()
