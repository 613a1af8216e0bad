"""Precompiled regions (kiln/compile/artifacts/precompiled.py): artifacts saved per call signature, loaded by a
later run without a Dynamo trace, checked before use, and rebuilt when they do not fit.

A "later run" is a new model compiled over the same folder after `torch._dynamo.reset()`: nothing
compiled in memory is reused then. The fresh-process case is the demo's test (tests/examples).
"""

import copy
import importlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.artifacts import precompiled as pc
from kiln.compile.artifacts.cache import KilnCacheWarning
from kiln.compile.regions import compile_regions, compiled_regions
from kiln.compile.report import compile_report
from kiln.compile.regions import KilnCompileWarning
from toy_models import BreakingEncoderDecoder, tiny_llama, train_step
from torch_features import PRECOMPILE_BACKEND, saves_ahead_of_time

ROOT = Path(__file__).resolve().parents[3]


def _llama(seed=0, layers=3):
    torch.manual_seed(seed)
    model = tiny_llama(layers).train()
    model.config.loss_type = model.loss_type = "ForCausalLM"
    return model


def _compiled(model, folder, **kwargs):
    kwargs.setdefault("backend", PRECOMPILE_BACKEND)
    kwargs.setdefault("fullgraph", True)
    return compile_regions(model, precompile=folder, **kwargs)


def _step(model, length=16, seed=1):
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _region(model):
    (region,) = compile_report(model).regions
    return region


def _artifacts(folder):
    return sorted(Path(folder).rglob("*.kpc"))


