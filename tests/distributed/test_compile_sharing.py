"""Compiling once per job across machines (kiln/compile/artifacts/sharing.py), with two simulated machines
on this host: two processes of one job, each the only process of its "machine" (GROUP_RANK 0 and 1,
LOCAL_WORLD_SIZE 1), each with its own Kiln and Inductor folders (share_worker.py).

The main pair runs under two real torch.distributed.run agents (--nnodes 2 --node_rank 0|1); the cases
that need a machine to differ or to die start the two processes from local_launch's forkserver with the
variables torchrun sets, which saves an agent and a fresh interpreter per process."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.compile.artifacts.trust import ENV_KEY, KEY_FILE
from local_launch import _start
from ports import free_port

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "share_worker.py"


def machine_env(folder: Path, node: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "TORCHINDUCTOR_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               KILN_COMPILE_CACHE_DIR=str(folder / f"machine{node}" / "kiln"),
               TORCHINDUCTOR_CACHE_DIR=str(folder / f"machine{node}" / "inductor"))
    return env


def records(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """The job under two torch.distributed.run agents: (records by rank, each agent's output)."""
    folder = tmp_path_factory.mktemp("two_machines")
    port, out = free_port(), folder / "out"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
         str(WORKER), "--out", str(out), "--reference", "--save-at", "1", "--checkpoint", str(folder / "ckpt")],
        env=machine_env(folder, node), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    logs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], logs[0][-4000:] + logs[1][-4000:]
    return records(out), logs, folder


def forked_machines(folder: Path, *flags: str, share_timeout_s: float, timeout: float = 120,
                    node_env: dict[int, dict[str, str]] | None = None):
    """The job's two processes forked from local_launch's server, each with `node_env[node]` added to its
    environment; (exit codes, outputs, seconds until machine 0's process ended, the output prefix).
    Machine 1's is killed once machine 0's failed."""
    port, out, procs, files = free_port(), folder / "out", [], []
    for node in (0, 1):
        env = dict(machine_env(folder, node), **(node_env or {}).get(node, {}), RANK=str(node), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(node), GROUP_WORLD_SIZE="2", ROLE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), KILN_COMPILE_SHARE_TIMEOUT=str(share_timeout_s))
        files.append((folder / f"{node}.out", folder / f"{node}.err"))
        procs.append(_start([str(WORKER), "--out", str(out), *flags], env, *map(str, files[-1])))
    start = time.monotonic()
    while procs[0].exitcode is None and time.monotonic() - start < timeout:
        time.sleep(0.05)
    seconds = time.monotonic() - start
    if procs[0].exitcode == 0:
        procs[1].join(max(1.0, timeout - seconds))
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    outputs = [Path(o).read_text(errors="replace") + Path(e).read_text(errors="replace") for o, e in files]
    return [p.exitcode for p in procs], outputs, seconds, out


def test_each_signature_is_compiled_on_one_machine_and_received_by_the_other(agents):
    # The documented settings (TorchDynamoPlugin(backend, use_regional_compilation=True)) and nothing
    # more: under DDP, precompile left unset is "auto", and each block that traces whole is shared.
    (first, second), logs, folder = agents
    for record in (first, second):
        assert record["precompile"] == "auto"
        assert any(n.startswith("precompile='auto' (left unset, the ddp strategy)") for n in record["plugin_notes"])
    compiler, receiver = (first, second) if first["compiled"] else (second, first)
    assert compiler["compiled"] == 1 and receiver["compiled"] == 0, (first, second)  # tiny Llama: one signature
    assert receiver["received"] == 1 and receiver["loaded"] == 1
    assert f"received from machine {compiler['node']}" in " ".join(receiver["notes"])
    # The receiver's own folder holds the artifact the compiler wrote, and it traced nothing.
    assert receiver["artifacts"] == compiler["artifacts"] and len(receiver["artifacts"]) == 1
    assert list((folder / f"machine{receiver['node']}" / "kiln").rglob(receiver["artifacts"][0]))
    assert receiver["traces"] == 0 and compiler["traces"] >= 1
    # Both machines ran precompiled code at every call of both layers, none JIT-compiled.
    for record in (first, second):
        assert record["precompiled_calls"] == 2 * 3 and record["jit_calls"] == 0
    # Evaluation under no_grad on process 0 alone compiled there, without waiting for machine 1.
    assert first["eval_compiled"] == 1 and first["eval_precompiled_calls"] == 2 and second["eval_compiled"] == 0
    print(f"\ncompile CPU-seconds, whole processes: compiling machine {compiler['cpu_s']:.1f}, "
          f"receiving machine {receiver['cpu_s']:.1f}; exchange {receiver['share_seconds']:.2f} s")


def test_two_machine_losses_equal_the_plain_single_process_loop(agents):
    (first, second), _, _ = agents
    assert first["losses"] == second["losses"]
    assert first["losses"] == pytest.approx(first["plain_losses"], rel=1e-5, abs=1e-6)


