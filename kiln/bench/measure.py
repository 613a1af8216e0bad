"""The compile suite's measurement of one row (build a Llama-style model, compile it one way, time it),
and the helpers every suite's child uses: the row's model, peak memory, Dynamo's counts.

Depends on torch, transformers, kiln.compile, (for its fp8 methods) kiln.fp8 and torchao, and (for
its two Accelerate methods only) accelerate; never on Kiln's facade, a distributed strategy or
another suite (they import this module, not the reverse).
The child process's entry point is kiln.bench.child.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kiln.bench.plan import DIFFUSION_MODELS, FP8_METHODS, MODEL_SIZES
from kiln.compile.artifacts.cache_key import cpu_model


def build_model(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(model, config, token ids): seeded random weights in the row's dtype, on the row's device."""
    import torch
    import transformers

    torch.manual_seed(row["seed"])
    config = transformers.LlamaConfig(**MODEL_SIZES[row["model"]], use_cache=False,
                                      max_position_embeddings=max(2048, row["seq"]))
    with torch.device(row["device"]):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=getattr(torch, row["dtype"]))
    ids = torch.randint(0, config.vocab_size, (row["batch"], row["seq"]), device=row["device"])
    return model, config, ids


def apply_method(model: Any, row: dict[str, Any]) -> Any:
    """The callable each step runs: the model itself (eager, Kiln, compiled in place) or Accelerate's."""
    method, kwargs = row["method"], {"backend": row["backend"]}
    if row["mode"] != "default":
        kwargs["mode"] = row["mode"]
    if method == "eager":
        return model
    if method in FP8_METHODS:
        from kiln.fp8 import convert_to_fp8

        # Float8 linear layers before compiling, as Accelerator.prepare does under mixed_precision="fp8";
        # the rows' bf16 weights keep the rest in bf16, as in the bf16 rows beside them.
        convert_to_fp8(model)
        method = method.removesuffix("-fp8")
    if method in ("full", "regional"):
        from kiln.compile.regions import compile_full, compile_regions

        if method == "regional":
            # Per-block regions, whose compile this suite times: under outer_graph="auto" (the default)
            # a helper would compile the outer graph beside the measured steps (host-overhead's rows).
            compile_regions(model, outer_graph=False, **kwargs)
        else:
            compile_full(model, **kwargs)
        return model
    if method in ("accelerate-full", "accelerate-regional"):
        # Accelerate's own path, as a user gets it: its Accelerator, its plugin, its prepare.
        from accelerate import Accelerator
        from accelerate.utils import TorchDynamoPlugin

        plugin = TorchDynamoPlugin(backend=row["backend"], mode=row["mode"],
                                   use_regional_compilation=method == "accelerate-regional")
        return Accelerator(dynamo_plugin=plugin, cpu=row["device"] == "cpu").prepare(model)
    raise ValueError(f"unknown method {method!r}")


