"""Compiled code travels with checkpoints (kiln/compile/artifacts/bundle.py, through kiln/checkpoint/api.py):
save_state packs the job's compile artifacts, load_state on a machine with empty caches installs them.

One job (tiny Llama, regional precompile with aot_eager where this torch saves its output) is saved
once in a child process; a second child with EMPTY Kiln and Inductor folders resumes from it. The
other cases resume in this process, each test with its own empty Kiln folder (conftest.py).
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

import kiln.compile.artifacts.bundle as bundle
from kiln import Accelerator, TorchDynamoPlugin
from kiln.checkpoint.integrity import COMPILE_ARTIFACTS
from kiln.compile.artifacts.cache import INDUCTOR_ENV, KilnCacheWarning, pack_envelope, read_envelope
from kiln.compile.artifacts.trust import ENV_KEY, KEY_FILE, KilnTrustWarning, key_id
from toy_models import llama_run_with_checkpoint, tiny_llama
from torch_features import PRECOMPILE_BACKEND

TESTS = Path(__file__).resolve().parents[1]
STEPS, SAVED_AT = 4, 2  # the saving run saves after 2 optimizer steps and goes on to 4
# The key a team gives every job (KILN_COMPILE_SIGNING_KEY): the saving run signs with it, and the
# resumes that hold it trust the checkpoint's compiled code.
TEAM_KEY = "kiln-tests-team-key-" + "5a" * 16
CHILD = ("import json, sys; sys.path[:0] = sys.argv[1:3]; import test_compile_artifacts as t; "
         "print('RESULT ' + json.dumps(t.run_job(sys.argv[3], sys.argv[4])))")


def run_job(checkpoint: str, mode: str, **load_kwargs) -> dict:
    """'save': steps 0..3, save_state after step 1; 'resume': load_state(checkpoint, **load_kwargs), then
    steps 2..3. Returns the losses and what the compiled region did."""
    plugin = TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, use_regional_compilation=True, precompile=True,
                               fullgraph=True)
    acc = Accelerator(dynamo_plugin=plugin)
    losses = llama_run_with_checkpoint(acc, checkpoint, mode, STEPS, SAVED_AT, **load_kwargs)
    report = acc.compile_report()
    (region,) = report.regions
    return {"losses": losses, "loaded": region.precompiled_loaded, "compiled": region.precompiled_saved,
            "traces": region.traces, "ran": region.ran, "artifact_cache": report.artifact_cache}


def run_child(checkpoint: Path, mode: str, folder: Path, key: str | None = TEAM_KEY) -> tuple[dict, str]:
    """`run_job` in a fresh interpreter whose Kiln and Inductor folders are `folder`'s, empty at the start,
    given the signing key `key` in its environment (None: none)."""
    (folder / "kiln-cache").mkdir(parents=True)
    (folder / "inductor").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_COMPILE_CACHE_DIR=str(folder / "kiln-cache"), OMP_NUM_THREADS="1",
               **{INDUCTOR_ENV: str(folder / "inductor")}, **({ENV_KEY: key} if key else {}))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(TESTS), str(TESTS / "checkpoint"), str(checkpoint), mode],
                          capture_output=True, text=True, timeout=300, env=env, cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saving run in a fresh process: its checkpoint, its output and its (uninterrupted) losses."""
    folder = tmp_path_factory.mktemp("saving-machine")
    checkpoint = folder / "checkpoint"
    result, output = run_child(checkpoint, "save", folder)
    assert result["compiled"] >= 1 and result["ran"] == "precompiled", result
    return checkpoint, result, output


@pytest.fixture
def checkpoint(saved, tmp_path):
    """A copy of the saved checkpoint this test may damage."""
    copy = tmp_path / "checkpoint"
    shutil.copytree(saved[0], copy)
    return copy


def resumed_here(checkpoint: Path, key: str | None = TEAM_KEY, **load_kwargs) -> tuple[dict, list[warnings.WarningMessage]]:
    """`run_job`'s resume in this process, holding the signing key `key` (None: none, as on a fresh
    machine); the Kiln cache and trust warnings it gave."""
    env = {k: v for k, v in os.environ.items() if k != ENV_KEY}
    with warnings.catch_warnings(record=True) as caught, mock.patch.dict(os.environ, env, clear=True):
        warnings.simplefilter("always")
        if key is not None:
            os.environ[ENV_KEY] = key
        result = run_job(str(checkpoint), "resume", **load_kwargs)
    return result, [w for w in caught if issubclass(w.category, (KilnCacheWarning, KilnTrustWarning))]


