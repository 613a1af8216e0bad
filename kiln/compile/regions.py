"""Regional compilation: find the repeated blocks of a model and compile each block class once, in place.

Depends on torch and the rest of kiln.compile; never on the facade or a distributed strategy.

How a region is compiled, and why not with `module.compile()`:
`module.compile()` compiles `nn.Module._call_impl`, one code object shared by every module in the
process, and Dynamo's recompile limit (8 by default) counts entries per code object. Two block
classes under fp32 and bf16, train and eval, exhaust it, and every later variant then runs eagerly
with one log line (seen with torch 2.13). Kiln instead gives each block class its own small entry
function, with a code object of its own, compiles that once, and binds it as the `forward` of every
instance. The module keeps its class, its `state_dict` keys and its hooks (they run, eagerly,
around the compiled forward, as FSDP2 and DeepSpeed need).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import types
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from kiln.compile import isa_probe, kv_cache, outer_graph
from kiln.compile import outer_graph as outer_graph_module  # where a parameter is named outer_graph
from kiln.compile.tier_up import TierUp
from kiln.compile.backend import TrackedBackend, resolve_backend
from kiln.compile.groups import describe_difference, group_instances, repeats_one_block
from kiln.compile.monitor import MONITOR, check_recompile_policy
from kiln.compile.progress import PROGRESS
from kiln.compile.artifacts.aot_workarounds import region_entry
from kiln.compile.artifacts.precompiled import EAGER, PrecompiledRegion, unsupported_reason
from kiln.compile.artifacts.signatures import UnsupportedCall
from kiln.plugins import parse_outer_graph, validate_backend, validate_mode_and_options

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_REGIONS: "weakref.WeakKeyDictionary[nn.Module, list[CompiledRegion]]" = weakref.WeakKeyDictionary()
# Root pre-forward hooks that start a new CUDA-graph step (see mark_cudagraph_steps).
_STEP_HOOKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


class KilnCompileWarning(UserWarning):
    """Something about compilation the user should know: a fallback, a skipped step."""


@dataclass(eq=False)
class CompiledRegion:
    """One compiled block class (or the whole model) and the instances that share its code.

    The counters are filled as the model runs: `invocations` calls of the region, `calls` of them
    ran compiled code (JIT-compiled or precompiled), `eager_calls` ran none (recompile limit hit,
    or nothing compiled). `traces` counts Dynamo traces of the region's frames in this process.
    """

    name: str
    block_class: type
    paths: list[str]
    backend: TrackedBackend
    kind: str  # "block", "full", or "outer" (the whole model, its blocks shared subgraphs: outer_graph.py)
    label: str  # the entry function's name, Dynamo's co_name for this region
    compiled_forward: Callable = field(repr=False, default=None)
    compiled_entry: Callable = field(repr=False, default=None)  # the torch.compile'd entry compiled_forward calls
    recompile_policy: str = "allow"
    warm: bool = False  # set after the warm-up steps; recompiles after it meet the policy
    invocations: int = 0
    eager_calls: int = 0
    graph_breaks: Counter = field(default_factory=Counter)
    recompile_reasons: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    recompile_limit_hit: bool = False
    warned: set = field(default_factory=set, repr=False)
    base_forward: Callable = field(repr=False, default=None)  # what was compiled
    jit_traces: int = 0  # Dynamo traces of the JIT entry (counted by the monitor)
    precompiled: PrecompiledRegion | None = field(repr=False, default=None)
    precompile_off: str | None = None  # why this region has no precompiled artifacts, when asked for
    chosen_by: str = "the whole model"  # what decided the region: the user, the model's declaration, or search
    group: tuple[int, int] = (1, 1)  # (this group, the class's groups): instances split by their graphs
    group_differs: str = ""  # how this group's instances differ from the class's first group
    cache_notes: dict[str, str] = field(default_factory=dict)  # KV cache class -> how calls got it (kv_cache.py)
    checkpointed: bool = False  # its instances run under Kiln's activation checkpointing (set at compile)
    shared_blocks: dict[str, int] = field(default_factory=dict)  # outer: block class -> instances sharing a subgraph
    first_blocks: list[nn.Module] = field(default_factory=list, repr=False)  # outer: one instance per class
    tier_up: TierUp | None = field(default=None, repr=False)  # outer, compiled in the background (tier_up.py)
    outer_off: str = ""  # outer_graph="auto" chose per-block regions alone: why (first region of a model)

    def __post_init__(self) -> None:
        self.checkpointed = hasattr(self.base_forward, "_kiln_checkpointed")

    @property
    def instances(self) -> int:
        return len(self.paths)

    @property
    def graphs(self) -> int:
        """Graphs compiled in this process: JIT, and ahead of time (one per new signature)."""
        ahead = self.precompiled.stats.compiled if self.precompiled is not None else 0
        return self.backend.graph_count + ahead

    @property
    def traces(self) -> int:
        """Dynamo traces of this region in this process: JIT ones and ahead-of-time compiles."""
        ahead = self.precompiled.stats.compiled if self.precompiled is not None else 0
        return self.jit_traces + ahead

    @property
    def jit_calls(self) -> int:
        return self.backend.calls

    @property
    def precompiled_calls(self) -> int:
        return self.precompiled.stats.calls if self.precompiled is not None else 0

    @property
    def calls(self) -> int:
        return self.backend.calls + self.precompiled_calls


def is_builtin_module(module: nn.Module) -> bool:
    """True for torch's own layers (nn.Linear, nn.LayerNorm, ...): single ops, not worth a region."""
    return type(module).__module__.split(".")[0] == "torch"


