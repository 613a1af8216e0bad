"""Damaged and foreign compiled code, with real Inductor kernels (issue: "a checkpoint never runs someone
else's code"): in a cache folder and in a checkpoint, kernel libraries replaced by one whose constructor
writes a marker file, sources and generated modules truncated or scrambled, Inductor's cache entries and
Kiln's own entry damaged. Each run must finish with the untampered run's losses, and the marker must
never be written (no foreign code ran).

One cold run of a 2-layer Llama with the default settings (Inductor, JIT regions) saves its folder and a
checkpoint; every other run is a fresh interpreter on a damaged copy (a crashing library would take the
test process with it).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.checkpoint.integrity import COMPILE_ARTIFACTS
from kiln.compile.artifacts import bundle
from kiln.compile.artifacts.cache import pack_envelope, read_envelope
from kiln.compile.artifacts.trust import ENV_KEY

pytestmark = [pytest.mark.inductor, pytest.mark.warm_starts]  # make test-warm-starts runs them
TESTS = Path(__file__).resolve().parents[2]
KEY = "kiln-tampering-tests-key-" + "3c" * 16
STEPS, SAVED_AT = 4, 2
CHILD = ("import json, sys; sys.path[:0] = sys.argv[1:3]; import test_tampering as t; "
         "print('RESULT ' + json.dumps(t.run_job(*sys.argv[3:])))")
MARKER_SOURCE = """#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    const char *path = getenv("KILN_TEST_MARKER");
    FILE *f = fopen(path ? path : "/dev/null", "a");
    if (f) { fputs("foreign code ran\\n", f); fclose(f); }
}
"""


def run_job(checkpoint: str, mode: str) -> dict:
    """'save': steps 0..3 with save_state after step 1; 'resume': load_state, then steps 2..3;
    'again': steps 0..3 on whatever the cache folder holds."""
    from kiln import Accelerator, TorchDynamoPlugin
    from toy_models import llama_run_with_checkpoint

    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True))
    losses = llama_run_with_checkpoint(acc, checkpoint, mode, STEPS, SAVED_AT)
    (region,) = acc.compile_report().regions
    return {"losses": losses, "compiled_calls": region.compiled_calls, "eager_calls": region.eager_calls}


# The C++ compiler every run uses: g++, each build it runs logged to $COMPILER_LOG (Inductor takes $CXX).
# Not logged: version queries, and the header Inductor preprocesses once per process to key its
# precompiled headers (`-E`, torch 2.13), which every warm start runs.
COMPILER = """#!/bin/sh
case " $* " in *" -E "*) ;; *" -o "*) echo "$*" >> "${COMPILER_LOG:-/dev/null}" ;; esac
exec g++ "$@"
"""


def run_child(folder: Path, mode: str, checkpoint: Path, marker: Path, compiler: Path,
              inductor_dir: Path | None = None, compiler_log: Path | None = None) -> tuple[dict, str]:
    """`run_job` in a fresh interpreter on `folder` (its Kiln folder, Inductor's inside it unless the
    user's `inductor_dir` is given), holding the job's signing key; fails the test on a crash, with its
    output. `compiler` (every run the same: it is part of a kernel's key) logs its builds to `compiler_log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "TORCHINDUCTOR_"))}
    # Per-block regions alone: the default's outer graph would add a helper and a region of its own.
    env.update(KILN_COMPILE_CACHE_DIR=str(folder), OMP_NUM_THREADS="1", KILN_TEST_MARKER=str(marker),
               KILN_DYNAMO_OUTER_GRAPH="false", CXX=str(compiler), COMPILER_LOG=str(compiler_log or os.devnull),
               **({"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)} if inductor_dir else {}), **{ENV_KEY: KEY})
    proc = subprocess.run([sys.executable, "-c", CHILD, str(TESTS), str(Path(__file__).parent), str(checkpoint), mode],
                          capture_output=True, text=True, timeout=600, env=env, cwd=folder.parent)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + output[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), output


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The untampered run: its Kiln folder, checkpoint and losses, and a library that marks its loading."""
    root = tmp_path_factory.mktemp("tampering")
    compiler = root / "compiler" / "g++"
    compiler.parent.mkdir()
    compiler.write_text(COMPILER)
    compiler.chmod(0o755)
    marker_library = root / "marker.so"
    (root / "marker.c").write_text(MARKER_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(marker_library), str(root / "marker.c")], check=True)
    result, _ = run_child(root / "cold", "save", root / "checkpoint", root / "unused-marker", compiler)
    assert result["eager_calls"] == 0 and result["compiled_calls"] == 2 * STEPS, result  # every layer call
    return {"root": root, "compiler": compiler, "folder": root / "cold", "checkpoint": root / "checkpoint", "losses": result["losses"],
            "marker_library": marker_library.read_bytes()}


def damage(data: bytes, how: str, replacement: bytes) -> bytes:
    if how == "replace":
        return replacement
    if how == "truncate":
        return data[: len(data) // 2]
    scrambled = bytearray(data)
    for i in range(len(scrambled) // 4, 3 * len(scrambled) // 4, 3):
        scrambled[i] ^= 0xFF
    return bytes(scrambled)


def kinds(folder: Path) -> dict[str, list[Path]]:
    """The files of a Kiln folder by kind: kernel libraries (the CPU probe's too) and their sources, the
    generated modules, Inductor's cache entries, Kiln's entry."""
    inductor = folder / "inductor"
    return {".so": sorted(inductor.glob("*/*.so")), ".cpp": sorted(inductor.glob("*/*.cpp")),
            ".py": sorted(inductor.glob("*/*.py")),
            "entries": sorted(p for sub in ("fxgraph", "aotautograd") for p in (inductor / sub).rglob("*") if p.is_file()),
            ".kiln": sorted(folder.glob("*.kiln"))}


# Two runs cover every kind with every damage: a kind's files take the three damages in turn, starting
# at another one in each run (a kind of one or two files gets the rest in the other run).
@pytest.mark.parametrize("offset", [0, 1], ids=["run-a", "run-b"])
def test_a_damaged_cache_folder_is_moved_aside_and_compiled_again_and_no_foreign_code_runs(cold, tmp_path, offset):
    folder = tmp_path / "kiln-cache"
    shutil.copytree(cold["folder"], folder, symlinks=True)
    done = set()
    for kind, files in kinds(folder).items():
        assert files, f"the cold run left no {kind} files"
        for i, path in enumerate(files):
            how = ("replace", "truncate", "scramble")[(i + offset * (2 if len(files) < 3 else 1)) % 3]
            other = files[(i + 1) % len(files)].read_bytes() if len(files) > 1 else path.read_bytes()[::-1]
            replacement = cold["marker_library"] if kind == ".so" else other
            path.write_bytes(damage(path.read_bytes(), how, replacement))
            done.add((kind, how))
    marker = tmp_path / "marker"
    result, output = run_child(folder, "again", cold["checkpoint"], marker, cold["compiler"])
    assert not marker.exists(), "a planted library's constructor ran"
    assert result["losses"] == cold["losses"] and result["eager_calls"] == 0 and result["compiled_calls"] == 2 * STEPS
    assert output.count("of this job's compiled code changed since Kiln recorded them") == 1, output[-3000:]
    assert list((folder / "quarantine").rglob("*.so"))


def test_a_tampered_checkpoint_is_refused_and_no_foreign_code_runs(cold, tmp_path):
    # Every kind of member changed inside the bundle, the envelope's checksum fixed: the signature no
    # longer matches, so nothing of it is installed, and the resume compiles cold.
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(cold["checkpoint"], checkpoint)
    path = checkpoint / COMPILE_ARTIFACTS
    header, payload = read_envelope(path.read_bytes(), bundle.MAGIC, bundle.FORMAT_VERSION, "bundle")
    members = bundle.read_members(payload)
    assert {name.rsplit(".", 1)[-1] for name, _ in members} >= {"so", "cpp", "kiln"}
    files = {}
    for i, (name, data) in enumerate(members):
        source = tmp_path / "members" / str(i)
        source.parent.mkdir(exist_ok=True)
        how = ("replace", "truncate", "scramble")[i % 3]
        source.write_bytes(damage(data, how, cold["marker_library"]) if name.endswith(".so")
                           else damage(data, "scramble", b""))
        files[name] = source
    _, tampered = read_envelope(bundle.pack_bundle(files, header["keys"], "cpu"), bundle.MAGIC,
                                bundle.FORMAT_VERSION, "bundle")
    path.write_bytes(pack_envelope(bundle.MAGIC, {k: v for k, v in header.items() if not k.startswith("payload_")},
                                   tampered))
    marker = tmp_path / "marker"
    result, output = run_child(tmp_path / "fresh-machine", "resume", checkpoint, marker, cold["compiler"])
    assert not marker.exists(), "the checkpoint's library ran"
    assert "KilnTrustWarning" in output and "does not match its contents" in output, output[-3000:]
    assert result["losses"] == cold["losses"][SAVED_AT:] and result["eager_calls"] == 0
    assert result["compiled_calls"] == 2 * (STEPS - SAVED_AT)
    # The cold compile built its own kernels: none of the checkpoint's planted libraries was installed.
    built = list((tmp_path / "fresh-machine" / "inductor").rglob("*.so"))
    assert built and all(p.read_bytes() != cold["marker_library"] for p in built)


def test_a_fresh_machine_resumes_into_the_users_inductor_folder_without_running_the_compiler(cold):
    # Issue 39: the CPU probe started at prepare, before load_state had installed its libraries, and
    # built them again with g++ (5 s of a 6.4 s resume); now it starts at the first compiled call.
    root, log = cold["root"], cold["root"] / "resume-compiler-calls"
    users = root / "users-inductor"
    users.mkdir()
    result, output = run_child(root / "fresh-machine", "resume", cold["checkpoint"], root / "marker",
                               cold["compiler"], inductor_dir=users, compiler_log=log)
    assert result["losses"] == cold["losses"][SAVED_AT:] and result["eager_calls"] == 0
    assert list(users.rglob("*.so")), "the checkpoint's kernels were not installed into the user's Inductor folder"
    assert not log.exists(), "the resume ran the C++ compiler:\n" + log.read_text()[:3000]