def rewrite_header(path: Path, change, key: str | None = TEAM_KEY) -> None:
    """Rewrite a bundle's header with `change(header)`, keeping its payload, with a valid checksum and,
    under `key`, a valid signature."""
    header, payload = read_envelope(path.read_bytes(), bundle.MAGIC, bundle.FORMAT_VERSION, "bundle")
    change(header)
    path.write_bytes(bundle.seal(header, payload, key.encode() if key else None))


def rename_members(path: Path, rename) -> None:
    """Rewrite a bundle with each file's name in it changed by `rename`, keeping its header (signed with
    the team key)."""
    header, payload = read_envelope(path.read_bytes(), bundle.MAGIC, bundle.FORMAT_VERSION, "bundle")
    folder = path.parent / "renamed"
    files = {}
    for i, (name, data) in enumerate(bundle.read_members(payload)):
        source = folder / str(i)
        source.parent.mkdir(exist_ok=True)
        source.write_bytes(data)
        files[rename(name)] = source
    packed = bundle.pack_bundle(files, header["keys"], "cpu")
    _, new_payload = read_envelope(packed, bundle.MAGIC, bundle.FORMAT_VERSION, "bundle")
    path.write_bytes(bundle.seal(header, new_payload, TEAM_KEY.encode()))
    shutil.rmtree(folder)


def assert_losses_continue(result: dict, saved_result: dict) -> None:
    torch.testing.assert_close(result["losses"], saved_result["losses"][SAVED_AT:], rtol=0, atol=1e-6)


# ----- what the checkpoint holds ---------------------------------------------------------------

def test_checkpoint_holds_the_jobs_artifacts_with_their_key_outside_the_strict_manifest(saved):
    checkpoint, _, output = saved
    header, payload = read_envelope((checkpoint / COMPILE_ARTIFACTS).read_bytes(), bundle.MAGIC,
                                    bundle.FORMAT_VERSION, "bundle")
    assert header["machine"] == bundle.machine_key("cpu")  # torch, ISA, CPU, python: this machine's
    assert header["machine"]["torch"] == torch.__version__ and header["machine"]["isa"]
    assert len(header["keys"]) == 1 and len(header["keys"][0]) == 64
    names = [name for name, _ in bundle.read_members(payload)]
    assert any(n.startswith("kiln/precompiled/") and n.endswith(".kpc") for n in names), names
    manifest = json.loads((checkpoint / "kiln_checkpoint.json").read_text())
    assert COMPILE_ARTIFACTS not in manifest["sizes"] and COMPILE_ARTIFACTS not in manifest["files"]
    size = (checkpoint / COMPILE_ARTIFACTS).stat().st_size
    assert output.count("compile artifacts: ") == 1 and f"{size / 1e6:.1f} MB" in output


# ----- resuming --------------------------------------------------------------------------------

def test_fresh_process_with_empty_caches_resumes_on_the_checkpoints_compiled_code(saved, tmp_path):
    checkpoint, saved_result, _ = saved
    result, output = run_child(checkpoint, "resume", tmp_path / "fresh-machine")
    assert result["loaded"] >= 1 and result["compiled"] == 0, result  # a cache hit: nothing compiled
    assert result["traces"] == 0 and result["ran"] == "precompiled", result
    assert_losses_continue(result, saved_result)
    assert "KilnCacheWarning" not in output
    if saved_result["artifact_cache"]["saves"]:  # Kiln's own entry travelled too, and was loaded
        assert result["artifact_cache"]["hits"] == 1 and result["artifact_cache"]["misses"] == 0, result
    assert list((tmp_path / "fresh-machine" / "kiln-cache" / "precompiled").rglob("*.kpc"))


def test_artifacts_of_another_torch_give_one_message_and_a_cold_compile(saved, checkpoint):
    rewrite_header(checkpoint / COMPILE_ARTIFACTS, lambda h: h["machine"].update(torch="2.0.0"))
    result, caught = resumed_here(checkpoint)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "torch '2.0.0' there" in str(caught[0].message) and "compiles cold" in str(caught[0].message)
    assert result["loaded"] == 0 and result["compiled"] >= 1
    assert_losses_continue(result, saved[1])


