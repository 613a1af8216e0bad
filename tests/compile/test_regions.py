import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from kiln import KilnCompileWarning, compile_regions, find_repeated_blocks
from kiln.compile.regions import compiled_regions, select_blocks, uncompile
from toy_models import DecoderBlock, EncoderBlock, EncoderDecoder, Flat, tiny_gpt2, tiny_llama

FAST = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}


def test_finds_blocks_in_both_stacks_of_an_encoder_decoder():
    blocks = find_repeated_blocks(EncoderDecoder(depth=3))
    assert blocks == {
        EncoderBlock: ["encoder.0", "encoder.1", "encoder.2"],
        DecoderBlock: ["decoder.0", "decoder.1", "decoder.2"],
    }


def test_finds_transformers_decoder_layers():
    assert {c.__name__: p for c, p in find_repeated_blocks(tiny_gpt2(3)).items()} == {
        "GPT2Block": ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    }
    assert {c.__name__: p for c, p in find_repeated_blocks(tiny_llama(2)).items()} == {
        "LlamaDecoderLayer": ["model.layers.0", "model.layers.1"]
    }


def test_builtin_layers_and_single_children_are_not_blocks():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), EncoderBlock(4))
    assert find_repeated_blocks(model) == {}


def test_outermost_repeated_block_wins():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.ModuleList(EncoderBlock(4) for _ in range(2))

    model = nn.ModuleList(Outer() for _ in range(2))
    assert find_repeated_blocks(model) == {Outer: ["0", "1"]}


@pytest.mark.parametrize("make, inputs", [
    (lambda: EncoderDecoder(), lambda: (torch.randn(2, 5, 8),)),
    (lambda: tiny_gpt2(3), lambda: (torch.randint(0, 97, (2, 12)),)),
    (lambda: tiny_llama(3), lambda: (torch.randint(0, 97, (2, 12)),)),
])
def test_regional_compile_matches_eager_and_shares_one_graph_per_class(make, inputs):
    model = make().eval()
    args = inputs()
    kwargs = {"use_cache": False} if not isinstance(model, EncoderDecoder) else {}
    with torch.no_grad():
        expected = _logits(model(*args, **kwargs))
        keys = list(model.state_dict())
        returned = compile_regions(model, **FAST)
        actual = _logits(model(*args, **kwargs))
    assert returned is model
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    regions = compiled_regions(model)
    assert regions and all(r.instances >= 2 for r in regions)
    # every instance ran compiled code, and all instances of a class share one graph
    assert all(r.graphs == 1 and r.calls == r.instances for r in regions)
    assert counters["stats"]["unique_graphs"] == len(regions)
    assert list(model.state_dict()) == keys


def test_regional_compile_keeps_class_keys_and_hooks():
    model = EncoderDecoder()
    block = model.decoder[1]
    keys = list(model.state_dict())
    seen = []
    block.register_forward_hook(lambda mod, inp, out: seen.append("before"))
    compile_regions(model, **FAST)
    block.register_forward_pre_hook(lambda mod, inp: seen.append("after-pre"))
    model(torch.randn(2, 3, 8))
    assert type(block) is DecoderBlock and type(model) is EncoderDecoder
    assert list(model.state_dict()) == keys
    assert seen == ["after-pre", "before"]


def test_regional_compile_trains_like_eager():
    torch.manual_seed(1)
    eager = EncoderDecoder()
    compiled = EncoderDecoder()
    compiled.load_state_dict(eager.state_dict())
    compile_regions(compiled, **FAST)
    x, target = torch.randn(4, 3, 8), torch.randn(4, 3, 4)
    for model in (eager, compiled):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, msg=name)
    assert all(r.calls > 0 for r in compiled_regions(compiled))


def test_each_block_class_has_its_own_recompile_budget():
    # module.compile() shares one Dynamo cache across all modules; past 8 entries the rest ran eagerly.
    classes = [type(f"Block{i}", (EncoderBlock,), {}) for i in range(10)]
    model = nn.Sequential(*(nn.Sequential(cls(4), cls(4)) for cls in classes))
    compile_regions(model, **FAST)
    model(torch.randn(2, 4))
    regions = compiled_regions(model)
    assert len(regions) == 10
    assert [r.calls for r in regions] == [2] * 10


def test_model_without_repeated_blocks_warns_and_compiles_whole_model():
    model = Flat()
    with pytest.warns(KilnCompileWarning, match="no repeated blocks"):
        compile_regions(model, **FAST)
    expected = Flat()
    expected.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), expected(x))
    (region,) = compiled_regions(model)
    assert region.kind == "full" and region.calls == 1


@pytest.mark.parametrize("precompile", [
    lambda m: compile_regions(m, **FAST),
    lambda m: m.decoder[0].compile(backend="aot_eager"),
])
def test_compiling_a_compiled_model_warns_and_changes_nothing(precompile):
    model = EncoderDecoder()
    precompile(model)
    before = compiled_regions(model)
    with pytest.warns(KilnCompileWarning, match="already compiled"):
        assert compile_regions(model, **FAST) is model
    assert compiled_regions(model) == before


def test_compiling_an_optimized_module_warns():
    wrapped = torch.compile(EncoderDecoder(), backend="aot_eager")
    with pytest.warns(KilnCompileWarning, match="already compiled"):
        assert compile_regions(wrapped, **FAST) is wrapped


