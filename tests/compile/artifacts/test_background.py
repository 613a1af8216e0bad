"""Train while compiling (kiln/compile/artifacts/background.py): eager steps while a helper process compiles
each region, a switch to its precompiled code between steps, and a helper that never outlives
training or stops it."""

import copy
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.artifacts.background import BackgroundCompiler, example_inputs, tree_cpu_seconds, weightless_copy
from kiln.compile.monitor import KilnFallbackWarning, KilnRecompileWarning
from kiln.compile.artifacts.signatures import call_signature
from toy_models import tiny_llama
from torch_features import PRECOMPILE_BACKEND

ROOT = Path(__file__).resolve().parents[3]


def _llama():
    torch.manual_seed(0)
    model = tiny_llama(3).train()
    model.config.loss_type = model.loss_type = "ForCausalLM"
    return model


def _prepared(tmp_path):
    # fullgraph and dynamic left unset, as most users leave them: precompiled, static signatures.
    plugin = TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, use_regional_compilation=True, cache_dir=str(tmp_path),
                               compile_in_background=True)
    acc = Accelerator(dynamo_plugin=plugin)
    model = _llama()
    reference = copy.deepcopy(model)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model, optimizer, reference


def _step(model, optimizer, step, acc=None):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    acc.backward(loss) if acc is not None else loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


# Alone on the machine: the helper needs a core of its own to finish while training steps run.
@pytest.mark.serial
def test_training_runs_eagerly_then_switches_to_the_helpers_precompiled_code(tmp_path):
    threads = torch.get_num_threads()
    acc, model, optimizer, reference = _prepared(tmp_path)
    losses, deadline, threads_while_eager = [], time.monotonic() + 240, set()
    while time.monotonic() < deadline:
        losses.append(_step(model, optimizer, len(losses), acc))
        if acc.compile_report().regions[0].switch_step is None:  # after an eager step, before the switch
            threads_while_eager.add(torch.get_num_threads())
        region = acc.compile_report().regions[0]
        if region.precompiled_calls >= 15:  # five steps on precompiled code
            break
    assert region.precompiled_calls >= 15, acc.compile_report().table()
    switch = region.switch_step
    assert switch is not None and region.background_eager_calls == 3 * switch  # 3 layers per step
    assert region.traces == 0 and region.jit_calls == 0  # this process traced nothing
    assert "compiled in the background" in acc.compile_report().table()
    # Threads filling every core make room for the helper until the switch, and come back.
    makes_room = threads > 1 and threads >= len(os.sched_getaffinity(0))
    assert threads_while_eager == ({threads - 1} if makes_room else {threads})
    assert torch.get_num_threads() == threads

    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = [_step(reference, eager_optimizer, i) for i in range(len(losses))]
    assert losses[:switch] == pytest.approx(expected[:switch], abs=1e-6)  # the eager steps: eager's numbers
    assert losses[switch:] == pytest.approx(expected[switch:], abs=1e-4)
    helper = acc.compiler.background.process
    acc.end_training()
    assert helper.poll() is not None  # end_training stopped it


def test_a_killed_helper_hands_its_regions_to_the_jit_compile_with_one_warning(tmp_path):
    acc, model, optimizer, reference = _prepared(tmp_path)
    losses = [_step(model, optimizer, 0, acc)]
    os.kill(acc.compiler.background.pid, signal.SIGKILL)
    acc.compiler.background.process.wait()
    with pytest.warns(KilnFallbackWarning, match=r"background compiler \(pid \d+\) exited.*JIT-compiled") as caught:
        for step in range(1, 4):
            losses.append(_step(model, optimizer, step, acc))
    assert len([w for w in caught if issubclass(w.category, KilnFallbackWarning)]) == 1
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert losses == pytest.approx([_step(reference, eager_optimizer, i) for i in range(4)], abs=1e-5)
    region = acc.compile_report().regions[0]
    # Step 0 ran eagerly while the helper lived; the step after its death found it gone, and the
    # steps after that ran JIT-compiled code: training ends on compiled code.
    assert region.switch_step == 2 and region.jit_calls == 3 * 2 and region.eager_calls == 3 * 2
    assert region.ran == "jit+eager"
    assert any("background compile failed" in n and "JIT-compiled after step 2" in n for n in region.precompile_notes)


