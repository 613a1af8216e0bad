"""The warm-start suite of `kiln bench`: the first training step of a regional-compiled model when
Kiln's compile cache folder holds nothing, part of an earlier run's files, or all of them.

Depends on the standard library and kiln.bench.plan (rows) at import; the child side imports torch, transformers and
kiln.compile (never the facade). Variants (what lies in the cache folder as the process starts):
    cold                    nothing; it saves its entry, which the other variants start from
    warm-inductor-dir-only  a copy of cold's Inductor folder, no Kiln entry (so no artifact load)
    warm-artifacts-only     a copy of cold's Kiln entry, an empty Inductor folder
    warm                    both (Kiln's default: the same folder as the previous run)
    cold-precompile         nothing, with precompiled regions on: it saves their artifacts
    warm-precompiled        cold-precompile's own folder (the same path: the next run of a job)
    warm-precompiled-copy   a copy of cold-precompile's folder at another path
    resume-fresh-machine    nothing but the compile artifacts cold's run packed as save_state puts them in a
                            checkpoint (kiln/compile/artifacts/bundle.py), installed as load_state does,
                            after the model is compiled (prepare) and before the first step: a resume on
                            a machine with empty caches
    resume-fresh-machine-user-inductor-dir
                            the same with the user's own TORCHINDUCTOR_CACHE_DIR, an empty folder
    resume-fresh-machine-precompiled
                            the same from cold-precompile's run, whose artifacts hold its precompiled
                            regions: they load with no Dynamo trace
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from kiln.bench.plan import measured

VARIANTS = ("cold", "warm-inductor-dir-only", "warm-artifacts-only", "warm", "cold-precompile",
            "warm-precompiled", "warm-precompiled-copy", "resume-fresh-machine", "resume-fresh-machine-user-inductor-dir",
            "resume-fresh-machine-precompiled")
PRECOMPILE_VARIANTS = ("cold-precompile", "warm-precompiled", "warm-precompiled-copy",
                       "resume-fresh-machine-precompiled")
RESUME_VARIANTS = ("resume-fresh-machine", "resume-fresh-machine-user-inductor-dir", "resume-fresh-machine-precompiled")
TARGET_RATIO = 0.25  # warm / cold, load + first step
RESUME_TARGET_RATIO = 0.2  # resume-fresh-machine / cold (issue 28)
BUNDLE = "compile_artifacts.kiln"  # the name save_state gives the file in a checkpoint
# A precompiled warm start's overhead (first step minus a steady step, loading included) over the
# cold compile's overhead (issue 11).
PRECOMPILED_OVERHEAD_RATIO = 0.10


def base_variant(variant: str) -> str:
    """The cold variant whose folder a warm variant starts from."""
    return "cold-precompile" if variant in PRECOMPILE_VARIANTS else "cold"
# Compilation-metrics fields summed over every compiled frame: where the warm path spends its time.
COUNT_FIELDS = ("aotautograd_local_cache_hit_count", "aotautograd_local_cache_miss_count",
                "inductor_fx_local_cache_hit_count", "inductor_fx_local_cache_miss_count")
TIME_FIELDS_US = ("dynamo_cumulative_compile_time_us", "aot_autograd_cumulative_compile_time_us",
                  "backward_cumulative_compile_time_us")


def checkpoint_folder(cache_folder: Path) -> Path:
    """Where a row's stand-in checkpoint (the compile-artifacts file only) lies: beside its cache folder."""
    return cache_folder.with_name(cache_folder.name + "-checkpoint")


