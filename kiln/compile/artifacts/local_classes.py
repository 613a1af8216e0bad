"""Objects whose class is defined in local scope (inside a function) kept out of what an ahead-of-time
compile saves, and a failed one explained: which object stopped it, where it sits in the block.

Depends on torch only; precompiled.py and aot_workarounds.py use it.

Why (torch 2.13, transformers 5.25 with kernels 0.19): `kernels`' `use_kernelized_func` gives each
`LlamaAttention` a `Func` module made by a factory function (`_create_func_module.<locals>.Func`).
torch saves a compiled function's guards by pickling what they check, and pickles classes by name:
- a type guard on such an object cannot be saved at all ("defined in local scope", TypeError);
- the pickled object comes back as a plain `nn.Module`, so every guard reached through its type (its
  forward's closure, defaults) cannot be rebuilt at load ("'NoneType' object is not subscriptable");
- aot_eager pickles the backward graph with its nodes' `fwd_nn_module_stack`, which torch's filter
  of unpicklable metadata misses (it names `nn_module_stack` and `fwd_source_fn_stack`): the class is
  pickled by name and fails (PicklingError).
The block instance is an input of the precompiled function, passed at each call, so none of this
needs saving: the guards on and beneath such objects are dropped (Kiln checks each call's signature
itself, and the region key covers the block's source), and the module stacks name the nearest
importable base class instead.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

_TYPE_GUARDS = ("TYPE_MATCH", "BUILTIN_MATCH")
# How torch 2.13 names what it could not save: "Type <class 'm.f.<locals>.C'> for object ...", "Can't
# pickle local object 'f.<locals>.C'", "Can't pickle <class 'm.f.<locals>.C'>: it's not found as ...".
_CLASS_IN_MESSAGE = re.compile(r"<class '([^']+)'>|local object '([^']+)'")


def defined_in_local_scope(cls: type) -> bool:
    """torch's own test for a class its package cannot save by name (a class made in a function,
    or nested in another class): its qualified name is not its name."""
    return getattr(cls, "__qualname__", "") != getattr(cls, "__name__", "")


def importable_class(cls: type) -> type:
    """The nearest class in `cls`'s MRO that pickle can name (nn.Module for kernels' Func)."""
    return next(c for c in cls.__mro__ if not defined_in_local_scope(c))


def portable_guards(user_filter: Callable | None = None) -> Callable:
    """A `guard_filter_fn` for an ahead-of-time compile: the guards torch would keep (the user's
    filter, else torch's default for one: no global guards and none of the kinds it cannot save),
    less every guard on or beneath an object whose class is defined in local scope."""

    def keep(entries: Sequence[Any]) -> list[bool]:
        base = user_filter(entries) if user_filter is not None else [_saveable(e) for e in entries]
        local = [e.name for e in entries if e.name and _holds_local_class(e)]
        if not local:
            return list(base)
        beneath = re.compile("|".join(re.escape(name) + r"(?=$|[.\[)])" for name in local))
        return [bool(k) and beneath.search(e.name) is None for e, k in zip(entries, base)]

    return keep


def _saveable(entry: Any) -> bool:
    from torch._dynamo.guards import CheckFunctionManager
    unsupported = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return not (entry.is_global or entry.guard_type in unsupported)


def _holds_local_class(entry: Any) -> bool:
    if not entry.has_value:
        return False
    value = entry.value
    if isinstance(value, type):
        return defined_in_local_scope(value)
    return entry.guard_type in _TYPE_GUARDS and defined_in_local_scope(type(value))


def importable_module_stacks(backend: Callable) -> Callable:
    """`backend` behind a step that names, in each graph node's module stack, the nearest importable
    class in place of one defined in local scope (for backends that pickle their graphs: aot_eager)."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        for node in gm.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack and any(isinstance(c, type) and defined_in_local_scope(c) for _, c in stack.values()):
                node.meta["nn_module_stack"] = {
                    key: (path, importable_class(c) if isinstance(c, type) else c) for key, (path, c) in stack.items()}
        return backend(gm, example_inputs, **kwargs)

    compile_graph.__name__ = getattr(backend, "__name__", "backend")
    return compile_graph


# ---------------------------------------------------------------- a failure explained

def explain_failure(exc: BaseException, module: nn.Module) -> str:
    """What stopped an ahead-of-time compile of `module`'s block and what the user can do, in words:
    the object torch could not save and where it sits in the block, when the error names a class
    Kiln finds there; the way out in every case."""
    way_out = ("or set precompile=False: the region is then JIT-compiled, and later runs still start "
               "warm from the compile caches")
    for name in (a or b for a, b in _CLASS_IN_MESSAGE.findall(str(exc))):
        path, cls = _find(module, name)
        if path is None:
            continue
        where = f"block.{path}" if path else "the block itself"
        if defined_in_local_scope(cls):
            fix = (f"define {cls.__name__} at the top level of a module (it is made inside "
                   f"{cls.__qualname__.rsplit('.', 1)[0].removesuffix('.<locals>')}) so torch can save it by name")
        else:
            fix = f"make {cls.__qualname__} picklable, or give it to the block after it is compiled"
        return (f"the object torch could not save is a {cls.__module__}.{cls.__qualname__} at {where}; "
                f"to precompile this region, {fix}, {way_out}")
    # Nothing in the block is named (a backend whose output this torch cannot save, say): say so
    # rather than send the user looking in the block.
    return "the error names nothing Kiln finds in the block; " + way_out.removeprefix("or ")


def _find(module: nn.Module, name: str) -> tuple[str | None, type | None]:
    for path, obj in _walk(module):
        cls = obj if isinstance(obj, type) else type(obj)
        if cls.__module__ == "builtins":  # "<class 'function'>" names a kind of value, not an object
            continue
        if name in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__):
            return path, cls
    return None, None


def _walk(root: nn.Module, limit: int = 5000) -> Iterator[tuple[str, Any]]:
    """(path, object) for the block, its submodules and the values in their attributes, breadth
    first, each object once."""
    seen: set[int] = set()
    queue: deque[tuple[str, Any]] = deque([("", root)])
    while queue and len(seen) < limit:
        path, obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield path, obj
        if isinstance(obj, nn.Module):
            children = [(k, v) for k, v in vars(obj).items() if k not in ("_parameters", "_buffers", "_modules")]
            children = list(obj._modules.items()) + children
            queue.extend((f"{path}.{k}" if path else k, v) for k, v in children if v is not None)
        elif isinstance(obj, dict):
            queue.extend((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            queue.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