def test_artifact_round_trip_equals_eager_on_another_instance(tmp_path):
    first = _compiled(_llama(seed=0), tmp_path)
    _step(first)
    saved = _region(first)
    assert (saved.ran, saved.traces, saved.precompiled_saved) == ("precompiled", 1, 1)
    assert len(_artifacts(tmp_path)) == 1

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    other = _llama(seed=5)  # other weights: the artifact holds code, not weights
    reference = copy.deepcopy(other)
    _compiled(other, tmp_path)
    loss, grads = _step(other)
    expected_loss, expected_grads = _step(reference)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6)
    region = _region(other)
    assert region.traces == 0 and region.jit_calls == 0  # no Dynamo trace: the code was loaded
    assert region.precompiled_calls == 3 and region.ran == "precompiled"
    assert region.precompiled_loaded == 1 and region.precompile_load_seconds > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_where_torch_cannot_save_a_backends_output_precompile_is_jit_with_one_warning(tmp_path):
    # torch 2.11 saves Inductor output only: with aot_eager there, precompile=True must still
    # train (JIT-compiled, the same numbers) and say why once; where it can be saved, it is.
    model = _compiled(_llama(), tmp_path, backend="aot_eager")
    reference = copy.deepcopy(model)
    from kiln.compile.regions import uncompile
    uncompile(reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = _step(model)
        _step(model, seed=2)
    cache_warnings = [w for w in caught if issubclass(w.category, KilnCacheWarning)]
    expected, _ = _step(reference)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    region = _region(model)
    if saves_ahead_of_time("aot_eager"):
        assert region.ran == "precompiled" and cache_warnings == [] and len(_artifacts(tmp_path)) == 1
    else:
        assert region.ran == "jit" and _artifacts(tmp_path) == []
        assert len(cache_warnings) == 1 and "ahead-of-time compile failed" in str(cache_warnings[0].message)
        assert "expected OutputCode" in " ".join(region.precompile_notes)


def test_an_ahead_of_time_compile_switched_off_in_dynamos_config_is_switched_on_for_it(tmp_path):
    # torch 2.11 gives compiled functions `.aot_compile` only under enable_aot_compile, off there
    # by default: Kiln switches it on for its own compile and leaves the setting as it found it.
    # (config.patch, not monkeypatch: undoing a monkeypatch deletes the config entry.)
    with torch._dynamo.config.patch(enable_aot_compile=False):
        model = _compiled(_llama(), tmp_path)
        _step(model)
        assert torch._dynamo.config.enable_aot_compile is False
    region = _region(model)
    assert (region.ran, region.precompiled_saved) == ("precompiled", 1), region.precompile_notes


def test_a_new_sequence_length_compiles_a_new_signature_and_says_why(tmp_path):
    _step(_compiled(_llama(), tmp_path), length=16)
    torch._dynamo.reset()
    model = _compiled(_llama(), tmp_path)
    _step(model, length=16)
    _step(model, length=24)
    region = _region(model)
    assert region.precompiled_loaded == 1 and region.precompiled_saved == 1
    assert region.recompiles == 1
    (note,) = region.precompile_notes
    assert "size mismatch, now tensor[2, 24, 32]" in note and "saved tensor[2, 16, 32]" in note
    assert "precompiled: signature" in compile_report(model).table()
    assert len(_artifacts(tmp_path)) == 2


def test_eval_after_train_is_another_signature(tmp_path):
    model = _compiled(_llama(), tmp_path)
    _step(model)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        compiled_logits = model(input_ids=ids, use_cache=False).logits
        reference = copy.deepcopy(model)
        from kiln.compile.regions import uncompile
        eager_logits = uncompile(reference)(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)
    notes = " ".join(_region(model).precompile_notes)
    assert "grad_enabled: differs, now True" not in notes and "grad_enabled: differs, now False" in notes
    assert "training: differs" in notes
    assert len(_artifacts(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "foreign torch"])
def test_a_bad_artifact_gives_one_warning_and_a_compile(tmp_path, damage):
    model = _compiled(_llama(), tmp_path)
    expected, _ = _step(model)
    (path,) = _artifacts(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip a byte":
        data[-100] ^= 0xFF
        problem = "checksum"
    elif damage == "truncate":
        data = data[:len(data) // 2]
        problem = "truncated"
    else:
        head, rest = bytes(data).split(b"\n", 2)[1], bytes(data).split(b"\n", 2)[2]
        header = json.loads(head)
        header["torch"] = "2.99.0"
        data = pc.MAGIC + json.dumps(header).encode() + b"\n" + rest
        problem = "written by torch 2.99.0"
    path.write_bytes(bytes(data))

    torch._dynamo.reset()
    model = _compiled(_llama(), tmp_path)
    with pytest.warns(KilnCacheWarning, match=problem) as caught:
        loss, _ = _step(model)
    assert len([w for w in caught if issubclass(w.category, KilnCacheWarning)]) == 1
    torch.testing.assert_close(loss, expected)
    region = _region(model)
    assert region.precompiled_loaded == 0 and region.precompiled_saved == 1 and region.ran == "precompiled"
    assert pc.read_envelope(path.read_bytes(), pc.MAGIC, pc.FORMAT_VERSION, "artifact")  # rewritten whole


def test_a_changed_block_source_is_a_new_key_and_the_report_says_so(tmp_path, monkeypatch):
    source = tmp_path / "changing_block.py"
    source.write_text("import torch\nclass Block(torch.nn.Module):\n    def __init__(self):\n"
                      "        super().__init__(); self.l = torch.nn.Linear(8, 8)\n"
                      "    def forward(self, x):\n        return torch.relu(self.l(x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("changing_block")

    def run():
        model = torch.nn.Sequential(module.Block(), module.Block())
        _compiled(model, tmp_path / "artifacts")
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        return _region(model)

    first = run()
    assert first.precompiled_saved == 1
    source.write_text(source.read_text().replace("torch.relu", "torch.tanh"))
    importlib.reload(module)
    torch._dynamo.reset()
    changed = run()
    assert changed.precompiled_loaded == 0 and changed.precompiled_saved == 1
    assert "another version of this block" in changed.precompile_notes[0]


def test_bf16_autocast_region_is_precompiled_and_loaded(tmp_path):
    def run():
        model = _compiled(_llama(), tmp_path)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), _region(model)

    cold_loss, cold = run()
    torch._dynamo.reset()
    warm_loss, warm = run()
    eager = _llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids = torch.randint(0, eager.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        eager_loss = eager(input_ids=ids, labels=ids, use_cache=False).loss
    assert cold.ran == warm.ran == "precompiled" and warm.traces == 0 and warm.precompiled_loaded == 1
    torch.testing.assert_close(warm_loss, cold_loss, rtol=0, atol=0)
    torch.testing.assert_close(warm_loss, eager_loss.detach(), rtol=0, atol=2e-2)
    assert "autocast" in " ".join(pc.signature_fields(pc.call_signature(
        torch.nn.Linear(1, 1), (), {})).keys())


def test_a_refused_call_takes_the_jit_path(tmp_path, monkeypatch):
    # A signature that forgot the training flag: torch's own guards then refuse the eval call.
    real = pc.call_signature
    monkeypatch.setattr(pc, "call_signature",
                        lambda m, a, k, *threads: tuple(f for f in real(m, a, k, *threads) if f[0] != "training"))
    model = _compiled(_llama(), tmp_path)
    _step(model)
    model.eval()
    with torch.no_grad(), torch.enable_grad():
        model(input_ids=torch.randint(0, 64, (2, 16)), use_cache=False)
    region = _region(model)
    assert region.jit_calls == 3 and region.precompiled_calls == 3
    assert any("refused a call" in note and "training" in note for note in region.precompile_notes)


def test_fullgraph_false_is_not_precompiled_and_the_report_says_why(tmp_path):
    model = _compiled(_llama(), tmp_path, fullgraph=False)
    _step(model)
    region = _region(model)
    assert region.ran == "jit" and "fullgraph=False" in region.precompile_off
    assert _artifacts(tmp_path) == []


def test_plugin_precompile_setting_is_validated():
    with pytest.raises(ValueError, match="precompile=True needs whole graphs, but fullgraph=False was given"):
        TorchDynamoPlugin(precompile=True, fullgraph=False)
    with pytest.raises(ValueError, match="KILN_DYNAMO_USE_FULLGRAPH=false in the environment"):
        TorchDynamoPlugin(precompile=True, environ={"KILN_DYNAMO_USE_FULLGRAPH": "0"})
    with pytest.raises(ValueError, match="cache=False"):
        TorchDynamoPlugin(precompile=True, fullgraph=True, cache=False)
    with pytest.raises(ValueError, match="static shapes"):
        TorchDynamoPlugin(precompile=True, fullgraph=True, dynamic=True)
    assert TorchDynamoPlugin(environ={"KILN_DYNAMO_PRECOMPILE": "no"}).precompile is False
    assert TorchDynamoPlugin().precompile is None  # off unless asked for
    assert TorchDynamoPlugin(fullgraph=True, environ={"KILN_DYNAMO_PRECOMPILE": "1"}).precompile is True


def test_precompile_and_background_imply_fullgraph_when_it_is_left_unset():
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True, compile_in_background=True)
    assert plugin.fullgraph is True and plugin.to_compile_kwargs()["fullgraph"] is True
    assert plugin.notes == ["fullgraph=True, implied by compile_in_background=True (left unset)"]
    assert TorchDynamoPlugin(precompile=True).notes == ["fullgraph=True, implied by precompile=True (left unset)"]
    assert TorchDynamoPlugin(precompile=True, fullgraph=True).notes == []
    assert TorchDynamoPlugin().fullgraph is False and TorchDynamoPlugin().notes == []
    # Set to False beside training while compiling, the helpers fill the compile caches instead.
    plugin = TorchDynamoPlugin(compile_in_background=True, fullgraph=False)
    assert plugin.fullgraph is False and plugin.notes[0].startswith("fullgraph=False with compile_in_background=True")
    with pytest.raises(ValueError, match="precompile=True needs whole graphs, but fullgraph=False"):
        TorchDynamoPlugin(compile_in_background=True, precompile=True, fullgraph=False)


def test_the_report_names_the_implied_fullgraph(tmp_path):
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, precompile=True,
                               cache_dir=str(tmp_path))
    acc = Accelerator(dynamo_plugin=plugin)
    model = acc.prepare(_llama())
    _step(model)
    report = acc.compile_report()
    assert report.settings == ["fullgraph=True, implied by precompile=True (left unset)"]
    assert "setting: fullgraph=True, implied by precompile=True" in report.table()
    assert report.as_dict()["settings"] == report.settings


def test_prepare_in_bf16_loads_precompiled_regions_on_the_second_run(tmp_path):
    def run():
        plugin = TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, fullgraph=True, dynamic=False,
                                   use_regional_compilation=True, cache_dir=str(tmp_path), precompile=True)
        acc = Accelerator(dynamo_plugin=plugin, mixed_precision="bf16")
        model = _llama()
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        losses = []
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(len(losses)))
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, acc.compile_report().regions[0]

    cold_losses, cold = run()
    torch._dynamo.reset()
    warm_losses, warm = run()
    assert cold.ran == "precompiled" and cold.precompiled_saved == 1
    assert warm.ran == "precompiled" and warm.traces == 0 and warm.precompiled_loaded == 1
    assert warm_losses == cold_losses
    assert (tmp_path / "precompiled").is_dir()


