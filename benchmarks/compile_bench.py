"""Compile benchmark: eager vs full vs regional compile of a Llama-style LM, one fresh process per row.

Depends on torch, transformers and kiln.compile only; never on the facade or a distributed strategy
(matplotlib is optional: without it the plot is skipped).

Usage:
    python benchmarks/compile_bench.py                                   # inductor, 6 rows, minutes on CPU
    python benchmarks/compile_bench.py --backend aot_eager --steps 3     # quick check of the logic
    python benchmarks/compile_bench.py --methods eager,regional --workloads train --layers 12 --hidden 256

Each (method, workload) row runs in its own subprocess with an empty Inductor/Triton cache, so no
in-process or on-disk cache fakes a warm start. "compile s" is the first step minus the median
steady step; "steady ms" is that median. The AdamW step stays eager in every method.
Results go to benchmarks/results/compile_bench_<device>.{jsonl,md,png}; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Measure the kiln of this checkout, not whichever kiln happens to be installed.
sys.path.insert(0, str(HERE.parent))

from kiln.compile.cache_key import cpu_model  # noqa: E402
from kiln.bench.report import pyplot  # noqa: E402
from kiln.bench.run import empty_compiler_caches, run_measuring_process  # noqa: E402

METHODS = ("eager", "full", "regional")
WORKLOADS = ("inference", "train")
CHILD_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; `--child` (hidden) runs one measurement from a JSON spec."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2 x hidden")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="steady steps timed after the first one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend, e.g. inductor, aot_eager")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for the result files")
    p.add_argument("--child", metavar="SPEC_JSON", help=argparse.SUPPRESS)  # one measurement, internal
    args = p.parse_args(argv)
    args.methods = _pick(args.methods, METHODS, "--methods")
    args.workloads = _pick(args.workloads, WORKLOADS, "--workloads")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


def _pick(value: str, choices: tuple[str, ...], flag: str) -> list[str]:
    picked = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in picked if v not in choices]
    if unknown or not picked:
        raise SystemExit(f"{flag}: {', '.join(unknown) or 'nothing'} given; choose from: {', '.join(choices)}")
    return picked


# ---------------------------------------------------------------- child: one measurement per process

def build_model(config: dict[str, Any], device: str) -> tuple[Any, Any]:
    """A Llama-style causal LM with seeded random weights, and one batch of token ids."""
    import torch
    import transformers

    torch.manual_seed(config["seed"])
    cfg = transformers.LlamaConfig(
        num_hidden_layers=config["layers"], hidden_size=config["hidden"],
        num_attention_heads=config["heads"], num_key_value_heads=config["kv_heads"],
        intermediate_size=config["intermediate"], vocab_size=config["vocab"],
        max_position_embeddings=max(2048, config["seq"]), use_cache=False,
    )
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    model.to(dtype=getattr(torch, config["dtype"]))
    ids = torch.randint(0, config["vocab"], (config["batch"], config["seq"]), device=device)
    return model, ids


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, compile, time one step then `steps` steady steps; return the row for this spec."""
    import torch
    import transformers
    from kiln.compile.regions import compile_full, compile_regions, compiled_regions

    config, method, workload = spec["config"], spec["method"], spec["workload"]
    device = config["device"]
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    model, ids = build_model(config, device)
    train = workload == "train"
    model.train(train)
    if train:
        # transformers 5 picks the loss inside forward through a logger.warning_once that breaks a
        # full-model graph (DESIGN.md pitfalls); fixing the loss type up front avoids it. 5.23 reads
        # the model attribute, the config one is what other versions read.
        model.config.loss_type = "ForCausalLM"
        model.loss_type = "ForCausalLM"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    if method == "full":
        compile_full(model, backend=config["backend"])
    elif method == "regional":
        compile_regions(model, backend=config["backend"])

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        if train:
            # use_cache=False: transformers 5's cache object recompiles every layer (DESIGN.md pitfalls).
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)

    def timed_step() -> float:
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    first_s = timed_step()
    regions = compiled_regions(model)
    graphs_after_first = sum(r.graphs for r in regions)
    steady = [timed_step() for _ in range(config["steps"])]
    median_s = statistics.median(steady)
    peak_mib, peak_kind, device_name = peak_memory(device)
    from torch._dynamo.utils import counters

    row = {
        "method": method, "workload": workload,
        "compile_s": round(first_s - median_s, 3), "steady_ms": round(median_s * 1e3, 3),
        "first_s": round(first_s, 3), "step_ms": [round(s * 1e3, 3) for s in steady],
        "graphs": sum(r.graphs for r in regions),
        "graphs_after_first_step": graphs_after_first,  # below `graphs`: the steady steps recompiled
        "compiled_calls": sum(r.calls for r in regions),
        "regions": len(regions), "instances": sum(r.instances for r in regions),
        "backend_s": round(sum(r.backend.backend_seconds for r in regions), 3),
        "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "peak_mib": round(peak_mib, 1), "peak_kind": peak_kind,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": device, "device_name": device_name, "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation, "config": config,
    }
    if method != "eager" and row["compiled_calls"] == 0:
        row["error"] = f"{method}: compiled code never ran (0 compiled calls over {len(regions)} regions)"
    return row