def find_repeated_blocks(model: nn.Module) -> dict[type, list[str]]:
    """Block classes that appear two or more times in one container, with their module paths.

    Looks in every `nn.ModuleList`, `nn.Sequential` and `nn.ModuleDict`, at any depth, and does not
    look inside a block once chosen (no region inside a region). torch's own layers are skipped, and
    so are classes whose instances there all hold tensors of other shapes (a UNet's down-sampling
    stages, each of its own width): a region for them would save no compile, so the search looks
    inside them instead. Instances with the same tensors that differ in a submodule's class (fp8's
    plain first linear) are blocks, in instance groups of their own (kiln/compile/groups.py).

    >>> find_repeated_blocks(gpt2)  # {GPT2Block: ['transformer.h.0', ..., 'transformer.h.11']}
    """
    found: dict[type, list[str]] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        chosen: set[str] = set()
        if isinstance(module, CONTAINERS):
            children = dict(module.named_children())
            by_class: dict[type, list[str]] = {}
            for name, child in children.items():
                if not is_builtin_module(child):
                    by_class.setdefault(type(child), []).append(name)
            for cls, names in by_class.items():
                if len(names) >= 2 and repeats_one_block([children[n] for n in names]):
                    found.setdefault(cls, []).extend(_join(prefix, n) for n in names)
                    chosen.update(names)
        for name, child in module.named_children():
            if name not in chosen:
                visit(child, _join(prefix, name))

    visit(model, "")
    return found


def select_blocks(
    model: nn.Module,
    block_classes: Sequence[type | str] | None = None,
    block_paths: Sequence[str] | None = None,
) -> dict[type, list[str]]:
    """The regions to compile: the user's choice when given, else the block classes the model
    declares (`_repeated_blocks`, as diffusers models do), else `find_repeated_blocks`."""
    if not block_classes and not block_paths:
        declared = declared_blocks(model)
        if not declared:
            return find_repeated_blocks(model)
        block_classes = declared
    modules = dict(model.named_modules())
    chosen: dict[type, list[str]] = {}
    for path in block_paths or ():
        if path not in modules or path == "":
            raise ValueError(f"no submodule at path {path!r}; the model's top-level children are: "
                             f"{', '.join(n for n, _ in model.named_children())}")
        chosen.setdefault(type(modules[path]), []).append(path)
    for wanted in block_classes or ():
        paths = [p for p, m in modules.items() if p and _class_matches(type(m), wanted)]
        if not paths:
            present = sorted({type(m).__name__ for m in modules.values() if not is_builtin_module(m)})
            raise ValueError(f"no module of class {_class_label(wanted)} in the model; "
                             f"its own classes are: {', '.join(present)}")
        for path in paths:
            chosen.setdefault(type(modules[path]), []).append(path)
    order = {path: i for i, path in enumerate(modules)}  # model order: blocks.2 before blocks.10
    all_paths = sorted({p for ps in chosen.values() for p in ps}, key=order.__getitem__)
    for outer in all_paths:
        for inner in all_paths:
            if inner.startswith(outer + "."):
                raise ValueError(f"region {inner!r} lies inside region {outer!r}; choose one of them")
    return {cls: sorted(set(paths), key=all_paths.index) for cls, paths in chosen.items()}