def test_artifacts_of_another_job_key_are_installed_and_the_regions_they_share_load(saved, checkpoint):
    # The same model under another strategy or number of processes: the job key differs, the region
    # (block source and compile settings) does not, and each artifact checks its call signature.
    rewrite_header(checkpoint / COMPILE_ARTIFACTS, lambda h: h.update(keys=["0" * 64]))
    result, caught = resumed_here(checkpoint)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "another job key" in str(caught[0].message) and "installed" in str(caught[0].message)
    assert result["loaded"] >= 1 and result["compiled"] == 0, result
    assert_losses_continue(result, saved[1])


def test_precompiled_regions_of_other_compile_settings_are_not_found_and_compile_cold(saved, checkpoint):
    # Other compile settings change the region key, hence the region's folder name: what is installed
    # is never looked up, and the region compiles ahead of time as in a cold start.
    rewrite_header(checkpoint / COMPILE_ARTIFACTS, lambda h: h.update(keys=["0" * 64]))
    rename_members(checkpoint / COMPILE_ARTIFACTS, lambda name: name.replace("LlamaDecoderLayer-", "OtherBlock-"))
    result, caught = resumed_here(checkpoint)
    assert len(caught) == 1 and "another job key" in str(caught[0].message)
    assert result["loaded"] == 0 and result["compiled"] >= 1
    assert_losses_continue(result, saved[1])


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _truncate], ids=["flipped byte", "truncated"])
def test_damaged_artifacts_give_one_warning_and_a_recompile_and_the_resume_succeeds(saved, checkpoint, damage):
    damage(checkpoint / COMPILE_ARTIFACTS)
    result, caught = resumed_here(checkpoint)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "not used" in str(caught[0].message) and "compiles cold" in str(caught[0].message)
    assert result["loaded"] == 0 and result["compiled"] >= 1
    assert_losses_continue(result, saved[1])


