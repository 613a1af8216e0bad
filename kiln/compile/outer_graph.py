"""Regional compile with the model around its blocks compiled too: one graph for the whole model, in
which every call of a block class runs that class's one shared subgraph
(`torch.compiler.nested_compile_region`, torch >= 2.8).

Depends on torch only. Per-block regions (regions.py) pay, at every block call, a Dynamo entry,
a guard check and a runtime wrapper, and run the model's own Python between the blocks (embedding,
rotary tables, mask creation, final norm, head, loss) eagerly: where the host bounds a step, that
is what keeps them from a full compile's speed (issue 34; docs/compiling.md). Here the whole
model is one graph, so there is one entry a step and the glue runs compiled; the block is traced
and lowered once and called as a subgraph at each of its call sites, so compiling costs a block
plus the glue, not the whole unrolled model. Measured (torch 2.13, CPU, Inductor, one thread, a
Llama of 8 thin layers, batch 1x16, DESIGN.md): steady steps 1.03x (inference) and 1.07x
(training) a full compile's, against 1.6-1.7x for per-block regions; cold compile 9.4 s and
16.7 s, against 5.5 s and 7.8 s per block and 14.2 s and 23.3 s for a full compile.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn


def compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The outer graph's compile settings: the user's, with Inductor's buffer reuse off.

    torch 2.13.0 and 2.14.1 (not 2.11; 2.12 not tried), Inductor, CPU: a graph that calls one
    nested region at several call sites trains with wrong gradients while buffer reuse is on (a
    2-layer Llama's embedding gradient off eager's by 5131; the loss right). Plain torch.compile
    with `nested_compile_region` does the same, Kiln or not; `allow_buffer_reuse=False` gives eager's
    gradients (within 1e-7). Intermediates are still freed when dead; only reusing a dead buffer's
    memory for a new one inside the graph is off. Asking for buffer reuse here is refused.
    """
    if kwargs.get("backend", "inductor") != "inductor":
        return kwargs
    options = dict(kwargs.get("options") or {})
    if options.get("allow_buffer_reuse", False):
        raise ValueError("options={'allow_buffer_reuse': True} with an outer graph: on torch 2.13 and 2.14 "
                         "Inductor's buffer reuse gives wrong gradients to a graph that calls one nested region "
                         "several times (kiln/compile/outer_graph.py); leave it unset")
    options["allow_buffer_reuse"] = False
    return {**kwargs, "options": options}


def supported() -> bool:
    """Whether this torch has nested compile regions (torch.compiler.nested_compile_region)."""
    return callable(getattr(torch.compiler, "nested_compile_region", None))


def share_block_code(forward: Callable, instances: list[nn.Module], outside: Callable | None = None) -> Callable:
    """Make every instance's forward run `forward` (the class's, or the one function Kiln's
    activation checkpointing gave them all) as one nested compile region, in place; returns the
    instance forward, which `uncompile` recognises. Outside a compiled graph it runs `outside`
    (the block's own compiled region, while the outer graph is compiled in the background:
    tier_up.py), or `forward` itself when none is given."""
    shared = torch.compiler.nested_compile_region(forward)

    if outside is None:
        def block_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return shared(module, *args, **kwargs)
    else:
        # Dynamo reads is_compiling() as True while it traces the outer graph, so the graph holds
        # the shared subgraph and nothing of the eager branch.
        def block_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return shared(module, *args, **kwargs)
            return outside(module, *args, **kwargs)

    block_forward._kiln_shared_block = forward  # what uncompile puts back
    for module in instances:
        # A bound method, not a closure over the module: copy.deepcopy rebinds it to the copy.
        module.forward = types.MethodType(block_forward, module)
    return block_forward


def unshare_block_code(module: nn.Module) -> bool:
    """Undo `share_block_code` on one instance; False if it was not shared."""
    forward = getattr(vars(module).get("forward"), "__func__", None)
    before = getattr(forward, "_kiln_shared_block", None)
    if before is None:
        return False
    if before is getattr(type(module), "forward", None):
        del module.forward
    else:
        module.forward = types.MethodType(before, module)
    return True


def subgraph_calls(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The nested regions one graph calls: subgraph identifier -> its call sites."""
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is getattr(torch.ops.higher_order, "invoke_subgraph", None):
            identifier = str(node.args[1])
            calls[identifier] = calls.get(identifier, 0) + 1
    return calls