def declared_blocks(model: nn.Module) -> list[str]:
    """The class names a model lists as its repeated blocks (`_repeated_blocks`, the declaration
    diffusers' `compile_repeated_blocks` reads) that it holds; names it lists but does not hold (a
    small config without those blocks) are left out. Empty when it declares none."""
    names = getattr(model, "_repeated_blocks", None)
    if not names:
        return []
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{type(model).__name__}._repeated_blocks must be a list of class names, got {names!r}")
    held = {c for m in model.modules() for c in (type(m).__name__, type(m).__qualname__)}
    return [n for n in names if n in held]


def chosen_by(model: nn.Module, block_classes: Any = None, block_paths: Any = None) -> str:
    """What decided a model's regions, for the report."""
    if block_classes or block_paths:
        return "block_classes/block_paths"
    declared = declared_blocks(model)
    return f"the model's _repeated_blocks ({', '.join(declared)})" if declared else "found: repeated in a container"


def compile_regions(
    model: nn.Module,
    *,
    block_classes: Sequence[type | str] | None = None,
    block_paths: Sequence[str] | None = None,
    recompile: str = "allow",
    precompile: str | os.PathLike | None = None,
    in_helpers: bool = False,
    blocks: Mapping[type, list[str]] | None = None,
    outer_graph: bool | str | None = None,
    **torch_compile_kwargs: Any,
) -> nn.Module:
    """Compile each repeated block of `model` once, in place, and return the same model.

    Takes the keywords of `torch.compile` (backend, mode, options, fullgraph, dynamic, ...).
    `block_classes` (classes or class names) or `block_paths` (module paths) pick the regions by
    hand. A model without repeated blocks gets a warning and a full compile instead.
    `recompile` ("warn", "error", "allow") is what a recompile after `mark_warm(model)` does.
    `precompile` is a folder for precompiled artifacts (kiln/compile/artifacts/precompiled.py): each call
    signature is compiled ahead of time and saved there, and a later run loads it with no trace.
    With `fullgraph` left unset, a region that does not trace as one whole graph is JIT-compiled
    instead (graph breaks allowed; the report's precompile notes say why); `fullgraph=True` makes a
    break an error, `fullgraph=False` JIT-compiles every region.
    `in_helpers` (with `precompile`): helper processes compile the signatures (train while
    compiling, kiln/compile/artifacts/background.py); under fullgraph=False, which rules an
    ahead-of-time compile out, they fill the compile caches and each signature is JIT-compiled here.
    `blocks` (class -> paths): regions already chosen from the same `block_classes`/`block_paths`
    (the Accelerator's plan, kiln/model_plan.py), so they are not chosen twice.
    `outer_graph=True` compiles the whole model as one graph in which each block class is one
    shared subgraph (outer_graph.py): a full compile's steady steps where the host bounds them, for
    about twice a block's compile time (just in time only, torch >= 2.8). `outer_graph="background"`
    starts on per-block regions and moves each call signature to the outer graph once a helper
    process has compiled it into Inductor's caches and checked it against eager (tier_up.py): a
    per-block start, a full compile's steady steps. `outer_graph="auto"`, the default (None reads
    KILN_DYNAMO_OUTER_GRAPH), is "background" where it is known to work (one process, Inductor, a
    CPU model: outer_graph.choose) and False elsewhere, with the reason in the compile report.

    >>> model = compile_regions(model, mode="max-autotune")
    """
    kwargs = _check_compile_kwargs(torch_compile_kwargs)
    check_recompile_policy(recompile)
    outer_graph = check_outer_graph(outer_graph_from_environment() if outer_graph is None else outer_graph)
    if kwargs.get("disable"):
        warnings.warn("compile_regions(disable=True) leaves the model uncompiled", KilnCompileWarning, 2)
        return model
    if _already_compiled(model):
        warnings.warn(
            f"{type(model).__name__} is already compiled; compile_regions leaves it as it is",
            KilnCompileWarning,
            stacklevel=2,
        )
        return model
    blocks = dict(blocks) if blocks is not None else select_blocks(model, block_classes, block_paths)
    if not blocks:
        warnings.warn(
            f"{type(model).__name__} has no repeated blocks (no ModuleList, Sequential or ModuleDict "
            "holding two or more modules of one class); compiling the whole model instead. "
            "Pass block_classes= or block_paths= to choose regions by hand.",
            KilnCompileWarning,
            stacklevel=2,
        )
        return compile_full(model, recompile=recompile, precompile=precompile, in_helpers=in_helpers, **kwargs)
    source = chosen_by(model, block_classes, block_paths)
    auto, outer_off = outer_graph == "auto", ""
    if auto:
        outer_graph, outer_off = outer_graph_module.choose(model, kwargs, precompiled=precompile is not None or in_helpers,
                                                           cudagraphs=_uses_cudagraphs(kwargs))
    if outer_graph is True:
        return _compile_outer(model, blocks, kwargs, recompile, precompile, in_helpers, source)
    if outer_graph:
        _check_outer(model, precompile, in_helpers, f"outer_graph={outer_graph!r}")
        _check_background_outer(kwargs)
    modules = dict(model.named_modules())
    regions = []
    for cls, paths in blocks.items():
        groups = group_instances([modules[p] for p in paths], paths)
        for number, group in enumerate(groups, 1):
            name = _class_label(cls) + (f"#{number}" if len(groups) > 1 else "")
            region = _compile_class(cls, group.modules, group.paths, "block", kwargs, recompile, precompile, name,
                                    in_helpers)
            region.chosen_by = source
            region.group = (number, len(groups))
            region.group_differs = describe_difference(group, groups[0]) if number > 1 else ""
            regions.append(region)
    if outer_graph:
        regions.append(_outer_in_background(model, regions, kwargs, recompile, source, auto))
    regions[0].outer_off = outer_off
    _REGIONS[model] = regions
    if _uses_cudagraphs(kwargs):
        mark_cudagraph_steps(model)
    _start_cpu_probe(model, kwargs, in_helpers)
    return model