def test_a_bundle_naming_a_file_outside_the_caches_installs_nothing(tmp_path):
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("kiln/../../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    path = tmp_path / COMPILE_ARTIFACTS
    path.write_bytes(pack_envelope(bundle.MAGIC, {"format": bundle.FORMAT_VERSION, "keys": [],
                                                  "machine": bundle.machine_key("cpu")}, buffer.getvalue()))
    from kiln.compile.artifacts.cache import CompileCache

    result = bundle.install_bundle(path, CompileCache(tmp_path / "cache"), [], "cpu",
                                   bundle.vouch_for(path, None, trust_all=True))
    assert result.installed == 0 and "'kiln/../../escaped.txt', which is not a cache file" in result.message
    assert not (tmp_path / "escaped.txt").exists()


def test_cpu_kernels_this_process_loaded_and_the_probes_builds_travel_into_the_other_machines_inductor_folder(tmp_path, monkeypatch):
    # Inductor keeps a C++ kernel's files in <cache dir>/<key[1:3]>/ and its key in CppCodeCache's
    # in-memory caches once loaded (torch 2.13); no real kernel is built here (tests never run gcc).
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from kiln.compile.artifacts.cache import CompileCache

    key = "ck7" + "a" * 49
    saving = CompileCache(tmp_path / "saving")
    (saving.inductor_dir / "k7").mkdir(parents=True)
    (saving.inductor_dir / "k7" / f"{key}.main.cpp").write_text("// kernel")
    (saving.inductor_dir / "k7" / f"{key}.main.so").write_bytes(b"\x7fELF built")
    (saving.inductor_dir / "zz").mkdir()
    (saving.inductor_dir / "zz" / f"c{'z' * 51}.main.cpp").write_text("// another job's kernel")
    (saving.inductor_dir / "zz" / f"c{'z' * 51}.main.so").write_bytes(b"not ours")
    # The CPU probe's check library: a tiny source without ".main", and its build.
    probe = "c24" + "b" * 49
    (saving.inductor_dir / "24").mkdir()
    (saving.inductor_dir / "24" / f"{probe}.cpp").write_text("extern \"C\" int __avx512_chk_kernel() { return 0; }")
    (saving.inductor_dir / "24" / f"{probe}.so").write_bytes(b"\x7fELF probe")
    monkeypatch.setitem(CppPythonBindingsCodeCache.cache, key, lambda: None)

    files = bundle.job_files(saving, [], [])
    assert sorted(files) == [f"inductor/24/{probe}.cpp", f"inductor/24/{probe}.so",
                             f"inductor/k7/{key}.main.cpp", f"inductor/k7/{key}.main.so"]
    bundle.write_bundle(tmp_path / COMPILE_ARTIFACTS, files, ["f" * 64], "cpu", TEAM_KEY.encode())
    fresh = CompileCache(tmp_path / "fresh")
    vouched = bundle.vouch_for(tmp_path / COMPILE_ARTIFACTS, TEAM_KEY.encode())
    result = bundle.install_bundle(tmp_path / COMPILE_ARTIFACTS, fresh, ["f" * 64], "cpu", vouched)
    assert (result.installed, result.present, result.message) == (4, 0, None)
    assert (fresh.inductor_dir / "k7" / f"{key}.main.so").read_bytes() == b"\x7fELF built"
    assert (fresh.inductor_dir / "24" / f"{probe}.so").read_bytes() == b"\x7fELF probe"
    again = bundle.install_bundle(tmp_path / COMPILE_ARTIFACTS, fresh, ["f" * 64], "cpu", vouched)
    assert (again.installed, again.present) == (0, 4)  # what a machine has already is left as it is


# ----- trust: only signed compiled code is installed ---------------------------------------------

def _assert_told_and_cold(result: dict, caught: list, saved_result: dict, *phrases: str) -> None:
    """One KilnTrustWarning containing `phrases` and the way to accept; nothing loaded; the right losses."""
    assert len(caught) == 1 and caught[0].category is KilnTrustWarning, [str(w.message) for w in caught]
    text = str(caught[0].message)
    for phrase in (*phrases, "not installed", "compiles cold", "trust_compile_artifacts=True", ENV_KEY):
        assert phrase in text, text
    assert result["loaded"] == 0 and result["compiled"] >= 1, result
    assert_losses_continue(result, saved_result)


def test_the_saving_job_signs_the_bundle_with_its_key(saved):
    header, payload = read_envelope((saved[0] / COMPILE_ARTIFACTS).read_bytes(), bundle.MAGIC,
                                    bundle.FORMAT_VERSION, "bundle")
    assert header["signed_by"] == key_id(TEAM_KEY.encode())
    assert bundle.vouch_for(saved[0] / COMPILE_ARTIFACTS, TEAM_KEY.encode()).sha256 is not None
    assert bundle.vouch_for(saved[0] / COMPILE_ARTIFACTS, b"another key of at least 32 characters").sha256 is None


def test_a_fresh_machine_without_the_key_is_told_to_set_it_and_compiles_cold(saved, checkpoint):
    result, caught = resumed_here(checkpoint, key=None)  # this test's Kiln folder holds no key either
    _assert_told_and_cold(result, caught, saved[1], "this machine holds no signing key",
                          key_id(TEAM_KEY.encode()))


def test_an_unsigned_bundle_is_refused_and_trust_compile_artifacts_installs_it(saved, checkpoint):
    rewrite_header(checkpoint / COMPILE_ARTIFACTS, lambda h: None, key=None)  # a valid checksum, no signature
    result, caught = resumed_here(checkpoint)
    _assert_told_and_cold(result, caught, saved[1], "carries no signature")

    torch._dynamo.reset()
    shutil.rmtree(os.environ["KILN_COMPILE_CACHE_DIR"] + "/precompiled")  # a fresh machine again
    result, caught = resumed_here(checkpoint, trust_compile_artifacts=True)
    assert caught == [] and result["loaded"] >= 1 and result["compiled"] == 0, result
    assert_losses_continue(result, saved[1])


def test_a_bundle_signed_with_another_key_is_refused(saved, checkpoint):
    other = "someone-elses-key-" + "e" * 32
    rewrite_header(checkpoint / COMPILE_ARTIFACTS, lambda h: None, key=other)
    result, caught = resumed_here(checkpoint)
    _assert_told_and_cold(result, caught, saved[1], f"signed with key {key_id(other.encode())}",
                          f"not with this job's key {key_id(TEAM_KEY.encode())}")


def test_a_bundle_changed_after_signing_is_refused_even_with_a_fixed_checksum(saved, checkpoint):
    path = checkpoint / COMPILE_ARTIFACTS
    header, payload = read_envelope(path.read_bytes(), bundle.MAGIC, bundle.FORMAT_VERSION, "bundle")
    changed = bytearray(payload)
    changed[len(changed) // 2] ^= 0xFF
    # The attacker's rewrite: the old signature kept, the checksum and size fixed for the new payload.
    path.write_bytes(pack_envelope(bundle.MAGIC, {k: v for k, v in header.items() if not k.startswith("payload_")},
                                   bytes(changed)))
    result, caught = resumed_here(checkpoint)
    _assert_told_and_cold(result, caught, saved[1], "does not match its contents")


def test_without_a_key_the_first_save_makes_one_owner_only_and_the_same_folder_trusts_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    folder = Path(os.environ["KILN_COMPILE_CACHE_DIR"])
    assert not (folder / KEY_FILE).exists()
    acc = _precompiling_accelerator()
    _short_job(acc)
    acc.save_state(tmp_path / "checkpoint")
    key_file = folder / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_text().strip()) == 64
    header, _ = read_envelope((tmp_path / "checkpoint" / COMPILE_ARTIFACTS).read_bytes(), bundle.MAGIC,
                              bundle.FORMAT_VERSION, "bundle")
    assert header["signed_by"] == key_id(key_file.read_text().strip().encode())
    acc.save_state(tmp_path / "again")
    assert key_file.read_text() == key_file.read_text()  # made once, kept
    assert bundle.vouch_for(tmp_path / "again" / COMPILE_ARTIFACTS,
                            key_file.read_text().strip().encode()).sha256 is not None

    key_file.chmod(0o644)  # readable by others: no longer a secret, so neither used nor trusted
    with pytest.warns(KilnTrustWarning, match=r"signing key .* not used: other users can read or write it"):
        acc.save_state(tmp_path / "exposed")
    header, _ = read_envelope((tmp_path / "exposed" / COMPILE_ARTIFACTS).read_bytes(), bundle.MAGIC,
                              bundle.FORMAT_VERSION, "bundle")
    assert "signature" not in header


def test_a_short_signing_key_is_an_error_at_accelerator(monkeypatch):
    monkeypatch.setenv(ENV_KEY, "hunter2")
    with pytest.raises(ValueError, match="KILN_COMPILE_SIGNING_KEY holds 7 characters; a signing key needs at "
                                         "least 32"):
        _precompiling_accelerator()


def test_trust_compile_artifacts_must_be_a_bool(saved, checkpoint):
    acc = _precompiling_accelerator()
    model = tiny_llama(2)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="trust_compile_artifacts must be True or False, got 'yes'"):
        acc.load_state(checkpoint, trust_compile_artifacts="yes")


