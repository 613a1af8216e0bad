"""The shape-bucket suite of `kiln bench`: recompiles and time over one epoch of variable-length
batches, with and without `BucketCollator`, under dynamic=False and dynamic=None.

Depends on the standard library and kiln.bench.plan (rows) at import; the child side imports torch, transformers, kiln.buckets
and kiln.compile (never the facade). Variants: static (dynamic=False, each batch padded to its
longest sequence), static-buckets (dynamic=False, lengths padded up to a multiple of
MULTIPLE_OF), dynamic and dynamic-buckets (the same with torch's default dynamic=None).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kiln.bench.plan import measured

VARIANTS = {"static": (False, False), "static-buckets": (False, True),
            "dynamic": (None, False), "dynamic-buckets": (None, True)}  # name: (dynamic, buckets)
EXAMPLES, MIN_LEN, MAX_LEN, MULTIPLE_OF = 64, 8, 128, 32


def make_examples(vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """Token-id examples with lengths uniform in [MIN_LEN, MAX_LEN]; labels are the inputs (an LM)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(EXAMPLES):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return examples


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """Compile, train one epoch, and count graphs, eager block calls and per-step times."""
    import torch
    from torch.utils.data import DataLoader

    from kiln.bench.measure import build_model
    from kiln.buckets import BucketCollator
    from kiln.compile.regions import compile_regions, compiled_regions

    dynamic, bucketed = VARIANTS[row["variant"]]
    cuda = row["device"] == "cuda"
    if row.get("threads"):
        torch.set_num_threads(row["threads"])
    model, config, _ = build_model(dict(row, seq=MAX_LEN))
    model.train()
    model.config.loss_type = model.loss_type = "ForCausalLM"  # see measure.measure
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compile_regions(model, backend=row["backend"], dynamic=dynamic)
    regions = compiled_regions(model)
    block_paths = {p for r in regions for p in r.paths}
    invocations = 0

    def count_invocation(module: Any, args: Any) -> None:
        nonlocal invocations
        invocations += 1

    for path, module in model.named_modules():
        if path in block_paths:
            module.register_forward_pre_hook(count_invocation)
    # multiple_of=1 is plain padding to the batch's longest sequence: the "no buckets" baseline.
    collate = BucketCollator(pad_token_id=0, multiple_of=MULTIPLE_OF if bucketed else 1)
    loader = DataLoader(make_examples(config.vocab_size, row["seed"]), batch_size=row["batch"], shuffle=True,
                        generator=torch.Generator().manual_seed(row["seed"]), collate_fn=collate)

    def totals() -> tuple[int, int, int]:
        return sum(r.graphs for r in regions), sum(r.calls for r in regions), invocations

    steps, seen = [], set()
    real_tokens = padded_tokens = 0
    epoch_start = time.perf_counter()
    for batch in loader:
        batch = {k: v.to(row["device"]) for k, v in batch.items()}
        length = batch["input_ids"].shape[1]
        real_tokens += int(batch["attention_mask"].sum())
        padded_tokens += batch["input_ids"].numel()
        before = totals()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(**batch, use_cache=False).loss  # transformers 5's cache recompiles every layer
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        after = totals()
        steps.append({"length": length, "ms": round(seconds * 1e3, 3), "compiled": after[0] > before[0],
                      "eager_calls": (after[2] - before[2]) - (after[1] - before[1])})
        seen.add(length)
    epoch_s = time.perf_counter() - epoch_start

    graphs, calls, total = totals()
    compiling = [s for s in steps if s["compiled"]]
    eager = [s for s in steps if not s["compiled"] and s["eager_calls"] > 0]
    steady = [s for s in steps if not s["compiled"] and s["eager_calls"] == 0]
    result = dict(row)
    result.update(
        dynamic=dynamic, buckets=f"multiple_of={MULTIPLE_OF}" if bucketed else "none", examples=EXAMPLES,
        lengths=[MIN_LEN, MAX_LEN], batches=len(steps), distinct_lengths=len(seen), graphs=graphs,
        recompiles=graphs - len(regions), eager_calls=total - calls, block_invocations=total,
        compiled_calls=calls, recompile_limit=torch._dynamo.config.recompile_limit, epoch_s=round(epoch_s, 3),
        compile_steps=len(compiling), compile_steps_s=round(sum(s["ms"] for s in compiling) / 1e3, 3),
        eager_steps=len(eager), eager_steps_s=round(sum(s["ms"] for s in eager) / 1e3, 3),
        steady_steps=len(steady), steady_steps_s=round(sum(s["ms"] for s in steady) / 1e3, 3),
        steady_median_ms=round(statistics.median(s["ms"] for s in steady), 3) if steady else None,
        pad_fraction=round(1 - real_tokens / padded_tokens, 4), torch=torch.__version__,
        threads=torch.get_num_threads(), step_log=steps,
    )
    if calls == 0:
        result["error"] = f"compiled code never ran (0 compiled calls over {len(regions)} regions)"
    return result


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | dynamic | buckets | lengths | graphs | recompiles | eager calls | epoch s "
             "| compiling steps: n, s | eager steps: n, s | steady steps: n, s, median ms | padding |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['variant']} | {r.get('error', r.get('skipped'))[:80]} |" + " |" * 10)
            continue
        median = "-" if r["steady_median_ms"] is None else f"{r['steady_median_ms']:.0f}"
        lines.append(
            f"| {r['variant']} | {r['dynamic']} | {r['buckets']} | {r['distinct_lengths']} | {r['graphs']} | "
            f"{r['recompiles']} | {r['eager_calls']} / {r['block_invocations']} | {r['epoch_s']:.1f} | "
            f"{r['compile_steps']}, {r['compile_steps_s']:.1f} | {r['eager_steps']}, {r['eager_steps_s']:.1f} | "
            f"{r['steady_steps']}, {r['steady_steps_s']:.1f}, {median} | {100 * r['pad_fraction']:.0f}% |")
    return "\n".join(lines)


def render(rows: list[dict[str, Any]]) -> str:
    text = (f"One epoch of {EXAMPLES} examples (lengths uniform in [{MIN_LEN}, {MAX_LEN}]), forward + backward + "
            "AdamW, regional compile; each row a fresh process. lengths: distinct padded lengths seen. graphs: "
            "summed over regions; recompiles: graphs minus one per region. eager calls: block calls that ran "
            "without compiled code (recompile limit hit), of all block calls. Steps are split into those that "
            "compiled a graph, those where a block ran eagerly, and the rest (steady). padding: share of the "
            f"epoch's tokens that were padding.\n\n{table(rows)}\n")
    for r in measured(rows):
        if r["eager_calls"]:
            text += (f"\n{r['variant']} hit Dynamo's recompile limit ({r['recompile_limit']}): {r['eager_calls']} of "
                     f"{r['block_invocations']} block calls ran eagerly, without compiled code.\n")
    return text


def progress(result: dict[str, Any]) -> str:
    return (f"{result['graphs']} graphs, {result['eager_calls']} eager block calls, "
            f"epoch {result['epoch_s']:.1f} s")
