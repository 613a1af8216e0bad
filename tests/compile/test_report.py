import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from kiln import Accelerator, KilnCompileWarning, TorchDynamoPlugin, compile_regions, compile_report
from kiln.compile.monitor import KilnFallbackWarning, KilnRecompileError, KilnRecompileWarning
from kiln.compile.regions import mark_warm
from toy_models import EncoderBlock, EncoderDecoder, tiny_gpt2


class BreakingBlock(nn.Module):
    """A block with a planted graph break in the middle of its forward."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x)


@contextlib.contextmanager
def no_kiln_warnings():
    """Kiln's own warnings become errors; torch's internal ones are none of these tests' business."""
    with warnings.catch_warnings():
        for category in (KilnCompileWarning, KilnRecompileWarning, KilnFallbackWarning):
            warnings.simplefilter("error", category)
        yield


def _plugin(**overrides):
    settings = dict(backend="aot_eager", fullgraph=True, dynamic=False, use_regional_compilation=True)
    return TorchDynamoPlugin(**{**settings, **overrides})


def _train_step(model, optimizer, acc, length):
    out = model(torch.randn(2, length, 8))
    acc.backward(out.float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def test_report_counts_a_planted_graph_break_with_its_reason():
    model = nn.Sequential(BreakingBlock(), BreakingBlock())
    compile_regions(model, backend="aot_eager", fullgraph=False)
    model(torch.randn(2, 8))
    (region,) = compile_report(model).regions
    assert region.name == "BreakingBlock" and region.instances == 2
    assert sum(region.graph_breaks.values()) >= 1
    assert any("graph_break" in reason for reason in region.graph_breaks)
    assert region.graphs >= 2  # a graph on each side of the break
    assert region.compiled_calls >= 2 and region.eager_calls == 0


def test_a_graph_break_after_dynamos_counters_were_cleared_is_still_counted():
    # torch's own test case and test harnesses clear Dynamo's counters; the same break counted up to
    # the same number again afterwards was taken for nothing new (a region reported no breaks).
    first = nn.Sequential(BreakingBlock())
    compile_regions(first, backend="aot_eager", fullgraph=False)
    first(torch.randn(2, 8))
    before = dict(torch._dynamo.utils.counters["graph_break"])
    assert sum(compile_report(first).regions[0].graph_breaks.values()) >= 1
    torch._dynamo.utils.counters.clear()
    torch._dynamo.reset()  # the same block class traces again
    second = nn.Sequential(BreakingBlock())
    compile_regions(second, backend="aot_eager", fullgraph=False)
    second(torch.randn(2, 8))
    assert dict(torch._dynamo.utils.counters["graph_break"]) == before  # back up to the same counts
    assert compile_report(second).regions[0].graph_breaks == compile_report(first).regions[0].graph_breaks


def test_report_counts_a_planted_recompile_with_its_reason():
    model = EncoderDecoder()
    compile_regions(model, backend="aot_eager", dynamic=False)
    model(torch.randn(2, 3, 8))
    model(torch.randn(2, 5, 8))  # another length under dynamic=False: one recompile per region
    report = compile_report(model)
    assert [(r.name, r.graphs, r.recompiles) for r in report.regions] == [
        ("EncoderBlock", 2, 1), ("DecoderBlock", 2, 1)]
    assert all("size mismatch" in r.recompile_reasons[0] for r in report.regions)
    assert all(r.compile_seconds > 0 for r in report.regions)
    table = report.table()
    assert "EncoderBlock" in table and "recompiled: " in table
    as_dict = report.as_dict()
    assert as_dict["graphs"] == 4 and as_dict["regions"][0]["recompiles"] == 1


def test_recompile_limit_fallback_is_reported_and_warned():
    model = nn.Sequential(EncoderBlock(8), EncoderBlock(8))
    compile_regions(model, backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        with pytest.warns(KilnFallbackWarning, match="recompile limit"):
            for length in range(1, 6):
                model(torch.randn(length, 8))
    (region,) = compile_report(model).regions
    assert region.recompile_limit_hit
    assert region.graphs == 2 and region.eager_calls > 0
    assert "recompile limit" in compile_report(model).table()


@pytest.mark.parametrize("policy", ["warn", "error", "allow"])
def test_recompile_after_warmup_meets_the_policy(policy):
    acc = Accelerator(dynamo_plugin=_plugin(recompile=policy))
    model = EncoderDecoder()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    with no_kiln_warnings():
        _train_step(model, optimizer, acc, length=3)  # warm-up: compiles freely
        _train_step(model, optimizer, acc, length=3)  # same shapes: no recompile, no warning
    if policy == "error":
        with pytest.raises(KilnRecompileError, match=r"EncoderBlock recompiled after warm-up: .*size mismatch"):
            _train_step(model, optimizer, acc, length=4)
    elif policy == "warn":
        with pytest.warns(KilnRecompileWarning, match="recompiled after warm-up: .*size mismatch"):
            _train_step(model, optimizer, acc, length=4)
    else:
        with no_kiln_warnings():
            _train_step(model, optimizer, acc, length=4)
    # the error stops the step in the encoder, before the decoder meets the new length
    expected = [1, 0] if policy == "error" else [1, 1]
    assert [r.recompiles for r in acc.compile_report().regions] == expected


def test_validation_under_no_grad_after_warmup_is_no_recompile_to_warn_about():
    acc = Accelerator(dynamo_plugin=_plugin(recompile="error"))
    model = EncoderDecoder()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    _train_step(model, optimizer, acc, length=3)
    _train_step(model, optimizer, acc, length=3)
    with no_kiln_warnings(), torch.no_grad():  # a new grad mode: a graph of its own, once, no error
        model(torch.randn(2, 3, 8))
    assert all("grad_mode" in r.recompile_reasons[-1] for r in acc.compile_report().regions)
    with pytest.raises(KilnRecompileError, match="size mismatch"), torch.no_grad():  # shapes still count
        model(torch.randn(2, 4, 8))


def test_switching_a_dropout_model_to_eval_after_warmup_is_no_recompile_error():
    model = tiny_gpt2(2)
    model.config.resid_pdrop = 0.1
    compile_regions(model, backend="aot_eager", recompile="error")
    ids = torch.randint(0, 97, (2, 8))
    model(ids, use_cache=False)
    mark_warm(model)
    model.eval()
    model(ids, use_cache=False)  # dropout's `training` flag is guarded: a new graph, no error
    (region,) = compile_report(model).regions
    assert region.recompiles == 1 and ".training == True" in region.recompile_reasons[0]


def test_silent_region_is_called_out_after_the_first_step():
    acc = Accelerator(dynamo_plugin=_plugin())
    model = EncoderDecoder()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    # force_eager stands in for whatever hides compiled code (a wrapper, a copy, a context)
    with torch.compiler.set_stance("force_eager"):
        with pytest.warns(KilnFallbackWarning, match=r"EncoderBlock ran NO compiled code.*ran eagerly") as caught:
            _train_step(model, optimizer, acc, length=3)
    assert caught[0].filename == __file__  # it points at the optimizer.step() call
    assert acc.compile_report().silent_regions == ["EncoderBlock", "DecoderBlock"]


def test_short_last_batch_under_static_shapes_warns():
    data = TensorDataset(torch.randn(10, 3, 8))
    with pytest.warns(KilnCompileWarning, match="last batch holds 2 samples instead of 4") as caught:
        Accelerator(dynamo_plugin=_plugin()).prepare(DataLoader(data, batch_size=4))
    assert caught[0].filename == __file__  # it points at the prepare() call
    with no_kiln_warnings():
        Accelerator(dynamo_plugin=_plugin()).prepare(DataLoader(data, batch_size=4, drop_last=True))
        Accelerator(dynamo_plugin=_plugin(dynamic=True)).prepare(DataLoader(data, batch_size=4))
        Accelerator().prepare(DataLoader(data, batch_size=4))  # no compile, nothing to warn about


def test_end_training_prints_the_report(capsys):
    acc = Accelerator(dynamo_plugin=_plugin())
    model = acc.prepare(EncoderDecoder())
    model(torch.randn(2, 3, 8))
    acc.end_training()
    out = capsys.readouterr().out
    assert "EncoderBlock" in out and "DecoderBlock" in out and "calls compiled/eager" in out


def test_unknown_recompile_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown recompile policy 'loud'"):
        _plugin(recompile="loud")


# ----- side by side: why this job's graphs were compiled one after another ------------------------

def _side_by_side_after_a_step(model, **plugin):
    acc = Accelerator(dynamo_plugin=_plugin(**plugin))
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train_step(model, optimizer, acc, 4)
    report = acc.compile_report()
    return report, report.table()


def test_report_says_two_region_groups_were_compiled_one_after_another_and_what_would_run_them_at_once():
    report, table = _side_by_side_after_a_step(EncoderDecoder())
    assert {r.name for r in report.regions} == {"EncoderBlock", "DecoderBlock"}
    assert report.side_by_side.startswith("no: 2 region groups compiled one after another in this process "
                                          "(the JIT path (the default)")
    assert "parallel_compile=True compiles them at once" in report.side_by_side
    assert f"side by side: {report.side_by_side}" in table
    assert report.as_dict()["side_by_side"] == report.side_by_side


def test_report_says_one_region_group_leaves_nothing_to_compile_side_by_side():
    report, _ = _side_by_side_after_a_step(nn.Sequential(nn.Linear(8, 8), *(EncoderBlock(8) for _ in range(3))))
    assert report.side_by_side.startswith("no: one compiled region (EncoderBlock)")


def test_report_says_nothing_of_side_by_side_before_anything_compiled():
    acc = Accelerator(dynamo_plugin=_plugin())
    acc.prepare(EncoderDecoder())
    report = acc.compile_report()
    assert report.side_by_side is None and "side by side" not in report.table()


def test_report_says_a_pool_had_nothing_to_run_at_once_for_a_single_region_group():
    from kiln.compile.report import CompileReport
    from kiln.compile.session import side_by_side_note

    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, parallel_compile=True)
    job = dict(region="LlamaDecoderLayer", signature="(4x64x128)", digest="8e68", worker=0, start=0.0, end=9.0,
               outcome="compiled")
    note = side_by_side_note(plugin, CompileReport(regions=[], timeline=[job]))
    assert note.startswith("no: one region group (LlamaDecoderLayer)")
    two = [job, dict(job, region="EncoderBlock", worker=1)]
    assert side_by_side_note(plugin, CompileReport(regions=[], timeline=two)) is None
