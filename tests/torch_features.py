"""What this torch can do ahead of time, probed once, for tests that must assert the path each
torch takes rather than skip where an API is missing."""

import functools

import torch

from kiln.compile.artifacts.aot_workarounds import compile_ahead_of_time, serialized


@functools.lru_cache(maxsize=None)
def saves_ahead_of_time(backend: str) -> bool:
    """Whether this torch compiles a function ahead of time with `backend` and saves it. torch 2.11
    saves Inductor output only ("expected OutputCode, got function" for aot_eager); 2.13 saves both."""
    def double(x):
        return x * 2

    try:
        serialized(compile_ahead_of_time(double, ((torch.ones(2),), {}), backend=backend, fullgraph=True))
    except Exception:
        return False
    finally:
        torch._dynamo.reset()
    return True


# The backend of the tests that need saved artifacts: aot_eager (seconds) where this torch saves
# its output, else Inductor (what the GPU image's torch 2.11 precompiles with).
PRECOMPILE_BACKEND = "aot_eager" if saves_ahead_of_time("aot_eager") else "inductor"
