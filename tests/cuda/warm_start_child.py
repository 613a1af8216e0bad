"""One fresh process of test_cuda_warm_start.py: trains a regional-compiled Llama on the GPU with
Kiln's compile cache (the folder in KILN_COMPILE_CACHE_DIR) and prints what it measured as JSON.

Depends on this checkout's kiln and tests/toy_models.py only. The last stdout line is the JSON:
compile_s (first step, prepare included, minus the median steady step), losses, Kiln's cache
statistics and the compile report's regions.
"""

import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]  # this checkout's kiln, and toy_models

import torch  # noqa: E402

from kiln import Accelerator, TorchDynamoPlugin  # noqa: E402
from toy_models import tiny_llama  # noqa: E402

LAYERS = 3
STEADY_STEPS = 5


def main() -> int:
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = tiny_llama(LAYERS).to(device)
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    # Start CUDA, cuBLAS and the eager kernels before the clock: they cost a cold and a warm
    # process the same, and would otherwise count as compile time.
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    plugin = TorchDynamoPlugin(backend="inductor", fullgraph=True, dynamic=False, use_regional_compilation=True)
    start = time.perf_counter()
    accelerator = Accelerator(dynamo_plugin=plugin)  # points Inductor's cache into Kiln's folder
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    prepare_s = time.perf_counter() - start  # loads Kiln's saved artifacts on a warm start

    def step() -> tuple[float, float]:
        torch.cuda.synchronize()
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        optimizer.step()  # the first one also saves the compiled artifacts
        optimizer.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - begin, loss.item()

    first_s, first_loss = step()
    steady = [step() for _ in range(STEADY_STEPS)]
    steady_s = statistics.median(s for s, _ in steady)
    report = accelerator.compile_report()
    accelerator.end_training()  # prints the report's table; the JSON line comes last
    print(json.dumps({
        "compile_s": prepare_s + first_s - steady_s,
        "prepare_s": prepare_s,
        "first_step_s": first_s,
        "steady_s": steady_s,
        "losses": [first_loss] + [loss for _, loss in steady],
        "artifact_cache": report.artifact_cache,
        "regions": [{"name": r.name, "graphs": r.graphs, "compiled_calls": r.compiled_calls,
                     "eager_calls": r.eager_calls, "cache_hits": r.cache_hits, "cache_misses": r.cache_misses}
                    for r in report.regions],
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
