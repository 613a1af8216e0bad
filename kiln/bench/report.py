"""The benchmark's results as a markdown table, the target ratios, PNG plots and JSON lines.

Depends on the standard library; matplotlib only when it is installed (plots are skipped without it).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from kiln.bench import buckets, checkpointing, host_overhead, local_processes, nd_parallel, startup, warm_start
from kiln.bench.plan import METHODS, measured

# The targets, checked on rows of the same run: same model, workload, batch and mode.
REGIONAL_VS_ACCELERATE_COMPILE = 0.5  # Kiln regional compile s / Accelerate regional compile s
REGIONAL_VS_FULL_STEP = 1.02  # Kiln regional steady ms / full steady ms, at batch >= 4
REGIONAL_VS_FULL_MEMORY = 1.05  # Kiln regional peak / full peak, at batch >= 4
REGIONAL_VS_FULL_COMPILE = 0.6  # Kiln regional compile s / full compile s (the diffusion issue's)
MIN_BATCH_FOR_STEP_TARGET = 4


def _case(row: dict[str, Any]) -> tuple:
    return (row["model"], row["workload"], row["batch"])


def _method_label(row: dict[str, Any]) -> str:
    return row["method"] if row.get("mode", "default") == "default" else f"{row['method']} [{row['mode']}]"


def _sort_key(row: dict[str, Any]) -> tuple:
    method = METHODS.index(row["method"]) if row["method"] in METHODS else len(METHODS)
    return (row["model"], row["workload"], row["batch"], row.get("mode", "default") != "default", method)


def combine_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured case: repeated runs (`kiln bench --repeat N`) become their median, with
    `runs` and the spread of steady times kept, so the noise between processes stays visible."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["model"], r["workload"], r["batch"], r["seq"], r["method"], r.get("mode", "default"),
               r.get("backend"))
        groups.setdefault(key, []).append(r)
    combined = []
    for runs in groups.values():
        ok = measured(runs)
        if len(runs) == 1 or not ok:
            combined.append(runs[0])
            continue
        row = dict(ok[0], runs=len(ok), failed_runs=len(runs) - len(ok))
        for key in ("compile_s", "steady_ms", "peak_mib", "steady_peak_mib"):
            row[key] = round(statistics.median(r[key] for r in ok), 3)
        row["steady_ms_runs"] = [r["steady_ms"] for r in ok]
        row["compile_s_runs"] = [r["compile_s"] for r in ok]
        row["compiled_frames_per_step"] = min(r["compiled_frames_per_step"] for r in ok)
        combined.append(row)
    return combined


def speedups(rows: list[dict[str, Any]]) -> dict[int, float]:
    """id(row) -> eager steady time over the row's, for rows whose case has an eager row."""
    eager = {_case(r): r["steady_ms"] for r in measured(rows) if r["method"] == "eager"}
    return {id(r): eager[_case(r)] / r["steady_ms"] for r in measured(rows) if _case(r) in eager and r["steady_ms"]}


def results_table(rows: list[dict[str, Any]]) -> str:
    """One line per row: compile seconds, steady ms, speedup over eager, memory, proof of compiled code."""
    speed = speedups(rows)
    repeated = any(r.get("runs", 1) > 1 for r in rows)
    extra = " runs: steady ms min-max, compile s min-max |" if repeated else ""
    lines = ["| model | workload | batch x seq | method | compile s | steady ms | vs eager | peak MiB | "
             f"steady peak MiB | compiled frames/step |{extra}",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" --- |" if repeated else "")]
    for r in sorted(rows, key=_sort_key):
        head = f"| {r['model']} | {r['workload']} | {r['batch']} x {r['seq']} | {_method_label(r)} |"
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or "error: " + r["error"].splitlines()[0][:80].replace("|", "/")
            lines.append(f"{head} {why} | | | | | |" + (" |" if repeated else ""))
            continue
        ratio = f"{speed[id(r)]:.2f}x" if id(r) in speed else "-"
        spread = ""
        if repeated:
            steady, compile_s = r.get("steady_ms_runs", [r["steady_ms"]]), r.get("compile_s_runs", [r["compile_s"]])
            spread = (f" {len(steady)}: {min(steady):.2f}-{max(steady):.2f}, "
                      f"{min(compile_s):.1f}-{max(compile_s):.1f} |")
        lines.append(f"{head} {r['compile_s']:.1f} | {r['steady_ms']:.2f} | {ratio} | {r['peak_mib']:.0f} | "
                     f"{r['steady_peak_mib']:.0f} | {r['compiled_frames_per_step']} |{spread}")
    return "\n".join(lines)


