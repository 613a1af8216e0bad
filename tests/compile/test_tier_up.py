"""compile_regions(outer_graph="background") (kiln/compile/tier_up.py): per-block regions first, the
outer graph once a helper process has compiled it. aot_eager, whose output no cache keeps: the
outer graph is then traced again here when the helper is done, which is what these tests check
the logic with (tests/compile/test_inductor.py shows that Inductor's compile finds the helper's
graphs in the caches)."""

import copy
import time
import warnings

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile import outer_graph
from kiln.compile.artifacts.background import same_tensors, with_same_tensors
from kiln.compile.regions import KilnCompileWarning, compile_regions, compiled_regions, uncompile
from kiln.compile.report import compile_report
from toy_models import tiny_llama

pytestmark = pytest.mark.skipif(not outer_graph.supported(), reason="torch without nested_compile_region")

SWITCH_TIMEOUT = 240  # seconds: a helper's start and its aot_eager compile, beside other test workers
# Seconds the loops wait between steps until the switch: on 2 cores beside another test worker, steps
# run back to back starve the helper they wait for (96 s for a switch that takes 20 s alone).
HELPER_SHARE = 0.2


def test_training_moves_to_the_outer_graph_when_the_helper_is_done_with_the_plain_loops_losses(monkeypatch):
    """Through prepare, as the docs show it: AdamW steps equal the plain eager loop's before, at and
    after the switch; the blocks' own regions run until it, the outer graph after it. Training's
    threads fill the (pretended) cores: it gives the helper one from its first call, before its
    blocks compile (no recompile for the thread count), and gets it back at the switch."""
    import kiln.compile.artifacts.background as background

    monkeypatch.setattr(background, "free_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _train_across_the_switch()
    finally:
        torch.set_num_threads(threads)


def _train_across_the_switch():
    torch.manual_seed(0)
    plain = tiny_llama(layers=3, width=64, init_std=0.08)
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 97, (4, 16))
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, outer_graph="background",
                               cache=False)
    accelerator = Accelerator(dynamo_plugin=plugin, cpu=True)
    with pytest.warns(KilnCompileWarning, match="only Inductor's output is cached"):
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    block, outer = compiled_regions(model)
    tier_up = outer.tier_up
    assert (block.kind, outer.kind, outer.shared_blocks) == ("block", "outer", {"LlamaDecoderLayer": 3})

    def step(net, opt, backward):
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    began, steps, switched_at = time.monotonic(), 0, None
    while switched_at is None or steps < switched_at + 3:
        expected = step(plain, plain_optimizer, torch.Tensor.backward)
        assert step(model, optimizer, accelerator.backward) == pytest.approx(expected, abs=1e-5), steps
        steps += 1
        if steps == 1:  # the helper gets the signature at its second call, after the blocks have compiled
            assert not tier_up.compiler.submitted and block.calls == 3 and outer.calls == 0
            assert torch.get_num_threads() == 1
        if switched_at is None and outer.calls:
            switched_at = steps
        assert time.monotonic() - began < SWITCH_TIMEOUT, f"no switch after {steps} steps"
        if switched_at is None:
            time.sleep(HELPER_SHARE)
    # After the switch every step is one call of the outer graph; the blocks' regions are not called.
    assert outer.calls == steps - switched_at + 1 and block.calls == 3 * (switched_at - 1)
    assert tier_up.compiler is None  # nothing else to compile: the helper has exited
    assert torch.get_num_threads() == 2 and not any("num_threads" in r for r in block.recompile_reasons)
    report = accelerator.compile_report()
    assert not report.silent_regions
    table = report.table()
    assert "compiled in the background" in table and "switched to the outer graph after" in table
    assert "checked against eager: worst relative difference" in table  # the helper ran it eagerly too

    # An evaluation is another signature: the blocks' regions run it until the helper has compiled it.
    with torch.no_grad():
        calls = block.calls
        got = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(got, plain(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
        assert block.calls == calls + 3


def test_generation_with_a_kv_cache_stays_on_the_per_block_regions():
    torch.manual_seed(0)
    eager = tiny_llama(layers=2, width=64)
    model = copy.deepcopy(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnCompileWarning)  # aot_eager's output is not cached
        compile_regions(model, backend="aot_eager", outer_graph="background")
    prompt = torch.randint(1, 97, (1, 5))
    for _ in range(2):  # twice: a second call would send a signature the helper could rebuild
        got = model.generate(prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(got, eager.generate(prompt, max_new_tokens=3, do_sample=False))
    block, outer = compiled_regions(model)
    assert outer.calls == 0 and block.calls > 0 and outer.tier_up.compiler is None
    assert any("DynamicCache" in note and "per-block regions" in note for note in outer.tier_up.notes)
    uncompile(model)
    assert compiled_regions(model) == []
    assert "forward" not in vars(model) and all("forward" not in vars(b) for b in model.model.layers)


def test_settings_it_cannot_work_with_are_refused(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="outer_graph must be False, True, 'background' or 'auto'"):
        compile_regions(tiny_llama(layers=2), backend="aot_eager", outer_graph="sometimes")
    with pytest.raises(NotImplementedError, match="choose one of the two"):
        compile_regions(tiny_llama(layers=2), backend="aot_eager", outer_graph="background", fullgraph=True,
                        precompile=tmp_path)
    # torch's own patch: pytest's monkeypatch deletes the setting on undo, which hides it on torch 2.11
    # ("torch._inductor.config.force_disable_caches does not exist" in every later test of the process)
    with torch._inductor.config.patch(force_disable_caches=True), \
            pytest.raises(ValueError, match="needs Inductor's compile caches"):
        compile_regions(tiny_llama(layers=2), backend="inductor", outer_graph="background")
    with pytest.raises(TypeError, match="must be a bool, 'background' or 'auto'"):
        TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, outer_graph="sometimes")
    monkeypatch.setenv("KILN_DYNAMO_OUTER_GRAPH", "background")
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    assert plugin.outer_graph == "background"
    from kiln.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin

    with pytest.raises(NotImplementedError, match="outer_graph='background'.*FSDP2"):
        FSDPStrategy(FullyShardedDataParallelPlugin(), torch.device("cpu")).check_compile(plugin)


def test_the_helper_gets_a_calls_repeated_tensor_as_one_tensor():
    # labels=input_ids: Dynamo makes one graph input of the two, so the helper's call must repeat it
    # too, or its graph (and so its cache entries) would not be the training process's.
    ids, mask = torch.ones(2, 3), torch.zeros(2, 3)
    same = same_tensors((ids,), {"attention_mask": mask, "labels": ids})
    assert same == (("labels", 0),)
    args, kwargs = with_same_tensors((torch.zeros(2, 3),), {"attention_mask": torch.zeros(2, 3),
                                                           "labels": torch.zeros(2, 3)}, same)
    assert kwargs["labels"] is args[0] and kwargs["attention_mask"] is not args[0]


def test_transformers_gradient_checkpointing_moves_to_the_outer_graph_with_eagers_gradients():
    # gradient_checkpointing_enable keeps handles of a hook defined in a function
    # (`_require_grads_hook(s)`), which do not pickle: the helper's copy leaves them out. With
    # Inductor the switch then finds all 3 of the outer graph's entries in the caches (host probe,
    # docs/compiling.md); here, with aot_eager, the losses and gradients are checked across it.
    torch.manual_seed(0)
    eager = tiny_llama(layers=2, width=64, init_std=0.08)
    model = copy.deepcopy(eager)
    for net in (eager, model):
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnCompileWarning)  # aot_eager's output is not cached
        compile_regions(model, backend="aot_eager", outer_graph="background")
    block, outer = compiled_regions(model)
    ids = torch.randint(0, 97, (2, 16))
    began, after = time.monotonic(), 0
    while after < 2:
        for net in (eager, model):
            net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for (name, a), b in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
            a.grad = b.grad = None
        after += bool(outer.calls)
        assert time.monotonic() - began < SWITCH_TIMEOUT, "the outer graph never took over: " + str(outer.tier_up.notes)
        if not outer.calls:
            time.sleep(HELPER_SHARE)
    assert not any("kept on the per-block regions" in note for note in outer.tier_up.notes)


def test_a_model_the_helper_cannot_get_stays_per_block_from_its_first_call_on_all_threads(monkeypatch):
    """Known at the first call, before training lends the helper a thread: lent, the blocks would
    compile for one thread fewer and all compile again when it came back (8 s on a 2-layer Llama)."""
    import kiln.compile.artifacts.background as background

    monkeypatch.setattr(background, "free_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        eager = tiny_llama(layers=2, width=64)
        model = copy.deepcopy(eager)
        model.scale_fn = lambda x: x  # a lambda: the model does not pickle
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KilnCompileWarning)  # aot_eager's output is not cached
            compile_regions(model, backend="aot_eager", outer_graph="background")
        block, outer = compiled_regions(model)
        ids = torch.randint(0, 97, (2, 16))
        with pytest.warns(KilnCompileWarning, match="cannot be sent to the helper"):
            got = model(input_ids=ids, labels=ids, use_cache=False).loss
        assert torch.get_num_threads() == 2 and outer.tier_up.compiler is None
        for _ in range(2):
            torch.testing.assert_close(got, eager(input_ids=ids, labels=ids, use_cache=False).loss)
            got = model(input_ids=ids, labels=ids, use_cache=False).loss
        assert outer.calls == 0 and block.calls == 6 and block.graphs == 1
    finally:
        torch.set_num_threads(threads)


def test_an_outer_graph_with_wrong_gradients_is_caught_by_the_helper_and_never_used():
    """The helper runs its copy eagerly too and compares (eager_check.py). A backend whose outer
    graph scales the gradients (right outputs, as under torch's buffer reuse bug) is refused there:
    training stays on its per-block regions, with eager's gradients, and says why once."""
    from wrong_outer_backend import wrong_outer_gradients

    torch.manual_seed(0)
    eager = tiny_llama(layers=2, width=64, init_std=0.08)
    model = copy.deepcopy(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnCompileWarning)  # a backend whose output is not cached
        compile_regions(model, backend=wrong_outer_gradients, outer_graph="background")
    block, outer = compiled_regions(model)
    tier_up = outer.tier_up
    ids = torch.randint(0, 97, (2, 16))
    began, caught = time.monotonic(), []
    while not any("differs from eager's" in note for note in tier_up.notes):
        with warnings.catch_warnings(record=True) as caught_now:
            warnings.simplefilter("always", KilnCompileWarning)
            got = model(input_ids=ids, labels=ids, use_cache=False).loss
        caught += [str(w.message) for w in caught_now]
        got.backward()
        eager(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for (name, a), b in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
            a.grad = b.grad = None
        assert time.monotonic() - began < SWITCH_TIMEOUT, "the helper never answered: " + str(tier_up.notes)
        time.sleep(HELPER_SHARE)
    assert outer.calls == 0
    assert [m for m in caught if "differs from eager's" in m] == [
        next(m for m in caught if "kept on the per-block regions" in m)]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # and later calls stay per-block
    assert outer.calls == 0 and tier_up.compiler is None
    assert "kept on the per-block regions: the outer graph's gradient of" in compile_report(model).table()