def _compile_outer(model: nn.Module, blocks: Mapping[type, list[str]], kwargs: dict[str, Any], recompile: str,
                   precompile: str | os.PathLike | None, in_helpers: bool, source: str) -> nn.Module:
    """compile_regions(outer_graph=True): each block class one nested compile region, then the
    whole model one region around them."""
    _check_outer(model, precompile, in_helpers, "outer_graph=True")
    modules = dict(model.named_modules())
    shared, first = {}, []
    for cls, paths in blocks.items():
        instances = [modules[p] for p in paths]
        outer_graph.share_block_code(_forward_to_compile(cls, instances, paths), instances)
        shared[_class_label(cls)] = len(paths)
        first.append(instances[0])
    region = _compile_class(type(model), [model], [""], "outer", outer_graph.compile_kwargs(kwargs), recompile)
    region.chosen_by, region.shared_blocks, region.first_blocks = source, shared, first
    _REGIONS[model] = [region]
    _start_cpu_probe(model, kwargs, in_helpers)
    return model


OUTER_GRAPH_VALUES = (False, True, "background", "auto")


def check_outer_graph(value: Any) -> bool | str:
    """`outer_graph` is False, True, "background" or "auto"; anything else is an error."""
    if not any(value is v if isinstance(v, bool) else value == v for v in OUTER_GRAPH_VALUES):
        raise ValueError(f"outer_graph must be False, True, 'background' or 'auto', got {value!r}")
    return value


def outer_graph_from_environment() -> bool | str:
    """KILN_DYNAMO_OUTER_GRAPH (true, false, background, auto), "auto" where unset."""
    raw = os.environ.get("KILN_DYNAMO_OUTER_GRAPH")
    return "auto" if raw is None or not raw.strip() else parse_outer_graph(raw, "KILN_DYNAMO_OUTER_GRAPH")


def _check_outer(model: nn.Module, precompile: str | os.PathLike | None, in_helpers: bool, setting: str) -> None:
    """What an outer graph needs, whether compiled now or in the background."""
    if not outer_graph.supported():
        raise RuntimeError(f"compile_regions({setting}) needs torch.compiler.nested_compile_region "
                           f"(torch >= 2.8); this torch is {torch.__version__}")
    if precompile is not None or in_helpers:
        raise NotImplementedError(f"compile_regions({setting}) compiles the outer graph just in time; precompiled "
                                  "regions (precompile=..., in_helpers) are compiled per block: choose one of the two")
    if any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        # torch 2.13, torchao 0.18: one graph, no subgraph, and gradients off eager's by 0.045 (so are
        # a full compile's); per-block regions give eager's exactly.
        raise NotImplementedError(f"compile_regions({setting}) with torchao's float8 layers (fp8) is not "
                                  "supported: Dynamo inlines their blocks instead of sharing them, and the "
                                  "whole-model graph's gradients differ from eager's; use per-block regions")


