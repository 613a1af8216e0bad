"""Tests for kiln/compile/artifacts/cache.py: keys, checked entry files, atomic saves, env settings, warm starts.

Every cache here lives under tmp_path; torch's save/load functions are faked where only Kiln's
logic is under test, and one test (marked inductor) does a real warm start in a second process.
"""

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kiln.compile.artifacts.cache as cache_module
import kiln.compile.artifacts.cache_key as cache_key_module
from kiln.compile.artifacts.cache import (ENTRY_SUFFIX, INDUCTOR_ENV, MAGIC, CompileCache, CorruptEntryError,
                                KilnCacheWarning, read_entry)
from toy_models import EncoderDecoder

TESTS_DIR = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
SETTINGS = {"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None}


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    """No cache setting leaks in or out: the env vars and Kiln's record of its own folder are restored."""
    for name in (INDUCTOR_ENV, "KILN_COMPILE_CACHE", "KILN_COMPILE_CACHE_DIR"):
        monkeypatch.setenv(name, "placeholder")  # records the original value for the undo
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default folder must not be the real ~/.cache
    monkeypatch.setattr(cache_module, "_kiln_inductor_dir", None)


@pytest.fixture
def fake_artifacts(monkeypatch):
    """torch's save/load of cache artifacts replaced by recorders; `payload` is what save returns."""
    state = SimpleNamespace(payload=b"compiled-artifacts:" + bytes(range(256)) * 8, loaded=[], save_calls=0)
    state.artifact_keys = lambda: {"inductor": [hashlib.sha1(state.payload).hexdigest(), "b"],
                                   "aot_autograd": ["c"]}  # new bytes, new artifacts, like torch's

    def save():
        state.save_calls += 1
        if state.payload is None:
            return None
        return state.payload, SimpleNamespace(artifacts=state.artifact_keys())

    def load(data):
        state.loaded.append(data)
        return SimpleNamespace(artifacts={})

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return state


def saved_entry(folder: Path, model=None) -> tuple[CompileCache, str, Path]:
    cache = CompileCache(folder)
    key = cache.key(model or EncoderDecoder(), SETTINGS, CPU)
    assert cache.save(key)
    return cache, key, cache.entry_path(key)


def load_warnings(cache: CompileCache, key: str) -> tuple[bool, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = cache.load(key)
    return hit, caught


# ----- save and load -----------------------------------------------------------------------

def test_saved_entry_loads_back_into_torch_in_a_new_cache_object(tmp_path, fake_artifacts):
    _, key, path = saved_entry(tmp_path)
    assert path.name == key + ENTRY_SUFFIX
    reader = CompileCache(tmp_path)
    hit, caught = load_warnings(reader, key)
    assert hit and not caught
    assert fake_artifacts.loaded == [fake_artifacts.payload]
    assert reader.stats.as_dict() == {"hits": 1, "misses": 0, "saves": 0, "rejected": 0}


def test_entry_header_describes_model_settings_and_versions(tmp_path, fake_artifacts):
    _, key, path = saved_entry(tmp_path)
    header, payload = read_entry(path)
    assert payload == fake_artifacts.payload
    assert header["key"] == key and header["torch"] == torch.__version__
    assert header["payload_bytes"] == len(payload)
    assert header["artifacts"] == {"inductor": 2, "aot_autograd": 1}
    assert "EncoderDecoder" in header["description"] and "backend=inductor" in header["description"]
    assert path.read_bytes().startswith(MAGIC)


def test_missing_entry_is_a_silent_miss(tmp_path, fake_artifacts):
    cache = CompileCache(tmp_path)
    hit, caught = load_warnings(cache, cache.key(EncoderDecoder(), SETTINGS, CPU))
    assert not hit and not caught and not fake_artifacts.loaded
    assert (cache.stats.misses, cache.stats.rejected) == (1, 0)


def test_saving_the_same_artifacts_again_keeps_the_file(tmp_path, fake_artifacts):
    cache, key, path = saved_entry(tmp_path)
    before = path.stat().st_mtime_ns, path.read_bytes()
    # A warm run re-serializes what it loaded in another order: other bytes, same artifacts.
    same_keys = fake_artifacts.artifact_keys()
    fake_artifacts.artifact_keys = lambda: {kind: keys[::-1] for kind, keys in reversed(same_keys.items())}
    fake_artifacts.payload = fake_artifacts.payload[::-1]
    assert cache.save(key)
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before
    assert cache.stats.saves == 1


def test_saving_new_artifacts_replaces_the_entry(tmp_path, fake_artifacts):
    cache, key, path = saved_entry(tmp_path)
    fake_artifacts.payload = b"after a recompile"
    assert cache.save(key)
    assert read_entry(path)[1] == b"after a recompile" and cache.stats.saves == 2


def test_save_returns_false_when_torch_has_no_artifacts(tmp_path, fake_artifacts):
    # Backends other than Inductor (aot_eager, eager) record no artifacts: save_cache_artifacts gives None.
    cache = CompileCache(tmp_path)
    key = cache.key(EncoderDecoder(), SETTINGS, CPU)
    fake_artifacts.payload = None
    assert not cache.save(key)
    fake_artifacts.payload = b""
    assert not cache.save(key)
    assert list(tmp_path.iterdir()) == []


def test_non_writer_never_writes(tmp_path, fake_artifacts):
    cache = CompileCache(tmp_path, is_writer=False)
    assert not cache.save(cache.key(EncoderDecoder(), SETTINGS, CPU))
    assert fake_artifacts.save_calls == 0
    assert list(tmp_path.iterdir()) == []


def test_non_writer_still_loads(tmp_path, fake_artifacts):
    _, key, _ = saved_entry(tmp_path)
    assert CompileCache(tmp_path, is_writer=False).load(key)


# ----- corrupt entries: one warning, a miss, never an exception ----------------------------

def _truncate(path, key, folder):
    path.write_bytes(path.read_bytes()[:-100])
    return "truncated"


def _flip_payload_byte(path, key, folder):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    return "checksum"


def _garbage(path, key, folder):
    path.write_bytes(os.urandom(4000))
    return "bad magic"


def _cut_inside_header(path, key, folder):
    path.write_bytes(path.read_bytes()[:len(MAGIC) + 20])
    return "header"


def _other_key(path, key, folder):
    other = "f" * 64
    (folder / (other + ENTRY_SUFFIX)).write_bytes(path.read_bytes())
    path.unlink()
    return "saved under key"


CORRUPTIONS = [_truncate, _flip_payload_byte, _garbage, _cut_inside_header, _other_key]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_entry_gives_one_warning_and_a_miss(tmp_path, fake_artifacts, corrupt):
    _, key, path = saved_entry(tmp_path)
    reason = corrupt(path, key, tmp_path)
    if corrupt is _other_key:
        key, path = "f" * 64, tmp_path / ("f" * 64 + ENTRY_SUFFIX)
    cache = CompileCache(tmp_path)
    hit, caught = load_warnings(cache, key)
    assert not hit
    assert [w.category for w in caught] == [KilnCacheWarning]
    message = str(caught[0].message)
    assert str(path) in message and reason in message
    assert not fake_artifacts.loaded
    assert (cache.stats.hits, cache.stats.misses, cache.stats.rejected) == (0, 1, 1)


def test_entry_from_another_torch_version_is_rejected(tmp_path, fake_artifacts, monkeypatch):
    cache = CompileCache(tmp_path)
    key = cache.key(EncoderDecoder(), SETTINGS, CPU)
    real_version = torch.__version__
    monkeypatch.setattr(torch, "__version__", "2.0.0+old")
    assert cache.save(key)
    monkeypatch.setattr(torch, "__version__", real_version)
    hit, caught = load_warnings(CompileCache(tmp_path), key)
    assert not hit and len(caught) == 1 and "torch 2.0.0+old" in str(caught[0].message)


@pytest.mark.parametrize("failure", ["raises", "returns_none"])
def test_torch_failing_to_load_artifacts_gives_one_warning(tmp_path, fake_artifacts, monkeypatch, failure):
    _, key, path = saved_entry(tmp_path)

    def load(data):
        if failure == "raises":
            raise RuntimeError("unpickling exploded")
        return None  # what torch does when its own deserializer fails

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    hit, caught = load_warnings(CompileCache(tmp_path), key)
    assert not hit
    assert [w.category for w in caught] == [KilnCacheWarning]
    assert str(path) in str(caught[0].message) and "load_cache_artifacts" in str(caught[0].message)


# ----- atomic writes -----------------------------------------------------------------------

def test_save_leaves_only_the_entry_file(tmp_path, fake_artifacts):
    _, _, path = saved_entry(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_reader_during_save_sees_the_old_complete_entry(tmp_path, fake_artifacts, monkeypatch):
    cache, key, path = saved_entry(tmp_path)
    old = fake_artifacts.payload
    fake_artifacts.payload = b"newer artifacts" * 500
    seen = []
    real_fsync = os.fsync

    def fsync_and_peek(fd):
        real_fsync(fd)
        if path.exists():  # the new bytes are written (to the temporary file) but not yet renamed
            seen.append(read_entry(path)[1])

    monkeypatch.setattr(os, "fsync", fsync_and_peek)
    assert cache.save(key)
    assert seen and seen[0] == old
    assert read_entry(path)[1] == fake_artifacts.payload


class _HalfWriter:
    """A file handle that writes half of what it is given, then fails like a full disk."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def write(self, data):
        self.handle.write(data[: len(data) // 2])
        self.handle.flush()
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure_point", ["write", "fsync"])
def test_failed_save_keeps_old_entry_and_leaves_no_partial_file(tmp_path, fake_artifacts, monkeypatch,
                                                                failure_point):
    cache, key, path = saved_entry(tmp_path)
    old_bytes = path.read_bytes()
    fake_artifacts.payload = b"newer artifacts" * 500
    if failure_point == "write":
        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _HalfWriter(real_fdopen(fd, *a, **k)))
    else:
        def fail(fd):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fsync", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not cache.save(key)
    assert [w.category for w in caught] == [KilnCacheWarning] and str(path) in str(caught[0].message)
    assert path.read_bytes() == old_bytes
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert cache.stats.saves == 1  # the first save only


# ----- keys --------------------------------------------------------------------------------

def _key(model=None, device=CPU, **settings):
    return CompileCache("unused").key(model or EncoderDecoder(), {**SETTINGS, **settings}, device)


def test_key_is_the_same_in_another_process():
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from kiln.compile.artifacts.cache import CompileCache
        from toy_models import EncoderDecoder
        print(CompileCache("unused").key(EncoderDecoder(), {SETTINGS!r}, torch.device("cpu")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == _key()


def test_key_ignores_weight_values_and_spelled_out_defaults():
    torch.manual_seed(1)
    a = EncoderDecoder()
    torch.manual_seed(2)
    b = EncoderDecoder()
    assert _key(a) == _key(b)
    assert CompileCache("unused").key(a, {}, CPU) == _key(a) == _key(a, mode="default", options={})


@pytest.mark.parametrize("change", [
    "shape", "dtype", "depth", "backend", "mode", "fullgraph", "dynamic", "options", "precision", "frozen",
])
def test_key_changes_with_what_makes_artifacts_valid(change):
    base = _key()
    model = EncoderDecoder()
    changed = {
        "shape": lambda: _key(EncoderDecoder(width=32)),
        "dtype": lambda: _key(model.to(torch.float64)),
        "depth": lambda: _key(EncoderDecoder(depth=4)),
        "backend": lambda: _key(backend="aot_eager"),
        "mode": lambda: _key(mode="max-autotune"),
        "fullgraph": lambda: _key(fullgraph=True),
        "dynamic": lambda: _key(dynamic=False),
        "options": lambda: _key(options={"max_autotune": True}),
        "precision": lambda: _key(precision="bf16"),
        "frozen": lambda: _key(model.requires_grad_(False)),
    }[change]()
    assert changed != base


def test_key_changes_with_torch_and_triton_versions(monkeypatch):
    base, real_version = _key(), torch.__version__
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert _key() != base
    monkeypatch.setattr(torch, "__version__", real_version)
    assert _key() == base
    monkeypatch.setattr(cache_key_module, "triton_version", lambda: "9.9.9")
    assert _key() != base


def test_key_names_a_callable_backend_by_qualified_name():
    def my_backend(gm, example_inputs):
        return gm

    def other_backend(gm, example_inputs):
        return gm

    assert _key(backend=my_backend) == _key(backend=my_backend)
    assert len({_key(backend=my_backend), _key(backend=other_backend), _key()}) == 3
    assert "0x" not in json.dumps(cache_key_module.normalize_compile_settings({"backend": my_backend}))


# ----- settings from arguments and the environment -----------------------------------------

@pytest.mark.parametrize("value", ["0", "false", "No", "off"])
def test_kiln_compile_cache_off_disables_everything(tmp_path, fake_artifacts, monkeypatch, value):
    monkeypatch.setenv("KILN_COMPILE_CACHE", value)
    cache = CompileCache(tmp_path)
    assert not cache.enabled
    cache.activate()
    key = cache.key(EncoderDecoder(), SETTINGS, CPU)
    assert not cache.save(key) and not cache.load(key)
    assert INDUCTOR_ENV not in os.environ and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_kiln_compile_cache_on_enables(monkeypatch, value):
    monkeypatch.setenv("KILN_COMPILE_CACHE", value)
    assert CompileCache().enabled


def test_kiln_compile_cache_bad_value_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("KILN_COMPILE_CACHE", "maybe")
    with pytest.raises(ValueError, match="KILN_COMPILE_CACHE='maybe'"):
        CompileCache()


def test_argument_wins_over_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_COMPILE_CACHE", "0")
    monkeypatch.setenv("KILN_COMPILE_CACHE_DIR", str(tmp_path / "from_env"))
    cache = CompileCache(tmp_path / "from_arg", enabled=True)
    assert cache.enabled and cache.directory == tmp_path / "from_arg"


def test_directory_comes_from_environment_else_home(tmp_path, monkeypatch):
    assert CompileCache().directory == tmp_path / "home" / ".cache" / "kiln" / "compile"
    monkeypatch.setenv("KILN_COMPILE_CACHE_DIR", str(tmp_path / "moved"))
    assert CompileCache().directory == tmp_path / "moved"


def test_activate_points_inductor_at_kiln_folder(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache = CompileCache(tmp_path)
    cache.activate()
    cache.activate()  # idempotent
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "inductor") == cache_dir()
    assert cache.inductor_dir_source == "kiln" and (tmp_path / "inductor").is_dir()


def test_activate_keeps_users_inductor_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "mine"))
    cache = CompileCache(tmp_path / "kiln")
    cache.activate()
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "mine")
    assert cache.inductor_dir_source == "user" and cache.inductor_dir_in_use == tmp_path / "mine"
    # Kiln's own folder is made owner-only up front (its entries are code it loads), but no Inductor
    # folder of Kiln's inside it.
    assert stat.S_IMODE((tmp_path / "kiln").stat().st_mode) == 0o700
    assert not (tmp_path / "kiln" / "inductor").exists()


def test_activate_replaces_the_default_torch_wrote_back(tmp_path, monkeypatch):
    # torch 2.13 writes its default folder into TORCHINDUCTOR_CACHE_DIR on first use.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(INDUCTOR_ENV, default_cache_dir())
    cache = CompileCache(tmp_path)
    cache.activate()
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "inductor") and cache.inductor_dir_source == "kiln"


def test_second_cache_moves_the_folder_the_first_one_set(tmp_path):
    CompileCache(tmp_path / "a").activate()
    second = CompileCache(tmp_path / "b")
    second.activate()
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "b" / "inductor")
    assert second.inductor_dir_source == "kiln"


# ----- listing and clearing ----------------------------------------------------------------

def test_entries_list_good_and_corrupt_files_without_raising(tmp_path, fake_artifacts):
    _, key, path = saved_entry(tmp_path)
    (tmp_path / ("0" * 64 + ENTRY_SUFFIX)).write_bytes(b"not an entry")
    listed = {e.file.name: e for e in CompileCache(tmp_path).entries()}
    assert set(listed) == {path.name, "0" * 64 + ENTRY_SUFFIX}
    good, bad = listed[path.name], listed["0" * 64 + ENTRY_SUFFIX]
    assert not good.corrupt and good.key == key and good.torch_version == torch.__version__
    assert good.size == path.stat().st_size and good.created is not None
    assert bad.corrupt and "bad magic" in bad.problem


def test_clear_removes_entries_and_kilns_inductor_folder_only(tmp_path, fake_artifacts, monkeypatch):
    saved_entry(tmp_path / "kiln")
    saved_entry(tmp_path / "kiln", EncoderDecoder(width=8))
    (tmp_path / "kiln" / "inductor" / "fxgraph").mkdir(parents=True)
    (tmp_path / "kiln" / ".tmp-stale.kiln.part").write_bytes(b"left by a crash")
    (tmp_path / "kiln" / "notes.txt").write_text("not Kiln's")
    (tmp_path / "mine").mkdir()
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "mine"))
    cache = CompileCache(tmp_path / "kiln")
    assert cache.clear() == 2
    assert [p.name for p in (tmp_path / "kiln").iterdir()] == ["notes.txt"]
    assert (tmp_path / "mine").is_dir()
    assert cache.clear() == 0


def test_corrupt_entry_helper_reports_what_is_wrong(tmp_path):
    path = tmp_path / ("a" * 64 + ENTRY_SUFFIX)
    path.write_bytes(MAGIC + b'{"format": 99}\n')
    with pytest.raises(CorruptEntryError, match="format 99"):
        read_entry(path)


# ----- a real warm start in a second process -----------------------------------------------

WARM_START_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import kiln
    from kiln.compile.artifacts.cache import CompileCache
    from torch._dynamo.utils import get_compilation_metrics

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            return x + torch.tanh(self.linear(x))

    class Tiny(nn.Module):
        def __init__(self, width=8):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(4, 8)
    cache = CompileCache()  # KILN_COMPILE_CACHE_DIR
    cache.activate()
    key = cache.key(model, {"backend": "inductor"}, torch.device("cpu"))
    hit = cache.load(key)
    kiln.compile_regions(model, backend="inductor")
    out = model(x)
    out.sum().backward()
    saved = cache.save(key)
    torch.save({"out": out.detach(), "grads": [p.grad for p in model.parameters()]}, sys.argv[1])
    metrics = get_compilation_metrics()
    print(json.dumps({"hit": hit, "saved": saved, "key": key, "stats": cache.stats.as_dict(),
                      "aot_hits": sum(m.aotautograd_local_cache_hit_count or 0 for m in metrics),
                      "aot_misses": sum(m.aotautograd_local_cache_miss_count or 0 for m in metrics)}))
""")


@pytest.mark.inductor
@pytest.mark.warm_starts
def test_second_process_loads_the_saved_compile_and_computes_the_same(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, "TRITON_CACHE_DIR")}
    env.update(KILN_COMPILE_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    runs = []
    for name in ("first", "second"):
        proc = subprocess.run([sys.executable, "-c", WARM_START_CHILD, str(tmp_path / f"{name}.pt")],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert (first["hit"], first["saved"], first["aot_hits"]) == (False, True, 0)
    assert second["key"] == first["key"]
    assert second["hit"] and second["aot_hits"] > 0 and second["aot_misses"] == 0
    assert second["stats"] == {"hits": 1, "misses": 0, "saves": 0, "rejected": 0}  # same artifacts: no rewrite
    assert len(list((tmp_path / "cache").glob("*" + ENTRY_SUFFIX))) == 1
    a, b = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    torch.testing.assert_close(b["out"], a["out"], rtol=0, atol=0)
    for grad_a, grad_b in zip(a["grads"], b["grads"]):
        torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=0)
