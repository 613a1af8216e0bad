"""One Accelerator's compilation: which models it compiled and how, the warm-start cache, the
warm-up steps after which recompiles meet the policy, and the compile report.

Depends on the rest of kiln.compile and kiln.plugins only; never on the facade or a strategy
(the facade hands in what it knows: device, precision, strategy name, process role).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from kiln.compile import isa_probe
from kiln.compile.artifacts import manifest
from kiln.compile.artifacts.bundle import Vouch, bundle_keys, install_bundle, job_files, vouch_for, write_bundle
from kiln.compile.artifacts.cache import CompileCache, KilnCacheWarning
from kiln.compile.artifacts.sharing import share_across_machines
from kiln.compile.artifacts.trust import KilnTrustWarning, signing_key
from kiln.compile.cores import free_cores
from kiln.compile.monitor import KilnFallbackWarning
from kiln.compile.progress import PROGRESS
from kiln.compile.regions import KilnCompileWarning, compile_full, compile_regions, compiled_regions, mark_warm
from kiln.compile.report import CompileReport, compile_report
from kiln.plugins import TorchDynamoPlugin


class CompileSession:
    """Applies a `TorchDynamoPlugin` to the models of one Accelerator, and follows them."""

    def __init__(self, plugin: TorchDynamoPlugin | None, is_writer: bool, is_local_main: bool = True) -> None:
        self.plugin = plugin if plugin is not None and plugin.enabled else None
        self.cache = None
        if self.plugin is not None:
            # Pointed at before anything compiles: Inductor reads its folder then.
            cache = CompileCache(self.plugin.cache_dir, self.plugin.cache, is_writer=is_writer)
            cache.activate()
            self.cache = cache if cache.enabled else None
            signing_key(None)  # a bad KILN_COMPILE_SIGNING_KEY fails here, in every process, before any waits
        self.is_writer = is_writer  # the job's main process: it signs and vouches for checkpoint bundles
        self.is_local_main = is_local_main
        if self.plugin is not None:
            PROGRESS.is_main = is_local_main  # the live compile line: one per machine, as Accelerate's tqdm
        self.background = None  # the helper that compiles while training (compile_in_background)
        self.sharing = None  # on several machines: precompiled signatures shared (sharing.py)
        self.in_process: str | None = None  # why parallel_compile compiles in this process instead
        self._warned_fill = False  # the helpers fill caches a backend other than Inductor cannot use
        self.models: list[nn.Module] = []  # the user's modules, unwrapped
        self._cache_keys: list[str] = []
        self._loaded_keys: set[str] = set()  # keys whose entry was loaded into torch's caches
        self._device: torch.device | None = None
        self._graphs_saved = 0
        self._steps = 0

    @property
    def enabled(self) -> bool:
        return self.plugin is not None

    def compile(self, model: nn.Module, device: torch.device, context: dict[str, Any],
                blocks: dict[type, list[str]] | None = None) -> None:
        """Compile `model` in place as the plugin says, and fill the caches from an earlier run.
        `context` (precision, strategy) joins the compile settings in the cache key; `blocks`, the
        regions the caller already chose (the Accelerator's plan), else chosen here."""
        self.models.append(model)
        if self.plugin is None:
            return
        self._device = device
        plugin = self.plugin
        kwargs = plugin.to_compile_kwargs()
        precompile = self.cache.precompiled_dir if self.cache is not None and plugin.precompile else None
        if plugin.precompile is True and precompile is None:
            warnings.warn("precompile=True, but the compile cache is off (KILN_COMPILE_CACHE=0 or an "
                          "unusable folder), so nothing is precompiled", KilnCompileWarning, stacklevel=4)
        in_helpers, backend = plugin.compile_in_background, kwargs.get("backend", "inductor")
        key = None
        if self.cache is not None:
            # "auto" starts on the per-block regions that False compiles (its outer graph's entries are
            # Inductor's, found by content): a job saved on the defaults resumes warm with it off.
            settings = {**kwargs, **context, "regional": plugin.use_regional_compilation,
                        **({"outer_graph": plugin.outer_graph} if plugin.outer_graph_asked else {})}
            key = self.cache.key(model, settings, device)
            if self.is_local_main:  # before anything of this job is compiled or loaded, the CPU probe's too
                self._check_recorded_files(key)
        if plugin.use_regional_compilation:
            outer = plugin.outer_graph
            strategy = context.get("strategy", "single")
            if outer == "auto" and strategy != "single":  # its hooks run around each block, or one helper a process
                outer = False
                note = f"outer_graph='auto': per-block regions alone under the {strategy} strategy"
                if note not in plugin.notes:
                    plugin.notes.append(note)
            compile_regions(model, block_classes=plugin.block_classes, block_paths=plugin.block_paths, blocks=blocks,
                            recompile=plugin.recompile, precompile=precompile, in_helpers=in_helpers,
                            outer_graph=outer, **kwargs)
        else:
            compile_full(model, recompile=plugin.recompile, precompile=precompile, in_helpers=in_helpers, **kwargs)
        here = in_helpers and self._compile_here(model)
        if backend == "inductor" and device.type == "cpu" and (here or not in_helpers):
            isa_probe.arm()  # this process compiles or loads from the first call, which starts it (isa_probe.py)
        if in_helpers and not here:
            self._compile_in_background(model)
            self._warn_uncached_fill(model, backend)
        elif plugin.precompile:
            self._share_across_machines(model)
        if plugin.precompile is True:  # "auto" says why in the report only
            for region in compiled_regions(model):
                if region.precompile_off:
                    warnings.warn(f"precompile=True, but region {region.name} cannot be precompiled: "
                                  f"{region.precompile_off}; it is JIT-compiled", KilnCompileWarning, stacklevel=4)
        if key is not None:
            if self.cache.load(key):  # before the first compiled call
                self._loaded_keys.add(key)
            self._cache_keys.append(key)
            PROGRESS.follow(key, [r.name for r in compiled_regions(model)], self.cache.read_record(key))

    def _check_recorded_files(self, key: str) -> None:
        """Move aside the job's Inductor files whose bytes differ from what an earlier run recorded
        (manifest.py): torch would load them as they are."""
        moved = manifest.check(self.cache, key)
        if moved:
            shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
            warnings.warn(f"compile cache: {len(moved)} file(s) of this job's compiled code changed since Kiln recorded "
                          f"them (damaged, or replaced: {shown}); moved aside to "
                          f"{self.cache.quarantine_dir} unloaded, and compiled again",
                          KilnCacheWarning, stacklevel=5)  # the user's prepare()

    def _compile_here(self, model: nn.Module) -> bool:
        """parallel_compile where nothing would compile side by side, while training waits for the
        helpers anyway: the training process compiles the regions itself (precompiled under
        fullgraph=True, JIT otherwise), sparing the helpers' start-up. Two cases, measured on this
        project's CPU with Inductor: a model of one region group (a 6-layer Llama's first two steps
        took 25.4 s through a helper, 12.5 s here), and a lone process with one free core (a
        UNet2DModel under `taskset -c 0`: 153 s against 104 s at batch 2, 150 s against 144 s at
        batch 4). Every local process decides alike:
        the first rests on the model, the second holds only when the machine runs one process."""
        if not self.plugin.parallel_compile or self.background is not None:
            return False
        regions = compiled_regions(model)
        precompiled = all(r.precompiled is not None and r.precompiled.aot_off is None for r in regions)
        how = "ahead of time" if precompiled else "JIT"
        cores, local = free_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if len(regions) == 1:
            why = f"one region group ({regions[0].name}), so parallel_compile has nothing to run at once"
        elif cores < 2 and local == 1:
            why = "one free core (this process's affinity), so parallel_compile's helpers would only take turns with it"
        else:
            return False
        self.in_process = f"{why}: the training process compiles {'it' if len(regions) == 1 else 'them'} ({how}) " \
                          "at the first call, sparing the helpers' start-up"
        for region in regions:
            if region.precompiled is not None and region.precompiled.aot_off is not None:
                region.precompiled = None  # nothing to fill without helpers: the plain JIT path, no per-call signature
        return True

    def _warn_uncached_fill(self, model: nn.Module, backend: Any) -> None:
        """Under fullgraph=False the helpers only fill the compile caches, and only Inductor's output
        is cached there (FX graph and AOTAutograd caches): with another backend the training process
        compiles everything again after them. Said once, not refused: the logic still holds."""
        filled = [r for r in compiled_regions(model) if r.precompiled is not None and r.precompiled.aot_off]
        if not filled or backend == "inductor" or self._warned_fill:
            return
        self._warned_fill = True
        flag = "parallel_compile=True" if self.plugin.parallel_compile else "compile_in_background=True"
        warnings.warn(f"{flag} with fullgraph=False and backend {backend!r}: the helpers JIT-compile each region "
                      "into the compile caches, but only Inductor's output is kept there, so training compiles "
                      "every region again after them and the helpers save no time. Use backend='inductor', "
                      "or fullgraph=True (the helpers then precompile).", KilnCompileWarning, stacklevel=5)

    def _compile_in_background(self, model: nn.Module) -> None:
        """One helper per machine: the local main process starts it, the other local processes
        load what it writes into the shared cache folder."""
        from kiln.compile.artifacts.background import BackgroundCompiler

        if self.is_local_main and self.background is None and self.cache is not None:
            self.background = BackgroundCompiler(self.cache.precompiled_dir, workers=self.plugin.compile_workers,
                                                 blocking=self.plugin.parallel_compile)
            self.background.start()
        for region in compiled_regions(model):
            if region.precompiled is not None:
                if self.is_local_main:
                    region.precompiled.background = self.background
                else:
                    region.precompiled.background_wait = True

    def _share_across_machines(self, model: nn.Module) -> None:
        """On several machines, each precompiled signature is compiled on one and sent to the others
        (kiln/compile/artifacts/sharing.py); one machine's processes share the folder instead."""
        if self.sharing is None:
            self.sharing = share_across_machines(self.cache)
        for region in compiled_regions(model):
            if region.precompiled is not None:
                region.precompiled.sharing = self.sharing

    def close(self) -> None:
        """Stop the background compiler, if one runs, and the live compile line's thread."""
        if self.background is not None:
            self.background.close()
        PROGRESS.close(self._cache_keys)

    def check_dataloader(self, dataloader: DataLoader) -> None:
        """Warn when a short last batch would compile new graphs every epoch."""
        plugin = self.plugin
        if plugin is None or plugin.dynamic is True:
            return
        batch_size = dataloader.batch_size
        try:
            samples = len(dataloader.dataset)
        except TypeError:  # an iterable dataset: its length is unknown
            return
        if batch_size and not dataloader.drop_last and samples % batch_size:
            warnings.warn(
                f"this dataloader's last batch holds {samples % batch_size} samples instead of {batch_size}; "
                f"under a static-shape compile (dynamic={plugin.dynamic}) that batch compiles new graphs "
                "once per epoch. Pass drop_last=True to the DataLoader, or pad the dataset.",
                KilnCompileWarning,
                stacklevel=4,  # the user's prepare() call (check_dataloader <- prepare_data_loader <- prepare)
            )

    def report(self) -> CompileReport:
        stats = self.cache.stats.as_dict() if self.cache is not None else None
        notes = self.plugin.notes if self.plugin is not None else None
        timeline = self.background.timeline() if self.background is not None else None
        wait = self.background.wait_seconds if self.background is not None else None
        report = compile_report(*self.models, artifact_cache=stats, settings=notes, timeline=timeline,
                                compile_wait_seconds=wait)
        if self.plugin is not None:
            report.side_by_side = f"no: {self.in_process}" if self.in_process else side_by_side_note(self.plugin, report)
        return report

    def after_optimizer_step(self) -> None:
        """At the end of warm-up: recompiles meet the policy, silent regions are called out, and
        what was compiled (forward and backward by now) is saved for the next run."""
        self._steps += 1
        if self.plugin is not None and self.plugin.compile_in_background:
            if self.background is not None:
                if self.plugin.parallel_compile and self._steps == 1:
                    self.background.wait_for_all()  # step 1 ran eagerly; compiled from step 2 on
                self.background.check_progress()  # a starved helper is given up for a foreground compile
                self.background.settle()
            for model in self.models:
                for region in compiled_regions(model):
                    if region.precompiled is not None:
                        region.precompiled.poll(self._steps)
        if self.plugin is None or self._steps != max(1, self.plugin.warmup_steps):
            return
        for model in self.models:
            mark_warm(model)
        self.save_cache()
        for region in self.report().regions:
            if region.silent and not region.background_eager_calls:  # eager by design while compiling
                how = (f"its {region.invocations} call(s) all ran eagerly" if region.invocations
                       else "it was never called (is the prepared model the one being run?)")
                warnings.warn(
                    f"compiled region {region.name} ran NO compiled code in the first {self._steps} "
                    f"step(s): {how}. The step runs uncompiled.",
                    KilnFallbackWarning,
                    stacklevel=3,  # the user's optimizer.step() (after_optimizer_step <- PreparedOptimizer.step)
                )

    def save_cache(self) -> None:
        """Save what was compiled since the last save (the main process writes, all read)."""
        if self.cache is None:
            return
        for key in self._cache_keys:  # graphs and seconds, for the next compile's estimate
            record = PROGRESS.record(key)
            if record is not None:
                self.cache.write_record(key, record)
        graphs = self.report().graphs
        if graphs > self._graphs_saved:
            for key in self._cache_keys:
                self.cache.save(key)
            self._graphs_saved = graphs
        if self.is_local_main:  # each machine's record of its folder, checked at the next start (manifest.py)
            try:
                manifest.record(self.cache, self._cache_keys)
            except OSError as exc:
                warnings.warn(f"compile cache: the record of this job's compiled files not written ({exc}); the "
                              "next run loads them unchecked", KilnCacheWarning, stacklevel=3)

    # ----- compile artifacts in checkpoints (kiln.checkpoint.api) -------------------------------
    def save_artifacts(self, path: Path) -> tuple[int, int]:
        """Pack what a warm start of this job needs into `path` (one file in a checkpoint); (bytes,
        files) written, (0, 0) when nothing was: the cache is off, this is not the writer, or nothing
        compiled left files to carry (aot_eager and eager leave none unless regions are precompiled)."""
        if self.cache is None or not self.cache.is_writer or self._device is None:
            return 0, 0
        self.save_cache()
        folders = [region.precompiled.directory for model in self.models for region in compiled_regions(model)
                   if region.precompiled is not None]
        try:
            files = job_files(self.cache, self._cache_keys, folders)
            if not files:
                return 0, 0
            key = signing_key(self.cache.directory, create=True)  # made on first use, owner-only (trust.py)
            return write_bundle(Path(path), files, self._cache_keys, self._device, key), len(files)
        except OSError as exc:  # the checkpoint is whole without them: a warning, not a failed save
            Path(path).unlink(missing_ok=True)
            warnings.warn(f"compile artifacts not added to the checkpoint: {exc}; a resume on a machine with "
                          "empty caches compiles cold", KilnCacheWarning, stacklevel=2)
            return 0, 0

    def install_artifacts(self, path: Path, device: torch.device, barrier: Callable[[], None],
                          trust_all: bool = False) -> None:
        """Install a checkpoint's compile artifacts into this machine's caches before the first step.

        Collective: every process calls it. The main process checks the bundle's signature with the job's
        signing key (or takes it as trusted with `trust_all`) and tells every process the digest of the
        bytes it vouches for; an untrusted bundle is one KilnTrustWarning per machine, nothing installed
        and a cold compile. The local main process writes the files that are missing
        (other local processes share its folder); then every process loads the cache entries it
        missed at prepare. A bundle of another machine or torch, or a damaged one, is one
        KilnCacheWarning per machine and a cold compile; never an error. One of another job key (this
        model under other settings, strategy, number of processes or precision) is installed and its
        entries loaded too, so that torch's caches reuse what the two jobs compile alike; one
        warning says so.
        """
        if self.plugin is None:  # the same in every process (one configuration): no process waits alone
            return
        path = Path(path)
        vouched = self._vouch(path, trust_all)
        present = self.cache is not None and path.is_file()
        if present and self.is_local_main:
            result = install_bundle(path, self.cache, self._cache_keys, self._device or device, vouched)
            if result.message is not None:
                category = KilnTrustWarning if result.untrusted else KilnCacheWarning
                warnings.warn(result.message, category, stacklevel=3)  # the user's load_state()
        barrier()  # whatever this process found: a machine whose cache folder failed must not hang the rest
        if not present:
            return
        for key in self._cache_keys:
            if key in self._loaded_keys:
                continue
            misses = self.cache.stats.misses  # prepare counted this key's miss already
            if self.cache.load(key):
                self._loaded_keys.add(key)
                misses -= 1
            self.cache.stats.misses = misses
        # Another job key's entries, where the local main process installed them.
        for key in bundle_keys(path):
            if key in self._cache_keys or key in self._loaded_keys or not self.cache.entry_path(key).is_file():
                continue
            if self.cache.load(key):
                self._loaded_keys.add(key)


    def _vouch(self, path: Path, trust_all: bool) -> Vouch:
        """Collective: the main process's verdict on the bundle at `path` (its signature checked with the
        job's key), sent to every process over the job's process group, so that every machine installs
        the bytes the main process checked and no machine needs the key (trust.py)."""
        verdict = None
        if self.is_writer:
            if path.is_file():
                verdict = vouch_for(path, signing_key(self.cache.directory if self.cache is not None else None),
                                    trust_all)
            else:
                verdict = Vouch(None, f"compile artifacts {path} not installed: the job's main process does not see "
                                      "this file, so nobody vouched for it; the first step compiles cold",
                                untrusted=True)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [verdict]
            dist.broadcast_object_list(box, src=0)
            verdict = box[0]
        return verdict


def side_by_side_note(plugin, report: CompileReport) -> str | None:
    """Why the graphs this job compiled were not compiled side by side, for the report; None when
    they were (the timeline shows it) or when nothing was compiled in this process."""
    if plugin.compile_in_background:
        groups = {job["region"] for job in report.timeline}
        if len(groups) == 1:
            return (f"no: one region group ({next(iter(groups))}); each signature is one helper job, its "
                    "forward and backward compiled together, so there is nothing to run at once")
        return None
    compiled = [r.name for r in report.regions if r.graphs or r.precompiled_saved]
    if not compiled:
        return None  # loaded, or not called yet: nothing compiled here
    if len(compiled) == 1:
        return (f"no: one compiled region ({compiled[0]}); its forward and backward compile one after the "
                "other, so there is nothing to run at once")
    how = ("precompile=True compiles each signature ahead of time at its first call" if plugin.precompile
           else "the JIT path (the default) compiles each graph at its first call")
    return (f"no: {len(compiled)} region groups compiled one after another in this process ({how}); "
            "parallel_compile=True compiles them at once on the free cores (under fullgraph=False into the "
            "compile caches, from which training then compiles them warm)")