def test_user_can_name_block_classes_and_paths():
    model = EncoderDecoder()
    assert select_blocks(model, block_classes=["DecoderBlock"]) == {
        DecoderBlock: ["decoder.0", "decoder.1", "decoder.2"]}
    assert select_blocks(model, block_paths=["encoder.1", "decoder.0"]) == {
        EncoderBlock: ["encoder.1"], DecoderBlock: ["decoder.0"]}
    compile_regions(model, block_classes=[DecoderBlock], **FAST)
    model(torch.randn(2, 3, 8))
    (region,) = compiled_regions(model)
    assert region.name == "DecoderBlock" and region.calls == 3


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = EncoderBlock(8), EncoderBlock(8)

    def forward(self, x):
        return self.second(self.first(x))


class _Declaring(nn.Module):
    """The search would pick the stages (repeated in a ModuleList); the model says its repeated
    block is the one inside them, as diffusers models do (UNet stages hold the blocks)."""

    _repeated_blocks = ["EncoderBlock", "NotInThisConfig"]

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(_Stage() for _ in range(2))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def test_a_models_own_declaration_of_its_repeated_blocks_decides():
    from kiln.compile.report import compile_report

    model = _Declaring()
    assert find_repeated_blocks(model) == {_Stage: ["stages.0", "stages.1"]}
    assert select_blocks(model) == {EncoderBlock: ["stages.0.first", "stages.0.second", "stages.1.first",
                                                   "stages.1.second"]}
    x = torch.randn(2, 5, 8)
    with torch.no_grad():  # one signature for every block (with grad the first block's input differs)
        expected = model(x)
        compile_regions(model, **FAST)
        torch.testing.assert_close(model(x), expected)
    (region,) = compile_report(model).regions
    assert region.name == "EncoderBlock" and region.instances == 4 and region.graphs == 1 and region.compiled_calls == 4
    assert region.chosen_by == "the model's _repeated_blocks (EncoderBlock)"
    assert "EncoderBlock: chosen by the model's _repeated_blocks (EncoderBlock)" in compile_report(model).table()
    # The user's choice still wins over the model's.
    assert select_blocks(_Declaring(), block_paths=["stages.0.first"]) == {EncoderBlock: ["stages.0.first"]}


def test_a_malformed_declaration_is_a_type_error():
    model = _Declaring()
    model._repeated_blocks = "EncoderBlock"
    with pytest.raises(TypeError, match="_repeated_blocks must be a list of class names"):
        select_blocks(model)


def test_unknown_block_class_lists_the_models_classes():
    with pytest.raises(ValueError, match=r"no module of class Nope.*DecoderBlock"):
        compile_regions(EncoderDecoder(), block_classes=["Nope"], **FAST)


def test_nested_regions_are_refused():
    with pytest.raises(ValueError, match="lies inside"):
        select_blocks(EncoderDecoder(), block_paths=["encoder", "encoder.0"])


def test_unknown_compile_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unknown torch.compile keyword"):
        compile_regions(EncoderDecoder(), backend="aot_eager", fullgrph=True)


def test_unknown_backend_is_refused_before_compiling():
    with pytest.raises(ValueError, match="unknown backend"):
        compile_regions(EncoderDecoder(), backend="indutor")


def test_uncompile_restores_eager_forwards():
    model = EncoderDecoder()
    compile_regions(model, **FAST)
    uncompile(model)
    assert compiled_regions(model) == []
    assert all("forward" not in vars(m) for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCompileWarning)
        compile_regions(model, **FAST)  # compilable again, no "already compiled" warning


def _logits(output):
    return output if isinstance(output, torch.Tensor) else output.logits


def test_activation_checkpointing_is_compiled_once_per_class_and_matches_eager():
    from kiln.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    eager = EncoderDecoder()
    model = EncoderDecoder()
    model.load_state_dict(eager.state_dict())
    blocks = find_repeated_blocks(model)
    apply_activation_checkpointing(model, [p for paths in blocks.values() for p in paths])
    compile_regions(model, **FAST)
    x = torch.randn(2, 3, 8)
    model(x).sum().backward()
    eager(x).sum().backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    regions = compiled_regions(model)
    assert [(r.graphs, r.calls) for r in regions] == [(1, 3), (1, 3)]
    uncompile(model)  # back to the checkpointed, uncompiled forward
    assert all(getattr(m.forward, "__func__", None) is not None for m in model.decoder)


@pytest.mark.parametrize("settings, marked", [({"mode": "reduce-overhead"}, True),
                                              ({"mode": "max-autotune"}, True),
                                              ({"options": {"triton.cudagraphs": True}}, True),
                                              ({"mode": "default"}, False)])
def test_cuda_graph_modes_start_a_new_step_at_each_call_of_the_model(monkeypatch, settings, marked):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = EncoderDecoder()
    compile_regions(model, backend="inductor", **settings)
    x = torch.randn(2, 5, 8)
    with torch._dynamo.config.patch(disable=True):  # the compiled forwards run eagerly: no compile on a CPU
        model(x)
        model(x)
    assert len(marks) == (2 if marked else 0)  # once per call of the model, not once per block
    uncompile(model)
    model(x)
    assert len(marks) == (2 if marked else 0)