def _check_background_outer(kwargs: dict[str, Any]) -> None:
    """outer_graph="background" hands the outer graph to the helper through Inductor's caches: refuse
    it where they are off, and say once that another backend's output is not cached (the outer graph
    is then compiled whole here, when the helper is done)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise NotImplementedError("outer_graph='background' runs in a single process for now: every process would "
                                  "start its own helper; use outer_graph=True, or per-block regions")
    if kwargs.get("backend", "inductor") == "inductor":
        if torch._inductor.config.force_disable_caches:
            raise ValueError("outer_graph='background' needs Inductor's compile caches, through which the helper "
                             "hands over the outer graph, and they are off (TORCHINDUCTOR_FORCE_DISABLE_CACHES)")
    else:
        warnings.warn(f"outer_graph='background' with backend {kwargs['backend']!r}: only Inductor's output is "
                      "cached, so the outer graph is compiled again here, whole, when the helper is done",
                      KilnCompileWarning, stacklevel=4)


def _outer_in_background(model: nn.Module, regions: list[CompiledRegion], kwargs: dict[str, Any], recompile: str,
                         source: str, auto: bool) -> CompiledRegion:
    """compile_regions(outer_graph="background"): the per-block regions stay each block's forward
    outside a compiled graph, and become its shared subgraph inside the outer graph, which the
    model's forward (tier_up.TierUp) runs once the helper has compiled the call's signature."""
    modules = dict(model.named_modules())
    groups, shared, first = [], {}, []
    for region in regions:
        instances = [modules[p] for p in region.paths]
        block_forward = outer_graph.share_block_code(region.base_forward, instances, outside=region.compiled_forward)
        block_forward._kiln_region = region  # still this region's forward, for _already_compiled
        groups.append((region.base_forward, list(region.paths)))
        label = _class_label(region.block_class)
        shared[label] = shared.get(label, 0) + len(region.paths)
        first.append(instances[0])
    kwargs = outer_graph.compile_kwargs(kwargs)
    outer = _compile_class(type(model), [model], [""], "outer", kwargs, recompile)
    outer.chosen_by, outer.shared_blocks, outer.first_blocks = source, shared, first
    block_regions = list(regions)  # the caller appends the outer region to `regions`

    def stand_down() -> None:
        """outer_graph="auto" refused at the first call: each block calls its own region directly
        again, without the shared-code wrapper's frame (host8 inference 4x64, 2 threads: 1.24x a full
        compile's step with it, 1.18x without)."""
        for region in block_regions:
            for path in region.paths:
                modules[path].forward = types.MethodType(region.compiled_forward, modules[path])

    outer.tier_up = TierUp(outer, groups, kwargs, KilnCompileWarning, auto=auto, stand_down=stand_down)
    model.forward = types.MethodType(outer.tier_up.forward, model)
    return outer


def _start_cpu_probe(model: nn.Module, kwargs: dict[str, Any], in_helpers: bool) -> None:
    """Have Inductor's CPU probe (isa_probe.py) start at the first compiled call of a CPU model this
    process compiles or loads with Inductor: its questions are asked side by side while Dynamo traces,
    instead of one by one when Inductor first needs them (a precompiled warm start's first step, torch
    2.13, 2 cores: 1.6 s of 2.2 s). Not at compile time: load_state may install the probe's libraries
    before the first step (isa_probe.arm). Under `in_helpers` the caller knows whether this process
    compiles (the session arms it)."""
    if in_helpers or kwargs.get("backend", "inductor") != "inductor":
        return
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    if tensor is None or tensor.device.type == "cpu":
        isa_probe.arm()


def _uses_cudagraphs(kwargs: dict[str, Any]) -> bool:
    options = kwargs.get("options") or {}
    return kwargs.get("mode") in CUDAGRAPH_MODES or bool(options.get("triton.cudagraphs"))


def mark_cudagraph_steps(model: nn.Module) -> None:
    """Start a new CUDA-graph step at each call of `model` (a root pre-forward hook).

    With CUDA graphs, each compiled block replays into buffers it reuses across calls; one block
    graph runs once per layer, and without a step mark the next step overwrote outputs still in
    use ("accessing tensor output of CUDAGraphs that has been overwritten", torch 2.11, H200,
    DESIGN.md). As with a full compile in this mode, outputs kept across calls must be cloned.
    Outside CUDA the mark only advances a counter.
    """
    if model not in _STEP_HOOKS:
        _STEP_HOOKS[model] = model.register_forward_pre_hook(
            lambda module, args: torch.compiler.cudagraph_mark_step_begin())