# ----- Kiln's JIT cache entries travel too --------------------------------------------------------

def test_kiln_cache_entry_travels_and_is_a_hit_after_load_state(tmp_path, monkeypatch):
    # aot_eager leaves torch no cache artifacts: torch's save/load of them are faked (as in test_cache.py),
    # so the entry Kiln writes after the first step is what must travel and be loaded after load_state.
    monkeypatch.setenv(ENV_KEY, TEAM_KEY)  # every job holds the team's key
    payload = b"compiled-artifacts:" + bytes(range(256))
    loaded = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: (payload, type("Info", (), {"artifacts": {"inductor": ["a"]}})()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or object())

    def job(cache_dir: Path, resume_from: Path | None = None, precision: str = "no") -> Accelerator:
        plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, cache_dir=str(cache_dir))
        acc = Accelerator(dynamo_plugin=plugin, mixed_precision=precision)
        model = tiny_llama(2)
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        if resume_from is not None:
            acc.load_state(resume_from)
        ids = torch.randint(0, 97, (2, 16))
        acc.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
        optimizer.step()
        return acc

    saving = job(tmp_path / "saving-cache")
    saving.save_state(tmp_path / "checkpoint")
    header, payload_tar = read_envelope((tmp_path / "checkpoint" / COMPILE_ARTIFACTS).read_bytes(), bundle.MAGIC,
                                        bundle.FORMAT_VERSION, "bundle")
    assert [n for n, _ in bundle.read_members(payload_tar)] == [f"kiln/{header['keys'][0]}.kiln"]

    torch._dynamo.reset()
    loaded.clear()
    resumed = job(tmp_path / "empty-cache", resume_from=tmp_path / "checkpoint")
    assert resumed.compile_report().artifact_cache["hits"] == 1
    assert resumed.compile_report().artifact_cache["misses"] == 0  # the miss at prepare became a hit
    assert loaded == [payload]
    assert (tmp_path / "empty-cache" / f"{header['keys'][0]}.kiln").is_file()

    # Resumed under another job key (here bf16; another strategy or number of processes alike): the
    # entry is installed and loaded as well, and torch's caches take what the two jobs share.
    torch._dynamo.reset()
    loaded.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = job(tmp_path / "other-cache", resume_from=tmp_path / "checkpoint", precision="bf16")
    assert [str(w.message) for w in caught if issubclass(w.category, KilnCacheWarning)
            and "another job key" in str(w.message)], [str(w.message) for w in caught]
    assert loaded == [payload]
    assert other.compile_report().artifact_cache["hits"] == 1  # the other key's entry
    assert (tmp_path / "other-cache" / f"{header['keys'][0]}.kiln").is_file()