@pytest.mark.parametrize("setting", [None, False])
def test_precompile_off_keeps_the_jit_path(tmp_path, setting):
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, use_regional_compilation=True,
                               cache_dir=str(tmp_path), precompile=setting)
    acc = Accelerator(dynamo_plugin=plugin)
    model = acc.prepare(_llama())
    _step(model)
    assert acc.compile_report().regions[0].ran == "jit"
    assert not (tmp_path / "precompiled").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    model = _compiled(_llama(), tmp_path)
    region = compiled_regions(model)[0].precompiled
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    region.directory.mkdir(parents=True)
    signature_path = None
    # Hold every lock a call could claim: the region folder gets one for the first signature.
    real_claim = region._claim

    def claim(path):
        nonlocal signature_path
        if signature_path is None:
            signature_path = path
            import socket
            path.with_suffix(pc.LOCK_SUFFIX).write_text(f"{socket.gethostname()} {dead.pid} {time.time()} x\n")
        return real_claim(path)

    region._claim = claim
    _step(model)
    assert signature_path.exists() and not signature_path.with_suffix(pc.LOCK_SUFFIX).exists()
    assert _region(model).precompiled_saved == 1


WORKER = """
import json, sys, time, torch
sys.path.insert(0, {tests!r})
from toy_models import tiny_llama
from kiln.compile.regions import compile_regions
from kiln.compile.report import compile_report
torch.manual_seed(0)
model = tiny_llama(3).train()
model.config.loss_type = model.loss_type = "ForCausalLM"
compile_regions(model, backend={backend!r}, fullgraph=True, precompile=sys.argv[1])
ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
start = time.process_time()
loss = model(input_ids=ids, labels=ids, use_cache=False).loss
loss.backward()
region = compile_report(model).regions[0]
print(json.dumps(dict(loss=loss.item(), saved=region.precompiled_saved, loaded=region.precompiled_loaded,
                      traces=region.traces, wait=region.precompile_wait_seconds, ran=region.ran)))
"""