def compile_full(model: nn.Module, *, recompile: str = "allow", precompile: str | os.PathLike | None = None,
                 in_helpers: bool = False, **torch_compile_kwargs: Any) -> nn.Module:
    """Compile the whole model as one region, in place (same object, class, keys and hooks);
    `precompile` and `in_helpers` as in `compile_regions`."""
    kwargs = _check_compile_kwargs(torch_compile_kwargs)
    check_recompile_policy(recompile)
    if _already_compiled(model):
        warnings.warn(f"{type(model).__name__} is already compiled; leaving it as it is",
                      KilnCompileWarning, stacklevel=2)
        return model
    _REGIONS[model] = [_compile_class(type(model), [model], [""], "full", kwargs, recompile, precompile,
                                      in_helpers=in_helpers)]
    _start_cpu_probe(model, kwargs, in_helpers)
    return model


def mark_warm(model: nn.Module) -> None:
    """End of warm-up: from now on a recompile of `model`'s regions meets their recompile policy."""
    for region in _REGIONS.get(model, ()):
        region.warm = True


def compiled_regions(model: nn.Module) -> list[CompiledRegion]:
    """The regions Kiln compiled in `model` (empty if none)."""
    return list(_REGIONS.get(model, ()))


def _compile_class(cls: type, instances: list[nn.Module], paths: list[str], kind: str,
                   kwargs: dict[str, Any], recompile: str,
                   precompile: str | os.PathLike | None = None, name: str | None = None,
                   in_helpers: bool = False) -> CompiledRegion:
    """Compile one entry for `instances` (one class, or one group of its instances: `name` then
    says which, "ResnetBlock2D#2") and bind it as their forward."""
    forward = _forward_to_compile(cls, instances, paths)
    all_kwargs = kwargs
    kwargs = dict(kwargs)
    backend = kwargs.pop("backend", "inductor")
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    name = name or _class_label(cls)
    label = _unique_label(name)
    tracked = TrackedBackend(resolve_backend(backend, mode, options, kwargs.get("dynamic")), name)
    entry = region_entry(forward, label)
    region = CompiledRegion(name, cls, list(paths), tracked, kind, label, recompile_policy=recompile,
                            base_forward=forward)
    if precompile is not None:
        # fullgraph left unset: the region is tried as one whole graph ahead of time, and JIT-compiled
        # as torch.compile would (graph breaks allowed) where that fails.
        whole_or_jit = "fullgraph" not in all_kwargs and not in_helpers
        aot_kwargs = {**all_kwargs, "fullgraph": True} if whole_or_jit else all_kwargs
        region.precompile_off = unsupported_reason(aot_kwargs)
        aot_off = None
        if in_helpers and region.precompile_off is not None and unsupported_reason({**all_kwargs, "fullgraph": True}) is None:
            aot_off, region.precompile_off = region.precompile_off, None  # only fullgraph=False: the helpers fill caches
        if region.precompile_off is None:
            try:
                region.precompiled = PrecompiledRegion(
                    precompile, name, label, entry, cls, forward, aot_kwargs,
                    on_compile=lambda reason, first: MONITOR.after_precompile(region, reason, first),
                    aot_off=aot_off, jit_on_failure=whole_or_jit)
            except UnsupportedCall as exc:
                region.precompile_off = str(exc)
    if region.precompiled is not None:
        # JIT is the fallback here: torch.compile() itself costs a start-up 0.36 s of imports
        # (Dynamo's debugging backends, AOTAutograd; torch 2.13), paid only if a call needs it.
        compiled = _LazyCompile(entry, tracked, kwargs)
    else:
        compiled = torch.compile(entry, backend=tracked, **kwargs)
    region.compiled_entry = compiled
    region.compiled_forward = _region_forward(region, compiled)
    MONITOR.watch(region)
    PROGRESS.watch()  # reads KILN_COMPILE_PROGRESS: a bad value is an error here, not mid-compile
    for module in instances:
        # A bound method, not a closure over the module: copy.deepcopy rebinds it to the copy.
        module.forward = types.MethodType(region.compiled_forward, module)
    return region


def _forward_to_compile(cls: type, instances: list[nn.Module], paths: list[str]) -> Callable:
    """The class's forward, or the one function all instances were given in its place (as Kiln's
    activation checkpointing does); a forward replaced per instance cannot be shared, so refuse."""
    replaced = [vars(m).get("forward") for m in instances]
    if all(f is None for f in replaced):
        return cls.forward
    functions = {getattr(f, "__func__", None) for f in replaced}
    if len(functions) == 1 and None not in functions:
        return functions.pop()
    path = next(p for p, f in zip(paths, replaced) if f is not None)
    raise ValueError(f"module {path or '<root>'} ({cls.__name__}) has its forward replaced on the instance; "
                     "Kiln compiles one forward per block class and would drop that replacement")


