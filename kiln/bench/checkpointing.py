"""The checkpointing suite of `kiln bench`: does the memory transformers' gradient checkpointing
saves stay saved when Kiln compiles each block (the recompute inside the block's own graph)?

Depends on the standard library and kiln.bench.plan (rows) at import; the child side imports torch,
transformers and kiln.compile (never the facade). Each row is a fresh process: a training step of
the row's Llama, eager or regionally compiled, with transformers' checkpointing off, non-reentrant
or reentrant (`gradient_checkpointing_enable`). Measured at a steady step: the activation memory
held for backward at the end of the forward (the bytes of the distinct tensors autograd saved,
parameters left out: seen through `torch.autograd.graph.saved_tensors_hooks`, exact on any
device), the step's peak allocated memory on CUDA, and the step's median time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kiln.bench.plan import measured

VARIANTS = {  # name: (compiled, checkpointing)
    "eager": (False, "off"), "eager-checkpointing": (False, "non-reentrant"),
    "eager-checkpointing-reentrant": (False, "reentrant"),
    "regional": (True, "off"), "regional-checkpointing": (True, "non-reentrant"),
    "regional-checkpointing-reentrant": (True, "reentrant"),
}
WARMUP, TIMED = 2, 5


def saved_activation_bytes(step_forward: Any, parameters: set[int]) -> tuple[Any, int]:
    """Run `step_forward()`; return its output and the bytes of the distinct storages autograd
    saved for backward during it, parameters' storages left out."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = step_forward()
    return output, sum(storages.values())


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """Compile (or not), warm up, then one measured forward and TIMED timed training steps."""
    import torch

    from kiln.bench.measure import build_model
    from kiln.compile.regions import compile_regions, compiled_regions

    compiled, checkpointing = VARIANTS[row["variant"]]
    cuda = row["device"] == "cuda"
    if row.get("threads"):
        torch.set_num_threads(row["threads"])
    model, _, ids = build_model(row)
    model.train()
    model.config.loss_type = model.loss_type = "ForCausalLM"  # see measure.measure
    if checkpointing != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compiled:
        compile_regions(model, backend=row["backend"])
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def forward() -> Any:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def step(measure_memory: bool = False) -> tuple[float, int]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, saved = saved_activation_bytes(forward, parameters) if measure_memory else (forward(), 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, saved

    compile_start = time.perf_counter()
    for _ in range(WARMUP):
        step()
    compile_s = time.perf_counter() - compile_start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _, saved = step(measure_memory=True)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    times = [step()[0] for _ in range(TIMED)]
    regions = compiled_regions(model)
    result = dict(row)
    result.update(
        compiled=compiled, checkpointing=checkpointing, saved_mib=round(saved / 2**20, 3),
        step_peak_mib=None if peak is None else round(peak, 1), warmup_s=round(compile_s, 3),
        steady_ms=round(statistics.median(times) * 1e3, 3), torch=torch.__version__,
        threads=torch.get_num_threads(), graphs=sum(r.graphs for r in regions),
        compiled_calls=sum(r.calls for r in regions), eager_calls=sum(r.eager_calls for r in regions),
        graph_breaks=sum(sum(r.graph_breaks.values()) for r in regions),
    )
    if compiled and result["compiled_calls"] == 0:
        result["error"] = f"compiled code never ran (0 compiled calls over {len(regions)} regions)"
    return result


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | checkpointing | saved for backward MiB | vs eager | step peak MiB (CUDA) | steady ms "
             "| block calls compiled / eager | graph breaks |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plain = next((r["saved_mib"] for r in measured(rows) if r["variant"] == "eager"), None)
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['variant']} | {r.get('error', r.get('skipped'))[:80]} |" + " |" * 6)
            continue
        ratio = f"{r['saved_mib'] / plain:.2f}x" if plain else "-"
        peak = "-" if r["step_peak_mib"] is None else f"{r['step_peak_mib']:.0f}"
        lines.append(f"| {r['variant']} | {r['checkpointing']} | {r['saved_mib']:.2f} | {ratio} | {peak} | "
                     f"{r['steady_ms']:.1f} | {r['compiled_calls']} / {r['eager_calls']} | {r['graph_breaks']} |")
    return "\n".join(lines)


def render(rows: list[dict[str, Any]]) -> str:
    return ("A training step (forward, backward, AdamW) with transformers' gradient checkpointing off, "
            "non-reentrant or reentrant, eager and regionally compiled; each row a fresh process. saved for "
            "backward: the distinct tensors autograd held at the end of the forward, parameters left out "
            f"(activation memory); steady: median of {TIMED} steps after {WARMUP} warm-up steps. Checkpointing "
            "compiled keeps its saving when the regional row's saved memory is near the eager row's with the "
            f"same checkpointing.\n\n{table(rows)}\n")


def progress(result: dict[str, Any]) -> str:
    return (f"saved {result['saved_mib']:.2f} MiB, steady {result['steady_ms']:.1f} ms, "
            f"{result['eager_calls']} eager block calls")
