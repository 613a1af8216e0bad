"""The helper's check of an outer graph against eager, before training switches to it (tier_up.py).

Depends on torch only. The outer graph calls one nested region at many call sites, a path of torch
that has trained with wrong gradients while the loss was right (Inductor's buffer reuse, torch
2.13.0 and 2.14.1: outer_graph.py). So the helper, which has compiled the graph on a copy of the
model with its own weights and inputs, runs that copy eagerly too, forward and backward, and
compares outputs and gradients before the training process is told the signature is ready. A
difference beyond rounding is an error: training keeps its per-block regions, with the reason.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

# Relative error (the difference's norm over eager's) a tensor may show: fp32 Inductor against eager
# is 1e-7 to 1e-6, bf16 autocast about 1e-2 (per-block regions and a full compile alike); the buffer
# reuse bug put the embedding gradient off by 11.5 and 5131 (Llamas of 8 and 2 layers).
TOLERANCE = {"full": 1e-2, "low": 1e-1}
# A tensor whose eager norm is below this share of the largest one is compared on that floor, so
# gradients that are nearly zero (an unused row, a cancelling sum) do not decide the check.
FLOOR = 1e-3


class OuterGraphDiffers(RuntimeError):
    """The compiled outer graph's outputs or gradients are not eager's: it must not be used."""


def checkable_weights(module: nn.Module) -> None:
    """Give a helper's weightless copy values an eager run can be compared on: each weight of two or
    more dimensions normal with std 1/sqrt(fan-in), as a trained layer's scale is, so activations
    neither overflow nor vanish through the layers; each vector (norm weights, biases) one plus
    small noise; integer buffers zero. Values do not change the compiled code (static shapes)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.dtype.is_floating_point:
                tensor.zero_()
            elif tensor.dim() >= 2:
                tensor.normal_(0.0, 1.0 / math.sqrt(max(1, tensor[0].numel())))
            else:
                tensor.normal_(1.0, 0.1)


def check_against_eager(compiled: Callable, eager: Callable, module: nn.Module, args: tuple,
                        kwargs: dict[str, Any], grad: bool, low_precision: bool) -> str:
    """Run `compiled` and `eager` on the same module and inputs with the same random seed, forward
    and (with `grad`) backward, and compare outputs and parameter gradients. Returns a line for the
    report; raises OuterGraphDiffers where they differ beyond rounding. A model that draws random
    numbers in this mode (dropout while training: eager's own runs differ with the seed) or whose
    eager run is not finite cannot be compared; the line then says so."""
    tolerance = TOLERANCE["low" if low_precision else "full"]
    reference = _run(eager, module, args, kwargs, grad, seed=0)
    if not all(torch.isfinite(t).all() for t in reference.values()):
        return "not checked against eager: eager's own outputs or gradients are not finite on the helper's weights"
    got = _run(compiled, module, args, kwargs, grad, seed=0)
    name, error = _worst(got, reference)
    if error <= tolerance:
        return f"checked against eager: worst relative difference {error:.1e} ({name}; {len(reference)} tensors)"
    again = _run(eager, module, args, kwargs, grad, seed=1)
    _, spread = _worst(again, reference)
    if spread > tolerance / 10:
        return ("not checked against eager: the model draws random numbers in this mode (dropout?), and "
                "eager's own runs differ")
    raise OuterGraphDiffers(f"the outer graph's {name} differs from eager's by {error:.2g} relative (tolerance "
                            f"{tolerance:g}): a torch compile bug; the per-block regions give eager's numbers")


def _run(call: Callable, module: nn.Module, args: tuple, kwargs: dict[str, Any], grad: bool,
         seed: int) -> dict[str, torch.Tensor]:
    """One forward (and backward of every output that needs a gradient, each seeded with ones):
    the outputs and parameter gradients by name, copied to the CPU in fp32."""
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(seed)
    with torch.set_grad_enabled(grad):
        outputs = output_tensors(call(module, *args, **kwargs))
    found = {f"output {i}": t.detach().float().cpu() for i, t in enumerate(outputs)}
    leaves = [t for t in outputs if t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        found.update({f"gradient of {n}": p.grad.detach().float().cpu()
                      for n, p in module.named_parameters() if p.grad is not None})
    for parameter in module.parameters():
        parameter.grad = None
    return found


def _worst(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The tensor with the largest relative difference, and that difference; a tensor one side
    lacks or shaped otherwise counts as infinitely different."""
    norms = {name: float(t.norm()) for name, t in reference.items()}
    floor = FLOOR * max(norms.values(), default=0.0)
    worst, error = next(iter(reference), ""), 0.0
    for name, expected in reference.items():
        actual = got.get(name)
        if actual is None or actual.shape != expected.shape:
            return name, math.inf
        difference = float((actual - expected).norm())
        scale = max(norms[name], floor)
        relative = 0.0 if not difference else difference / scale if scale else math.inf
        if not math.isfinite(relative) or relative > error:
            worst, error = name, relative if math.isfinite(relative) else math.inf
    if set(got) - set(reference):
        return sorted(set(got) - set(reference))[0], math.inf
    return worst, error


def output_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a call's output (a tensor, or tuples, lists and dicts of them, as model outputs are)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in output_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in output_tensors(v)]
    return []