@pytest.mark.multiprocess
def test_local_processes_compile_each_signature_once(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests"), backend=PRECOMPILE_BACKEND))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    folder = str(tmp_path / "artifacts")
    procs = [subprocess.Popen([sys.executable, str(script), folder], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["saved"] for r in results) == [0, 1]  # one compiler
    assert sorted(r["loaded"] for r in results) == [0, 1]  # the other loaded its artifact
    assert sorted(r["traces"] for r in results) == [0, 1]
    assert results[0]["loss"] == results[1]["loss"]
    assert all(r["ran"] == "precompiled" for r in results)
    assert len(_artifacts(folder)) == 1 and not list(Path(folder).rglob("*.lock"))


def _losses_and_grads(model, seed=1):
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_a_module_changed_after_its_calls_settled_gets_code_that_fits_it(tmp_path):
    """Settled precompiled calls are found by their arguments alone (no walk of the module); a change
    to the module that its code depends on must switch to code compiled for it, never run the stale
    code: the loaded function's guards refuse it, and the call is looked up again by its full key."""
    model, reference = _compiled(_llama(), tmp_path), _llama()
    changes = [
        ("as built", None, 1),
        ("eval, with grad on (the attention reads its training flag)", lambda m: m.eval(), 2),
        ("train again", lambda m: m.train(), 2),
        ("a norm's weight frozen", lambda m: m.model.layers[1].input_layernorm.weight.requires_grad_(False), 3),
        ("weights changed in place (inputs of the code, no new signature)",
         lambda m: m.model.layers[0].mlp.up_proj.weight.data.mul_(2), 3),
    ]
    for what, change, signatures in changes:
        if change is not None:
            change(model)
            change(reference)
        for _ in range(2):
            loss, grads = _losses_and_grads(model)
            expected_loss, expected_grads = _losses_and_grads(reference)
            torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6, msg=what)
            for name, grad in grads.items():
                if expected_grads[name] is None:
                    assert grad is None, (what, name)
                else:
                    torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=what)
        region = _region(model)
        assert region.precompiled_saved == signatures, what
        assert region.jit_calls == 0 and not any("refused" in note for note in region.precompile_notes), what
    # Back and forth between known states: found again, nothing compiled, nothing refused for good.
    for _ in range(2):
        model.eval(), _losses_and_grads(model)
        model.train(), _losses_and_grads(model)
    region = _region(model)
    assert region.precompiled_saved == 4 and region.jit_calls == 0  # layer 1 in eval with its frozen norm
    assert region.precompiled_calls == 3 * (2 * len(changes) + 4)


