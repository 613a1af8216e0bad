"""Instance groups: the instances of one block class whose compiled graphs can be the same, told
apart by what Dynamo guards on (parameter shapes, which submodules exist, flag attributes).

Depends on torch only. kiln/compile/regions.py gives each group an entry of its own.

Why: Dynamo keeps at most `recompile_limit` (8) graphs per code object. A UNet's `ResnetBlock2D`
instances differ in channels, in whether they have a shortcut convolution and in flags such as
`up`/`down`; with one entry per class, 24 of 144 calls of a tiny Stable-Diffusion UNet ran eagerly
once the limit was reached (torch 2.13, diffusers 0.40). One entry per group keeps the cost model
of regional compilation, one compile per distinct block, and leaves each entry's 8 graphs for what
the data varies (train/eval, grad mode, input shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

# Attribute kinds that decide a graph when forward reads them (Dynamo guards on their value) and
# that describe a block's build: flags and modes. Numbers are left out: an index such as
# transformers' `layer_idx` differs on every instance yet is not read in training, and sizes
# already show in the parameter shapes.
FLAG_TYPES = (bool, str, type(None))


@dataclass
class InstanceGroup:
    """Instances of one class that share an entry, in model order."""

    paths: list[str]
    modules: list[nn.Module]
    features: dict[str, Any]  # what this group is, readable: "conv1.weight" -> (32, 16, 3, 3), ...


def group_instances(modules: list[nn.Module], paths: list[str]) -> list[InstanceGroup]:
    """Split one class's instances into groups with equal `instance_features`, in order of first
    appearance (so group numbers are the same in every run of the same model)."""
    groups: dict[tuple, InstanceGroup] = {}
    for module, path in zip(modules, paths):
        features = instance_features(module)
        key = tuple(features.items())
        if key not in groups:
            groups[key] = InstanceGroup([], [], features)
        groups[key].paths.append(path)
        groups[key].modules.append(module)
    return list(groups.values())


def instance_features(module: nn.Module) -> dict[str, Any]:
    """What about a block instance decides its graph, by name: each parameter's and buffer's shape,
    dtype and requires_grad; each submodule's class (or None where a slot is empty); each flag
    attribute (bool, str, None) of the block and its submodules, except `training`."""
    features: dict[str, Any] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, child in sub._modules.items():
            features[f"{dot}{name}"] = type(child).__qualname__ if child is not None else None
        for name, tensor in [*sub._parameters.items(), *sub._buffers.items()]:
            features[f"{dot}{name}"] = None if tensor is None else _tensor_features(tensor)
        for name, value in vars(sub).items():
            if not name.startswith("_") and name != "training" and isinstance(value, FLAG_TYPES):
                features[f"{dot}{name}"] = value
    return features


def _tensor_features(tensor: Any) -> tuple:
    # DeepSpeed ZeRO-3 leaves an empty partition in place and keeps the full shape in `ds_shape`.
    shape = tuple(getattr(tensor, "ds_shape", None) or tensor.shape)
    return (shape, str(tensor.dtype), bool(tensor.requires_grad))


def repeats_one_block(modules: list[nn.Module]) -> bool:
    """True when `modules` (instances of one class in one container) are repeats of one block, so
    each becomes a region: at least two hold the same tensors (names, shapes, dtypes). That covers
    two in one group (a region saves compiles) and two that differ only in which submodule classes
    or flags they have, as the float8 swap leaves a model's decoder layers (the first layer keeps a
    plain linear the others lose); each group gets an entry of its own. Instances whose tensors all
    differ (a UNet's down-sampling stages, each of its own width) are not: the search looks inside."""
    layouts = [_tensor_layout(m) for m in modules]
    return len(set(layouts)) < len(layouts)


def _tensor_layout(module: nn.Module) -> tuple:
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return tuple((name, _tensor_features(tensor)) for name, tensor in tensors)


def describe_difference(group: InstanceGroup, first: InstanceGroup, limit: int = 3) -> str:
    """How `group` differs from the class's first group, for the report: up to `limit` features."""
    names = [n for n in {**first.features, **group.features}
             if group.features.get(n, "absent") != first.features.get(n, "absent")]
    parts = [f"{n} {_show(group.features.get(n, 'absent'))}" for n in names[:limit]]
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(parts) + more


def _show(value: Any) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # a tensor's features
        return "x".join(map(str, value[0])) or "scalar"
    return repr(value)
