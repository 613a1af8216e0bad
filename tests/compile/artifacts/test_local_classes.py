"""Blocks that hold objects whose class is defined in local scope (kiln/compile/artifacts/local_classes.py):
precompiled, then loaded by a later run with no Dynamo trace and eager's numbers; and where an
ahead-of-time compile still fails, a warning that names the object, its place in the block and the
way out.

transformers 5.25 with `kernels` is the case met in the field: each `LlamaAttention` holds a `Func`
module made by `kernels._internals.layer.layer._create_func_module`.
"""

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.compile.artifacts.cache import KilnCacheWarning
from kiln.compile.regions import compile_regions
from kiln.compile.report import compile_report
from torch_features import PRECOMPILE_BACKEND

ROOT = Path(__file__).resolve().parents[3]


def _made_in_a_function(seed: int):
    """A gate module, a config object, an autograd function and a helper that calls it, each of a
    class (or a function) defined here, anew at each call, as kernels does for every decorated
    function."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16))

        def forward(self, x):
            return Twice.apply(x) * self.weight

    class Settings:
        factor = 1.5

    slope = 0.1

    def squash(x):
        return torch.tanh(x) + slope * x

    torch.manual_seed(seed)
    return Gate(), Settings(), Twice, squash


class Block(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.gate, self.settings, _, self.squash = _made_in_a_function(seed)
        self.kernels = {"gate": self.gate}  # outside _modules, reached through a dict, as kernels' Func

    def forward(self, x):
        return x + self.squash(self.kernels["gate"](self.proj(x)) * self.settings.factor)


class BlockHoldingAFunctionClass(Block):
    """Holds the autograd function's class itself: torch 2.13 pickles a block's callable attributes
    by name when it saves the guards, and cannot name this one (nor a function of the block's whose
    closure holds it)."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.twice = _made_in_a_function(seed)[2]

    def forward(self, x):
        return x + self.twice.apply(self.gate(self.proj(x))) * self.settings.factor


class Stack(nn.Module):
    def __init__(self, seed: int, layers: int = 3, block=Block):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(block(seed + i) for i in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _run(model, x):
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _region(model):
    (region,) = compile_report(model).regions
    return region


def test_a_block_holding_classes_made_in_a_function_is_precompiled_and_loaded_by_a_later_run(tmp_path):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    first = Stack(seed=0)
    compile_regions(first, backend=PRECOMPILE_BACKEND, fullgraph=True, precompile=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCacheWarning)
        _run(first, x)
    # Two signatures: the first block's input needs no gradient, the others' do.
    assert (_region(first).ran, _region(first).precompiled_saved) == ("precompiled", 2)

    # A later run: nothing compiled in memory, and every class above made anew (other class objects).
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    later = Stack(seed=7)
    reference = copy.deepcopy(later)
    compile_regions(later, backend=PRECOMPILE_BACKEND, fullgraph=True, precompile=tmp_path)
    loss, grads = _run(later, x)
    expected_loss, expected_grads = _run(reference, x)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6)
    region = _region(later)
    assert (region.traces, region.jit_calls, region.precompiled_loaded, region.precompiled_calls) == (0, 0, 2, 3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


LLAMA_RUN = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from toy_models import tiny_llama
from kiln.compile.regions import compile_regions, uncompile
from kiln.compile.report import compile_report
torch.manual_seed(0)
model = tiny_llama({layers}).train()
attention = model.model.layers[0].self_attn
funcs = [type(f).__qualname__ for f in vars(attention).get("_kernel_funcs", {{}}).values()]
compile_regions(model, backend={backend!r}, fullgraph=True, precompile=sys.argv[1])
ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
loss = model(input_ids=ids, labels=ids, use_cache=False).loss
loss.backward()
region = compile_report(model).regions[0]
uncompile(model)
model.zero_grad()
eager = model(input_ids=ids, labels=ids, use_cache=False).loss
print(json.dumps(dict(loss=loss.item(), eager=eager.item(), funcs=funcs, saved=region.precompiled_saved,
                      loaded=region.precompiled_loaded, traces=region.traces, ran=region.ran,
                      notes=region.precompile_notes)))
"""


@pytest.mark.parametrize("backend", [
    PRECOMPILE_BACKEND,
    # torch 2.13 refuses Inductor's save at another step (a type guard) than aot_eager's (the graph's
    # module stacks): both are kept out of what is saved. make test-latest runs this one (26 s).
    pytest.param("inductor", marks=[pytest.mark.inductor, pytest.mark.latest]),
] if PRECOMPILE_BACKEND != "inductor" else ["inductor"])
def test_transformers_llama_with_kernels_is_precompiled_and_a_fresh_process_loads_it(tmp_path, backend):
    pytest.importorskip("kernels")
    script = tmp_path / "run.py"
    # Two layers under Inductor (the fewest that make them repeated blocks: cold compiles are this
    # test's cost), three otherwise.
    script.write_text(LLAMA_RUN.format(tests=str(ROOT / "tests"), backend=backend, layers=2 if backend == "inductor" else 3))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    folder = str(tmp_path / "artifacts")
    runs = []
    for _ in range(2):  # a cold run, then a fresh process over its folder
        done = subprocess.run([sys.executable, "-W", "error::kiln.compile.artifacts.cache.KilnCacheWarning",
                               str(script), folder], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["funcs"], "transformers did not give LlamaAttention a kernelized function"
    assert all("<locals>" in name for name in cold["funcs"])
    assert (cold["saved"], cold["ran"]) == (1, "precompiled"), cold["notes"]
    assert (warm["saved"], warm["loaded"], warm["traces"], warm["ran"]) == (0, 1, 0, "precompiled"), warm["notes"]
    assert warm["loss"] == pytest.approx(warm["eager"], abs=1e-6)
    assert warm["loss"] == cold["loss"]


def test_a_block_torch_cannot_save_is_jit_compiled_with_a_warning_naming_the_object_and_the_way_out(tmp_path):
    model = Stack(seed=0, block=BlockHoldingAFunctionClass)
    reference = copy.deepcopy(model)
    compile_regions(model, backend=PRECOMPILE_BACKEND, fullgraph=True, precompile=tmp_path)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = _run(model, x)
    torch.testing.assert_close(loss, _run(reference, x)[0], rtol=1e-6, atol=1e-6)
    warned = [str(w.message) for w in caught if issubclass(w.category, KilnCacheWarning)]
    region = _region(model)
    if region.precompiled_saved:  # a torch that can save it: nothing to explain
        assert warned == [] and region.ran == "precompiled"
        return
    (text,) = warned
    assert "ahead-of-time compile failed" in text
    assert "_made_in_a_function.<locals>.Twice at block.twice" in text
    assert "define Twice at the top level of a module (it is made inside _made_in_a_function)" in text
    assert "precompile=False" in text
    assert region.ran == "jit" and any("block.twice" in note for note in region.precompile_notes)


def test_an_error_that_names_nothing_in_the_block_says_so_and_still_gives_the_way_out():
    from kiln.compile.artifacts.local_classes import explain_failure

    # torch 2.11 with aot_eager: the backend's output cannot be saved, whatever the block holds.
    text = explain_failure(AssertionError("expected OutputCode, got <class 'function'>"), Block(seed=0))
    assert text.startswith("the error names nothing Kiln finds in the block") and "precompile=False" in text