def test_the_machine_that_holds_an_artifact_sends_it_and_nothing_is_compiled_again(agents, tmp_path):
    # The next run of the job, where only the machine that received the artifact last time kept its
    # folder: it sends it (whatever the signature's hash would pick), and neither machine traces.
    (first, second), _, folder = agents
    compiler = first if first["compiled"] else second
    shutil.copytree(folder / f"machine{1 - compiler['node']}", tmp_path / f"machine{1 - compiler['node']}")
    codes, outputs, _, out = forked_machines(tmp_path, share_timeout_s=120)
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    again = {r["node"]: r for r in records(out)}
    holder, empty = again[1 - compiler["node"]], again[compiler["node"]]
    assert holder["compiled"] == empty["compiled"] == 0 and holder["traces"] == empty["traces"] == 0
    assert holder["received"] == 0 and empty["received"] == 1 and holder["loaded"] == empty["loaded"] == 1
    assert f"received from machine {holder['node']}" in " ".join(empty["notes"])
    assert again[0]["losses"] == first["losses"]


def test_fresh_machines_resume_on_the_checkpoint_the_main_process_vouched_for(agents, tmp_path):
    # The saving job signed with machine 0's key (made in its Kiln folder at the first save). The resumed
    # job runs on two fresh machines, and only machine 0 is given that key, as a secret in its
    # environment: machine 1 installs the bytes machine 0 checked, told over the job's process group.
    (first, _), _, folder = agents
    key = (folder / "machine0" / "kiln" / KEY_FILE).read_text().strip()
    codes, outputs, _, out = forked_machines(tmp_path, "--resume", "--save-at", "1", "--checkpoint",
                                             str(folder / "ckpt"), share_timeout_s=120, node_env={0: {ENV_KEY: key}})
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    for record in records(out):
        assert record["load_warnings"] == [], record["load_warnings"]
        assert record["loaded"] == 1 and record["compiled"] == record["received"] == record["traces"] == 0, record
        assert record["losses"] == pytest.approx(first["losses"][1:], rel=1e-6, abs=1e-7)
    assert not (tmp_path / "machine1" / "kiln" / KEY_FILE).exists()


def test_without_the_key_fresh_machines_refuse_the_checkpoints_code_and_still_compile_once_per_job(agents, tmp_path):
    (first, _), _, folder = agents
    codes, outputs, _, out = forked_machines(tmp_path, "--resume", "--save-at", "1", "--checkpoint",
                                             str(folder / "ckpt"), share_timeout_s=120)
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    resumed = records(out)
    for record in resumed:
        (warning,) = record["load_warnings"]
        assert warning.startswith("KilnTrustWarning: compile artifacts") and "holds no signing key" in warning
        assert record["losses"] == pytest.approx(first["losses"][1:], rel=1e-6, abs=1e-7)
    # Nothing installed, so the job compiles, once: one machine compiles, the other receives it.
    assert sorted(r["compiled"] for r in resumed) == [0, 1] and sorted(r["received"] for r in resumed) == [0, 1]


@pytest.fixture(scope="module")
def other_torch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other_torch")
    codes, outputs, _, out = forked_machines(folder, "--other-torch", "--reference", share_timeout_s=120)
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    return records(out), outputs


def test_a_machine_with_another_torch_compiles_for_itself_with_one_message(other_torch):
    (first, second), outputs = other_torch
    for record, output in zip((first, second), outputs):
        assert record["compiled"] == 1 and record["received"] == 0 and record["precompiled_calls"] == 6
        assert output.count("compiled code cannot run on machine") == 1, output[-3000:]
    assert "'2.99.0+fake' there" in outputs[0] and "'2.99.0+fake' here" in outputs[1]
    assert first["losses"] == second["losses"]
    assert first["losses"] == pytest.approx(first["plain_losses"], rel=1e-5, abs=1e-6)


def test_machines_that_meet_different_signatures_each_compile_with_one_warning(tmp_path):
    codes, outputs, _, out = forked_machines(tmp_path, "--uneven", "--precompile-true", share_timeout_s=120)
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    for record, output in zip(records(out), outputs):
        assert record["compiled"] == 1 and record["received"] == 0 and record["precompiled_calls"] == 6
        assert output.count("KilnCacheWarning: region LlamaDecoderLayer: the processes met different") == 1, \
            output[-3000:]
    assert records(out)[0]["artifacts"] != records(out)[1]["artifacts"]


def test_a_machine_that_dies_at_the_transfer_fails_the_job_naming_the_timeout(tmp_path):
    codes, outputs, seconds, _ = forked_machines(tmp_path, "--die", share_timeout_s=20, timeout=90)
    assert codes[1] == 3, outputs[1][-3000:]
    assert codes[0] not in (0, None), outputs[0][-3000:]
    assert "CompileShareError" in outputs[0] and "KILN_COMPILE_SHARE_TIMEOUT=20 s" in outputs[0], outputs[0][-3000:]
    assert seconds < 60


def test_a_machine_that_stalls_at_the_transfer_fails_the_job_after_the_timeout(tmp_path):
    # Machine 0 waits at the transfer through machine 1's compile and then the time-out.
    codes, outputs, seconds, _ = forked_machines(tmp_path, "--stall", share_timeout_s=6, timeout=90)
    assert codes[0] not in (0, None), outputs[0][-3000:]
    assert "CompileShareError" in outputs[0] and "KILN_COMPILE_SHARE_TIMEOUT=6 s" in outputs[0], outputs[0][-3000:]
    assert seconds < 60