def target_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target the run's rows allow checking: the ratio, the limit and whether it was met."""
    by = {(_case(r), r["method"], r.get("mode", "default")): r for r in measured(rows)}
    checks = []

    def add(target: str, case: tuple, mode: str, ratio: float, limit: float | None, detail: str) -> None:
        verdict = "measured" if limit is None else ("met" if ratio <= limit else "missed")
        checks.append(dict(target=target, model=case[0], workload=case[1], batch=case[2], mode=mode,
                           ratio=round(ratio, 3), limit=limit, verdict=verdict, detail=detail))

    for (case, method, mode), regional in sorted(by.items(), key=lambda kv: kv[0][0]):
        if method != "regional":
            continue
        accelerate = by.get((case, "accelerate-regional", mode))
        if accelerate and accelerate["compile_s"] > 0:
            add("regional compile / Accelerate regional compile", case, mode,
                regional["compile_s"] / accelerate["compile_s"], REGIONAL_VS_ACCELERATE_COMPILE,
                f"{regional['compile_s']:.1f} s vs {accelerate['compile_s']:.1f} s")
        full = by.get((case, "full", mode))
        if full and full["compile_s"] > 0:
            add("regional compile / full compile", case, mode, regional["compile_s"] / full["compile_s"],
                REGIONAL_VS_FULL_COMPILE, f"{regional['compile_s']:.1f} s vs {full['compile_s']:.1f} s "
                f"({regional.get('kiln_graphs', '?')} vs {full.get('kiln_graphs', '?')} graphs)")
        if full and case[2] >= MIN_BATCH_FOR_STEP_TARGET:
            add("regional steady step / full steady step", case, mode,
                regional["steady_ms"] / full["steady_ms"], REGIONAL_VS_FULL_STEP,
                f"{regional['steady_ms']:.2f} ms vs {full['steady_ms']:.2f} ms")
            add("regional peak memory / full peak memory", case, mode,
                regional["peak_mib"] / full["peak_mib"], REGIONAL_VS_FULL_MEMORY,
                f"{regional['peak_mib']:.0f} vs {full['peak_mib']:.0f} MiB "
                f"(steady peak {regional['steady_peak_mib']:.0f} vs {full['steady_peak_mib']:.0f})")
        # CUDA graphs at batch 1: regional with reduce-overhead against a plain full compile.
        plain_full = by.get((case, "full", "default"))
        if mode == "reduce-overhead" and case[2] == 1 and plain_full:
            add("regional [reduce-overhead] steady / full steady, batch 1", case, mode,
                regional["steady_ms"] / plain_full["steady_ms"], None,
                f"{regional['steady_ms']:.2f} ms vs {plain_full['steady_ms']:.2f} ms")
    return checks