def test_settled_calls_skip_the_walk_of_the_module(tmp_path, monkeypatch):
    """Issue 34's per-call cost: the walk of a Llama layer's modules was 20 of the 26 us of Kiln's
    lookup; once a call's arguments have met one signature, it is not made."""
    model = _compiled(_llama(), tmp_path)
    _step(model)
    walks = []
    real = pc.module_keys
    monkeypatch.setattr(pc, "module_keys", lambda module: walks.append(module) or real(module))
    _step(model)
    _step(model, seed=2)
    assert walks == [] and _region(model).precompiled_calls == 9


def test_the_per_call_key_changes_with_everything_the_signature_sees():
    """Each precompiled call is looked up by `call_key`; a change the signature would see must change
    the key too, or a settled function would run for a call it does not fit."""
    from kiln.compile.artifacts.signatures import AUTOCAST_FIELD, call_key, call_signature

    block = _llama().model.layers[0]
    hidden = torch.randn(2, 16, 32)
    kwargs = {"position_embeddings": (torch.randn(1, 16, 8), torch.randn(1, 16, 8)), "use_cache": False}

    def both():
        return call_key(block, (hidden,), kwargs), call_signature(block, (hidden,), kwargs)

    first_key, first_signature = both()
    assert first_signature[AUTOCAST_FIELD][0] == "autocast"  # where each precompiled call reads it
    assert both() == (first_key, first_signature)  # the same call: the same key
    changes = {
        "eval": lambda: block.eval(),
        "a submodule's flag": lambda: block.mlp.train(),
        "dtype in place (model.to)": lambda: block.mlp.down_proj.to(torch.float64),
        "requires_grad": lambda: block.input_layernorm.weight.requires_grad_(False),
        "a parameter replaced by one of another shape": lambda: setattr(
            block.mlp.up_proj, "weight", torch.nn.Parameter(torch.randn(65, 32))),
        "a keyword's value": lambda: kwargs.update(use_cache=None),
        "grad mode": lambda: torch.set_grad_enabled(False),
    }
    try:
        for what, change in changes.items():
            key, signature = both()
            change()
            new_key, new_signature = both()
            assert new_signature != signature, what
            assert new_key != key, what
    finally:
        torch.set_grad_enabled(True)


