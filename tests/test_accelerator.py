import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from kiln import Accelerator, DistributedType, TorchDynamoPlugin
from kiln.compile.regions import compiled_regions
from kiln.optim import PreparedOptimizer, PreparedScheduler
from toy_models import EncoderDecoder, Regressor, tiny_gpt2

REGIONAL = dict(backend="aot_eager", fullgraph=True, dynamic=False, use_regional_compilation=True)


def _loader(n=8, batch=2):
    x, y = torch.randn(n, 3, 8), torch.randn(n, 3)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def test_process_facts_on_one_process():
    acc = Accelerator()
    assert acc.distributed_type is DistributedType.NO
    assert (acc.num_processes, acc.process_index, acc.is_main_process, acc.is_local_main_process) == (1, 0, True, True)
    assert acc.device.type in ("cpu", "cuda")
    assert {"NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", "XLA"} <= set(DistributedType.__members__)
    assert DistributedType.NO == "NO"


def test_prepare_returns_objects_in_order_and_schedulers_find_their_optimizer():
    acc = Accelerator()
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = _loader()
    s, m, l, o = acc.prepare(scheduler, model, loader, optimizer)
    assert m is model and isinstance(o, PreparedOptimizer) and isinstance(s, PreparedScheduler)
    assert len(l) == len(loader) and l.dataset is loader.dataset
    assert s.optimizers == [o]


def test_second_prepare_of_the_same_object_is_an_error():
    acc = Accelerator()
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    with pytest.raises(ValueError, match="already prepared"):
        acc.prepare(model)
    with pytest.raises(ValueError, match="already prepared"):
        acc.prepare(optimizer)
    with pytest.raises(ValueError, match="already prepared"):
        acc.prepare(optimizer.optimizer)


def test_prepare_rejects_unknown_objects():
    with pytest.raises(TypeError, match="prepare\\(\\) got a str"):
        Accelerator().prepare("model")


def test_unknown_mixed_precision_is_an_error():
    with pytest.raises(ValueError, match="unknown mixed_precision 'fp32'"):
        Accelerator(mixed_precision="fp32")


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("regional", [True, False])
def test_compiled_code_runs_under_every_precision(precision, regional):
    torch.manual_seed(0)
    model = EncoderDecoder()
    reference = EncoderDecoder()
    reference.load_state_dict(model.state_dict())
    plugin = TorchDynamoPlugin(**{**REGIONAL, "use_regional_compilation": regional})
    acc = Accelerator(dynamo_plugin=plugin, mixed_precision=precision)
    model = acc.prepare(model)
    x = torch.randn(2, 3, 8)
    out = model(x)
    regions = compiled_regions(model)
    assert regions and all(r.calls > 0 for r in regions), [(r.name, r.calls) for r in regions]
    assert [r.kind for r in regions] == (["block", "block"] if regional else ["full"])
    assert out.dtype == torch.float32  # outputs handed back in fp32
    with acc.autocast():
        expected = reference(x).float()
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert acc.compile_report().silent_regions == []


def test_gradient_accumulation_matches_one_large_batch():
    torch.manual_seed(0)
    data_x, data_y = torch.randn(8, 3, 8), torch.randn(8, 3)
    big = Regressor()
    small = Regressor()
    small.load_state_dict(big.state_dict())

    # one step on the whole batch of 8
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    big(data_x, data_y)["loss"].backward()
    opt_big.step()

    # four micro-batches of 2 with accumulation, compiled regionally
    acc = Accelerator(gradient_accumulation_steps=4, dynamo_plugin=TorchDynamoPlugin(**REGIONAL))
    opt_small = torch.optim.SGD(small.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(data_x, data_y), batch_size=2)
    small, opt_small, loader = acc.prepare(small, opt_small, loader)
    syncs = []
    for x, y in loader:
        with acc.accumulate(small):
            acc.backward(small(x, y)["loss"])
            syncs.append(acc.sync_gradients)
            opt_small.step()
            opt_small.zero_grad()
    assert syncs == [False, False, False, True]
    for (name, a), b in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_last_partial_window_of_an_epoch_still_steps():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, _loader(n=10, batch=2))
    synced = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(model(x, y)["loss"])
            synced.append(acc.sync_gradients)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert synced == [False, True, False, True, True]
    assert scheduler.scheduler.last_epoch == 3  # stepped only with the optimizer


