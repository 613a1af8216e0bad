"""The start-up suite of `kiln bench`: a whole training job in a fresh process, timed from the process's
start: the first step (prepare, loading and compiling inside it) and the time to finish 20, 100, 400
and 500 steps, for each way of starting.

Depends on the standard library and kiln.bench.plan (rows) at import; the child side imports torch, transformers, Kiln's
Accelerator and (for one variant) Accelerate. Variants (what the Kiln cache folder holds, and how):
    eager                   no compile
    regional-cold           Kiln's regional compile, JIT, an empty folder (today's blocking start)
    regional-warm           the same, from a copy of regional-cold's folder (today's warm start)
    precompiled-cold        precompile=True, an empty folder: it writes the precompiled artifacts
    precompiled-warm        precompiled-cold's own folder (the next run of the same job)
    precompiled-warm-copy   a copy of precompiled-cold's folder at another path
    background-cold         compile_in_background=True, an empty folder
    full-cold               Kiln's whole-model compile, JIT, an empty folder (the regional rows' yardstick)
    outer-cold              regional with outer_graph=True (the whole model one graph, the blocks one
                            shared subgraph), JIT, an empty folder
    outer-background-cold   regional with outer_graph="background": per-block regions from step 1, the
                            outer graph once a helper has compiled it into the empty Inductor folder
    parallel-cold           parallel_compile=True, an empty folder: step 1 eager while a pool of helpers
                            compiles the region groups side by side, a wait, compiled from step 2
    default-cold            regional-cold as most users leave it: fullgraph and dynamic unset (JIT on
                            one process; under DDP, Kiln's default there: precompile="auto")
    parallel-default-cold   default-cold with parallel_compile=True: under fullgraph=False the helpers
                            fill the compile caches side by side, and training compiles warm at step 2
    accelerate-regional     Accelerate's own regional compile, an empty Inductor folder
    busy-<variant>          <variant> (eager, regional-cold, background-cold) on a busy machine: a
                            plain Python busy loop (nice 0) runs beside the job from its start to its end
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from kiln.bench.plan import measured

VARIANTS = ("eager", "regional-cold", "regional-warm", "precompiled-cold", "precompiled-warm",
            "precompiled-warm-copy", "background-cold", "accelerate-regional", "full-cold", "parallel-cold", "default-cold",
            "outer-cold", "outer-background-cold",
            "parallel-default-cold")
BUSY = "busy-"
MILESTONES = (20, 100, 400, 500, 2000)
# Background rows train 4x the steps (2000 for the plan's 500): on 2 cores the helper's compile
# outlasts 500 eager steps, and the row should show the switch and the compiled steps after it.
BACKGROUND_STEPS_FACTOR = 4
SAME_FOLDER = ("precompiled-warm",)  # runs in its base row's folder itself
WARM_OVERHEAD_RATIO = 0.10  # a precompiled warm start's overhead over the cold compile's
BACKGROUND_FIRST_STEP_RATIO = 2.0  # background mode's first step over an eager process's
BACKGROUND_TIME_RATIO = 0.85  # background mode's time to 400 steps over the blocking compile's
OUTER_SWITCH_TIMEOUT = 900.0  # seconds an outer-background-cold row trains at most, waiting for its switch
BUSY_TIME_RATIO = 1.0  # on a busy machine: background mode's time to 2000 steps over the blocking compile's
# Issue 28 (side by side): compile overheads to the end of step 2 (the first compiled step of a
# parallel_compile run), as ratios of rows of the same run.
REGIONAL_OVER_FULL_RATIO = 0.6  # a UNet's regional cold compile over its whole-model compile
PARALLEL_OVER_ACCELERATE_RATIO = 0.55  # Kiln's regional cold start over Accelerate's regional
PARALLEL_CPU_RATIO = 1.15  # the job's CPU seconds (helpers included) over the blocking compile's
# The demo's model (examples/train_lm.py's defaults): GPT-2, 4 layers of width 128.
DEMO_GPT2 = dict(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=256)


def base_variant(variant: str) -> str:
    """The variant whose folder this one starts from (itself for a cold start)."""
    return {"regional-warm": "regional-cold", "precompiled-warm": "precompiled-cold",
            "precompiled-warm-copy": "precompiled-cold"}.get(variant, variant)


def prepare_folder(variant: str, base: Path, target: Path) -> None:
    """A warm variant's folder: a copy of its base row's whole folder."""
    shutil.copytree(base, target, symlinks=True)


def _process_start() -> float:
    """When this process started (wall clock), from /proc; now where /proc is missing."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return time.time()