def targets_table(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return "No target could be checked: the run lacks the rows each target compares."
    lines = ["| target | model | workload | batch | ratio | limit | verdict | values |",
             "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for c in checks:
        limit = "-" if c["limit"] is None else f"<= {c['limit']}"
        mode = "" if c["mode"] == "default" else f" [{c['mode']}]"
        lines.append(f"| {c['target']}{mode} | {c['model']} | {c['workload']} | {c['batch']} | {c['ratio']:.2f} | "
                     f"{limit} | {c['verdict']} | {c['detail']} |")
    return "\n".join(lines)


def describe_run(rows: list[dict[str, Any]]) -> str:
    """One paragraph naming what every row shares: versions, device, threads, dtype, backend, steps."""
    done = measured(rows)
    if not done:
        return "No row finished."
    def values(key: str) -> str:
        return "/".join(str(v) for v in dict.fromkeys(r.get(key) for r in done if r.get(key) is not None))

    accelerate, diffusers = values("accelerate"), values("diffusers")
    kinds = " and ".join(k for k, present in (("Llama-style causal LMs", any(not r.get("diffusers") for r in done)),
                                               ("diffusers UNets", bool(diffusers))) if present)
    return (f"{kinds} with random weights, {values('dtype')}, backend {values('backend')}, "
            f"median of {values('steps')} steady steps after {values('warmup')} warm-up steps; "
            f"torch {values('torch')}, transformers {values('transformers')}"
            f"{', accelerate ' + accelerate if accelerate else ''}{', diffusers ' + diffusers if diffusers else ''}; "
            f"{values('device_name')}, "
            f"{values('threads')} threads. Each row is a fresh process with an empty compiler cache; "
            f"compile s = first step - median steady step.")


def render(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    text = f"{describe_run(rows)}\n\n{results_table(rows)}\n\nTargets (ratios within this run):\n\n{targets_table(checks)}\n"
    busy = max((r.get("busy_cores_before") or 0) for r in rows) if rows else 0
    if busy > 0.25:
        text += f"\nWarning: other processes kept up to {busy} cores busy before some rows; timings are unreliable.\n"
    return text


def _label_order(label: str) -> tuple:
    method = label.split(" [")[0]
    return (METHODS.index(method) if method in METHODS else len(METHODS), label)


def _bar_style(label: str) -> dict[str, Any]:
    """One colour per method in every plot; a non-default compile mode is hatched."""
    method = label.split(" [")[0]
    index = METHODS.index(method) if method in METHODS else len(METHODS)
    return {"color": f"C{index}", "hatch": "//" if " [" in label else None}


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (the Agg backend), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(rows: list[dict[str, Any]], stem: Path) -> list[Path]:
    """`<stem>_compile.png` (compile s per method and case) and `<stem>_speedup.png` (speedup over
    eager per method, model and batch size); [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    done = sorted(measured(rows), key=_sort_key)
    if not done:
        return []
    paths = []
    methods = sorted({_method_label(r) for r in done if r["method"] != "eager"}, key=_label_order)
    cases = list(dict.fromkeys(_case(r) for r in done if r["method"] != "eager"))
    if methods and cases:
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cases) + 2), 4.5))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            value = {_case(r): r["compile_s"] for r in done if _method_label(r) == method}
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cases))]
            ax.bar(xs, [value.get(c, 0) for c in cases], width, label=method, **_bar_style(method))
        ax.set_xticks(range(len(cases)), [f"{m}\n{w} b{b}" for m, w, b in cases])
        ax.set_ylabel("compile time (s): first step - steady step")
        ax.set_title("Cold compile time per method (fresh process, empty cache)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(stem.with_name(stem.name + "_compile.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    speed = speedups(done)
    panels = list(dict.fromkeys((r["model"], r["workload"]) for r in done
                                if id(r) in speed and r["method"] != "eager"))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
        for ax, (model, workload) in zip(axes[0], panels):
            mine = [r for r in done if (r["model"], r["workload"]) == (model, workload) and id(r) in speed
                    and r["method"] != "eager"]  # eager is the 1.0 line
            batches = sorted({r["batch"] for r in mine})
            labels = sorted({_method_label(r) for r in mine}, key=_label_order)
            width = 0.8 / len(labels)
            for i, method in enumerate(labels):
                value = {r["batch"]: speed[id(r)] for r in mine if _method_label(r) == method}
                xs = [b + (i - (len(labels) - 1) / 2) * width for b in range(len(batches))]
                ax.bar(xs, [value.get(b, 0) for b in batches], width, label=method, **_bar_style(method))
            ax.axhline(1.0, color="grey", linewidth=0.8, label="eager")
            ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
            ax.set_title(f"{model} {workload}: speedup over eager")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(stem.with_name(stem.name + "_speedup.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_results(rows: list[dict[str, Any]], out: Path, name: str, plots: bool = True) -> tuple[str, list[Path]]:
    """Write `<name>.jsonl` (every run), `<name>.md`, `<name>_targets.json` and the plots (repeated
    runs combined to their median) under `out`; return the markdown and the files. Each suite in
    the rows gets its own section."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / name
    files = [stem.with_suffix(".jsonl"), stem.with_suffix(".md")]
    files[0].write_text("".join(json.dumps(r) + "\n" for r in rows))  # every run, as measured
    sections, checks = [], []
    compile_rows = [r for r in rows if r.get("suite", "compile") == "compile"]
    if compile_rows:
        compile_rows = combine_repeats(compile_rows)
        compile_checks = target_checks(compile_rows)
        sections.append(render(compile_rows, compile_checks))
        checks += compile_checks
        if plots:
            files += plot(compile_rows, stem)
    warm_rows = _runs_numbered([r for r in rows if r.get("suite") == "warm-start"])
    if warm_rows:
        sections.append(warm_start.render(warm_rows))
        checks += warm_start.target_checks(warm_rows)
    startup_rows = [r for r in rows if r.get("suite") == "startup"]
    if startup_rows:
        sections.append(startup.render(startup_rows))
        checks += startup.target_checks(startup_rows)
        if plots and pyplot() is not None:
            files += startup.plot(startup_rows, stem, pyplot())
    local_rows = [r for r in rows if r.get("suite") == "local-processes"]
    if local_rows:
        sections.append(local_processes.render(local_rows))
        checks += local_processes.target_checks(local_rows)
    bucket_rows = [r for r in rows if r.get("suite") == "buckets"]
    if bucket_rows:
        sections.append(buckets.render(bucket_rows))
    host_rows = [r for r in rows if r.get("suite") == "host-overhead"]
    if host_rows:
        sections.append(host_overhead.render(host_rows))
        checks += host_overhead.target_checks(host_rows)
    nd_rows = [r for r in rows if r.get("suite") == "nd-parallel"]
    if nd_rows:
        sections.append(nd_parallel.render(nd_rows))
    checkpointing_rows = [r for r in rows if r.get("suite") == "checkpointing"]
    if checkpointing_rows:
        sections.append(checkpointing.render(checkpointing_rows))
    text = "\n".join(sections)
    if not compile_rows:
        text = f"{describe_suite_run(rows)}\n\n{text}"
    files[1].write_text(text)
    with open(stem.with_name(name + "_targets.json"), "w") as f:
        json.dump(checks, f, indent=1)
    files.append(stem.with_name(name + "_targets.json"))
    return text, files


def _runs_numbered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Number the repeats of the warm-start rows (`run`), counting a new run at each cold row."""
    run, numbered = 0, []
    for r in rows:
        run += r["variant"] == "cold"
        numbered.append(dict(r, run=max(run, 1)))
    return numbered


def describe_suite_run(rows: list[dict[str, Any]]) -> str:
    """What the rows of the warm-start and bucket suites share: model, versions, device, backend."""
    done = measured(rows) or rows
    def values(key: str) -> str:
        return "/".join(str(v) for v in dict.fromkeys(r.get(key) for r in done if r.get(key) is not None))

    from kiln.bench.plan import DIFFUSION_MODELS

    models = list(dict.fromkeys(r.get("model") for r in done if r.get("model") is not None))
    llamas = [m for m in models if m not in DIFFUSION_MODELS]
    unets = [m for m in models if m in DIFFUSION_MODELS]
    kinds = " and ".join(f"{kind} `{'/'.join(names)}`" for kind, names in
                         (("Llama-style causal LM", llamas), ("diffusers UNet", unets)) if names)
    return (f"{kinds} with random weights, {values('workload')} at batch "
            f"{values('batch')}, {values('dtype')}, backend {values('backend')}; torch {values('torch')}, "
            f"{values('device')}, {values('threads')} threads.")


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a results .jsonl file, to re-render a table or plots without measuring again."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
