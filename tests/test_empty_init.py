import copy
import os
import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.overrides import _get_current_function_mode_stack
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import kiln
from kiln import Accelerator, CheckpointMismatchError, TorchDynamoPlugin
from kiln.checkpoint import save_state_dict
from kiln.compile.regions import compiled_regions
from toy_models import tiny_gpt2, tiny_llama

ROPE = "model.rotary_emb.inv_freq"


def _empty_like(reference, include_buffers=False, **kwargs):
    with kiln.init_empty_weights(include_buffers=include_buffers):
        model = AutoModelForCausalLM.from_config(reference.config, **kwargs)
    model.loss_type = "ForCausalLM"
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids, use_cache=False).logits


@pytest.fixture
def reference():
    return tiny_llama(2).eval()


@pytest.fixture
def ids():
    return torch.randint(0, 97, (2, 12))


def test_parameters_are_built_on_meta_and_buffers_keep_their_values_on_cpu(reference):
    model = _empty_like(reference)
    assert all(p.is_meta for p in model.parameters())
    assert dict(model.named_buffers()).keys() == dict(reference.named_buffers()).keys()
    for name, buffer in model.named_buffers():
        assert buffer.device.type == "cpu", name
        assert torch.equal(buffer, reference.get_buffer(name)), name  # rotary inv_freq needs no re-initialising