def test_a_starved_helper_is_given_up_for_a_foreground_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(BackgroundCompiler, "WATCH_SECONDS", 1.0)
    threads = torch.get_num_threads()
    acc, model, optimizer, reference = _prepared(tmp_path)
    losses = [_step(model, optimizer, 0, acc)]
    helper = acc.compiler.background.process
    os.kill(helper.pid, signal.SIGSTOP)  # as starved as a helper can be: it gets no CPU at all
    try:
        with pytest.warns(KilnFallbackWarning, match=r"got \d+% of a core.*compiling in the foreground instead") as caught:
            deadline = time.monotonic() + 120
            while acc.compile_report().regions[0].jit_calls < 6 and time.monotonic() < deadline:
                time.sleep(0.05)  # a step of a real model's length
                losses.append(_step(model, optimizer, len(losses), acc))
    finally:
        _continue(helper.pid)
    assert len([w for w in caught if issubclass(w.category, KilnFallbackWarning)]) == 1
    assert helper.wait(timeout=10) is not None  # killed, not left behind
    region = acc.compile_report().regions[0]
    assert region.ran == "jit+eager" and region.jit_calls >= 6 and region.switch_step is not None
    assert any("compiled in the foreground instead" in note and "% of a core" in note
               for note in region.precompile_notes)
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert losses == pytest.approx([_step(reference, eager_optimizer, i) for i in range(len(losses))], abs=1e-4)
    assert torch.get_num_threads() == threads  # training has its threads back


def _continue(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def test_a_helpers_cpu_time_counts_its_compiler_processes():
    # A helper's compile runs partly in gcc processes: their CPU time is the helper's progress.
    busy = "import time\nwhile time.process_time() < 1.5: pass"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"])
    try:
        deadline = time.monotonic() + 30
        seen = 0.0
        while parent.poll() is None and time.monotonic() < deadline:
            seen = max(seen, tree_cpu_seconds(parent.pid) or 0.0)
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
    assert seen >= 1.0  # the child's 1.5 s of CPU, counted while it ran (the parent itself only waits)
    assert tree_cpu_seconds(parent.pid) is None  # gone


def _refused_run(folder, steps, deadline_s=120):
    """Train RefusedStack (its blocks cannot be compiled ahead of time in the helper) until the
    region has run a whole step JIT-compiled, or `steps` steps are done."""
    from refusing_block import RefusedStack

    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, cache_dir=str(folder),
                               compile_in_background=True)
    acc = Accelerator(dynamo_plugin=plugin)
    torch.manual_seed(0)
    model = RefusedStack()
    reference = copy.deepcopy(model)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    losses, deadline, eager_before = [], time.monotonic() + deadline_s, -1
    while len(losses) < steps and time.monotonic() < deadline:
        time.sleep(0.01)  # a step of a real model's length: the tiny stack's take a few ms
        data = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(len(losses)))
        loss = model(data, data.mean(-1))
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        region = acc.compile_report().regions[0]
        if region.jit_calls >= 9 and region.eager_calls == eager_before:  # a whole step JIT-compiled
            break
        eager_before = region.eager_calls
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    expected = []
    for step in range(len(losses)):
        data = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(step))
        loss = reference(data, data.mean(-1))
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.item())
    report = acc.compile_report()
    acc.end_training()
    return losses, expected, report


