"""Per-block regions first, the outer graph once a helper has compiled it:
`compile_regions(outer_graph="background")`, and the default "auto" where it applies.

Depends on torch and kiln.compile (the outer graph's block sharing, the background compiler, call
signatures); never on kiln.compile.regions, the facade or a strategy. Where the host bounds a step,
per-block regions run at 1.4-1.6x a full compile's step but start after one block's compile; the
outer graph (outer_graph.py) runs at a full compile's speed, but its cold compile costs 0.7-0.8x a
full compile's, mostly gcc building the glue's kernels (issue 34; docs/compiling.md). Here the
model starts on its per-block regions while a helper process (kiln/compile/artifacts/background.py),
on a core training leaves it, JIT-compiles the outer graph for the call's signature into Inductor's
caches, and runs it against eager on its own copy (eager_check.py: a wrong graph is never used).
At the model's first call with that signature after the helper is done, the outer graph is
compiled here from those caches (Dynamo traces the model again; Inductor builds nothing) and runs
from then on. A signature the helper has not done (an evaluation under no_grad) keeps the per-block
regions until it has; one it cannot do keeps them for good, with the reason in the report.
"""

from __future__ import annotations

import pickle
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn

from kiln.compile.artifacts import background
from kiln.compile.artifacts.background import BackgroundCompiler, Job, _path_of, same_tensors, weightless_copy
from kiln.compile.artifacts.eager_check import OuterGraphDiffers
from kiln.compile.outer_graph import off_device
from kiln.compile.artifacts.signatures import UnsupportedCall, argument_key, autocast_state, call_signature, signature_digest

# SEEN: called once. The job goes to the helper at a signature's second call, once the per-block
# regions have compiled: sent at the first, the helper's compile (gcc) took turns with theirs on 2
# cores, and the first step of the 8-layer host8 Llama took 12.6 s instead of 7.0 s.
SEEN, PENDING, READY, KEPT = "seen", "pending", "ready", "kept"  # KEPT: stays on the per-block regions
_AOT_OFF = "the outer graph is compiled just in time: the helper fills the compile caches"
ROOM_CALLS = 3  # calls after which training's lowered thread count comes back if no signature was sent


