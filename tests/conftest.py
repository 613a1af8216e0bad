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


@pytest.fixture(autouse=True)
def private_precompiled_artifacts(private_compile_cache, tmp_path_factory, monkeypatch):
    """Each test gets a cache folder of its own, so one test's precompiled artifacts never stand in
    for another's compile; its Inductor folder is the session's (a link), so built kernels stay warm."""
    folder = tmp_path_factory.mktemp("kiln-cache")
    shared = private_compile_cache / "inductor"
    shared.mkdir(exist_ok=True)
    (folder / "inductor").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("KILN_COMPILE_CACHE_DIR", str(folder))
    yield folder
