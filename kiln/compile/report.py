"""What the compiler did, per region: instances sharing the code, graphs, graph breaks, recompiles
and their reasons, compile seconds, cache hits, and calls that ran compiled or eagerly.

Depends on kiln.compile.regions and kiln.compile.monitor only. A dict for loggers, a table for people.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from kiln.compile.messages import first_line
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
    traces: int = 0  # Dynamo traces in this process (JIT and ahead of time); 0 on a precompiled start
    jit_calls: int = 0
    precompiled_calls: int = 0
    precompiled_loaded: int = 0  # artifacts loaded from the cache folder
    precompiled_saved: int = 0
    precompile_load_seconds: float = 0.0
    precompile_wait_seconds: float = 0.0  # waiting for another local process's artifact
    precompile_notes: list[str] = field(default_factory=list)  # why signatures were not loaded
    precompile_off: str | None = None  # why the region has no precompiled artifacts
    background_eager_calls: int = 0  # calls run eagerly while compiling in the background
    switch_step: int | None = None  # the optimizer step after which precompiled code took over
    switch_seconds: float | None = None
    chosen_by: str = ""  # what decided the region: block_classes/paths, the model's _repeated_blocks, or search
    block_class: str = ""  # the class whose instances share this region's code
    group: tuple[int, int] = (1, 1)  # (this group, the class's groups): kiln/compile/groups.py
    group_differs: str = ""  # how this group's instances differ from the class's first group
    paths: list[str] = field(default_factory=list)  # the instances, as module paths
    kv_caches: dict[str, str] = field(default_factory=dict)  # KV cache class -> how the calls got it
    shared_blocks: dict[str, int] = field(default_factory=dict)  # outer graph: block class -> instances
    subgraph_calls: dict[str, int] = field(default_factory=dict)  # its last graph: subgraph -> call sites
    # outer_graph="background" (kiln/compile/tier_up.py): per signature, when it switched or why it did not.
    background_outer: list[str] = field(default_factory=list)
    outer_off: str = ""  # outer_graph="auto" chose per-block regions alone: why
    waiting_for_helper: bool = False  # an outer graph the helper is still compiling: not run yet, by design
    stood_down: bool = False  # an outer graph every call was kept off (tier_up.TierUp.stood_down): by design

    @property
    def silent(self) -> bool:
        """Meant to run compiled, yet no compiled code ran."""
        return self.compiled_calls == 0 and not self.waiting_for_helper and not self.stood_down

    @property
    def ran(self) -> str:
        """How the region's calls ran: precompiled, jit, eager, or a mix ("precompiled+jit")."""
        kinds = [name for name, n in (("precompiled", self.precompiled_calls), ("jit", self.jit_calls),
                                      ("eager", self.eager_calls)) if n]
        return "+".join(kinds) or "not called"


