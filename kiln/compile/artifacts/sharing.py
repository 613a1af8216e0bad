"""Compiling once per job across machines: one machine compiles a precompiled region's new signature and
its artifact reaches the other machines over the job's own processes, written into each machine's folder.

Depends on torch.distributed, kiln.compile.artifacts.bundle and cache, and kiln.compile.messages only;
never on precompiled.py (which calls this), the facade or a strategy.

Why only precompiled regions: their forward and backward compile together, ahead of time, at the region's
first call with a signature, where every process of an SPMD job arrives with the same signature; one
machine can compile and send before any process needs the code. The JIT path compiles the backward inside
the backward pass, among DDP's gradient collectives: a process waiting there for another machine's
artifact would hold up the collective that machine waits on, a deadlock.

One exchange per new signature, on a gloo group of its own (its time-out is KILN_COMPILE_SHARE_TIMEOUT):
every process says which signature it meets and whether its folder holds the artifact (the first exchange
also says what machine it is, bundle.machine_key); then, per group of machines with the same key, one
machine (one that has the artifact, else one picked by the signature's hash, so machines split the work)
loads or compiles it, its local main process sends the artifact and the CPU kernels it loaded, and each
other machine's local main process installs them into its own folders; the other local processes wait
at a barrier and then load from the folder as they do today.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from kiln.compile.artifacts import bundle
from kiln.compile.artifacts.bundle import install_packed, loaded_kernel_folders, pack_bundle
from kiln.compile.artifacts.cache import CompileCache, KilnCacheWarning
from kiln.compile.messages import first_line

TIMEOUT_ENV = "KILN_COMPILE_SHARE_TIMEOUT"
# A receiving machine waits through the sending machine's whole compile of the signature: Inductor
# compiles of one large block's forward and backward take minutes on a CPU, so the default is generous.
DEFAULT_TIMEOUT_S = 1800.0


class CompileShareError(RuntimeError):
    """Another machine did not send or receive a compiled artifact in time (it died or stalled)."""


@dataclass
class Shared:
    """What one exchange decided for this process.

    `here`: this machine loaded or compiled the signature itself (the caller's `compile_here` ran and
    `result` is what it gave). `source`: the machine it came from otherwise.
    `payload_missing`: the source machine had no artifact to send (its ahead-of-time compile failed).
    `mismatch`: the processes met different signatures; sharing stops for the region.
    """

    here: bool = False
    result: Any = None
    source: int | None = None
    payload_missing: bool = False
    installed: int = 0
    mismatch: str | None = None
    seconds: float = 0.0


def machines_in_job() -> tuple[int, int] | None:
    """(this machine's index, local rank) when the job's processes run on more than one machine, from
    the launcher's variables (torchrun: GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE); None otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_world >= world:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    node = int(os.environ["GROUP_RANK"]) if "GROUP_RANK" in os.environ else dist.get_rank() // local_world
    return node, local_rank


def share_timeout_s() -> float:
    """KILN_COMPILE_SHARE_TIMEOUT in seconds; ValueError naming the bad value otherwise."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds; set it to e.g. 1800")
    return seconds


class CompileSharing:
    """The exchanges of one job's precompiled regions between machines (one per process)."""

    def __init__(self, cache: CompileCache, node: int, local_rank: int, timeout_s: float | None = None) -> None:
        self.cache = cache
        self.node = node
        self.local_rank = local_rank
        self.timeout_s = share_timeout_s() if timeout_s is None else timeout_s
        self._group: Any = None
        self._key_groups: list[list[int]] | None = None  # machines with the same key, each sorted
        self._local_mains: dict[int, int] = {}  # machine -> the rank of its local main process

    def exchange(self, region: str, digest: str, has_file: bool, device: torch.device,
                 compile_here: Callable[[], tuple[Any, Path | None]]) -> Shared:
        """Collective: every process calls it at the region's first call with a signature.

        `compile_here()` loads or compiles the signature in this process and gives (result, the
        artifact's path or None); it runs on every machine that does not receive the signature (the one
        that sends it, and those that hold it already). When every machine holds it, the exchange is
        one gather of a few hundred bytes.
        """
        start = time.perf_counter()
        first = self._key_groups is None
        mine = {"digest": digest, "has": has_file, "node": self.node, "local_rank": self.local_rank,
                "rank": dist.get_rank(), "key": bundle.machine_key(device) if first else None}
        everyone = self._collective(region, digest, lambda group: _all_gather(mine, group))
        digests = sorted({p["digest"] for p in everyone})
        if len(digests) > 1:
            shown = ", ".join(d[:8] for d in digests)
            text = f"the processes met different input signatures at the same call ({shown})"
            if self.local_rank == 0:
                warnings.warn(f"region {region}: {text}: each machine compiles its own, and this region's artifacts "
                              "are no longer shared between machines (is the batch the same shape on every process?)",
                              KilnCacheWarning, stacklevel=5)
            return Shared(mismatch=text, seconds=time.perf_counter() - start)
        if first:
            self._learn_machines(everyone)
        have = {p["node"] for p in everyone if p["has"]}
        transfers = []  # (source machine, machines receiving), in the same order on every process
        for members in self._key_groups:
            holders = sorted(have & set(members))
            source = holders[0] if holders else members[int(digest[:8], 16) % len(members)]
            receivers = [m for m in members if m != source and m not in have]
            if receivers:
                transfers.append((source, receivers))
        shared = Shared()
        receiving = next((source for source, receivers in transfers if self.node in receivers), None)
        path, kernels_before = None, set()
        if receiving is None:  # this machine has it, or makes it for the others
            kernels_before = self._kernel_folders()
            shared.here = True
            shared.result, path = compile_here()
        for source, receivers in transfers:
            sending = source == self.node and self.local_rank == 0
            payload = self._payload(path, kernels_before, device) if sending else None
            received = self._collective(region, digest,
                                        lambda group: _broadcast(payload, self._local_mains[source], group))
            if self.node in receivers:
                shared.source = source
                shared.payload_missing = received is None
                if received is not None and self.local_rank == 0:
                    result = install_packed(received, f"from machine {source}", self.cache, [], device,
                                            vouched=None)  # the job's own process: no signature needed
                    if result.message is not None:
                        warnings.warn(result.message, KilnCacheWarning, stacklevel=5)
                    shared.installed = result.installed
        if transfers:  # the local main process installed before the others load
            self._collective(region, digest, lambda group: dist.barrier(group=group))
        shared.seconds = time.perf_counter() - start
        return shared

    # ----- pieces --------------------------------------------------------------------------------
    def _learn_machines(self, everyone: list[dict[str, Any]]) -> None:
        """Group machines by key, once: the first exchange is the only one that carries keys."""
        keys = {p["node"]: json.dumps(p["key"], sort_keys=True) for p in everyone if p["local_rank"] == 0}
        self._local_mains = {p["node"]: p["rank"] for p in everyone if p["local_rank"] == 0}
        groups: dict[str, list[int]] = {}
        for node in sorted(keys):
            groups.setdefault(keys[node], []).append(node)
        self._key_groups = list(groups.values())
        mine = json.loads(keys[self.node])
        others = [node for node in sorted(keys) if keys[node] != keys[self.node]]
        if others and self.local_rank == 0:
            there = json.loads(keys[others[0]])
            differences = "; ".join(bundle.machine_differences(there, mine))
            warnings.warn(f"machine {self.node}'s compiled code cannot run on machine {others[0]}"
                          + (f" and {len(others) - 1} other(s)" if len(others) > 1 else "")
                          + f" ({differences}): each compiles its own precompiled regions", KilnCacheWarning,
                          stacklevel=6)

    def _kernel_folders(self) -> set[Path]:
        return loaded_kernel_folders(self.cache.inductor_dir_in_use)

    def _payload(self, path: Path | None, kernels_before: set[Path], device: torch.device) -> bytes | None:
        """The artifact, the CPU kernels its load or compile brought in and the CPU probe's builds
        (bundle.cpu_probe_builds: without them a receiving machine runs gcc about 8 times before it
        can load the kernels), packed; None without an artifact."""
        if path is None or not path.is_file() or not path.is_relative_to(self.cache.directory):
            return None
        files = bundle.named_files([path], self.cache.directory, bundle.KILN_PREFIX)
        inductor = self.cache.inductor_dir_in_use
        for folder in self._kernel_folders() - kernels_before:
            files.update(bundle.named_files(bundle.files_under(folder), inductor, bundle.INDUCTOR_PREFIX))
        files.update(bundle.named_files(bundle.cpu_probe_builds(inductor), inductor, bundle.INDUCTOR_PREFIX))
        return pack_bundle(files, [], device)

    def _collective(self, region: str, digest: str, step: Callable[[Any], Any]) -> Any:
        """One step of an exchange on the sharing group; a machine that died or stalled past the
        time-out is a CompileShareError naming it, never a hang."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        start = time.perf_counter()
        try:
            return step(self._group)
        except RuntimeError as exc:  # gloo's errors (DistBackendError) are RuntimeErrors
            raise CompileShareError(
                f"machine {self.node}: sharing region {region}'s compiled artifact (signature {digest[:8]}) "
                f"with the other machines failed after {time.perf_counter() - start:.1f} s: another machine left "
                f"the job or did not arrive within {TIMEOUT_ENV}={self.timeout_s:g} s (raise it when one "
                f"machine's compile takes longer). torch said: {first_line(str(exc)) or type(exc).__name__}"
            ) from exc


def _all_gather(mine: dict[str, Any], group: Any) -> list[dict[str, Any]]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def _broadcast(payload: bytes | None, source_rank: int, group: Any) -> bytes | None:
    box = [payload]
    dist.broadcast_object_list(box, src=source_rank, group=group)
    return box[0]


def share_across_machines(cache: CompileCache | None) -> CompileSharing | None:
    """The job's sharing between machines, or None on one machine (local processes share the folder)."""
    where = machines_in_job()
    if cache is None or where is None:
        return None
    return CompileSharing(cache, *where)