def _build(row: dict[str, Any]):
    """(model, inputs, step loss): the row's model with random weights, one batch, and its loss."""
    import torch

    from kiln.bench.plan import DIFFUSION_MODELS

    if row["model"] in DIFFUSION_MODELS:
        from kiln.bench.diffusion import build_unet, unet_loss

        model, _, inputs = build_unet(row)
        return model, inputs, unet_loss
    if row["model"] != "demo":
        from kiln.bench.measure import build_model
        model, config, ids = build_model(row)
    else:
        import transformers

        torch.manual_seed(row["seed"])
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**DEMO_GPT2, use_cache=False))
        ids = torch.randint(0, DEMO_GPT2["vocab_size"], (row["batch"], row["seq"]))
    model.config.loss_type = model.loss_type = "ForCausalLM"  # see measure.measure
    return model, ids, _lm_loss


def _lm_loss(model: Any, ids: Any) -> Any:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """One training job of `row["steps"]` AdamW steps as its variant starts it; timings from the
    process's start."""
    process_start = _process_start()
    busy = None
    if row["variant"].startswith(BUSY):
        import subprocess
        import sys

        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core taken, at nice 0
    try:
        return _measure(row, process_start, row["variant"].removeprefix(BUSY))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def _measure(row: dict[str, Any], process_start: float, variant: str) -> dict[str, Any]:
    import torch

    if row.get("threads"):
        torch.set_num_threads(row["threads"])
    # As a user's script is laid out: imports and the Accelerator at the top, then the model, then
    # prepare. "First step" is timed from just before prepare.
    accelerator, backward = None, None
    if variant == "accelerate-regional":
        from accelerate import Accelerator
        from accelerate.utils import TorchDynamoPlugin

        accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=row["backend"], use_regional_compilation=True),
                                  cpu=row["device"] == "cpu")
    elif variant != "eager":
        from kiln import Accelerator, TorchDynamoPlugin

        regional = variant != "full-cold"  # a whole model may break its graph: fullgraph for regions only
        # fullgraph and dynamic unset, as most users leave them (and the local-processes suite's
        # default-two-machines: under DDP that is precompile="auto", Kiln's default there)
        as_left = variant in ("default-cold", "parallel-default-cold", "default-two-machines")
        local = int(os.environ.get("WORLD_SIZE", "1")) > 1
        outer = variant == "outer-cold"  # the whole model one graph: like full-cold, it may break
        outer_graph = "background" if variant == "outer-background-cold" else outer
        plugin = TorchDynamoPlugin(backend=row["backend"],
                                   fullgraph=None if as_left else regional and not outer_graph,
                                   dynamic=None if as_left else False, use_regional_compilation=regional,
                                   outer_graph=outer_graph,
                                   # regional-cold is the JIT path, also where several processes
                                   # would precompile by default
                                   precompile=(True if variant.startswith("precompiled")
                                               else False if variant == "regional-cold" and local else None),
                                   compile_in_background=variant == "background-cold",
                                   parallel_compile=variant in ("parallel-cold", "parallel-default-cold"))
        accelerator = Accelerator(dynamo_plugin=plugin, cpu=row["device"] == "cpu")
    model, ids, compute_loss = _build(row)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before_prepare = time.time()
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
        backward = accelerator.backward
    times, at, losses = [], {}, []
    two_done, cpu_two = None, None
    long_run = variant in ("background-cold", "outer-background-cold") or row["variant"].startswith(BUSY)
    outer = None
    if variant == "outer-background-cold":
        from kiln.compile.regions import compiled_regions

        outer = compiled_regions(accelerator.unwrap_model(model))[-1]
    outer_switch = outer_switch_s = None
    steps = row["steps"] * (BACKGROUND_STEPS_FACTOR if long_run else 1)
    step = 0
    # outer-background-cold runs on until 100 steps after its switch (the steady median is of the last
    # 50), however long the helper takes, within OUTER_SWITCH_TIMEOUT.
    while step < steps or (outer is not None and (outer_switch or step) + 100 > step
                           and time.time() - before_prepare < OUTER_SWITCH_TIMEOUT):
        step += 1
        begin = time.perf_counter()
        loss = compute_loss(model, ids)
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - begin)
        losses.append(float(loss))
        if step == 1:
            first_done = time.time()
        if step == 2:  # the first compiled step of every variant (parallel rows' step 1 runs eagerly)
            two_done, cpu_two = time.time(), _job_cpu_seconds()
        if step in MILESTONES:
            at[step] = round(time.time() - process_start, 3)
        if outer is not None and outer_switch is None and outer.calls:
            outer_switch = step  # this step ran the outer graph (compiled at its start, from the caches)
            outer_switch_s = round(time.time() - before_prepare, 3)
    steady = statistics.median(times[-50:])
    result = dict(row)
    result.update(
        start_to_prepare_s=round(before_prepare - process_start, 3),
        first_s=round(first_done - before_prepare, 3), first_from_start_s=round(first_done - process_start, 3),
        overhead_s=round(first_done - before_prepare - steady, 3), steady_ms=round(steady * 1e3, 3),
        two_s=two_done and round(two_done - before_prepare, 3),
        two_overhead_s=two_done and round(two_done - before_prepare - 2 * steady, 3),
        cpu_two_s=cpu_two,
        **{f"t{n}_s": at.get(n) for n in MILESTONES}, total_s=round(time.time() - process_start, 3),
        loss_first=round(losses[0], 6), loss_last=round(losses[-1], 6), torch=torch.__version__,
        outer_switch_s=outer_switch_s, outer_switch_step_time_s=outer_switch and round(times[outer_switch - 1], 3),
        threads=torch.get_num_threads(),
    )
    if accelerator is not None and variant != "accelerate-regional":
        regions = accelerator.compile_report().regions
        result.update(ran="/".join(r.ran for r in regions), traces=sum(r.traces for r in regions),
                      precompiled_loaded=sum(r.precompiled_loaded for r in regions),
                      switch_step=min((r.switch_step for r in regions if r.switch_step is not None),
                                      default=outer_switch),
                      background_eager_calls=sum(r.background_eager_calls for r in regions))
        report = accelerator.compile_report()
        if report.timeline:  # who compiled which region group when (parallel-cold, background-cold)
            result.update(timeline=report.timeline, compile_wait_s=report.compile_wait_seconds,
                          compile_workers=len({job["worker"] for job in report.timeline}))
        accelerator.end_training()
    return result