def test_a_dtensor_parameter_keys_its_placements_and_its_process_group():
    """Tensor-parallel blocks hold DTensor parameters: code compiled for one placement, or for one
    process group (the compiled collectives call it by name), must not be taken for another."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kiln.compile.artifacts.signatures import call_key, call_signature, holds_distributed, module_keys

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer, hidden = torch.nn.Linear(8, 8), torch.randn(2, 8)
        weight = layer.weight.detach()

        def with_weight(mesh, placement):
            layer.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [placement]))
            return call_key(layer, (hidden,), {}), call_signature(layer, (hidden,), {})

        mesh = DeviceMesh.from_group(dist.new_group([0]), "cpu", mesh_dim_names=("tp",))
        sharded = with_weight(mesh, Shard(0))
        # Looked up by the full key at every call: torch's guards do not see the process group.
        assert holds_distributed(module_keys(layer)) and not holds_distributed(module_keys(torch.nn.Linear(8, 8)))
        assert with_weight(mesh, Shard(0)) == sharded
        replicated = with_weight(mesh, Replicate())
        assert replicated[0] != sharded[0] and replicated[1] != sharded[1]
        # The group by name, as the compiled collectives call it (ranks 0-1 and 2-3 of dp_shard=2 x
        # tp=2 have different names: tests/distributed/test_strategies.py runs them).
        assert ("mesh", ("tp",), (1,), (mesh.get_group(0).group_name,)) in sharded[1][-2][1][0]
    finally:
        dist.destroy_process_group()


# ----- fullgraph left unset: ahead of time where a block is one whole graph, JIT where it breaks ---

def _encoder_decoder_run(model, steps=2):
    """Training steps of `train_step`'s batches with SGD: the losses and the last gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [train_step(model, optimizer, step) for step in range(steps)]
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(99))
    model(x).square().mean().backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_with_fullgraph_unset_a_block_that_breaks_is_jit_compiled_and_the_others_precompiled(tmp_path):
    # Issue 39: one block class graph-breaks (its encoder blocks), the other traces whole. Nobody asked
    # for whole graphs, so the break is no error and no warning: that block is JIT-compiled with its
    # break, the report says why, and the decoder blocks are precompiled and load in a later run.
    torch.manual_seed(0)
    eager = BreakingEncoderDecoder()
    expected = _encoder_decoder_run(copy.deepcopy(eager))

    def run():
        model = copy.deepcopy(eager)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnCacheWarning)
            warnings.simplefilter("error", KilnCompileWarning)
            compile_regions(model, backend=PRECOMPILE_BACKEND, precompile=tmp_path)
            result = _encoder_decoder_run(model)
        return result, {r.name: r for r in compile_report(model).regions}

    (losses, grads), regions = run()
    encoder, decoder = regions["BreakingEncoderBlock"], regions["DecoderBlock"]
    assert decoder.ran == "precompiled" and decoder.precompiled_saved == 1
    assert encoder.ran == "jit" and encoder.precompiled_saved == 0 and encoder.precompile_off is None
    assert any("not one whole graph ahead of time" in note and "fullgraph was left unset" in note
               for note in encoder.precompile_notes), encoder.precompile_notes
    assert losses == pytest.approx(expected[0], rel=1e-6)
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)

    torch._dynamo.reset()
    (again, _), regions = run()
    assert again == losses
    assert regions["DecoderBlock"].precompiled_loaded == 1 and regions["DecoderBlock"].traces == 0
    assert regions["BreakingEncoderBlock"].ran == "jit"


def test_with_fullgraph_true_a_block_that_breaks_still_fails_loudly(tmp_path):
    torch.manual_seed(0)
    model = BreakingEncoderDecoder()
    compile_regions(model, backend=PRECOMPILE_BACKEND, precompile=tmp_path, fullgraph=True)
    with pytest.warns(KilnCacheWarning, match="ahead-of-time compile failed"), \
            pytest.raises(Exception, match="graph_break"):
        model(torch.randn(4, 6, 8))


