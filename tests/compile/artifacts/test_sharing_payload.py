"""What one machine sends another with a precompiled artifact (kiln/compile/artifacts/sharing.py): the
artifact, and the CPU probe's builds with Kiln's load records, so that the receiving machine runs no gcc
before it can load the kernels (the two-machine exchange itself: tests/distributed/test_compile_sharing.py)."""

import torch

from kiln.compile.artifacts.bundle import install_packed, read_members
from kiln.compile.artifacts.cache import CompileCache, read_envelope
from kiln.compile.artifacts import bundle
from kiln.compile.artifacts.sharing import CompileSharing


def _machine(folder):
    cache = CompileCache(folder, enabled=True)
    cache.inductor_dir_source = "kiln"  # as activate() leaves it, without pointing this process at it
    return cache


def test_the_payload_carries_the_artifact_and_the_cpu_probes_builds_and_records(tmp_path):
    sender = _machine(tmp_path / "machine0")
    artifact = sender.precompiled_dir / "Block-1234" / "abcd.kpc"
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"compiled code")
    probe = sender.inductor_dir / "3g"
    probe.mkdir(parents=True)
    (probe / "c3gprobe.cpp").write_text("int main() { return 0; }\n")  # a probe source: a few hundred bytes
    (probe / "c3gprobe.so").write_bytes(b"\x7fELF library")
    (probe / "c3gprobe.so.kiln-load").write_text("library 00\n")
    (probe / "c3gkernel.main.cpp").write_text("// a kernel, not a probe build\n")
    (probe / "c3gkernel.so").write_bytes(b"\x7fELF kernel")

    payload = CompileSharing(sender, node=0, local_rank=0)._payload(artifact, set(), torch.device("cpu"))
    _, body = read_envelope(payload, bundle.MAGIC, bundle.FORMAT_VERSION, "bundle", ("keys", "machine"))
    names = sorted(name for name, _ in read_members(body))
    assert names == ["inductor/3g/c3gprobe.cpp", "inductor/3g/c3gprobe.so", "inductor/3g/c3gprobe.so.kiln-load",
                     "kiln/precompiled/Block-1234/abcd.kpc"]

    receiver = _machine(tmp_path / "machine1")
    result = install_packed(payload, "from machine 0", receiver, [], torch.device("cpu"), vouched=None)
    assert result.message is None and result.installed == 4
    assert (receiver.inductor_dir / "3g" / "c3gprobe.so.kiln-load").read_text() == "library 00\n"
    assert (receiver.precompiled_dir / "Block-1234" / "abcd.kpc").read_bytes() == b"compiled code"