def peak_memory(device: str) -> tuple[float, str, str]:
    """(peak MiB, what was measured, device name). On CPU, this process's peak resident set:
    Inductor's C++ builds run in worker processes and are not counted."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated", torch.cuda.get_device_name()
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**(20 if sys.platform == "darwin" else 10), "ru_maxrss", cpu_model()


def run_child(spec_json: str, measure_row: Any, identity: tuple[str, ...]) -> int:
    """Run one measurement; print its row as the last stdout line; non-zero exit on any error.
    Shared by the benchmarks beside this one; `identity` names the spec keys that label a row."""
    spec = json.loads(spec_json)
    try:
        row = measure_row(spec)
    except Exception as exc:  # the parent still gets a row, with the reason
        import traceback

        traceback.print_exc()
        row = {**{key: spec[key] for key in identity}, "config": spec["config"],
               "error": f"{type(exc).__name__}: {exc}"[:2000]}
    print(json.dumps(row), flush=True)
    return 1 if "error" in row else 0


def child_main(spec_json: str) -> int:
    return run_child(spec_json, measure, ("method", "workload"))


def check_backend(backend: str) -> None:
    """Exit with the list of choices when torch does not know `backend`."""
    import torch

    choices = torch._dynamo.list_backends(exclude_tags=())
    if backend not in choices:
        raise SystemExit(f"--backend {backend!r} is unknown; choose one of: {', '.join(choices)}")


def parent_device(backend: str) -> str:
    """Check `backend` (exit with the choices when unknown) and name the device the children will find."""
    import torch

    check_backend(backend)
    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_line(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    """'torch 2.13.0+cpu, <CPU or GPU name>, 2 threads', from the first row that measured."""
    any_row = next((r for r in rows if "torch" in r), {})
    return (f"torch {any_row.get('torch', '?')}, {any_row.get('device_name', config['device'])}, "
            f"{any_row.get('threads', '?')} threads")


# ---------------------------------------------------------------- parent: one subprocess per row

def run_row(method: str, workload: str, config: dict[str, Any]) -> dict[str, Any]:
    """Measure one row in a fresh interpreter with an empty compiler cache, deleted afterwards."""
    spec = {"method": method, "workload": workload, "config": config}
    return run_script_row(Path(__file__), spec, config["device"])


def run_script_row(script: Path, spec: dict[str, Any], device: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script --child spec` in a fresh interpreter: with empty compiler caches, or in `env`
    when given (a benchmark that brings its own cache). Shared by the benchmarks beside this one."""
    command = [sys.executable, str(script.resolve()), "--child", json.dumps(spec)]
    if env is not None:
        return run_measuring_process(command, spec, env=env, timeout_s=CHILD_TIMEOUT_S, device=device,
                                     parse=_last_json_line)
    with empty_compiler_caches() as caches:
        return run_measuring_process(command, spec, env=dict(os.environ, **caches), timeout_s=CHILD_TIMEOUT_S,
                                     device=device, parse=_last_json_line)


