"""What the compiler did, per region: instances sharing the code, graphs built, compiled calls run.

Depends on kiln.compile.regions only. Returned as a dict (for loggers) or a readable table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from kiln.compile.regions import compiled_regions


@dataclass
class RegionReport:
    name: str
    kind: str
    instances: int
    graphs: int
    compiled_calls: int
    backend_seconds: float


@dataclass
class CompileReport:
    regions: list[RegionReport]

    @property
    def graphs(self) -> int:
        return sum(r.graphs for r in self.regions)

    @property
    def silent_regions(self) -> list[str]:
        """Regions whose compiled code never ran: compiled in name only."""
        return [r.name for r in self.regions if r.compiled_calls == 0]

    def as_dict(self) -> dict:
        return {"graphs": self.graphs, "regions": [asdict(r) for r in self.regions]}

    def table(self) -> str:
        header = ("region", "kind", "instances", "graphs", "compiled calls", "backend s")
        rows = [header] + [
            (r.name, r.kind, str(r.instances), str(r.graphs), str(r.compiled_calls), f"{r.backend_seconds:.1f}")
            for r in self.regions
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def compile_report(*models: nn.Module) -> CompileReport:
    """The report for every region Kiln compiled in `models`."""
    regions = []
    for model in models:
        for region in compiled_regions(model):
            regions.append(RegionReport(region.name, region.kind, region.instances, region.graphs,
                                        region.calls, round(region.backend.backend_seconds, 3)))
    return CompileReport(regions)