def make_step(run_model: Any, model: Any, ids: Any, row: dict[str, Any]) -> Callable[[], None]:
    """One inference call under no_grad, or one training step (forward, backward, AdamW, zero_grad)."""
    import torch

    train = row["workload"] == "train"
    cudagraphs = row["mode"] in ("reduce-overhead", "max-autotune") and row["device"] == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if train else None

    def step() -> None:
        if cudagraphs:
            # Per-block CUDA graphs reuse output buffers across calls; without marking the step
            # start the next step reads overwritten outputs (seen on torch 2.11, DESIGN.md).
            torch.compiler.cudagraph_mark_step_begin()
        # use_cache=False: transformers 5's cache object recompiles every layer (DESIGN.md pitfalls).
        if train:
            loss = run_model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                run_model(input_ids=ids, use_cache=False)

    return step


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """Build, compile, time the first step, warm up, time `steps` steady steps; the result row."""
    start = time.perf_counter()
    import torch
    import transformers

    if row.get("threads"):
        torch.set_num_threads(row["threads"])
    cuda = row["device"] == "cuda"
    diffusion = row["model"] in DIFFUSION_MODELS
    if diffusion:
        from kiln.bench.diffusion import build_unet, make_unet_step

        model, config, inputs = build_unet(row)
    else:
        model, config, inputs = build_model(row)
    # Train or eval before compiling: Accelerate's regional compile copies the model's modules'
    # attributes, flags included, and a later switch would also recompile.
    model.train(row["workload"] == "train")
    if row["workload"] == "train" and not diffusion:
        # transformers 5 picks the loss inside forward through a logger.warning_once that breaks a
        # full-model graph (DESIGN.md pitfalls); fixing the loss type up front avoids it.
        model.loss_type = "ForCausalLM"
        model.config.loss_type = "ForCausalLM"
    t0 = time.perf_counter()
    run_model = apply_method(model, row)  # lazy everywhere: the compiling happens in the first step
    apply_s = time.perf_counter() - t0
    step = (make_unet_step if diffusion else make_step)(run_model, model, inputs, row)

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first_s = timed()
    graphs_after_first = dynamo_graphs()
    for _ in range(row["warmup"]):
        timed()
    # The whole run's peak must be read before the reset: on Linux ru_maxrss follows VmHWM.
    run_peak = peak_memory_mib(cuda)
    reset_peak_memory(cuda)
    times = [timed() for _ in range(row["steps"])]
    steady_s = statistics.median(times)
    steady_peak = peak_memory_mib(cuda)
    frames_per_step = compiled_frames_per_step(step)
    result = dict(row)
    result.update(
        compile_s=round(first_s - steady_s, 3), first_s=round(first_s, 3), apply_s=round(apply_s, 3),
        steady_ms=round(steady_s * 1e3, 3), step_ms=[round(t * 1e3, 3) for t in times],
        peak_mib=round(max(run_peak, steady_peak), 1), steady_peak_mib=round(steady_peak, 1),
        peak_kind="cuda_max_allocated" if cuda else "peak_rss",
        params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        compiled_frames_per_step=frames_per_step,
        torch=torch.__version__, transformers=transformers.__version__,
        device_name=torch.cuda.get_device_name() if cuda else cpu_model(),
        threads=torch.get_num_threads(), attn_implementation=getattr(config, "_attn_implementation", None),
    )
    result.update(dynamo_facts(graphs_after_first))
    result.update(kiln_facts(model) if row["method"] in ("full", "regional") else {})
    if diffusion:
        import diffusers

        result["diffusers"] = diffusers.__version__
    if row["method"].startswith("accelerate"):
        import accelerate

        result["accelerate"] = accelerate.__version__
    problem = compiled_code_problem(result)
    if problem:
        result["error"] = problem
    result["child_s"] = round(time.perf_counter() - start, 1)
    return result


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def dynamo_facts(graphs_after_first: int) -> dict[str, Any]:
    """What Dynamo recorded: graphs, frames, graph breaks, recompiles after the first step."""
    from torch._dynamo.utils import counters

    return {
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "dynamo_frames_ok": counters["frames"]["ok"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs_after_first_step": graphs_after_first,  # below dynamo_graphs: later steps recompiled
    }


def kiln_facts(model: Any) -> dict[str, Any]:
    """Kiln's own counts: its backend wrapper counts each call of compiled code."""
    from kiln.compile.regions import compiled_regions

    regions = compiled_regions(model)
    return {
        "kiln_regions": [r.name for r in regions],
        "kiln_instances": sum(r.instances for r in regions),
        "kiln_graphs": sum(r.graphs for r in regions),
        "kiln_compiled_calls": sum(r.calls for r in regions),
        "kiln_eager_calls": sum(r.eager_calls for r in regions),
    }


def compiled_frames_per_step(step: Callable[[], None]) -> int:
    """Compiled frames entered during one more step, counted from the profiler's
    'Torch-Compiled Region' events: one yardstick that works for Kiln and Accelerate alike."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("Torch-Compiled Region"))


def compiled_code_problem(result: dict[str, Any]) -> str | None:
    """Why a compiled method's numbers would be eager numbers in disguise, or None if compiled code ran."""
    if result["method"] == "eager":
        return None
    if result["compiled_frames_per_step"] == 0:
        return f"{result['method']}: no compiled frame ran during a steady step"
    if result["method"] in ("full", "regional") and result["kiln_compiled_calls"] == 0:
        return f"{result['method']}: Kiln counted 0 compiled calls"
    return None


def reset_peak_memory(cuda: bool) -> None:
    """Start a new peak after warm-up: the steady peak leaves out what compiling needed."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: writing 5 to clear_refs resets this process's peak resident set (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mib(cuda: bool) -> float:
    """Peak since the start or the last reset: CUDA's max allocated, else the process's peak
    resident set (VmHWM; ru_maxrss where /proc is missing). Inductor's C++ builds run in worker
    processes and are not counted."""
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**(20 if sys.platform == "darwin" else 10)