def write_outputs(stem: Path, rows: list[dict[str, Any]], text: str, plot_rows: Any = None) -> str:
    """Write `stem`.jsonl (every row), `stem`.md (`text`) and, given a plotting function, `stem`.png;
    return what to print last."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stem.with_suffix(".md").write_text(text)
    if plot_rows is not None and not plot_rows(rows, stem.with_suffix(".png")):
        print("matplotlib is not installed: plot skipped (pip install matplotlib to get one)")
    return f"wrote {stem}.jsonl and {stem}.md\n\n{text}"


def load_warning(rows: list[dict[str, Any]]) -> str:
    busy = max((r.get("busy_cores_before") or 0) for r in rows)
    if busy > 0.25:
        return f"\nWarning: other processes kept up to {busy} cores busy during this run; timings are unreliable.\n"
    return ""


def progress_error(row: dict[str, Any]) -> str | None:
    """The line to print for a row that failed, else None."""
    if "error" not in row:
        return None
    return f"ERROR after {row['process_s']} s: {row['error']}\n{row.get('stderr_tail', '')}"


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table; speedup is eager's steady time over the method's, per workload."""
    eager = {r["workload"]: r["steady_ms"] for r in rows if r["method"] == "eager" and "error" not in r}
    lines = ["| method | workload | compile s | steady ms | speedup vs eager | graphs | peak MiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['workload']} | error: {r['error'][:60]} | | | | |")
            continue
        base = eager.get(r["workload"])
        speedup = f"{base / r['steady_ms']:.2f}x" if base else "-"
        lines.append(f"| {r['method']} | {r['workload']} | {r['compile_s']:.1f} | {r['steady_ms']:.2f} | "
                     f"{speedup} | {r['graphs']} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Bar charts of compile seconds and steady ms per method and workload; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    ok = [r for r in rows if "error" not in r]
    methods = list(dict.fromkeys(r["method"] for r in ok))
    workloads = list(dict.fromkeys(r["workload"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(workloads))
    for ax, key, title in ((axes[0], "compile_s", "compile (s)"), (axes[1], "steady_ms", "steady step (ms)")):
        for i, workload in enumerate(workloads):
            by_method = {r["method"]: r[key] for r in ok if r["workload"] == workload}
            xs = [m + (i - (len(workloads) - 1) / 2) * width for m in range(len(methods))]
            ax.bar(xs, [by_method.get(m, 0) for m in methods], width, label=workload)
        ax.set_xticks(range(len(methods)), methods)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(rows: list[dict[str, Any]], config: dict[str, Any], out: Path) -> str:
    """Write the run's JSON lines, markdown table and plot; return the text to print last."""
    text = (f"Llama-style LM, {config['layers']} layers x {config['hidden']} wide, batch {config['batch']} x "
            f"{config['seq']}, {config['dtype']}, backend {config['backend']}, median of {config['steps']} steps; "
            f"{machine_line(rows, config)}.\n\n{results_table(rows)}\n{load_warning(rows)}")
    return write_outputs(out / f"compile_bench_{config['device']}", rows, text, plot)


def model_config(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The model and run settings every row of a benchmark shares."""
    return {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
        "intermediate": args.intermediate or 2 * args.hidden, "vocab": args.vocab, "batch": args.batch,
        "seq": args.seq, "steps": args.steps, "seed": args.seed, "threads": args.threads,
        "backend": args.backend, "device": device,
        # bf16 on GPU as in DESIGN.md's H200 numbers; fp32 on CPU, where bf16 kernels are slow.
        "dtype": "bfloat16" if device == "cuda" else "float32",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    device = parent_device(args.backend)
    config = model_config(args, device)
    plan = [(m, w) for w in args.workloads for m in args.methods]
    rows = []
    for i, (method, workload) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {method} {workload} ({args.backend}, {device}) ...", end=" ", flush=True)
        row = run_row(method, workload, config)
        rows.append(row)
        if (row["busy_cores_before"] or 0) > 0.25:
            print(f"[other processes kept {row['busy_cores_before']} cores busy]", end=" ", flush=True)
        if progress_error(row):
            print(progress_error(row), flush=True)
        else:
            print(f"compile {row['compile_s']:.1f} s, steady {row['steady_ms']:.2f} ms, "
                  f"{row['graphs']} graphs, process {row['process_s']} s", flush=True)
    print(write_results(rows, config, args.out))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