# Alone on the machine, like the switch test above: the helper compiles while training steps run.
@pytest.mark.serial
def test_a_block_torch_cannot_compile_ahead_of_time_ends_jit_compiled_not_eager(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnRecompileWarning)  # compiles owed from before warm-up are none
        losses, expected, report = _refused_run(tmp_path, steps=10_000)
    region = report.regions[0]
    assert region.jit_calls >= 9 and region.precompiled_calls == 0, report.table()
    # Each signature switches at the first step boundary after the helper answered for it; the
    # run ends with a step of JIT-compiled calls only.
    assert region.ran == "jit+eager" and region.eager_calls >= 3 * region.switch_step
    assert any("cannot be compiled ahead of time here" in note and "expected OutputCode" in note
               and f"JIT-compiled after step {region.switch_step}" in note for note in region.precompile_notes)
    assert losses == pytest.approx(expected, abs=1e-5)
    # The helper's word for later runs and other processes, one per signature (the first block's
    # input needs no gradient, the others' do).
    assert len(list(tmp_path.rglob("*.jit"))) == 2

    # The next run knows from the folder: JIT-compiled from its first call, no eager steps.
    torch._dynamo.reset()
    losses, expected, report = _refused_run(tmp_path, steps=3)
    region = report.regions[0]
    assert region.ran == "jit" and region.eager_calls == 0 and region.jit_calls == 9
    assert any("an earlier run found it cannot be compiled ahead of time" in n for n in region.precompile_notes)
    assert losses == pytest.approx(expected, abs=1e-5)


SCRIPT = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from toy_models import tiny_llama
from kiln import Accelerator, TorchDynamoPlugin
plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, use_regional_compilation=True,
                           cache_dir=sys.argv[1], compile_in_background=True)
acc = Accelerator(dynamo_plugin=plugin)
model = acc.prepare(tiny_llama(2).train())
model(input_ids=torch.zeros(2, 8, dtype=torch.long), use_cache=False).logits.sum().backward()
print(acc.compiler.background.pid, flush=True)
time.sleep(600)
"""


def test_no_helper_outlives_a_killed_training_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    training = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache")], env=env,
                                stdout=subprocess.PIPE, text=True)
    helper = int(training.stdout.readline())
    os.kill(helper, 0)  # alive while training runs
    training.kill()
    training.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        _reap(helper)
        time.sleep(0.1)
    else:
        os.kill(helper, signal.SIGKILL)
        pytest.fail(f"helper {helper} outlived its training process")


def _reap(pid):
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def test_the_helper_rebuilds_a_block_and_its_inputs_from_a_signature():
    model = _llama()
    layer = model.model.layers[0]
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    cos_sin = model.model.rotary_emb(hidden, torch.arange(16)[None])
    kwargs = {"position_embeddings": cos_sin, "attention_mask": None, "use_cache": False}
    signature = call_signature(layer, (hidden,), kwargs)
    skeleton = weightless_copy(layer)
    assert all(p.is_meta for p in skeleton.parameters()) and not skeleton._forward_pre_hooks
    rebuilt = skeleton.to_empty(device="cpu")
    args, rebuilt_kwargs = example_inputs(signature)
    assert call_signature(rebuilt, args, rebuilt_kwargs) == signature


def test_the_helper_rebuilds_non_contiguous_inputs_with_their_strides():
    # A UNet's channels-last activations and an expanded tensor: their strides are in the signature
    # and in the compiled code's guards, so the helper must rebuild them, not refuse the job.
    block = torch.nn.Linear(4, 4)
    channels_last = torch.randn(2, 3, 4, 5).permute(0, 3, 1, 2)
    expanded = torch.randn(1, 4).expand(3, 4)
    signature = call_signature(block, (channels_last, expanded), {})
    args, _ = example_inputs(signature)
    assert [a.stride() for a in args] == [channels_last.stride(), expanded.stride()]
    assert call_signature(block, args, {}) == signature


def test_background_setting_is_validated():
    with pytest.raises(ValueError, match="precompile=False"):
        TorchDynamoPlugin(fullgraph=True, compile_in_background=True, precompile=False)
    with pytest.raises(ValueError, match="precompile=True needs whole graphs, but fullgraph=False was given"):
        TorchDynamoPlugin(compile_in_background=True, precompile=True, fullgraph=False)
    plugin = TorchDynamoPlugin(fullgraph=True, environ={"KILN_DYNAMO_COMPILE_IN_BACKGROUND": "1"})
    assert plugin.compile_in_background is True and plugin.precompile is True
