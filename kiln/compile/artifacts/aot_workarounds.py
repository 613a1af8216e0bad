"""The torch behaviours an ahead-of-time compile of a region has to work around (torch 2.13): a
shared AOTAutograd cache that answers with another signature's code, FSDP2's run-time classes,
classes defined in local scope, functions compiled under autocast, saving through a file, and
(torch 2.11) an ahead-of-time compile that is there but switched off.

Depends on torch and kiln.compile.artifacts.local_classes only.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kiln.compile.artifacts.local_classes import importable_module_stacks, portable_guards


def compile_ahead_of_time(fn: Callable, examples: tuple, **compile_kwargs: Any) -> Any:
    """`torch.compile(fn, **compile_kwargs).aot_compile(examples)`, keeping objects whose class is
    defined in local scope out of what is saved (local_classes.py). torch 2.11 has the ahead-of-time
    compile but attaches `.aot_compile` to compiled functions only under
    `torch._dynamo.config.enable_aot_compile`, off by default there (on in 2.13): it is switched on
    for this one compile."""
    options = dict(compile_kwargs.get("options") or {})  # torch.compile pops guard_filter_fn from it
    options["guard_filter_fn"] = portable_guards(options.get("guard_filter_fn"))
    compile_kwargs = {**compile_kwargs, "options": options}
    backend = compile_kwargs.get("backend", "inductor")
    if isinstance(backend, str) and backend != "inductor":
        compile_kwargs["backend"] = importable_module_stacks(torch._dynamo.lookup_backend(backend))
    config = torch._dynamo.config
    if getattr(config, "enable_aot_compile", True):
        return torch.compile(fn, **compile_kwargs).aot_compile(examples)
    with config.patch(enable_aot_compile=True):
        return torch.compile(fn, **compile_kwargs).aot_compile(examples)


class ServedFromCache(Exception):
    """AOTAutograd's shared disk cache answered an ahead-of-time compile. With torch 2.13 (bf16,
    aot_eager), a compile at batch 3 in a run that followed one at batch 6 of the same block was
    answered with batch-6 code under batch-3 guards ("shape '[18, 16]' is invalid for input of
    size 144" at its first call); with the Inductor folder emptied between the runs it was not.
    Switching the cache off is no way out (the result can then not be saved: "does not implement
    SerializableCallable"), nor is `torch.compiler.config.cache_key_tag`. So each signature gets a
    cache folder of its own (`private_autograd_cache`), and where that cannot be done, a compile
    the shared cache answered is not used."""


class private_autograd_cache:
    """AOTAutograd's disk cache in a folder of one signature's own while it is compiled ahead of
    time (`ServedFromCache` says why a shared one cannot be trusted). It stays on, as saving needs
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


def autograd_cache_hits() -> int:
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


def serialized(compiled: Any) -> bytes:
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    temp = folder / f"kiln-precompiled-{os.getpid()}-{secrets.token_hex(4)}.bin"
    try:
        result = compiled.save_compiled_function(str(temp))
        if getattr(result, "external_data", None):
            raise RuntimeError("the compiled function needs external data, which Kiln does not save")
        return temp.read_bytes()
    finally:
        temp.unlink(missing_ok=True)


def detached(value: Any) -> Any:
    """Example inputs for the ahead-of-time compile: the call's values, tensors detached from
    their graph (autograd history and .grad do not belong in the artifact)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(detached(v) for v in value)
    if isinstance(value, list):
        return [detached(v) for v in value]
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    return value


class as_class:
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


def _dtype(name: str) -> torch.dtype:
    """A dtype from its name in a call signature ("torch.bfloat16")."""
    return getattr(torch, name.replace("torch.", ""))


class _autocast_regions:
    """Enter several autocast contexts (at most one per device type) as one."""

    def __init__(self, contexts: list) -> None:
        self.contexts = contexts

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        return False


class autocast_off(_autocast_regions):
    """Switch off the given autocast regions (a call signature's autocast state)."""

    def __init__(self, state: tuple) -> None:
        super().__init__([torch.autocast(device_type, enabled=False) for device_type, _ in state])


class autocast_on(_autocast_regions):
    """Enter the given autocast regions (a call signature's autocast state): the background
    helper's JIT compile runs the region the way the training process's JIT path calls it."""

    def __init__(self, state: tuple) -> None:
        super().__init__([torch.autocast(device_type, dtype=_dtype(dtype)) for device_type, dtype in state])


def with_autocast(forward: Callable, state: tuple, label: str) -> Callable:
    dtypes = [(device_type, _dtype(dtype)) for device_type, dtype in state]
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

    return renamed(with_autocast, label)


def renamed(fn: Callable, label: str) -> Callable:
    """`fn` with the region's label as its code name: Dynamo's records name the region by it."""
    changes = {"co_name": label}
    if hasattr(fn.__code__, "co_qualname"):
        changes["co_qualname"] = label
    code = fn.__code__.replace(**changes)
    return type(fn)(code, fn.__globals__, label, fn.__defaults__, fn.__closure__)


def region_entry(forward: Callable, label: str) -> Callable:
    """A fresh function that calls `forward`, with its own code object, hence its own Dynamo cache,
    named by the region's label. The training process and the background helper build it the same way."""

    def entry(module, *args, **kwargs):
        return forward(module, *args, **kwargs)

    return renamed(entry, label)