def _job_cpu_seconds() -> float | None:
    """CPU seconds of this process and its helpers and compiler processes, living or reaped."""
    from kiln.compile.artifacts.background import tree_cpu_seconds

    cpu = tree_cpu_seconds(os.getpid())
    return None if cpu is None else round(cpu, 2)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | variant | first step s (prepare + step) | overhead s | to 20 steps s | to 100 s | to 400 s | "
             "to 500 s | to 2000 s | steady ms | ran | traces | switched after step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        if r not in measured(rows):
            lines.append(f"| {r['model']} | {r['variant']} | {r.get('error', r.get('skipped'))[:80]} |" + " |" * 10)
            continue
        def cell(key: str) -> str:
            value = r.get(key)
            return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        lines.append(f"| {r['model']} | {r['variant']} | {cell('first_s')} | {cell('overhead_s')} | {cell('t20_s')} | "
                     f"{cell('t100_s')} | {cell('t400_s')} | {cell('t500_s')} | {cell('t2000_s')} | {r['steady_ms']:.1f} | "
                     f"{r.get('ran', '-')} | {cell('traces')} | {cell('switch_step')} |")
    return "\n".join(lines)


def side_by_side_table(rows: list[dict[str, Any]]) -> str:
    """Issue 28's view: compile overhead and the job's CPU seconds to the end of step 2, the
    helpers and how long training waited for them; empty without full-cold or parallel rows."""
    done = [r for r in measured(rows) if r.get("two_overhead_s") is not None]
    if not any(r["variant"] in ("full-cold", "parallel-cold", "parallel-default-cold") for r in done):
        return ""
    lines = ["| model | variant | compile overhead to step 2 s | CPU s to step 2 | compile workers | waited s |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in done:
        lines.append(f"| {r['model']} | {r['variant']} | {r['two_overhead_s']:.2f} | {r.get('cpu_two_s', '-')} | "
                     f"{r.get('compile_workers', '-')} | {r.get('compile_wait_s', '-')} |")
    return "\n".join(lines)


# The times the targets compare; with `kiln bench --repeat N` each is the median of a variant's runs.
TIMED = ("first_s", "overhead_s", "two_overhead_s", "cpu_two_s", "t400_s", "t2000_s")


def by_variant(rows: list[dict[str, Any]], model: str) -> dict[str, dict[str, Any]]:
    """One row per variant of `model`: a repeated variant's times are the medians of its runs."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in measured(rows):
        if r["model"] == model:
            runs.setdefault(r["variant"], []).append(r)
    combined = {}
    for variant, same in runs.items():
        row = dict(same[-1], runs=len(same))
        for key in TIMED:
            values = [r[key] for r in same if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        combined[variant] = row
    return combined


def target_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 11's CPU targets, per model, as ratios of rows measured in the same run (medians of
    a variant's runs when repeated)."""
    checks = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = by_variant(rows, model)

        def check(name: str, value: float, limit: float) -> None:
            checks.append({"target": f"{model}: {name} <= {limit}", "value": round(value, 3), "limit": limit,
                           "met": value <= limit})

        cold = by.get("regional-cold")
        for warm in ("precompiled-warm", "precompiled-warm-copy"):
            if cold and warm in by:
                check(f"{warm} overhead / regional-cold overhead", by[warm]["overhead_s"] / cold["overhead_s"],
                      WARM_OVERHEAD_RATIO)
        background, eager = by.get("background-cold"), by.get("eager")
        if background and eager:
            check("background-cold first step / eager first step", background["first_s"] / eager["first_s"],
                  BACKGROUND_FIRST_STEP_RATIO)
        if background and cold and background.get("t400_s") and cold.get("t400_s"):
            check("background-cold time to 400 steps / regional-cold's", background["t400_s"] / cold["t400_s"],
                  BACKGROUND_TIME_RATIO)
        background, cold = by.get("busy-background-cold"), by.get("busy-regional-cold")
        if background and cold and background.get("t2000_s") and cold.get("t2000_s"):
            check("busy-background-cold time to 2000 steps / busy-regional-cold's",
                  background["t2000_s"] / cold["t2000_s"], BUSY_TIME_RATIO)
        checks.extend(_side_by_side_checks(model, by))
        if background:
            switched = background.get("switch_step")
            checks.append({"target": f"{model}: busy-background-cold runs compiled code before step 2000",
                           "value": switched, "limit": 2000, "met": switched is not None and switched < 2000})
    return checks


def _side_by_side_checks(model: str, by: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 28's targets on the compile overhead to the end of step 2 (the parallel rows' first
    compiled step): UNet regional / full, Kiln's regional / Accelerate's, and CPU seconds (each
    parallel row beside its serial row: parallel-cold beside regional-cold, parallel-default-cold
    beside default-cold)."""
    from kiln.bench.plan import DIFFUSION_MODELS

    checks = []

    def ratio(name: str, a: dict | None, b: dict | None, key: str, limit: float) -> None:
        if a and b and a.get(key) and b.get(key):
            value = a[key] / b[key]
            checks.append({"target": f"{model}: {name} <= {limit}", "value": round(value, 3), "limit": limit,
                           "met": value <= limit})

    full, accelerate = by.get("full-cold"), by.get("accelerate-regional")
    kiln_rows = [(name, by.get(name)) for name in ("regional-cold", "parallel-cold", "default-cold",
                                                    "parallel-default-cold")]
    for name, row in kiln_rows:
        if model in DIFFUSION_MODELS:
            ratio(f"{name} compile to step 2 / full-cold's", row, full, "two_overhead_s", REGIONAL_OVER_FULL_RATIO)
        else:
            ratio(f"{name} compile to step 2 / accelerate-regional's", row, accelerate, "two_overhead_s",
                  PARALLEL_OVER_ACCELERATE_RATIO)
    for parallel, serial in (("parallel-cold", "regional-cold"), ("parallel-default-cold", "default-cold")):
        ratio(f"{parallel} CPU seconds to step 2 / {serial}'s", by.get(parallel), by.get(serial), "cpu_two_s",
              PARALLEL_CPU_RATIO)
    return checks


def render(rows: list[dict[str, Any]]) -> str:
    side_by_side = side_by_side_table(rows)
    side_by_side = side_by_side and f"{side_by_side}\n\n"
    checks = "\n".join(f"- {c['target']}: {c['value']} ({'met' if c['met'] else 'missed'})" for c in target_checks(rows))
    return ("Start-up of a training job (AdamW), each row a fresh process; the step times are from the process's "
            "start, \"first step\" from just before `prepare` to the end of step 1, \"overhead\" that minus a "
            f"steady step (the median of the last 50); background and busy rows train {BACKGROUND_STEPS_FACTOR}x "
            "the steps; busy rows run beside a Python busy loop that takes one core.\n\n"
            f"{table(rows)}\n\n{side_by_side}{checks}\n")


def progress(result: dict[str, Any]) -> str:
    return (f"first step {result['first_s']:.2f} s, to 400 steps {result.get('t400_s') or float('nan'):.1f} s, "
            f"steady {result['steady_ms']:.1f} ms, ran {result.get('ran', '-')}")


def plot(rows: list[dict[str, Any]], stem: Path, plt: Any) -> list[Path]:
    """`<stem>_startup.png`: seconds from process start to each step milestone, one line per
    variant, one panel per model."""
    done = measured(rows)
    models = list(dict.fromkeys(r["model"] for r in done))
    if not models:
        return []
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in done if r["model"] == model):
            points = [(1, r["first_from_start_s"])] + [(n, r[f"t{n}_s"]) for n in MILESTONES if r.get(f"t{n}_s")]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=r["variant"])
        ax.set_xlabel("steps finished")
        ax.set_ylabel("seconds since the process started")
        ax.set_title(f"{model}: training job start-up ({done[0]['backend']}, {done[0]['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = stem.with_name(stem.name + "_startup.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
