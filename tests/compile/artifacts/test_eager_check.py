"""The helper's check of an outer graph against eager (kiln/compile/artifacts/eager_check.py), on
plain functions standing in for the compiled graph: what passes, what is refused, and what cannot
be compared."""

import math

import pytest
import torch
from torch import nn

from kiln.compile.artifacts.eager_check import OuterGraphDiffers, check_against_eager, checkable_weights


def _mlp(depth: int = 6, width: int = 32, dropout: float = 0.0) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers)


def _eager(module, x):
    return module(x)


def _scaled_gradients(module, x):
    """The same outputs, every gradient 1.5 times eager's (the kind of bug the check is for)."""
    return _GradientScale.apply(module(x))


class _GradientScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


def test_the_same_computation_passes_and_says_how_close_it_was():
    module = _mlp()
    checkable_weights(module)
    x = torch.randn(4, 32)
    line = check_against_eager(_eager, _eager, module, (x,), {}, grad=True, low_precision=False)
    assert line.startswith("checked against eager: worst relative difference 0.0e+00")
    assert all(p.grad is None for p in module.parameters())  # the check leaves no gradient behind


def test_wrong_gradients_with_right_outputs_are_refused_naming_the_tensor():
    module = _mlp()
    checkable_weights(module)
    with pytest.raises(OuterGraphDiffers, match=r"gradient of \S+ differs from eager's by 0\.5 relative"):
        check_against_eager(_scaled_gradients, _eager, module, (torch.randn(4, 32),), {}, grad=True,
                            low_precision=True)


def test_rounding_within_the_tolerance_passes():
    module = _mlp()
    checkable_weights(module)

    def rounded(m, x):  # bf16 rounding of the output: about 4e-3 relative
        return m(x).bfloat16().float()

    line = check_against_eager(rounded, _eager, module, (torch.randn(4, 32),), {}, grad=True, low_precision=False)
    assert line.startswith("checked against eager")


def test_without_gradients_only_outputs_are_compared():
    module = _mlp()
    checkable_weights(module)
    line = check_against_eager(_scaled_gradients, _eager, module, (torch.randn(4, 32),), {}, grad=False,
                               low_precision=False)
    assert line.endswith("(output 0; 1 tensors)")


def test_a_model_that_draws_random_numbers_is_not_checked_rather_than_refused():
    module = _mlp(dropout=0.1).train()
    checkable_weights(module)
    line = check_against_eager(_scaled_gradients, _eager, module, (torch.randn(4, 32),), {}, grad=True,
                               low_precision=False)
    assert line.startswith("not checked against eager: the model draws random numbers")


def test_an_eager_run_that_overflows_is_not_checked():
    module = _mlp()
    checkable_weights(module)
    line = check_against_eager(_eager, _eager, module, (torch.full((4, 32), math.inf),), {}, grad=True,
                               low_precision=False)
    assert line.startswith("not checked against eager: eager's own outputs or gradients are not finite")


def test_the_helpers_weights_keep_a_deep_stack_at_a_trained_layers_scale():
    # normal(0, 1) weights, as the helper gave them before, grow a 24-layer linear stack's output by
    # sqrt(width) a layer; scaled by fan-in the scale stays near the input's.
    module = nn.Sequential(*[nn.Linear(64, 64) for _ in range(24)])
    checkable_weights(module)
    out = module(torch.randn(8, 64))
    assert torch.isfinite(out).all() and 0.1 < out.std().item() < 100
    assert all(torch.allclose(layer.bias.mean(), torch.tensor(1.0), atol=0.1) for layer in module)
