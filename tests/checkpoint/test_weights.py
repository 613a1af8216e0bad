import json

import pytest
import torch
from safetensors import safe_open

from kiln import Accelerator, CheckpointCorruptError, TorchDynamoPlugin, load_model
from kiln.checkpoint import clean_key, load_state_dict, parse_size, save_state_dict
from toy_models import EncoderDecoder, tiny_gpt2

REGIONAL = dict(backend="aot_eager", use_regional_compilation=True)


def test_save_model_after_regional_compile_loads_into_a_fresh_model(tmp_path):
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(**REGIONAL), mixed_precision="bf16")
    model = acc.prepare(EncoderDecoder())
    acc.save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(EncoderDecoder().state_dict())
    fresh = load_model(EncoderDecoder(), tmp_path)
    x = torch.randn(2, 3, 8)
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    torch.testing.assert_close(fresh(x), plain(x))


def test_tied_weights_are_saved_once_and_restored(tmp_path):
    model = tiny_gpt2(2)
    assert model.lm_head.weight is model.transformer.wte.weight
    Accelerator().save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
    fresh = load_model(tiny_gpt2(2), tmp_path)
    ids = torch.randint(0, 97, (1, 8))
    torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_sharded_save_writes_an_index_and_replaces_an_older_save(tmp_path):
    model = EncoderDecoder(width=32)
    acc = Accelerator()
    acc.save_model(model, tmp_path, max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert set(index["weight_map"]) == set(model.state_dict())
    torch.testing.assert_close(load_model(EncoderDecoder(width=32), tmp_path).state_dict(), model.state_dict())
    # a later unsharded save must not leave the old shards or index to be picked up
    acc.save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_missing_shard_is_named(tmp_path):
    save_state_dict(EncoderDecoder(width=32).state_dict(), tmp_path, max_shard_size="8KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_state_dict(tmp_path)


def test_no_weights_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("damage", ["header too large", "cut short", "pickle zeroed", "shard cut short"])
def test_load_model_names_a_damaged_weights_file_and_says_what_to_do(tmp_path, damage):
    model = EncoderDecoder(width=32)
    if damage == "shard cut short":
        save_state_dict(model.state_dict(), tmp_path, max_shard_size="8KB")
        victim = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    else:
        Accelerator().save_model(model, tmp_path, safe_serialization=not damage.startswith("pickle"))
        victim = tmp_path / ("pytorch_model.bin" if damage.startswith("pickle") else "model.safetensors")
    data = victim.read_bytes()
    # safetensors reads a huge header size as "header too large", a zeroed file as an empty header:
    # must come out as the file's name and what to do, not the library's bare words.
    victim.write_bytes(data[:len(data) // 2] if "cut short" in damage else b"\xff" * 8 + data[8:]
                       if damage == "header too large" else b"\0" * len(data))
    with pytest.raises(CheckpointCorruptError, match=rf"cannot read {victim}: .*restore it from another copy"):
        load_model(EncoderDecoder(width=32), tmp_path)


def test_torch_pickle_format_round_trips(tmp_path):
    model = EncoderDecoder()
    Accelerator().save_model(model, tmp_path, safe_serialization=False)
    assert (tmp_path / "pytorch_model.bin").is_file()
    torch.testing.assert_close(load_model(EncoderDecoder(), tmp_path).state_dict(), model.state_dict())


def test_clean_key_removes_compile_segments_only():
    assert clean_key("h.0._orig_mod.fc.weight") == "h.0.fc.weight"
    assert clean_key("module.fc.weight") == "module.fc.weight"  # a user's submodule may be "module"


@pytest.mark.parametrize("text, expected", [("10GB", 10**10), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), (123, 123)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_nonsense():
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("lots")