def _region_forward(region: CompiledRegion, compiled: Callable) -> Callable:
    """The forward every instance runs: the compiled entry, plus the counting that proves it ran."""
    backend = region.backend

    # One frame per call (issue 34 counts each block call's microseconds): the live compile line
    # learns the region from PROGRESS, restored on the way out.
    def forward(module, *args, **kwargs):
        outer = PROGRESS.enter(region.name)  # names the region in the live compile line
        try:
            handed_back = False  # a signature the background helper gave back to the JIT path
            precompiled = region.precompiled
            if precompiled is not None and _stance() == "default":
                fn, signature = precompiled.function_for(module, args, kwargs)
                handed_back = fn is None and precompiled.take_handback(signature)
                if fn is EAGER:  # compiling in the background: this call runs the block's own forward
                    region.invocations += 1
                    region.eager_calls += 1
                    precompiled.stats.background_eager_calls += 1
                    return region.base_forward(module, *args, **kwargs)
                if fn is not None:
                    output = precompiled.call(fn, signature, module, args, kwargs)
                    if output is not _NOT_RUN:
                        region.invocations += 1
                        return output
            if not region.invocations:
                # The CPU probe (isa_probe.py), at the first JIT call; the precompiled path starts it
                # where it compiles or loads, after another machine's probe builds may have arrived.
                isa_probe.start_if_armed()
            graphs, calls = len(backend.graphs), backend.calls
            if kwargs:
                kwargs = _with_block_caches(region, module, kwargs)
            with _under_checkpointing(region, module):
                output = compiled(module, *args, **kwargs)
            region.invocations += 1
            if backend.calls == calls:
                region.eager_calls += 1
                MONITOR.after_eager_call(region)
            if len(backend.graphs) != graphs:
                MONITOR.after_compile(region, policy=not handed_back)
                if region.shared_blocks:
                    _check_shared(region)
            return output
        finally:
            PROGRESS.region = outer

    forward._kiln_region = region  # lets _already_compiled recognise Kiln's forwards
    return forward


_NOT_RUN = PrecompiledRegion.NOT_RUN


def _check_shared(region: CompiledRegion) -> None:
    """One warning when an outer graph was compiled with its blocks inlined, not shared: nothing
    is then gained over a full compile (a block Dynamo cannot make a subgraph of)."""
    if not region.backend.graphs[-1].subgraphs and "inlined" not in region.warned:
        region.warned.add("inlined")
        warnings.warn(f"outer_graph=True: {region.name}'s graph holds no shared block subgraph (Dynamo inlined "
                      f"{', '.join(region.shared_blocks)}), so it compiled like a full compile; per-block regions "
                      "(outer_graph=False) compile each block once", KilnCompileWarning, stacklevel=3)