def test_fp16_clipping_sees_unscaled_gradients():
    torch.manual_seed(0)
    model = Regressor()
    reference = Regressor()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 3, 8), torch.randn(4, 3)
    acc = Accelerator(mixed_precision="fp16")
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(x, y)["loss"])
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    with acc.autocast():
        loss = reference(x, y)["loss"].float()
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=1e-3)
    assert acc.scaler.get_scale() > 1  # the loss really was scaled
    optimizer.step()
    assert not acc.optimizer_step_was_skipped


def test_clip_grad_value_clips():
    acc = Accelerator()
    model = acc.prepare(Regressor())
    x, y = torch.randn(4, 3, 8), torch.randn(4, 3) * 100
    acc.backward(model(x, y)["loss"])
    acc.clip_grad_value_(model.parameters(), 0.01)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01 + 1e-7


def test_unwrap_model_returns_the_users_module():
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(**REGIONAL), mixed_precision="bf16")
    model = EncoderDecoder()
    prepared = acc.prepare(model)
    assert acc.unwrap_model(prepared) is model
    plain = acc.unwrap_model(prepared, keep_fp32_wrapper=False, keep_torch_compile=False)
    assert plain is model
    assert all("forward" not in vars(m) for m in model.modules())


def test_get_state_dict_has_plain_keys_even_with_a_users_torch_compile():
    model = EncoderDecoder()
    keys = list(model.state_dict())
    model.head = torch.compile(model.head, backend="eager")
    assert any("_orig_mod" in k for k in model.state_dict())
    assert list(Accelerator().get_state_dict(model)) == keys


def test_print_and_wait_for_everyone_on_one_process(capsys):
    acc = Accelerator()
    acc.print("hello", 1)
    acc.wait_for_everyone()
    assert capsys.readouterr().out == "hello 1\n"


def test_prepared_dataloader_moves_dict_batches_and_forwards_attributes():
    dataset = [{"x": torch.ones(2), "meta": "a"} for _ in range(3)]
    loader = DataLoader(dataset, batch_size=2)
    acc = Accelerator()
    prepared = acc.prepare(loader)
    batches = list(prepared)
    assert len(batches) == 2 and batches[0]["x"].device.type == acc.device.type
    assert batches[0]["meta"] == ["a", "a"]
    assert prepared.batch_size == 2


def test_world_size_without_rendezvous_address_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set; start the processes with `kiln launch`"):
        Accelerator()


def test_transformers_model_trains_compiled_in_bf16():
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(**REGIONAL), mixed_precision="bf16")
    model = tiny_gpt2(2)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 97, (4, 16))
    losses = []
    for _ in range(5):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        acc.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    assert out.logits.dtype == torch.float32
    assert losses[-1] < losses[0]
    (region,) = compiled_regions(model)
    assert region.name == "GPT2Block" and region.instances == 2 and region.calls == 10


def test_prepare_chooses_a_models_blocks_once_for_every_step(monkeypatch):
    """One plan per model (kiln/model_plan.py): checkpointing, compile and the strategy all take the
    blocks chosen once, not each its own selection."""
    import kiln.compile.regions as regions
    import kiln.model_plan as model_plan

    calls = []
    real = regions.select_blocks

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(regions, "select_blocks", counted)
    monkeypatch.setattr(model_plan, "select_blocks", counted)
    from toy_models import tiny_llama

    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    accelerator.prepare(tiny_llama(layers=2))
    assert len(calls) == 1
    report = accelerator.compile_report()
    assert [r.name for r in report.regions] == ["LlamaDecoderLayer"] and report.regions[0].instances == 2