def prepare_folder(variant: str, cold: Path, target: Path) -> None:
    """Fill `target` (a Kiln cache folder) with the part of cold's folder this variant keeps."""
    target.mkdir(parents=True)
    if variant in RESUME_VARIANTS:  # empty caches; the checkpoint's file beside them
        shutil.copytree(checkpoint_folder(cold), checkpoint_folder(target))
        return
    if variant == "warm-precompiled-copy":
        shutil.rmtree(target)
        shutil.copytree(cold, target, symlinks=True)
        return
    if variant in ("warm-inductor-dir-only", "warm") and (cold / "inductor").is_dir():
        shutil.copytree(cold / "inductor", target / "inductor", symlinks=True)
    if variant in ("warm-artifacts-only", "warm"):
        for entry in cold.glob("*.kiln"):
            shutil.copy2(entry, target / entry.name)


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """One job start with whatever KILN_COMPILE_CACHE_DIR holds: key, load, compile, first step,
    steady steps, save, as a training job does with Kiln's compile cache."""
    import torch
    from torch._dynamo.utils import get_compilation_metrics

    from kiln.bench.measure import build_model, peak_memory_mib
    from kiln.compile.artifacts.bundle import install_bundle, job_files, vouch_for, write_bundle
    from kiln.compile.artifacts.cache import CompileCache
    from kiln.compile.artifacts.trust import ENV_KEY, KEY_FILE, signing_key
    from kiln.compile.regions import compile_regions, compiled_regions

    if row.get("threads"):
        torch.set_num_threads(row["threads"])
    cuda = row["device"] == "cuda"
    model, config, ids = build_model(row)
    model.train()
    model.config.loss_type = model.loss_type = "ForCausalLM"  # see measure.measure
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    cache = CompileCache()
    cache.activate()
    start = time.perf_counter()
    key = cache.key(model, {"backend": row["backend"]}, torch.device(row["device"]))
    hit = cache.load(key)  # what prepare does: a fresh machine misses here
    if row["variant"] in PRECOMPILE_VARIANTS:  # loaded (or compiled and saved) at the first call
        compile_regions(model, backend=row["backend"], fullgraph=True, precompile=cache.precompiled_dir)
    else:  # per-block regions: what a warm start loads (outer_graph="auto" adds its helper from the second step)
        compile_regions(model, backend=row["backend"], outer_graph=False)
    installed, verify_s = None, 0.0
    if row["variant"] in RESUME_VARIANTS:  # what load_state does after prepare, before the first step
        # The saving job's key, as a fresh machine gets it: in the environment (docs/checkpoints.md#trust).
        os.environ[ENV_KEY] = (checkpoint_folder(cache.directory) / KEY_FILE).read_text().strip()
        bundle = checkpoint_folder(cache.directory) / BUNDLE
        verify_start = time.perf_counter()
        vouched = vouch_for(bundle, signing_key(cache.directory))  # the signature check (trust.py)
        verify_s = time.perf_counter() - verify_start
        installed = install_bundle(bundle, cache, [key], row["device"], vouched)
        if installed.message is not None:
            return dict(row, error=installed.message)
        hit = cache.load(key)
    load_s = time.perf_counter() - start
    losses = []  # the same in every variant if warm code computes what cold code did

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        losses.append(float(loss))
        return time.perf_counter() - begin

    first_s = step()
    metrics = list(get_compilation_metrics())  # the first step's compiles only
    steady = [step() for _ in range(row["steps"])]
    start = time.perf_counter()
    saved = cache.save(key)
    save_s = time.perf_counter() - start
    bundle_bytes = None
    regions = compiled_regions(model)
    if row["variant"] in ("cold", "cold-precompile"):  # what save_state would add to a checkpoint, to resume from
        folders = [r.precompiled.directory for r in regions if r.precompiled is not None]
        signer = signing_key(cache.directory, create=True)
        bundle_bytes = write_bundle(checkpoint_folder(cache.directory) / BUNDLE, job_files(cache, [key], folders),
                                    [key], row["device"], signer)
        # The stand-in for the secret a resuming job is given (never kept beside a real checkpoint).
        (checkpoint_folder(cache.directory) / KEY_FILE).write_bytes(signer)
    median_s = statistics.median(steady)
    result = dict(row)
    result.update(
        hit=hit, saved=saved, load_s=round(load_s, 3), first_step_s=round(first_s, 3),
        first_s=round(load_s + first_s, 3), compile_s=round(load_s + first_s - median_s, 3),
        steady_ms=round(median_s * 1e3, 3), step_ms=[round(s * 1e3, 3) for s in steady],
        save_s=round(save_s, 3), losses=[round(v, 6) for v in losses], graphs=sum(r.graphs for r in regions),
        compiled_calls=sum(r.calls for r in regions), frames_compiled=len(metrics),
        traces=sum(r.traces for r in regions), precompiled_calls=sum(r.precompiled_calls for r in regions),
        precompiled_loaded=sum(r.precompiled.stats.loaded for r in regions if r.precompiled is not None),
        precompile_load_s=round(sum(r.precompiled.stats.load_seconds for r in regions if r.precompiled), 3),
        cache_stats=cache.stats.as_dict(), peak_mib=round(peak_memory_mib(cuda), 1), torch=torch.__version__,
        threads=torch.get_num_threads(), bundle_bytes=bundle_bytes,
        installed_files=installed.installed if installed is not None else None,
        verify_ms=round(verify_s * 1e3, 2) if installed is not None else None,
        inductor_dir=cache.inductor_dir_source,
    )
    for name in COUNT_FIELDS:
        result[name] = sum(getattr(m, name, None) or 0 for m in metrics)
    for name in TIME_FIELDS_US:
        result[name.replace("_us", "_s")] = round(sum(getattr(m, name, None) or 0 for m in metrics) / 1e6, 3)
    if result["compiled_calls"] == 0:
        result["error"] = "compiled code never ran (0 compiled calls)"
    return result