def _with_block_caches(region: CompiledRegion, module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with a transformers KV cache replaced by this block's layer (kv_cache.py); one
    warning for each cache class the region gets whole, which compiles a graph per layer."""
    known = len(region.cache_notes)
    kwargs = kv_cache.for_block(module, kwargs, region.cache_notes)
    if len(region.cache_notes) != known:
        for kind, note in list(region.cache_notes.items())[known:]:
            if note.startswith("passed whole"):
                warnings.warn(f"compiled region {region.name}: the KV cache {kind} is {note}",
                              KilnCompileWarning, stacklevel=5)
    return kwargs


class _LazyCompile:
    """`torch.compile(entry, backend=..., **kwargs)`, made at its first call."""

    def __init__(self, entry: Callable, backend: TrackedBackend, kwargs: dict[str, Any]) -> None:
        self.entry, self.backend, self.kwargs, self.fn = entry, backend, kwargs, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            self.fn = torch.compile(self.entry, backend=self.backend, **self.kwargs)
        return self.fn(*args, **kwargs)


def _under_checkpointing(region: CompiledRegion, module: nn.Module):
    """Dynamo told to trace, not refuse, Python side effects inside the checkpoint of a block that
    checkpoints its activations, and not to replay them in the backward's recompute: a transformers
    layer that checkpoints itself (`GradientCheckpointingLayer`, `gradient_checkpointing` on, in
    training with grad; for an outer graph, its blocks), or a block under Kiln's activation
    checkpointing (with grad). With transformers 5.25 and kernels 0.19, the kernelized attention
    sets and resets a context variable (which rotary function runs) inside the layer: torch 2.13
    refuses that mutation inside a checkpoint, and the whole layer ran eagerly ("HOP: Unsafe side
    effect"). Nothing in it needs replaying; the recompute's arithmetic is the forward's. Other
    blocks are traced as torch does."""
    if not _SKIPS_SIDE_EFFECTS_UNDER_CHECKPOINT:
        return _AS_TORCH_TRACES
    if region.checkpointed:
        checkpoints = torch.is_grad_enabled()
    else:
        # An outer graph asks its first block (they checkpoint themselves inside it); a block, itself.
        block = region.first_blocks[0] if region.first_blocks else module
        # Every JIT call of every region asks: the class attribute first (transformers declares it there,
        # False), so other blocks pay no failed instance lookup through nn.Module.__getattr__.
        checkpoints = (getattr(type(block), "gradient_checkpointing", None) is not None
                       and block.gradient_checkpointing is True and block.training and torch.is_grad_enabled())
    if checkpoints:
        return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    return _AS_TORCH_TRACES


_AS_TORCH_TRACES = contextlib.nullcontext()  # reusable: it holds no state
# Asked once: torch's config module answers attribute lookups through __getattr__ (about 1 us).
_SKIPS_SIDE_EFFECTS_UNDER_CHECKPOINT = hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")


def _stance() -> str:
    """torch.compiler.set_stance's current stance ("force_eager", ...): under any stance but the
    default, calls take the JIT path, where Dynamo applies it (a private attribute, torch >= 2.6)."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(stance, "stance", "default")
_LABELS: set[str] = set()


def _unique_label(name: str) -> str:
    """The entry's function name: Dynamo's logs and records name the region by it."""
    base = "kiln_region_" + "".join(c if c.isalnum() else "_" for c in name)
    label, n = base, 1
    while label in _LABELS:
        n += 1
        label = f"{base}_{n}"
    _LABELS.add(label)
    return label


def _already_compiled(model: nn.Module) -> bool:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return True
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            return True
        forward = vars(module).get("forward")
        if forward is not None and (hasattr(getattr(forward, "__func__", None), "_kiln_region")
                                    or _tier_up_of(module) is not None):
            return True
    return False


def _tier_up_of(module: nn.Module) -> TierUp | None:
    """The TierUp whose forward `module` runs (bound to it: MethodType(tier_up.forward, module))."""
    method = getattr(vars(module).get("forward"), "__func__", None)
    owner = getattr(method, "__self__", None)
    return owner if isinstance(owner, TierUp) else None


def _check_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    allowed = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(f"unknown torch.compile keyword(s) {', '.join(unknown)}; "
                        f"torch {torch.__version__} takes: {', '.join(sorted(allowed))}")
    kwargs = dict(kwargs)
    if kwargs.get("fullgraph", False) is None:  # left unset (TorchDynamoPlugin(precompile="auto")): torch's default
        del kwargs["fullgraph"]
    kwargs["backend"] = validate_backend(kwargs.get("backend", "inductor"))
    if kwargs["backend"] in ("no", "none"):
        raise ValueError("backend 'no' means no compile; do not call compile_regions then")
    validate_mode_and_options(kwargs["backend"], kwargs.get("mode"), kwargs.get("options"))
    return kwargs


def _class_matches(cls: type, wanted: type | str) -> bool:
    if isinstance(wanted, str):
        return wanted in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")
    return cls is wanted


def _class_label(cls: type | str) -> str:
    return cls if isinstance(cls, str) else cls.__qualname__


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def uncompile(model: nn.Module) -> nn.Module:
    """Remove the forwards Kiln compiled in `model`, in place; the model runs eagerly again."""
    hook = _STEP_HOOKS.pop(model, None)
    if hook is not None:
        hook.remove()
    # An outer graph compiled in the background first: it gives the blocks back their per-block regions.
    for region in sorted(_REGIONS.pop(model, ()), key=lambda r: r.tier_up is None):
        modules = dict(model.named_modules())
        if region.tier_up is not None:
            region.tier_up.close()
            if _tier_up_of(model) is region.tier_up:
                del model.forward
            for module in modules.values():  # back to their per-block regions, undone below
                forward = getattr(vars(module).get("forward"), "__func__", None)
                if getattr(forward, "_kiln_shared_block", None) is not None:
                    module.forward = types.MethodType(forward._kiln_region.compiled_forward, module)
            continue
        if region.shared_blocks:
            for module in modules.values():
                outer_graph.unshare_block_code(module)
        for path in region.paths:
            module = modules[path]
            if getattr(vars(module).get("forward"), "__func__", None) is not region.compiled_forward:
                continue
            if region.base_forward is region.block_class.forward:
                del module.forward
            else:  # back to the shared forward it had before compile (activation checkpointing)
                module.forward = types.MethodType(region.base_forward, module)
    return model