class Holder(nn.Module):
    """Registers tensors made before it was built, which no default device reaches."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)
        self.weight = nn.Parameter(table.clone())


def test_include_buffers_puts_buffers_on_meta_too(reference, monkeypatch):
    model = _empty_like(reference, include_buffers=True)
    assert all(p.is_meta for p in model.parameters())
    assert model.get_buffer(ROPE).is_meta
    table = torch.arange(4.0)
    with kiln.init_empty_weights(include_buffers=True):
        everything = Holder(table)
    with kiln.init_empty_weights():
        parameters_only = Holder(table)
    assert everything.table.is_meta and everything.weight.is_meta
    assert parameters_only.table is table and parameters_only.weight.is_meta
    monkeypatch.setenv("KILN_INIT_INCLUDE_BUFFERS", "1")  # Accelerate's ACCELERATE_INIT_INCLUDE_BUFFERS
    with kiln.init_empty_weights():
        built = AutoModelForCausalLM.from_config(reference.config)
    assert built.get_buffer(ROPE).is_meta
    monkeypatch.setenv("KILN_INIT_INCLUDE_BUFFERS", "sometimes")
    with pytest.raises(ValueError, match="KILN_INIT_INCLUDE_BUFFERS='sometimes' is not a boolean"):
        kiln.init_empty_weights()


def test_a_model_of_hundreds_of_megabytes_allocates_no_parameter_memory():
    config = LlamaConfig(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=32000)
    resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    before = resident()
    with kiln.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    grown = resident() - before
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > 600e6
    assert all(p.is_meta for p in model.parameters())
    assert grown < weight_bytes / 20, f"resident memory grew by {grown / 1e6:.0f} MB"


def test_load_state_dict_with_assign_gives_the_normally_built_models_outputs(reference, ids):
    model = _empty_like(reference)
    model.load_state_dict(reference.state_dict(), assign=True)
    assert not any(t.is_meta for t in model.state_dict().values())
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_load_model_fills_the_empty_model_in_place(reference, ids, tmp_path):
    Accelerator().save_model(reference, tmp_path)
    model = _empty_like(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the empty parameters
    assert kiln.load_model(model, tmp_path) is model
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    # filled in place: the optimizer's parameters are the model's, no longer empty
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert not any(p.is_meta for p in model.parameters())


def test_load_model_keeps_tied_weights_and_the_models_dtype(ids, tmp_path):
    reference = tiny_gpt2(2).eval()
    save_state_dict(reference.state_dict(), tmp_path)
    with kiln.init_empty_weights():
        model = AutoModelForCausalLM.from_config(reference.config, dtype=torch.bfloat16)
    kiln.load_model(model, tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(_logits(model, ids), _logits(reference.to(torch.bfloat16), ids))
    # the file's two names share one tensor; a model that does not tie them gets two
    config = copy.deepcopy(reference.config)
    config.tie_word_embeddings = False
    with kiln.init_empty_weights():
        untied = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # from_config set bf16 on the config
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    kiln.load_model(untied, tmp_path)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    assert torch.equal(untied.lm_head.weight, untied.transformer.wte.weight)


def test_load_model_names_the_empty_parameter_that_the_file_lacks(reference, tmp_path):
    state = reference.state_dict()
    del state["model.norm.weight"]
    save_state_dict(state, tmp_path)
    with pytest.raises(CheckpointMismatchError, match="model.norm.weight"):
        kiln.load_model(_empty_like(reference), tmp_path, strict=False)
    # non-persistent buffers are never saved: with include_buffers=True they cannot be filled
    save_state_dict(reference.state_dict(), tmp_path)
    with pytest.raises(CheckpointMismatchError, match=f"{ROPE}.*include_buffers=False"):
        kiln.load_model(_empty_like(reference, include_buffers=True), tmp_path)


def test_from_pretrained_loads_the_saved_weights_outside_and_inside_the_block(reference, ids, tmp_path):
    reference.save_pretrained(tmp_path)
    expected = _logits(reference, ids)
    outside = LlamaForCausalLM.from_pretrained(tmp_path)
    with kiln.init_empty_weights():
        inside = LlamaForCausalLM.from_pretrained(tmp_path)  # a loader's weights are kept, not emptied
    for model in (outside, inside):
        assert not any(t.is_meta for t in model.state_dict().values())
        assert torch.equal(_logits(model, ids), expected)
    # under torch's meta default device (include_buffers=True) transformers 5 refuses by itself
    with pytest.raises(RuntimeError, match="from_pretrained.+meta device"):
        with kiln.init_empty_weights(include_buffers=True):
            LlamaForCausalLM.from_pretrained(tmp_path)


def test_regional_compile_trains_the_filled_model_like_eager(reference, ids, tmp_path):
    Accelerator().save_model(reference, tmp_path)
    eager = tiny_llama(2)
    eager.load_state_dict(reference.state_dict())
    model = kiln.load_model(_empty_like(reference), tmp_path).train()
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected = eager(input_ids=ids, labels=ids, use_cache=False).loss
        expected.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    regions = compiled_regions(model)
    assert regions and all(r.calls > 0 for r in regions), [(r.name, r.calls) for r in regions]


def test_prepare_refuses_a_model_with_empty_parameters_naming_them(reference):
    with pytest.raises(ValueError, match="model.embed_tokens.weight, .+ more. Load the weights before prepare: "
                                         "kiln.load_model"):
        Accelerator().prepare(_empty_like(reference))
    model = _empty_like(reference, include_buffers=True)
    model.load_state_dict(reference.state_dict(), assign=True)  # persistent tensors only: inv_freq stays empty
    with pytest.raises(ValueError, match=f"buffer.+{ROPE}.+include_buffers=False"):
        Accelerator().prepare(model)


def test_prepare_refuses_an_optimizer_built_on_the_empty_parameters(reference):
    model = _empty_like(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(reference.state_dict(), assign=True)  # new parameter objects in the model
    with pytest.raises(ValueError, match="optimizer holds 21 parameter.+meta device.+after loading"):
        Accelerator().prepare(model, optimizer)


def _torch_state():
    return (list(torch_module._global_parameter_registration_hooks),
            list(torch_module._global_buffer_registration_hooks),
            [type(mode) for mode in _get_current_function_mode_stack()])


@pytest.mark.parametrize("include_buffers", [False, True])
def test_leaving_the_block_restores_torch_even_after_an_exception(include_buffers):
    before = _torch_state()
    with pytest.raises(KeyError):
        with kiln.init_empty_weights(include_buffers=include_buffers):
            assert nn.Linear(2, 2).weight.is_meta
            raise KeyError("inside")
    assert _torch_state() == before
    assert torch.empty(1).device.type == "cpu"
    assert not nn.Linear(2, 2).weight.is_meta


def test_nested_blocks_each_restore_their_own_setting():
    before = _torch_state()
    with kiln.init_empty_weights():
        with kiln.init_empty_weights(include_buffers=True):
            inner = nn.BatchNorm1d(3)
        outer = nn.BatchNorm1d(3)
        with kiln.init_on_device("meta"):
            same = nn.Linear(2, 2)
        with kiln.init_on_device("cpu"):
            innermost_wins = nn.Linear(2, 2)
        after_inner = nn.Linear(2, 2)
    assert inner.weight.is_meta and inner.running_mean.is_meta
    assert innermost_wins.weight.device.type == "cpu"
    assert outer.weight.is_meta and outer.running_mean.device.type == "cpu"
    assert same.weight.is_meta and after_inner.weight.is_meta
    assert _torch_state() == before and not nn.Linear(2, 2).weight.is_meta


def test_only_what_a_constructor_creates_goes_to_meta_in_this_thread(reference):
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.proj.weight = nn.Parameter(torch.randn(4, 4))  # a parent setting a child's parameter
            self.scale = nn.Parameter(torch.ones(4))

    built_elsewhere = []
    with kiln.init_empty_weights():
        wrapper = Wrapper()
        thread = threading.Thread(target=lambda: built_elsewhere.append(nn.Linear(2, 2)))
        thread.start()
        thread.join()
        loaded = tiny_llama(2)
        loaded.load_state_dict(reference.state_dict(), assign=True)  # a loader, not a constructor
    assert all(p.is_meta for p in wrapper.parameters())
    assert not built_elsewhere[0].weight.is_meta  # another thread is not inside the block
    assert not any(p.is_meta for p in loaded.parameters())
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
