"""`kiln env`: the versions, hardware and settings to paste into a bug report.

Depends on torch and the standard library (other packages are reported only when installed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from typing import Any

import kiln

from kiln.cli.settings import DEFAULT_CONFIG


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("env", help="print versions and hardware for a bug report")
    parser.set_defaults(run=run)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> dict[str, str]:
    import torch

    facts = {
        "kiln": f"{kiln.__version__} (distribution kiln-torch {_version('kiln-torch')})",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda available": str(torch.cuda.is_available()),
        "cpu cores": str(os.cpu_count()),
    }
    if torch.cuda.is_available():
        facts["gpus"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        facts["cuda"] = str(torch.version.cuda)
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        facts["memory"] = f"{pages * size / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    for package in ("transformers", "safetensors", "triton", "deepspeed", "accelerate", "numpy"):
        facts[package] = _version(package)
    facts["config file"] = str(DEFAULT_CONFIG) + ("" if DEFAULT_CONFIG.is_file() else " (none)")
    for name in sorted(os.environ):
        if name.startswith(("KILN_", "TORCHINDUCTOR_", "TORCH_LOGS")):
            facts[name] = os.environ[name]
    return facts


def run(args: argparse.Namespace) -> int:
    facts = report()
    width = max(len(k) for k in facts)
    print("Copy this into your bug report:\n")
    for key, value in facts.items():
        print(f"- {key.ljust(width)}  {value}")
    return 0
