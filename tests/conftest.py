import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# These tests pin Kiln's own behaviour; keep the launcher's and the user's settings out of them.
for _name in list(os.environ):
    if _name.startswith("KILN_") or _name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        del os.environ[_name]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty Dynamo caches and counters, and a fixed seed."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="session")
def private_compile_cache(tmp_path_factory):
    """Kiln's warm-start cache (and Inductor's, which it points at) live in a folder of this test
    session, never in the user's ~/.cache."""
    folder = tmp_path_factory.mktemp("kiln-compile-cache")
    os.environ["KILN_COMPILE_CACHE_DIR"] = str(folder)
    yield folder
