"""parallel_compile under fullgraph=False (the JIT path most users keep): an ahead-of-time compile
takes whole graphs only, so the pool of helpers JIT-compiles each region group into the shared
compile caches while step 1 runs eagerly; training waits for them at its end and JIT-compiles each
region from those caches (warm, with Inductor) at its first call in step 2."""

import copy
import warnings

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.monitor import KilnRecompileWarning
from kiln.compile.regions import KilnCompileWarning
from toy_models import BreakingEncoderDecoder, EncoderBlock, EncoderDecoder, train_step

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of an encoder-decoder whose encoder blocks break the graph, under fullgraph=False
    and parallel_compile with two workers: (accelerator, losses, final report, plain losses, cache folder)."""
    torch.manual_seed(0)
    model = BreakingEncoderDecoder()
    reference = copy.deepcopy(model)
    cache = tmp_path_factory.mktemp("cache")
    # aot_eager: the logic on any torch (no compiler cache to warm; the benchmark measures Inductor's).
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, fullgraph=False,
                               cache_dir=str(cache), parallel_compile=True, compile_workers=2)
    acc = Accelerator(dynamo_plugin=plugin)
    with pytest.warns(KilnCompileWarning, match=r"parallel_compile=True with fullgraph=False and backend 'aot_eager'"
                                                r".*only Inductor's output is kept there") as caught:
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len([w for w in caught if issubclass(w.category, KilnCompileWarning)]) == 1
    assert acc.compiler.background.pool.wait_ready(timeout=180)
    with warnings.catch_warnings():
        # The compiles at step 2 were owed since step 1: none of them is a recompile after warm-up.
        warnings.simplefilter("error", KilnRecompileWarning)
        losses = [train_step(model, optimizer, step, acc) for step in range(STEPS)]
    report = acc.compile_report()
    acc.end_training()
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = [train_step(reference, plain_optimizer, step) for step in range(STEPS)]
    return acc, losses, report, expected, cache


def test_fullgraph_false_with_parallel_compile_is_a_setting_with_a_note():
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=False, parallel_compile=True)
    assert plugin.compile_in_background and plugin.fullgraph is False
    assert any(note.startswith("fullgraph=False with parallel_compile=True: the helpers JIT-compile each region "
                               "into the compile caches") for note in plugin.notes)
    # Asked for by name, precompiled regions still need whole graphs.
    with pytest.raises(ValueError, match="precompile=True needs whole graphs, but fullgraph=False was given"):
        TorchDynamoPlugin(fullgraph=False, parallel_compile=True, precompile=True)


def test_step_1_runs_eagerly_and_every_later_call_runs_jit_compiled_code(run):
    _, _, report, _, _ = run
    assert {r.name for r in report.regions} == {"BreakingEncoderBlock", "DecoderBlock"}
    for region in report.regions:
        assert region.switch_step == 1, report.table()
        assert region.background_eager_calls == 3 and region.eager_calls == 3  # step 1's three instances
        assert region.precompiled_calls == 0 and region.jit_calls > 0
        assert region.invocations == 3 * STEPS and region.ran == "jit+eager"
        assert any("the helper JIT-compiled it into the shared compile caches (fullgraph=False rules an "
                   "ahead-of-time compile out); JIT-compiled after step 1" in note
                   for note in region.precompile_notes), region.precompile_notes
    breaking = next(r for r in report.regions if r.name == "BreakingEncoderBlock")
    assert breaking.graph_breaks and breaking.graphs >= 2  # the break split it: fullgraph=True would refuse


def test_the_helpers_filled_the_caches_side_by_side(run):
    _, _, report, _, cache = run
    assert sorted(job["region"] for job in report.timeline) == ["BreakingEncoderBlock", "DecoderBlock"]
    assert all(job["outcome"] == "caches only" for job in report.timeline), report.table()
    assert {job["worker"] for job in report.timeline} == {0, 1}
    assert report.side_by_side is None
    # Their word for the other local processes and for later runs: one marker per signature.
    assert len(list(cache.rglob("*.jit"))) == 2


def test_one_region_group_compiles_in_the_training_process_with_a_note(tmp_path):
    # One group leaves the pool nothing to run at once, and training would wait for it: the
    # training process compiles the region itself, from step 1, and the report says why.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), *(EncoderBlock(16) for _ in range(3)), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, fullgraph=False,
                               cache_dir=str(tmp_path), parallel_compile=True)
    acc = Accelerator(dynamo_plugin=plugin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is filled, so no warning about the backend either
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.compiler.background is None
    losses = [train_step(model, optimizer, step, acc) for step in range(2)]
    report = acc.compile_report()
    region = report.regions[0]
    assert region.ran == "jit" and region.eager_calls == 0 and region.jit_calls == 3 * 2
    assert report.side_by_side.startswith("no: one region group (EncoderBlock), so parallel_compile has nothing "
                                          "to run at once: the training process compiles it (JIT)")
    acc.end_training()
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = [train_step(reference, plain_optimizer, step) for step in range(2)]
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_a_lone_process_with_one_free_core_compiles_in_the_training_process(tmp_path, monkeypatch):
    # The helpers would only take turns with training on that core (measured: 1.48x slower).
    import kiln.compile.session as session

    monkeypatch.setattr(session, "free_cores", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    model = BreakingEncoderDecoder()
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, fullgraph=False,
                               cache_dir=str(tmp_path), parallel_compile=True)
    acc = Accelerator(dynamo_plugin=plugin)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.compiler.background is None
    train_step(model, optimizer, 0, acc)
    report = acc.compile_report()
    assert all(r.ran == "jit" and r.eager_calls == 0 for r in report.regions), report.table()
    assert report.side_by_side.startswith("no: one free core (this process's affinity), so parallel_compile's "
                                          "helpers would only take turns with it: the training process compiles "
                                          "them (JIT)")
    acc.end_training()


@pytest.mark.inductor
@pytest.mark.warm_starts
def test_with_inductor_training_compiles_every_graph_from_the_helpers_caches(tmp_path):
    # What the mode is for: the training process's own compiles at step 2 find every forward and
    # backward graph the helpers compiled (an empty Inductor folder of this test's own), so Inductor
    # generates and builds nothing in training.
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = EncoderDecoder()
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True, fullgraph=False,
                               cache_dir=str(tmp_path), parallel_compile=True, compile_workers=2)
    acc = Accelerator(dynamo_plugin=plugin)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train_step(model, optimizer, 0, acc)  # eager, then the wait for the helpers
    assert not counters["inductor"]["fxgraph_cache_miss"]  # nothing compiled here yet
    train_step(model, optimizer, 1, acc)
    report = acc.compile_report()
    acc.end_training()
    assert [job["outcome"] for job in report.timeline] == ["caches only", "caches only"], report.table()
    assert all(r.ran == "jit+eager" for r in report.regions), report.table()
    # Two region groups, each a forward and a backward graph.
    assert counters["inductor"]["fxgraph_cache_hit"] == 4 and counters["inductor"]["fxgraph_cache_miss"] == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] == 2 and not counters["aot_autograd"]["autograd_cache_miss"]


def test_losses_equal_the_plain_loop(run):
    _, losses, _, expected, _ = run
    assert losses[0] == expected[0]  # step 1 ran the blocks eagerly
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-6)
