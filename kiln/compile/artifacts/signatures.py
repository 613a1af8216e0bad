"""Call signatures and region keys: what decides whether saved precompiled code fits a call
(kiln/compile/artifacts/precompiled.py), described as hashable tuples and as readable fields for the report.

Depends on torch and kiln.compile.artifacts.cache_key only.
"""

from __future__ import annotations

import hashlib
import inspect
import platform
import sys
from typing import Any, Callable

import torch
from torch import nn

from kiln.compile.artifacts.cache_key import canonical_json, cpu_model, device_name, triton_version

FORMAT_VERSION = 1  # of the precompiled artifacts; part of every region key
AUTOCAST_DEVICES = ("cpu", "cuda")

class UnsupportedCall(Exception):
    """A call Kiln cannot describe by a signature (an argument of an unknown kind): JIT it."""



# ---------------------------------------------------------------- signatures

AUTOCAST_FIELD = 4  # call_signature's ("autocast", state) pair, read at every precompiled call


def call_signature(module: nn.Module, args: tuple, kwargs: dict[str, Any], num_threads: int | None = None) -> tuple:
    """Everything about one call that decides which compiled code fits it, as a hashable tuple:
    each argument (tensors by shape, dtype, device, strides when not contiguous, requires_grad;
    plain values by value), grad and inference mode, autocast, torch's thread count (`num_threads`
    where the process runs on fewer for a while: kiln/compile/artifacts/background.py), the training flags
    of the block's modules, and its parameters' and buffers' shapes, dtypes and devices."""
    return (
        ("args", tuple(_describe(a) for a in args)),
        ("kwargs", tuple((k, _describe(v)) for k, v in sorted(kwargs.items()))),
        ("grad_enabled", torch.is_grad_enabled()),
        ("inference_mode", torch.is_inference_mode_enabled()),
        ("autocast", autocast_state()),
        # Loaded functions guard on the thread count (torch 2.13); torchrun sets 1 per process.
        ("num_threads", num_threads or torch.get_num_threads()),
        ("training", tuple(m.training for m in module.modules())),
        ("parameters", tuple(_tensor_meta(p) for p in module.parameters())),
        ("buffers", tuple(_tensor_meta(b) for b in module.buffers())),
    )


def call_key(module: nn.Module, args: tuple, kwargs: dict[str, Any], num_threads: int | None = None) -> tuple:
    """The facts of `call_signature`, as the objects themselves (dtypes, devices, sizes) instead of
    their text: a key for a lookup at every call, about twice as fast to make. Two calls with one
    key have one signature; a call it cannot describe raises UnsupportedCall, as the signature does."""
    return (*arguments_key(args, kwargs, num_threads), *module_keys(module))


def arguments_key(args: tuple, kwargs: dict[str, Any], num_threads: int | None = None) -> tuple:
    """The part of `call_key` that the call brings (its arguments, grad and inference mode, autocast,
    the thread count), without the module's: 5 us for a Llama layer's call, against 26 us with the
    walk of its modules (torch 2.13, one thread)."""
    return (
        tuple(_key(a) for a in args),
        tuple((k, _key(v)) for k, v in kwargs.items()),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        autocast_state(),
        num_threads or torch.get_num_threads(),
    )


def module_keys(module: nn.Module) -> tuple[tuple, tuple, tuple]:
    """The training flags of the module tree, and its parameters' and buffers' keys, from one walk
    of its dictionaries (`modules()` and `parameters()` build every path's name, 3x the time)."""
    training, parameters, buffers = [], [], []
    stack = [module]
    while stack:
        m = stack.pop()
        training.append(m.training)
        parameters.extend(_tensor_key(p) for p in m._parameters.values() if p is not None)
        buffers.extend(_tensor_key(b) for b in m._buffers.values() if b is not None)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return tuple(training), tuple(parameters), tuple(buffers)


def _tensor_key(t: torch.Tensor) -> tuple:
    key = (t.shape, t.dtype, t.device, t.requires_grad, None if t.is_contiguous() else t.stride())
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return key
    return (*key, *_distributed(t))


_PLAIN_TENSOR_KEY = 5  # the length of a plain tensor's `_tensor_key`; a DTensor's adds its placements


def holds_distributed(keys: tuple[tuple, tuple, tuple]) -> bool:
    """Whether `module_keys` describe a DTensor among the parameters or buffers (tensor parallel)."""
    return any(len(key) > _PLAIN_TENSOR_KEY for key in (*keys[1], *keys[2]))


def _distributed(t: torch.Tensor) -> tuple:
    """What a DTensor's compiled code depends on beyond its global shape (tensor parallel blocks): its
    placements, its local shape, and its mesh, down to the names of this process's groups, which the
    compiled collectives call by name. Two processes in different tensor-parallel groups (ranks 0-1
    and 2-3 of dp_shard=2 x tp=2) have different group names: code compiled in one cannot run in the
    other ("Could not resolve the process group registered under the name 3"). Empty for other tensors."""
    mesh = getattr(t, "device_mesh", None)
    placements = getattr(t, "placements", None)
    if mesh is None or placements is None:
        return ()
    return (tuple(str(p) for p in placements), tuple(t.to_local().shape), _mesh_key(mesh))


_MESH_KEYS: dict[int, tuple[Any, tuple]] = {}


def _mesh_key(mesh: Any) -> tuple:
    """(dimension names, shape, this process's group name in each dimension), made once per mesh."""
    known = _MESH_KEYS.get(id(mesh))
    if known is None or known[0] is not mesh:
        groups = tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))
        known = _MESH_KEYS[id(mesh)] = (mesh, (mesh.mesh_dim_names, tuple(mesh.shape), groups))
    return known[1]


def argument_key(value: Any) -> Any:
    """One argument's part of `call_key` (a tensor by its shape, dtype, device, requires_grad and
    strides; a plain value by itself); UnsupportedCall for a value it cannot describe."""
    return _key(value)


def _key(value: Any) -> Any:
    kind = type(value)
    if kind is torch.Tensor or kind is nn.Parameter:
        return _tensor_key(value)
    if value is None or kind in (bool, int, float, str, torch.dtype, torch.device):
        return (kind, value)
    if kind in (tuple, list):
        return (kind, tuple(_key(v) for v in value))
    if kind is dict and all(type(k) is str for k in value):
        return (dict, tuple((k, _key(v)) for k, v in sorted(value.items())))
    raise UnsupportedCall(f"an argument of type {kind.__qualname__}")  # call_signature says it precisely


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The autocast regions active now, as (device type, dtype) pairs."""
    state = []
    for device_type in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, str(torch.get_autocast_dtype(device_type))))
    return tuple(state)


def _tensor_meta(t: torch.Tensor) -> tuple:
    strides = None if t.is_contiguous() else tuple(t.stride())
    meta = ("tensor", tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad, strides)
    distributed = _distributed(t)
    if distributed:
        placements, local, (names, shape, groups) = distributed
        meta += (("placements", placements), ("local", local), ("mesh", names, shape, groups))
    return meta


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
