"""A compile backend with a planted bug, for tests of the helper's eager check (eager_check.py):
aot_eager, except that a graph calling a nested region (an outer graph) gets its gradients scaled
by 1.5, as torch's buffer reuse bug once made them wrong while the outputs stayed right. Graphs
without one (per-block regions) are compiled correctly. Importable by the helper process too (the
tests' folders are on its path)."""

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def _calls_nested_region(graph_module: torch.fx.GraphModule) -> bool:
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    return any(node.target is invoke for node in graph_module.graph.nodes)


def _scaled(graph_module, example_inputs):
    def run(*args):
        return [out * 1.5 if isinstance(out, torch.Tensor) else out for out in graph_module(*args)]

    return make_boxed_func(run)


def _as_is(graph_module, example_inputs):
    return make_boxed_func(graph_module)


def wrong_outer_gradients(graph_module: torch.fx.GraphModule, example_inputs):
    backward = _scaled if _calls_nested_region(graph_module) else _as_is
    return aot_autograd(fw_compiler=_as_is, bw_compiler=backward)(graph_module, example_inputs)