# ----- the switch and the size line --------------------------------------------------------------

def _short_job(acc: Accelerator):
    model = tiny_llama(2)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 97, (2, 16))
    acc.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
    optimizer.step()


def _precompiling_accelerator() -> Accelerator:
    return Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=PRECOMPILE_BACKEND, use_regional_compilation=True,
                                                       precompile=True, fullgraph=True))


def test_size_is_printed_once_and_the_switch_leaves_the_artifacts_out(tmp_path, monkeypatch, capsys):
    acc = _precompiling_accelerator()
    _short_job(acc)
    acc.save_state(tmp_path / "first")
    acc.save_state(tmp_path / "second")
    out = capsys.readouterr().out
    assert out.count("compile artifacts: ") == 1 and "KILN_CHECKPOINT_COMPILE_ARTIFACTS=0 leaves them out" in out
    assert (tmp_path / "first" / COMPILE_ARTIFACTS).is_file() and (tmp_path / "second" / COMPILE_ARTIFACTS).is_file()

    monkeypatch.setenv("KILN_CHECKPOINT_COMPILE_ARTIFACTS", "0")
    acc.save_state(tmp_path / "off")
    assert not (tmp_path / "off" / COMPILE_ARTIFACTS).exists()
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == \
        sorted(p.name for p in (tmp_path / "first").iterdir() if p.name != COMPILE_ARTIFACTS)


def test_a_bad_switch_value_is_an_error_naming_it_before_anything_is_written(tmp_path, monkeypatch):
    acc = _precompiling_accelerator()
    _short_job(acc)
    monkeypatch.setenv("KILN_CHECKPOINT_COMPILE_ARTIFACTS", "sometimes")
    with pytest.raises(ValueError, match="KILN_CHECKPOINT_COMPILE_ARTIFACTS='sometimes' is not a boolean"):
        acc.save_state(tmp_path / "checkpoint")
    assert not any(tmp_path.iterdir())


def test_with_the_compile_cache_off_nothing_is_carried(tmp_path):
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True,
                                                      cache=False))
    _short_job(acc)
    acc.save_state(tmp_path / "checkpoint")
    assert not (tmp_path / "checkpoint" / COMPILE_ARTIFACTS).exists()


# ----- another number of processes ----------------------------------------------------------------

@pytest.mark.multiprocess
def test_two_processes_resume_from_one_process_checkpoint_on_its_installed_artifacts(tmp_path):
    # Saved by 1 process (batch 6), resumed by 2 with empty caches, the same batch per process (12 in
    # all) and the same thread count: the regions' signatures are the saved ones. The job key is not
    # (another strategy), so the precompiled regions are what is installed; the local main process
    # installs, then both load.
    sys.path.insert(0, str(TESTS / "distributed"))
    from test_strategies import run_worker

    saving, resuming = tmp_path / "saving", tmp_path / "resuming"
    saving.mkdir()
    resuming.mkdir()
    one_thread = dict(os.environ, OMP_NUM_THREADS="1", **{ENV_KEY: TEAM_KEY})  # the key, as the jobs' secret
    saved_run = run_worker(saving, 1, "--precompile", "--epochs", "2", "--save-at", "1",
                           env=dict(one_thread, KILN_COMPILE_CACHE_DIR=str(saving / "cache")))
    assert saved_run["compiled_ahead"] == [2], saved_run  # the encoder's and the decoder's block
    assert (saving / "ckpt" / COMPILE_ARTIFACTS).is_file()

    resumed = run_worker(resuming, 2, "--precompile", "--epochs", "2", "--global-batch", "12", "--resume-from",
                         str(saving / "ckpt"), env=dict(one_thread, KILN_COMPILE_CACHE_DIR=str(resuming / "cache")))
    assert resumed["load_report"]["saved_processes"] == 1 and resumed["processes"] == 2
    assert all(n > 0 for n in resumed["precompiled_calls"]), resumed
    assert resumed["compiled_ahead"] == [0, 0], resumed["precompile_notes"]  # every process loaded
    assert list((resuming / "cache" / "precompiled").rglob("*.kpc"))
    assert resumed["checksums"][0] == resumed["checksums"][1]
