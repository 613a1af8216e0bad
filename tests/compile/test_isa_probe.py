"""Inductor's CPU vector-instruction probe asked side by side (kiln/compile/isa_probe.py): the
answers are Inductor's own, and Inductor finds them cached instead of probing again."""

import json
import os
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import json, subprocess, sys, threading
from kiln.compile import isa_probe
from torch._inductor import cpu_vec_isa
inductors = cpu_vec_isa.valid_vec_isa_list
calls = []
real = subprocess.run
def counting(*a, **k):  # a question Inductor asks on this thread, not on the probe's
    if threading.current_thread() is threading.main_thread():
        calls.append(a)
    return real(*a, **k)
subprocess.run = counting
if sys.argv[1] != "inductor":
    isa_probe.start()
    waits_when_asked = cpu_vec_isa.valid_vec_isa_list is not inductors
    if sys.argv[1] == "kiln":
        isa_probe.wait()
    else:  # "kiln-asked": Inductor asks while the probe runs
        assert isa_probe._thread.is_alive() or isa_probe._thread.ident is None
answer = [str(cpu_vec_isa.pick_vec_isa())] + [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"isas": answer, "probes_after": len(calls), "done": not isa_probe._thread or not isa_probe._thread.is_alive(),
                  "inductors_back": cpu_vec_isa.valid_vec_isa_list is inductors}))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="Inductor probes x86 Linux only")
def test_probe_gives_inductors_own_answers_and_inductor_does_not_ask_again(private_compile_cache):
    # The session's Inductor folder: the probe libraries other tests built are reused (gcc is slow).
    inductor = private_compile_cache / "inductor"

    def run(mode):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env,
                             timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    kiln = run("kiln")  # first: its side-by-side builds leave the probe libraries for the serial run
    serial = run("inductor")
    assert kiln["isas"] == serial["isas"] and kiln["isas"]  # the same instruction sets, found
    assert serial["probes_after"] > 0 and kiln["probes_after"] == 0
    assert kiln["inductors_back"] and serial["inductors_back"]


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="Inductor probes x86 Linux only")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="on one core the compile waits for the probe first")
def test_inductors_question_asked_while_the_probe_runs_waits_for_its_answers(tmp_path):
    # Kiln's compile waits for the probe only where Inductor asks (isa_probe._wait_when_asked): asked
    # early, the question waits, takes the probe's answers without asking again, and Inductor's own
    # function is back afterwards. An empty Inductor folder: the probe is still building when asked.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, "kiln-asked"], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    asked = json.loads(out.stdout.strip().splitlines()[-1])
    assert asked["isas"] and asked["probes_after"] == 0 and asked["done"] and asked["inductors_back"]


STARTS = """
import json, torch
from torch import nn
from kiln.compile import isa_probe
from kiln.compile.regions import compile_regions

def blocks(device):
    return nn.Sequential(*[nn.Linear(4, 4, device=device) for _ in range(2)])

seen = []
for backend, device in (("aot_eager", "cpu"), ("inductor", "meta"), ("inductor", "cpu")):
    model = compile_regions(blocks(device), backend=backend)
    seen.append([isa_probe._armed, isa_probe._thread is not None])
with torch.compiler.set_stance("force_eager"):  # the region's first call, without a compile
    model(torch.ones(1, 4))
seen.append([isa_probe._armed, isa_probe._thread is not None])
isa_probe.wait()
print(json.dumps(seen))
"""


def test_the_probe_starts_at_the_first_call_of_a_cpu_model_compiled_with_inductor_only():
    # Armed by compile_regions, started by the first compiled call: its questions are asked while
    # Dynamo traces, and not before load_state has installed a checkpoint's probe libraries (which a
    # probe started at prepare found missing and built again with gcc: 5 s of a 6.4 s resume).
    out = subprocess.run([sys.executable, "-c", STARTS], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[False, False], [False, False], [True, False],
                                                              [True, True]]


REMEMBERED = """
import json, subprocess, sys
loads = []
real = subprocess.run
subprocess.run = lambda cmd, *a, **k: (loads.append(1) if "LoadLibrary" in " ".join(map(str, cmd)) else None) or real(cmd, *a, **k)
from kiln.compile import isa_probe
from torch._inductor import cpu_vec_isa
isa_probe.start()
isa_probe.wait()
during = len(loads)
answer = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
own = any("_probe_load" in vars(isa) for isa in cpu_vec_isa.supported_vec_isa_list)
print(json.dumps({"isas": answer, "loads": during, "loads_after": len(loads) - during, "substitute_left": own}))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="Inductor probes x86 Linux only")
def test_a_load_that_succeeded_is_remembered_and_anything_else_asks_again(private_compile_cache, tmp_path):
    from torch._inductor import cpu_vec_isa

    from kiln.compile import isa_probe
    from kiln.compile.artifacts.bundle import cpu_probe_builds

    if not callable(getattr(cpu_vec_isa.VecISA, "_probe_load", None)):
        pytest.skip("this torch's probe has no separate load step: every process asks (the stable path)")

    def run(inductor):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-c", REMEMBERED], capture_output=True, text=True, env=env,
                             timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    shared = private_compile_cache / "inductor"
    reference = run(shared)  # builds the probe libraries once for the session (gcc is slow)
    inductor = tmp_path / "inductor"
    for path in cpu_probe_builds(shared):  # the libraries and sources, without any record
        if path.name.endswith(isa_probe.RECORD_SUFFIX):
            continue
        target = inductor / path.relative_to(shared)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())

    first = run(inductor)
    kilns = sorted(inductor.glob(f"*/*.so{isa_probe.RECORD_SUFFIX}"))
    # torch 2.14 remembers a load itself (<library>.load_ok): there Kiln writes no record of its own.
    inductors_own = isa_probe._inductor_remembers_loads(cpu_vec_isa.VecISA)
    records = sorted(inductor.glob("*/*.so.load_ok")) if inductors_own else kilns
    assert not (inductors_own and kilns)
    failed = first["loads"] - len(records)  # a load that failed is never remembered (none on most CPUs)
    assert records and failed >= 0
    again = run(inductor)
    assert again["loads"] == failed  # every load that succeeded answered from its record: no process
    results = [first, again]
    if not inductors_own:
        records[0].write_text(records[0].read_text().replace("torch ", "torch 0.0 ", 1))  # another torch
        results.append(run(inductor))
        assert results[-1]["loads"] == failed + 1  # that one library's load is asked again
    for result in results:
        assert result["isas"] == reference["isas"] and result["isas"]  # the same instruction sets
        assert result["loads_after"] == 0 and not result["substitute_left"]  # Inductor's own method back


ONE_CORE = """
import json, os
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from kiln.compile import isa_probe
from torch._inductor import cpu_vec_isa
inductors = cpu_vec_isa.valid_vec_isa_list
isa_probe.start()
print(json.dumps({"asked_late": isa_probe._asked_late, "inductors": cpu_vec_isa.valid_vec_isa_list is inductors}))
isa_probe.wait()
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="Inductor probes x86 Linux only")
def test_on_one_core_the_compile_waits_for_the_probe_as_it_starts(tmp_path):
    # Overlapping the compile with the probe's builds only pays where a core is idle: on one core it
    # cost 3% of the first step (isa_probe's docstring), so Inductor's question is left as it is.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", ONE_CORE], capture_output=True, text=True, env=env, timeout=300,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"asked_late": False, "inductors": True}
