"""Inductor's CPU vector-instruction probe asked side by side (kiln/compile/isa_probe.py): the
answers are Inductor's own, and Inductor finds them cached instead of probing again."""

import json
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import json, subprocess, sys
from kiln.compile import isa_probe
from torch._inductor import cpu_vec_isa
if sys.argv[1] == "kiln":
    isa_probe.start()
    isa_probe.wait()
calls = []
real = subprocess.run
subprocess.run = lambda *a, **k: calls.append(a) or real(*a, **k)
answer = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"isas": answer, "probes_after": len(calls)}))
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


STARTS = """
import json, torch
from torch import nn
from kiln.compile import isa_probe
from kiln.compile.regions import compile_regions

def blocks(device):
    return nn.Sequential(*[nn.Linear(4, 4, device=device) for _ in range(2)])

started = []
for backend, device in (("aot_eager", "cpu"), ("inductor", "meta"), ("inductor", "cpu")):
    compile_regions(blocks(device), backend=backend)
    started.append(isa_probe._thread is not None)
isa_probe.wait()
print(json.dumps(started))
"""


def test_compile_regions_starts_the_probe_for_a_cpu_model_compiled_with_inductor_only():
    # Started when compile_regions returns, so the probe runs beside the first step's eager code
    # instead of one question after another inside the first compiled call.
    out = subprocess.run([sys.executable, "-c", STARTS], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False, True]
