"""The key of a warm-start cache entry: everything that decides whether compiled artifacts fit a job
(versions, device, compile settings, model structure), hashed the same way in every process.

Depends on torch only.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn


def job_key(model: nn.Module, compile_kwargs: dict[str, Any], device: torch.device | str,
            format_version: int) -> tuple[str, str]:
    """(hex digest, a short description for `kiln cache ls`) of one compile job."""
    device = torch.device(device)
    settings = normalize_compile_settings(compile_kwargs)
    digest = hashlib.sha256()
    environment = {
        "format": format_version, "torch": torch.__version__, "triton": triton_version(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "machine": platform.machine(), "device_type": device.type, "device_name": device_name(device),
        "settings": settings,
    }
    digest.update(canonical_json(environment).encode())
    for line in model_structure(model):
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest(), describe(model, settings, device)


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return getattr(triton, "__version__", "unknown")


def device_name(device: torch.device) -> str:
    """The accelerator's name (CUDA: name and compute capability) or, on a CPU, the CPU model."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"
    if device.type == "cpu":
        return cpu_model()
    return f"{device.type} on {platform.machine()}"


def cpu_model() -> str:
    """The CPU model name: it decides which vector instructions Inductor's C++ kernels use."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def normalize_compile_settings(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The compile settings with torch's defaults filled in, as plain JSON values.

    Defaults are filled so that `{}` and `{"backend": "inductor", "mode": "default"}` give one key.
    """
    settings = {"backend": "inductor", "mode": "default", "options": {}, "fullgraph": False,
                "dynamic": None, "precision": "no"}
    for name, value in compile_kwargs.items():
        if value is not None or name == "dynamic":
            settings[name] = value
    if settings["mode"] is None:
        settings["mode"] = "default"
    return {name: _stable(value) for name, value in settings.items()}


def model_structure(model: nn.Module) -> Iterator[str]:
    """One line per module (path and class), parameter and buffer (name, shape, dtype)."""
    for name, module in model.named_modules():
        yield f"module {name} {_qualified_name(type(module))}"
    for name, param in model.named_parameters():
        yield f"param {name} {tuple(param.shape)} {param.dtype} grad={param.requires_grad}"
    for name, buffer in model.named_buffers():
        yield f"buffer {name} {tuple(buffer.shape)} {buffer.dtype}"


def describe(model: nn.Module, settings: dict[str, Any], device: torch.device) -> str:
    """A short human line for `kiln cache ls`: what model, how compiled, where."""
    params = sum(p.numel() for p in model.parameters())
    text = (f"{type(model).__name__} ({_human_count(params)} params), backend={settings['backend']}, "
            f"mode={settings['mode']}")
    for name in ("fullgraph", "dynamic"):
        if settings[name]:
            text += f", {name}={settings[name]}"
    if settings["precision"] != "no":
        text += f", precision={settings['precision']}"
    return f"{text}, {device.type}"


def _human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _stable(value: Any) -> Any:
    """A JSON value that is the same in every process: no ids, no memory addresses."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(str(_stable(v)) for v in value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return _qualified_name(value)  # a backend function or class, by name
    if callable(value):
        return _qualified_name(type(value))  # a backend object: by its class
    return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{_qualified_name(type(value))}:{value!r}")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
