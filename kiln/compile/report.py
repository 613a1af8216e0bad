"""What the compiler did, per region: instances sharing the code, graphs, graph breaks, recompiles
and their reasons, compile seconds, cache hits, and calls that ran compiled or eagerly.

Depends on kiln.compile.regions and kiln.compile.monitor only. A dict for loggers, a table for people.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from kiln.compile.monitor import MONITOR
from kiln.compile.regions import compiled_regions


@dataclass
class RegionReport:
    name: str
    kind: str
    instances: int
    graphs: int
    graph_breaks: dict[str, int]
    recompiles: int
    recompile_reasons: list[str]
    compile_seconds: float
    cache_hits: int
    cache_misses: int
    invocations: int
    compiled_calls: int
    eager_calls: int
    recompile_limit_hit: bool

    @property
    def silent(self) -> bool:
        """Meant to run compiled, yet no compiled code ran."""
        return self.compiled_calls == 0


@dataclass
class CompileReport:
    regions: list[RegionReport]
    artifact_cache: dict[str, int] = field(default_factory=dict)  # Kiln's warm-start cache, if any

    @property
    def graphs(self) -> int:
        return sum(r.graphs for r in self.regions)

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.regions)

    @property
    def silent_regions(self) -> list[str]:
        """Regions whose compiled code never ran: compiled in name only."""
        return [r.name for r in self.regions if r.silent]

    def as_dict(self) -> dict:
        return {
            "graphs": self.graphs,
            "compile_seconds": round(self.compile_seconds, 3),
            "silent_regions": self.silent_regions,
            "artifact_cache": dict(self.artifact_cache),
            "regions": [asdict(r) for r in self.regions],
        }

    def table(self) -> str:
        header = ("region", "instances", "graphs", "breaks", "recompiles", "compile s",
                  "cache hit/miss", "calls compiled/eager")
        rows = [header] + [
            (r.name + ("" if r.kind == "block" else f" ({r.kind})"), str(r.instances), str(r.graphs),
             str(sum(r.graph_breaks.values())), str(r.recompiles), f"{r.compile_seconds:.1f}",
             f"{r.cache_hits}/{r.cache_misses}", f"{r.compiled_calls}/{r.eager_calls}")
            for r in self.regions
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for r in self.regions:
            for reason, count in r.graph_breaks.items():
                lines.append(f"{r.name}: graph break x{count}: {_first_line(reason)}")
            for reason in dict.fromkeys(r.recompile_reasons):
                lines.append(f"{r.name}: recompiled: {_first_line(reason)}")
            if r.recompile_limit_hit:
                lines.append(f"{r.name}: hit Dynamo's recompile limit; {r.eager_calls} call(s) ran eagerly")
            elif r.silent:
                lines.append(f"{r.name}: WARNING: no compiled code ran ({r.invocations} call(s))")
        if self.artifact_cache:
            lines.append("warm-start cache: " + ", ".join(f"{k} {v}" for k, v in self.artifact_cache.items()))
        return "\n".join(lines)


def compile_report(*models: nn.Module, artifact_cache: dict[str, int] | None = None) -> CompileReport:
    """The report for every region Kiln compiled in `models`."""
    MONITOR.collect()
    regions = []
    for model in models:
        for region in compiled_regions(model):
            regions.append(RegionReport(
                name=region.name,
                kind=region.kind,
                instances=region.instances,
                graphs=region.graphs,
                graph_breaks=dict(region.graph_breaks),
                recompiles=len(region.recompile_reasons),
                recompile_reasons=list(region.recompile_reasons),
                compile_seconds=round(region.compile_seconds, 3),
                cache_hits=region.cache_hits,
                cache_misses=region.cache_misses,
                invocations=region.invocations,
                compiled_calls=region.calls,
                eager_calls=region.eager_calls,
                recompile_limit_hit=region.recompile_limit_hit,
            ))
    return CompileReport(regions, dict(artifact_cache or {}))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