@dataclass
class CompileReport:
    regions: list[RegionReport]
    artifact_cache: dict[str, int] = field(default_factory=dict)  # Kiln's warm-start cache, if any
    settings: list[str] = field(default_factory=list)  # compile settings Kiln decided for the user
    # The background compiler's jobs, in start order: region, signature, worker, start and end
    # seconds after its first job, outcome (kiln/compile/artifacts/compile_pool.py).
    timeline: list[dict] = field(default_factory=list)
    compile_wait_seconds: float | None = None  # how long training waited for the helpers (parallel_compile)
    # Why this job's graphs were not compiled side by side, when they were not (kiln/compile/session.py).
    side_by_side: str | None = None

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
            "settings": list(self.settings),
            "timeline": [dict(job) for job in self.timeline],
            "compile_wait_seconds": self.compile_wait_seconds,
            "side_by_side": self.side_by_side,
            "regions": [{**asdict(r), "ran": r.ran} for r in self.regions],
        }

    def table(self) -> str:
        header = ("region", "instances", "graphs", "breaks", "recompiles", "compile s",
                  "cache hit/miss", "calls compiled/eager", "traces", "ran", "load s")
        rows = [header] + [
            (r.name + ("" if r.kind == "block" else f" ({r.kind})"), str(r.instances), str(r.graphs),
             str(sum(r.graph_breaks.values())), str(r.recompiles), f"{r.compile_seconds:.1f}",
             f"{r.cache_hits}/{r.cache_misses}", f"{r.compiled_calls}/{r.eager_calls}", str(r.traces),
             r.ran, f"{r.precompile_load_seconds:.2f}")
            for r in self.regions
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for r in self.regions:
            for reason, count in r.graph_breaks.items():
                lines.append(f"{r.name}: graph break x{count}: {first_line(reason)}")
            for reason in dict.fromkeys(r.recompile_reasons):
                lines.append(f"{r.name}: recompiled: {first_line(reason)}")
            if r.recompile_limit_hit:
                lines.append(f"{r.name}: hit Dynamo's recompile limit; {r.eager_calls} call(s) ran eagerly")
            elif r.silent:
                lines.append(f"{r.name}: WARNING: no compiled code ran ({r.invocations} call(s))")
            if r.background_eager_calls:
                when = (f"switched to compiled code after step {r.switch_step} ({r.switch_seconds:.1f} s "
                        "after its first call)" if r.switch_step is not None else "not switched yet")
                lines.append(f"{r.name}: compiled in the background: {r.background_eager_calls} call(s) "
                             f"ran eagerly meanwhile; {when}")
            for note in r.precompile_notes:
                lines.append(f"{r.name}: precompiled: {note}")
            if r.precompile_off:
                lines.append(f"{r.name}: not precompiled: {r.precompile_off}")
            if r.chosen_by.startswith("the model's"):
                lines.append(f"{r.name}: chosen by {r.chosen_by}")
            if r.group[0] == 1 and r.group[1] > 1:
                lines.append(f"{r.block_class}: {r.group[1]} groups of instances whose graphs differ "
                             "(parameter shapes, submodules, flags), one compiled entry each")
            elif r.group_differs:
                lines.append(f"{r.name}: {r.instances} instance(s) ({', '.join(r.paths[:2])}"
                             f"{', ...' if r.instances > 2 else ''}); unlike #1: {r.group_differs}")
            for kind, note in r.kv_caches.items():
                lines.append(f"{r.name}: KV cache {kind}: {note}")
            if r.shared_blocks:
                sites = ", ".join(f"{n} call site(s)" for n in r.subgraph_calls.values()) or "not compiled yet"
                lines.append(f"{r.name}: one graph; blocks as shared subgraphs: "
                             + ", ".join(f"{name} x{n}" for name, n in r.shared_blocks.items())
                             + f"; {len(r.subgraph_calls)} subgraph(s) in its last graph ({sites})")
            if r.waiting_for_helper and not r.compiled_calls:
                lines.append(f"{r.name}: the outer graph is being compiled in the background; the per-block "
                             "regions run meanwhile")
            for note in r.background_outer:
                lines.append(f"{r.name}: {note}")
            if r.outer_off:
                lines.append(f"{r.name}: no outer graph (outer_graph='auto'): {r.outer_off}")
        for note in self.settings:
            lines.append(f"setting: {note}")
        if self.timeline:
            workers = len({job["worker"] for job in self.timeline})
            end = max(job["end"] for job in self.timeline)
            waited = (f"; training waited {self.compile_wait_seconds:.1f} s for it"
                      if self.compile_wait_seconds is not None else "")
            lines.append(f"compile timeline: {len(self.timeline)} job(s) on {workers} helper process(es), "
                         f"{end:.1f} s from the first{waited}")
            for job in self.timeline:
                lines.append(f"  worker {job['worker']}: {job['start']:6.1f} -> {job['end']:6.1f} s  "
                             f"{job['region']} {job['signature']}  {job['outcome']}")
        if self.side_by_side:
            lines.append(f"side by side: {self.side_by_side}")
        if self.artifact_cache:
            lines.append("warm-start cache: " + ", ".join(f"{k} {v}" for k, v in self.artifact_cache.items()))
        return "\n".join(lines)


def compile_report(*models: nn.Module, artifact_cache: dict[str, int] | None = None,
                   settings: list[str] | None = None, timeline: list[dict] | None = None,
                   compile_wait_seconds: float | None = None) -> CompileReport:
    """The report for every region Kiln compiled in `models`; `settings`: notes on compile
    settings decided for the user (an implied fullgraph); `timeline`: the background compiler's jobs."""
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
                compile_seconds=round(region.compile_seconds + _ahead_seconds(region), 3),
                cache_hits=region.cache_hits,
                cache_misses=region.cache_misses,
                invocations=region.invocations,
                compiled_calls=region.calls,
                eager_calls=region.eager_calls,
                recompile_limit_hit=region.recompile_limit_hit,
                chosen_by=region.chosen_by,
                block_class=region.block_class.__qualname__,
                group=region.group,
                group_differs=region.group_differs,
                paths=list(region.paths),
                kv_caches=dict(region.cache_notes),
                shared_blocks=dict(region.shared_blocks),
                subgraph_calls=dict(region.backend.graphs[-1].subgraphs) if region.backend.graphs else {},
                background_outer=list(region.tier_up.notes) if region.tier_up is not None else [],
                outer_off=region.outer_off,
                waiting_for_helper=region.tier_up is not None and region.tier_up.waiting,
                stood_down=region.tier_up is not None and region.tier_up.stood_down,
                **_precompile_fields(region),
            ))
    return CompileReport(regions, dict(artifact_cache or {}), list(settings or ()), list(timeline or ()),
                         compile_wait_seconds)


def _ahead_seconds(region) -> float:
    return region.precompiled.stats.compile_seconds if region.precompiled is not None else 0.0


def _precompile_fields(region) -> dict:
    stats = region.precompiled.stats if region.precompiled is not None else None
    fields = {"traces": region.traces, "jit_calls": region.jit_calls, "precompiled_calls": region.precompiled_calls,
              "precompile_off": region.precompile_off}
    if stats is not None:
        fields.update(precompiled_loaded=stats.loaded, precompiled_saved=stats.saved,
                      precompile_load_seconds=round(stats.load_seconds, 3),
                      precompile_wait_seconds=round(stats.wait_seconds, 3), precompile_notes=list(stats.notes),
                      background_eager_calls=stats.background_eager_calls, switch_step=stats.switch_step,
                      switch_seconds=stats.switch_seconds)
    return fields

