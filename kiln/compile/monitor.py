"""Watches Dynamo on behalf of the compiled regions: compile time, recompile reasons, graph breaks,
cache hits, the recompile limit, and the recompile policy after warm-up.

Depends on torch, kiln.plugins and kiln.compile.messages only; the regions hand themselves in, so this never imports
kiln.compile.regions.
Dynamo's per-frame records (`torch._dynamo.utils.get_compilation_metrics`, a private API present
since torch 2.4) are read where available; without them the report has graph and call counts only.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Protocol

import torch

from kiln.compile.messages import KilnFallbackWarning  # noqa: F401  (re-exported: users filter it from here)
from kiln.plugins import RECOMPILE_POLICIES


class KilnRecompileWarning(UserWarning):
    """A compiled region recompiled after its warm-up steps."""


class KilnRecompileError(RuntimeError):
    """A compiled region recompiled after warm-up while the policy was recompile='error'."""




class Watched(Protocol):
    name: str
    label: str
    warm: bool
    recompile_policy: str
    graph_breaks: Counter
    recompile_reasons: list[str]
    compile_seconds: float
    cache_hits: int
    cache_misses: int
    recompile_limit_hit: bool
    warned: set
    jit_traces: int


def check_recompile_policy(policy: str) -> str:
    if policy not in RECOMPILE_POLICIES:
        raise ValueError(f"unknown recompile policy {policy!r}; choose one of: {', '.join(RECOMPILE_POLICIES)}")
    return policy


class CompileMonitor:
    """One per process: reads Dynamo's records once and gives each region the ones for its frames."""

    def __init__(self) -> None:
        self._by_label: dict[str, Watched] = {}
        self._by_frame: dict[str, Watched] = {}
        self._seen: set[tuple[Any, Any]] = set()
        self._breaks_seen: Counter = Counter()
        self._breaks_counter: Counter | None = None  # Dynamo's own Counter the counts were read from

    def watch(self, region: Watched) -> None:
        self._by_label[region.label] = region

    def collect(self) -> list[tuple[Watched, Any]]:
        """Hand new Dynamo records to their regions; returns (region, record) for forward frames."""
        fresh = []
        for record in _compilation_metrics():
            key = (getattr(record, "compile_id", None), getattr(record, "start_time_us", None))
            if key in self._seen:
                continue
            self._seen.add(key)
            frame = str(getattr(record, "compile_id", "") or "").split("/")[0]
            region = self._by_label.get(getattr(record, "co_name", None) or "")
            if region is not None:
                self._by_frame[frame] = region
            else:
                region = self._by_frame.get(frame) if getattr(record, "is_forward", True) is False else None
            if region is None:
                continue
            region.compile_seconds += (getattr(record, "duration_us", None) or 0) / 1e6
            region.cache_hits += _sum(record, "aotautograd_local_cache_hit_count", "inductor_fx_local_cache_hit_count")
            region.cache_misses += _sum(record, "aotautograd_local_cache_miss_count", "inductor_fx_local_cache_miss_count")
            reason = getattr(record, "recompile_reason", None)
            if reason:
                region.recompile_reasons.append(reason.strip())
            if getattr(record, "co_name", None):
                region.jit_traces += 1
                fresh.append((region, record))
        return fresh

    def take_graph_breaks(self, region: Watched) -> None:
        """Graph breaks counted by Dynamo since the last look belong to the region that just ran."""
        dynamos = torch._dynamo.utils.counters["graph_break"]
        now = Counter(dynamos)
        # Someone cleared Dynamo's counters: `counters.clear()` (torch's test case, a test harness)
        # gives a new Counter, which may since have counted back up to the old numbers; a clear of the
        # Counter itself shows as fewer breaks.
        if dynamos is not self._breaks_counter or any(now[k] < count for k, count in self._breaks_seen.items()):
            self._breaks_seen = Counter()
            self._breaks_counter = dynamos
        new = now - self._breaks_seen
        self._breaks_seen = now
        region.graph_breaks.update(new)

    def after_compile(self, region: Watched, policy: bool = True) -> None:
        """Called by a region's forward when the call built new graphs. `policy=False`: the
        compile was owed from before warm-up (a signature the background helper handed back to
        the JIT path), so it is recorded but is no recompile after warm-up."""
        self.take_graph_breaks(region)
        for owner, record in self.collect():
            reason = getattr(record, "recompile_reason", None)
            if reason and owner.warm and (policy or owner is not region):
                self.apply_policy(owner, reason.strip())

    def after_precompile(self, region: Watched, reason: str, first: bool) -> None:
        """Called when a region compiled a new call signature ahead of time: unless it is the
        region's first code in this process, that is a recompile (Dynamo records none to read)."""
        self.collect()
        if first:
            return
        region.recompile_reasons.append(reason)
        if region.warm:
            self.apply_policy(region, reason)

    def after_eager_call(self, region: Watched) -> None:
        """Called by a region's forward when no compiled code ran during the call."""
        self.take_graph_breaks(region)
        self.collect()
        limit = torch._dynamo.config.recompile_limit
        if len(region.recompile_reasons) + 1 >= limit and not region.recompile_limit_hit:
            region.recompile_limit_hit = True
            last = region.recompile_reasons[-1] if region.recompile_reasons else "unknown"
            warnings.warn(
                f"compiled region {region.name} hit Dynamo's recompile limit ({limit}) and now runs "
                f"eagerly, without compiled code. Last recompile reason: {last}. Keep shapes static "
                "(pad to buckets, drop_last=True) or compile with dynamic=True.",
                KilnFallbackWarning,
                stacklevel=4,
            )

    def apply_policy(self, region: Watched, reason: str) -> None:
        if region.recompile_policy == "allow" or is_mode_switch(reason):
            return
        message = f"compiled region {region.name} recompiled after warm-up: {reason}"
        if region.recompile_policy == "error":
            raise KilnRecompileError(message + " (recompile='error'; use 'warn' or 'allow' to go on)")
        if reason not in region.warned:
            region.warned.add(reason)
            warnings.warn(message, KilnRecompileWarning, stacklevel=5)


def is_mode_switch(reason: str) -> bool:
    """True for a recompile caused only by grad mode or train/eval (a validation pass under no_grad
    after training): one graph per mode, met once, not the shape churn the recompile policy is for.
    Dynamo words these "GLOBAL_STATE changed: grad_mode" and a guard on a module's `training`."""
    failed = [line for line in reason.split("User stack trace:")[0].splitlines() if line.strip()]
    return bool(failed) and all("grad_mode" in line or ".training" in line for line in failed)


def _compilation_metrics() -> list[Any]:
    getter = getattr(torch._dynamo.utils, "get_compilation_metrics", None)
    return list(getter()) if getter is not None else []


def _sum(record: Any, *names: str) -> int:
    return sum(getattr(record, name, None) or 0 for name in names)


MONITOR = CompileMonitor()
