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


def choose(model: nn.Module, kwargs: dict[str, Any], *, precompiled: bool, cudagraphs: bool) -> tuple[bool | str, str]:
    """`outer_graph="auto"`, the default: "background" (tier_up.py) where Kiln has measured that it
    works and pays, else False and why (for the compile report). Per-block regions start as fast,
    and the outer graph takes over once a helper has compiled it and checked it against eager
    (eager_check.py); what it needs:"""
    import torch.distributed as dist

    backend = kwargs.get("backend", "inductor")
    if not supported():
        return False, f"this torch ({torch.__version__}) has no nested compile regions"
    if precompiled:
        return False, "precompiled regions are compiled per block"
    if backend != "inductor":
        return False, f"backend {backend!r}: the helper hands the outer graph over through Inductor's caches"
    if torch._inductor.config.force_disable_caches:
        return False, "Inductor's caches are off (TORCHINDUCTOR_FORCE_DISABLE_CACHES)"
    if kwargs.get("dynamic"):
        return False, "dynamic=True: not yet measured with an outer graph"
    if cudagraphs:
        return False, "CUDA graphs: not yet measured with an outer graph"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return False, "several processes (DDP, FSDP, DeepSpeed): one helper per process is not yet supported"
    if any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        return False, "torchao's float8 layers: their whole-model graph's gradients differ from eager's"
    where = off_device(model)
    if where:
        return False, where
    return "background", ""


def off_device(model: nn.Module) -> str:
    """Why the model's device rules the automatic outer graph out ("" on the CPU or not placed yet):
    on a GPU the helper's copy of the whole model and its compile have not been run yet."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"), None)
    if device is None or device.type == "cpu":
        return ""
    return f"a model on {device.type}: the background outer graph is not yet verified there"


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