def test_plugin_precompile_auto_leaves_fullgraph_unset_and_gives_way_to_an_outer_graph(tmp_path):
    plugin = TorchDynamoPlugin(precompile="auto", use_regional_compilation=True)
    assert plugin.precompile == "auto" and plugin.fullgraph is None and plugin.notes == []
    assert plugin.to_compile_kwargs()["fullgraph"] is None
    assert TorchDynamoPlugin(precompile="auto", fullgraph=True).fullgraph is True
    assert TorchDynamoPlugin(environ={"KILN_DYNAMO_PRECOMPILE": "Auto"}).precompile == "auto"
    with pytest.raises(ValueError, match="KILN_DYNAMO_PRECOMPILE='sometimes': use true, false or auto"):
        TorchDynamoPlugin(environ={"KILN_DYNAMO_PRECOMPILE": "sometimes"})
    with pytest.raises(TypeError, match="precompile must be None, a bool or 'auto'"):
        TorchDynamoPlugin(precompile="yes")
    beside = TorchDynamoPlugin(precompile="auto", use_regional_compilation=True, outer_graph=True)
    assert beside.precompile is False and "precompile='auto': off beside outer_graph=True" in beside.notes[0]
    # Settings that rule an ahead-of-time compile out are no error under "auto": the report says why.
    assert TorchDynamoPlugin(precompile="auto", dynamic=True, cache=False).precompile == "auto"


def test_accelerator_with_precompile_auto_trains_like_eager_with_no_warning(tmp_path):
    torch.manual_seed(0)
    eager = BreakingEncoderDecoder()
    expected = _encoder_decoder_run(copy.deepcopy(eager), steps=3)[0]
    plugin = TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, use_regional_compilation=True, precompile="auto",
                               cache_dir=str(tmp_path), outer_graph=False)
    acc = Accelerator(dynamo_plugin=plugin)
    model = copy.deepcopy(eager)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCacheWarning)
        warnings.simplefilter("error", KilnCompileWarning)
        model, optimizer = acc.prepare(model, optimizer)
        losses = [train_step(model, optimizer, step, acc) for step in range(3)]
    assert losses == pytest.approx(expected, rel=1e-6)
    ran = {r.name: r.ran for r in acc.compile_report().regions}
    assert ran == {"BreakingEncoderBlock": "jit", "DecoderBlock": "precompiled"}
    assert "not one whole graph ahead of time" in acc.compile_report().table()


def test_multi_process_strategies_default_precompile_to_auto_and_leave_what_the_user_set():
    from kiln.parallel.base import SingleProcess, Strategy
    from kiln.parallel.ddp import DDPStrategy
    from kiln.parallel.deepspeed import DeepSpeedStrategy
    from kiln.parallel.fsdp import FSDPStrategy
    from kiln.parallel.fsdp_plugin import FullyShardedDataParallelPlugin

    def defaulted(**settings):
        plugin = TorchDynamoPlugin(environ={}, **settings)
        plugin.precompile_by_default("the ddp strategy")
        return plugin

    plain = defaulted(use_regional_compilation=True)
    assert plain.precompile == "auto" and plain.fullgraph is None
    assert plain.notes[-1].startswith("precompile='auto' (left unset, the ddp strategy)")
    # fullgraph=True stays (a break fails loudly); precompile=False, an outer graph and a whole-model
    # compile keep their meaning; so does the environment's precompile setting.
    strict = defaulted(use_regional_compilation=True, fullgraph=True)
    assert strict.precompile == "auto" and strict.fullgraph is True
    for settings in ({"use_regional_compilation": True, "precompile": False},
                     {"use_regional_compilation": True, "outer_graph": True}, {}):
        plugin = defaulted(**settings)
        assert plugin.precompile in (None, False) and not any("left unset" in n for n in plugin.notes), settings
    from_env = TorchDynamoPlugin(use_regional_compilation=True, environ={"KILN_DYNAMO_PRECOMPILE": "0"})
    from_env.precompile_by_default("the ddp strategy")
    assert from_env.precompile is False and from_env.fullgraph is False
    # Which strategies: DDP and FSDP2 (not with context parallelism); not one process, not DeepSpeed.
    cpu = torch.device("cpu")
    fsdp = FSDPStrategy(FullyShardedDataParallelPlugin(), cpu)
    assert DDPStrategy(cpu).precompiles_by_default and fsdp.precompiles_by_default
    fsdp.cp_mesh = object()
    assert not fsdp.precompiles_by_default
    assert not SingleProcess().precompiles_by_default
    assert DeepSpeedStrategy.precompiles_by_default is Strategy.precompiles_by_default  # the base's: False
