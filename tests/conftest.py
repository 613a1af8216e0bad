import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# These tests pin Kiln's own behaviour; keep the launcher's and the user's settings out of them.
for _name in list(os.environ):
    if _name.startswith("KILN_") or _name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        del os.environ[_name]
# outer_graph="auto", the default, starts a helper at a model's second call that compiles the whole
# model with Inductor: tens of seconds of a core in every real-Inductor test, beside the other
# workers. Those tests are about other things; the default's own tests unset this
# (tests/compile/test_auto_outer_graph.py).
os.environ["KILN_DYNAMO_OUTER_GRAPH"] = "false"

# Under pytest-xdist the workers share the cores: each runs torch (and what it starts) on one
# intra-op thread, since an OpenMP thread whose core another process holds stalls the others at
# every barrier (a 2-thread step 10-60x slower on 2 cores beside a busy process, torch 2.13).
PARALLEL_WORKER = os.environ.get("PYTEST_XDIST_WORKER") is not None
if PARALLEL_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# Rough seconds a test costs on 2 cores, by marker: what orders the modules below.
COST_MULTIPROCESS, COST_INDUCTOR, COST_SUBPROCESSES, COST_OTHER = 20.0, 10.0, 10.0, 0.5


def _cost(item) -> float:
    if item.get_closest_marker("multiprocess") is not None:
        return COST_MULTIPROCESS
    if item.get_closest_marker("inductor") is not None:
        return COST_INDUCTOR
    if item.get_closest_marker("subprocesses") is not None:
        return COST_SUBPROCESSES
    return COST_OTHER


def pytest_collection_modifyitems(config, items):
    """Modules in order of their estimated cost, the longest first, and in each module its
    launches and real compiles first. Parallel workers take whole modules in this order
    (make test: --dist loadscope --no-loadscope-reorder), longest first, so the short modules
    left at the end even out the finish instead of one worker running a long module alone."""
    module_cost: dict[str, float] = {}
    for item in items:
        module_cost[item.nodeid.split("::")[0]] = module_cost.get(item.nodeid.split("::")[0], 0.0) + _cost(item)
    position = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-module_cost[item.nodeid.split("::")[0]], -_cost(item), position[item.nodeid]))


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
    run, never in the user's ~/.cache; parallel workers share it (the run's folder above theirs),
    so a kernel one worker built is there for the others (Inductor writes its entries atomically)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if PARALLEL_WORKER else base) / "kiln-compile-cache"
    folder.mkdir(exist_ok=True)
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
