"""fp8 training through torchao: which linear layers become torchao's `Float8Linear`, and the swap.

Depends on torch, and on torchao only when called (`pip install torchao`); nothing in Kiln but
kiln.precision calls it.

What fp8 means in Kiln, as in Accelerate's torchao path: the chosen `nn.Linear` layers run their
three matmuls (output, input gradient, weight gradient) in float8 with dynamic tensorwise scales,
their weights stay in the model's dtype (fp32), and everything else (attention, norms,
embeddings, the layers left out) runs under bf16 autocast, as mixed_precision="bf16" would.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
from torch import nn

INSTALL_HINT = "pip install torchao==0.18.0"
# torch._scaled_mm needs float8 tensor cores on NVIDIA GPUs: Ada (8.9) and Hopper (9.0) onwards.
MIN_CUDA_CAPABILITY = (8, 9)
# What torch._scaled_mm asks of both dimensions of a float8 weight (torchao and Accelerate skip the rest).
DIVISOR = 16

LinearFilter = Callable[[nn.Module, str], bool]


def require_torchao() -> None:
    """An ImportError naming the install command when torchao's float8 training is not importable."""
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(f"mixed_precision='fp8' trains through torchao's float8 linear layers, and torchao "
                          f"is not installed: {INSTALL_HINT} (or choose mixed_precision='bf16')")
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # a torchao built for another torch fails here, not at find_spec
        raise ImportError(f"mixed_precision='fp8' needs torchao.float8, whose import failed ({error!r}); "
                          f"install a torchao that matches torch {torch.__version__}: {INSTALL_HINT}") from error


def check_fp8_device(device: torch.device) -> None:
    """A CUDA GPU without float8 matmuls is an error that says so; CPUs run torch._scaled_mm."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"mixed_precision='fp8' needs float8 matmuls, which {name} (compute capability "
                         f"{capability[0]}.{capability[1]}) lacks: they start at "
                         f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}; use mixed_precision='bf16'")


def first_and_last_linear(model: nn.Module) -> tuple[str | None, str | None]:
    """The paths of the model's first and last `nn.Linear` in module order (often the input
    projection and the output head, which fp8 training leaves in higher precision for stability)."""
    paths = [path for path, module in model.named_modules() if isinstance(module, nn.Linear)]
    return (paths[0], paths[-1]) if paths else (None, None)


def default_linear_filter(model: nn.Module) -> LinearFilter:
    """The rule Accelerate's torchao path applies: every linear layer except the model's first and
    last, and except those with an input or output size not divisible by 16."""
    skipped = set(first_and_last_linear(model)) - {None}

    def convert(module: nn.Module, path: str) -> bool:
        return (path not in skipped and module.in_features % DIVISOR == 0
                and module.out_features % DIVISOR == 0)

    return convert


def float8_linear_paths(model: nn.Module) -> list[str]:
    """Paths of the model's torchao `Float8Linear` layers (none when torchao is not installed)."""
    if importlib.util.find_spec("torchao") is None:
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [path for path, module in model.named_modules() if isinstance(module, Float8Linear)]


def convert_to_fp8(model: nn.Module, config: Any = None, module_filter_func: LinearFilter | None = None) -> list[str]:
    """Swap the chosen linear layers of `model`, in place, for torchao's `Float8Linear`, which
    keeps the same parameters (so `state_dict` keys and values are unchanged); returns their paths.

    Only exact `nn.Linear` layers are candidates: subclasses (quantized linears, a `Float8Linear`
    already converted) keep their own forward. `module_filter_func(module, path)`, as in
    Accelerate's AORecipeKwargs, replaces the default rule (`default_linear_filter`).

    >>> convert_to_fp8(model)   # e.g. ['model.layers.0.mlp.up_proj', ...]
    """
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = config if config is not None else Float8LinearConfig(pad_inner_dim=True)
    if getattr(config, "enable_fsdp_float8_all_gather", False):
        raise ValueError("enable_fsdp_float8_all_gather=True (FSDP2's float8 all-gather) is not supported by Kiln: "
                         "with it, FSDP2 training on torchao 0.18 learned far slower than with the plain all-gather "
                         "(tests here); leave it False: FSDP2 then gathers the weights as they are and casts them")
    chosen = module_filter_func if module_filter_func is not None else default_linear_filter(model)
    converted: list[str] = []

    def should_convert(module: nn.Module, path: str) -> bool:
        # The root cannot be swapped in place (torchao returns a new module for it).
        if type(module) is not nn.Linear or not path or not chosen(module, path):
            return False
        converted.append(path)
        return True

    convert_to_float8_training(model, module_filter_fn=should_convert, config=config)
    return converted