class TierUp:
    """The root forward of a model compiled with `outer_graph="background"`: per call, the outer
    graph where the helper has compiled the call's signature, else the model's own forward, whose
    blocks run their per-block regions. `groups`: per block region group, the forward its instances
    share as one nested region (outer_graph.share_block_code) and their module paths."""

    def __init__(self, outer: Any, groups: list[tuple[Callable, list[str]]], compile_kwargs: dict[str, Any],
                 warn: type[Warning], auto: bool = False, stand_down: Callable[[], None] | None = None) -> None:
        self.outer = outer  # the CompiledRegion of kind "outer"; its compiled_forward runs the outer graph
        self.groups = groups
        self.compile_kwargs = dict(compile_kwargs)
        self.warn = warn
        self.states: dict[tuple, str] = {}
        self._digests: dict[tuple, tuple[str, str, float]] = {}  # key -> (digest, signature text, when sent)
        self.notes: list[str] = []  # for the report: switches and signatures kept on the per-block regions
        self.per_block_calls = 0  # calls that ran the per-block regions
        self.folder: str | None = None
        self.compiler: BackgroundCompiler | None = None
        self.failure: str | None = None  # the helpers failed: later signatures stay per-block too
        self._warned = False
        self._room_calls: int | None = None  # calls since training's threads were lowered, nothing sent yet
        # outer_graph="auto" (the default, not asked for): a signature kept on the per-block regions is
        # a note in the report, not a warning, unless the helper found the outer graph wrong; and a
        # model found on a device the background outer graph is not verified on stays per-block.
        self.auto = auto
        self.off = False
        self._auto_checked = False
        self.stand_down = stand_down  # undoes the blocks' shared-code wrappers where "auto" refuses

    @property
    def stood_down(self) -> bool:
        """Every call so far stays on the per-block regions by design ("auto" refused, or each
        signature kept): the outer region not running is no fallback."""
        return self.off or (bool(self.states) and all(state is KEPT for state in self.states.values()))

    @property
    def waiting(self) -> bool:
        """A signature is on its way to the outer graph (met once, or with the helper)."""
        return any(state is SEEN or state is PENDING for state in self.states.values())

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.off:
            self.per_block_calls += 1
            return self.outer.base_forward(module, *args, **kwargs)
        if self.auto and not self._auto_checked:
            self._auto_checked = True
            why = _auto_refuses(module)
            if why:
                self.off = True
                self._keep_note(why)
                if self.stand_down is not None:
                    self.stand_down()
                return self.forward(module, *args, **kwargs)
        try:
            key = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), module.training, autocast_state(),
                   tuple(argument_key(a) for a in args), tuple((k, argument_key(v)) for k, v in kwargs.items()),
                   same_tensors(args, kwargs))
        except UnsupportedCall as exc:  # a KV cache object: generation stays on the per-block regions
            key = None
            self._keep_note(f"a call with {exc} runs the per-block regions (the helper cannot rebuild it)",
                            warn=False)
        self._give_back_room()
        state = self.states.get(key) if key is not None else KEPT
        if state is READY or (state is PENDING and self._poll(key)):
            return self.outer.compiled_forward(module, *args, **kwargs)
        if state is None:
            unsendable = self._unsendable(module)
            if unsendable is not None:  # known before training's threads are lowered for the helper
                self._keep(key, unsendable)
            else:
                self.states[key] = SEEN
                self._make_room()
        elif state is SEEN:
            self._submit(key, module, args, kwargs)
        self.per_block_calls += 1
        return self.outer.base_forward(module, *args, **kwargs)

    # ----- the helper ------------------------------------------------------------------------
    def _submit(self, key: tuple, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.failure is not None:
            self._keep(key, f"the background compiler failed earlier ({self.failure})")
            return
        compiler = self._compiler()
        try:
            signature = call_signature(module, args, kwargs, compiler.own_threads)
            device = next((str(t.device) for t in [*module.parameters(), *module.buffers()]), "cpu")
            job = Job(self.outer.name, self.outer.label, _path_of(type(module)), _path_of(self.outer.base_forward),
                      self.compile_kwargs, self.folder, pickle.dumps(weightless_copy(module)), device, signature,
                      aot_off=_AOT_OFF, same_tensors=key[-1],
                      shared_blocks=tuple((_path_of(forward), tuple(paths)) for forward, paths in self.groups))
        except (UnsupportedCall, ValueError, TypeError, AttributeError, pickle.PicklingError) as exc:
            self._keep(key, f"the model cannot be sent to the helper ({type(exc).__name__}: {exc})")
            return
        digest = signature_digest(signature)
        if not compiler.submit(job, digest):
            self.failure = compiler.failure or "the job could not be sent"
            self._keep(key, f"the background compiler failed ({self.failure})")
            return
        self.states[key] = PENDING
        self._digests[key] = (digest, _call_text(module, args, kwargs), time.perf_counter())

    def _unsendable(self, module: nn.Module) -> str | None:
        """Why the model cannot go to the helper (an attribute that does not pickle), or None."""
        try:
            pickle.dumps(weightless_copy(module))
        except (ValueError, TypeError, AttributeError, pickle.PicklingError) as exc:
            return f"the model cannot be sent to the helper ({type(exc).__name__}: {exc})"
        return None

    def _compiler(self) -> BackgroundCompiler:
        if self.compiler is None:
            self.folder = self.folder or tempfile.mkdtemp(prefix="kiln-outer-graph-")
            self.compiler = BackgroundCompiler(self.folder, workers=1, on_failure=(
                "the model keeps its per-block regions (compiled) for the signatures it had not compiled"))
        return self.compiler

    def _make_room(self) -> None:
        """Training on one thread fewer where its threads fill every core (the background compiler's
        rule: beside them a helper at nice 10 took 295 s to compile what it compiled in 44 s with a
        core of its own; small6, 2 cores), from the first call on, before the per-block regions
        compile: lowered later, the count Dynamo guards on changes and every block region compiles
        again ("GLOBAL_STATE changed: num_threads": 7.8 s at small6's second step). Given back when
        the helper is done, before the outer graph's first call, which is compiled for the full
        count; or after a few calls if no signature was sent. Only before any signature has switched:
        lowering them then would recompile the outer graph."""
        if self.failure is None and READY not in self.states.values():
            self._compiler()._make_room()
            self._room_calls = 0

    def _give_back_room(self) -> None:
        if self._room_calls is None:
            return
        self._room_calls += 1
        if self.compiler is None or self.compiler.submitted:
            self._room_calls = None  # a job was sent: _poll gives the threads back when it is done
        elif self._room_calls > ROOM_CALLS:
            self.compiler.settle()  # nothing outstanding: back to the full count
            self._room_calls = None

    def _poll(self, key: tuple) -> bool:
        """Whether the helper has compiled `key`'s signature (then it is READY); settles a failure."""
        compiler = self.compiler
        digest, text, sent = self._digests[key]
        # A slow helper (a busy machine) is waited for, not given up as the background compiler's
        # eager steps do (BackgroundCompiler.check_progress): here the steps meanwhile run compiled.
        done, outcome = compiler.status(self.outer.name, digest)
        if not done:
            return False
        if outcome.error is not None:
            if compiler.failure is not None:
                self.failure = compiler.failure
            differs = outcome.error.startswith(OuterGraphDiffers.__name__ + ": ")
            self._keep(key, outcome.error.split(": ", 1)[1] if differs
                       else f"the helper could not compile it ({outcome.error})", warn=differs or not self.auto)
        else:
            self.states[key] = READY
            checked = (outcome.jit_only or "").removeprefix(_AOT_OFF).removeprefix("; ")
            self.notes.append(f"{text}: compiled in the background, {time.perf_counter() - sent:.1f} s after "
                              f"its first call, {checked or 'not checked against eager'}; switched to the "
                              f"outer graph after {self.per_block_calls} per-block call(s) of the model")
        if self.states[key] is READY:
            # Training's threads back before the outer graph's first call, even with other signatures
            # still at the helper: the helper compiled it for the full count (the caches hold that one).
            compiler._restore_threads()
        else:
            compiler.settle()  # training's threads back once nothing is outstanding
        if PENDING not in self.states.values():
            compiler.close()  # the helper exits; a later signature starts another
            self.compiler = None
        return self.states[key] is READY

    def _keep(self, key: tuple, why: str, warn: bool | None = None) -> None:
        self.states[key] = KEPT
        self._keep_note(why, warn)

    def _keep_note(self, why: str, warn: bool | None = None) -> None:
        """A note for the report; a warning too (once) where the user asked for the outer graph,
        or `warn` says so."""
        note = f"kept on the per-block regions: {why}"
        if note in self.notes:
            return
        self.notes.append(note)
        if (not self.auto if warn is None else warn) and not self._warned:
            self._warned = True
            setting = "auto" if self.auto else "background"
            warnings.warn(f"outer_graph={setting!r}: {self.outer.name} {note}", self.warn, stacklevel=4)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None


def _auto_refuses(module: nn.Module) -> str:
    """Why outer_graph="auto" keeps a model on its per-block regions, found at its first call ("" if
    nothing): the device it was moved to after compile_regions, or no free core for the helper.
    "background" asked for by name lends the helper one of training's threads instead; "auto" does
    not: on 2 cores, training on one thread took 432 ms a step against about 200 ms (make demo's
    GPT-2), and 150 steps ended before the helper was done."""
    where = off_device(module)
    if where:
        return where
    threads, cores = torch.get_num_threads(), background.free_cores()
    if threads >= cores:
        return (f"training's {threads} thread(s) fill this process's {cores} core(s), leaving none for the "
                "helper (outer_graph='background' lends it one of training's threads until it is done)")
    return ""


def _call_text(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str:
    """A call as the report names it: "training call (input_ids 4x64, labels 4x64)"."""
    mode = "training" if module.training and torch.is_grad_enabled() else (
        "evaluation" if torch.is_grad_enabled() else "no_grad")
    tensors = [(str(i), v) for i, v in enumerate(args)] + list(kwargs.items())
    shapes = ", ".join(f"{name} {'x'.join(map(str, v.shape))}" for name, v in tensors if isinstance(v, torch.Tensor))
    return f"{mode} call ({shapes})"