def _cold_first_s(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {r.get("run", 1): r["first_s"] for r in rows if r["variant"] == "cold" and "error" not in r}


def _cold_compile_s(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {r.get("run", 1): r["compile_s"] for r in rows if r["variant"] == "cold" and "error" not in r}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown, one line per measured process; "vs cold" is load + first step over the same run's cold one."""
    colds = _cold_first_s(rows)
    cold_overheads = _cold_compile_s(rows)
    lines = ["| variant | run | entry loaded | first s (load + step) | vs cold | overhead s | overhead vs cold | "
             "steady ms | traces | precompiled loaded | AOT cache hit/miss | FX cache hit/miss | dynamo s | "
             "AOT s | backward s | process s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['variant']} | {r.get('run', 1)} | {r.get('error', r.get('skipped'))[:70]} |" + " |" * 13)
            continue
        cold = colds.get(r.get("run", 1))
        cold_overhead = cold_overheads.get(r.get("run", 1)) or float("nan")
        lines.append(
            f"| {r['variant']} | {r.get('run', 1)} | {'yes' if r['hit'] else 'no'} | {r['first_s']:.2f} | "
            f"{r['first_s'] / cold:.3f} | {r['compile_s']:.2f} | {r['compile_s'] / cold_overhead:.3f} | "
            f"{r['steady_ms']:.1f} | {r.get('traces', '-')} | {r.get('precompiled_loaded', 0)} | "
            f"{r['aotautograd_local_cache_hit_count']}/{r['aotautograd_local_cache_miss_count']} | "
            f"{r['inductor_fx_local_cache_hit_count']}/{r['inductor_fx_local_cache_miss_count']} | "
            f"{r['dynamo_cumulative_compile_time_s']:.2f} | {r['aot_autograd_cumulative_compile_time_s']:.2f} | "
            f"{r['backward_cumulative_compile_time_s']:.2f} | {r['process_s']:.1f} |"
            if cold else f"| {r['variant']} | {r.get('run', 1)} | no cold row in this run |" + " |" * 13)
    return "\n".join(lines)


def target_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """warm / cold (load + first step, medians over runs) against TARGET_RATIO, per warm variant."""
    by_variant: dict[str, list[float]] = {}
    for r in measured(rows):
        by_variant.setdefault(r["variant"], []).append(r["first_s"])
    if "cold" not in by_variant:
        return []
    cold = statistics.median(by_variant["cold"])
    checks = []
    for variant, values in by_variant.items():
        if variant in ("cold", "cold-precompile"):
            continue
        limit = RESUME_TARGET_RATIO if variant in RESUME_VARIANTS else TARGET_RATIO
        value = statistics.median(values) / cold
        checks.append({"target": f"warm start: {variant} / cold <= {limit}", "value": round(value, 3),
                       "limit": limit, "met": value <= limit})
    overheads: dict[str, list[float]] = {}
    for r in measured(rows):
        overheads.setdefault(r["variant"], []).append(r["compile_s"])
    cold_overhead = statistics.median(overheads["cold"])
    for variant in ("warm-precompiled", "warm-precompiled-copy"):
        if variant in overheads:
            value = statistics.median(overheads[variant]) / cold_overhead
            checks.append({"target": f"overhead (first step minus steady, loading included): {variant} / cold "
                                     f"<= {PRECOMPILED_OVERHEAD_RATIO}", "value": round(value, 3),
                           "limit": PRECOMPILED_OVERHEAD_RATIO, "met": value <= PRECOMPILED_OVERHEAD_RATIO})
    return checks


def render(rows: list[dict[str, Any]]) -> str:
    losses = {tuple(r["losses"]) for r in measured(rows)}
    same = "Every process computed the same losses." if len(losses) == 1 else \
        "Note: the processes' losses differ."
    checks = "\n".join(f"- {c['target']}: {c['value']} ({'met' if c['met'] else 'missed'})" for c in target_checks(rows))
    return (f"Warm start of a regional-compiled training step (AdamW, the optimizer eager): each row is a fresh "
            f"process whose Kiln cache folder holds what its variant says ({', '.join(VARIANTS)}).\n\n"
            f"{table(rows)}\n\n{checks}\n\n{same}\n")


def progress(result: dict[str, Any]) -> str:
    return (f"entry loaded: {result['hit']}, load + first step {result['first_s']:.2f} s, "
            f"steady {result['steady_ms']:.1f} ms")
