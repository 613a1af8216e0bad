"""A backend wrapper that counts what the compiler did for one region: graphs built, compiled calls run.

Depends on torch, kiln.compile.isa_probe, kiln.compile.outer_graph and kiln.compile.progress only. The counters are how
Kiln proves compiled code ran (DESIGN.md: wrappers and mixed precision can hide it), so every
region Kiln compiles goes through `TrackedBackend`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kiln.compile import isa_probe
from kiln.compile.outer_graph import subgraph_calls
from kiln.compile.progress import PROGRESS


def resolve_backend(backend: str | Callable, mode: str | None, options: dict | None, dynamic: bool | None):
    """Build the compiler callable `torch.compile` would build for these settings.

    torch.compile turns (backend, mode, options) into one callable internally; doing the same
    here lets Kiln wrap it. The two wrapper classes have had this signature since torch 2.0.
    """
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


@dataclass
class GraphRecord:
    """One graph the backend compiled: when, how long the backend took, how big it is, and the
    shared subgraphs it calls (identifier -> call sites: outer_graph.py)."""

    index: int
    seconds: float
    nodes: int
    subgraphs: dict[str, int] = field(default_factory=dict)


class TrackedBackend:
    """Wraps a compiler callable; counts graphs compiled and calls of the compiled code.

    One instance is shared by every instance of a block class, so Dynamo sees one backend
    and reuses one graph for all of them.
    """

    def __init__(self, inner: Callable, name: str) -> None:
        self.inner = inner
        self.name = name
        self.graphs: list[GraphRecord] = []
        self.calls = 0
        # Dynamo reads these off the backend to name it in logs and errors.
        self.compiler_name = f"kiln[{getattr(inner, 'compiler_name', name)}]"

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def backend_seconds(self) -> float:
        return sum(g.seconds for g in self.graphs)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        start = time.perf_counter()
        if isinstance(self.inner, torch._TorchCompileInductorWrapper):
            isa_probe.wait_before_compile()  # Inductor's CPU probe, if Kiln started it (isa_probe.py)
        with PROGRESS.backend_compile(self.name):  # the live compile line (progress.py)
            compiled = self.inner(gm, example_inputs)
        nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method")
        self.graphs.append(GraphRecord(len(self.graphs), time.perf_counter() - start, nodes, subgraph_calls(gm)))

        def run_compiled(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run_compiled

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()
