"""Tests for kiln/buckets.py: padding values and masks, bucket choice, validation, and that buckets
bound the graphs a regionally compiled model builds over variable sequence lengths."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import kiln
from kiln.buckets import BucketCollator, bucket_lengths, pad_to_bucket
from kiln.compile.regions import compiled_regions
from toy_models import tiny_gpt2


def example(length: int, start: int = 1, **extra) -> dict:
    ids = list(range(start, start + length))
    return {"input_ids": ids, **extra}


# ---------------------------------------------------------------- padding values and masks

def test_right_padding_fills_pad_id_and_masks_padding():
    batch = BucketCollator(pad_token_id=7, multiple_of=4)([example(2), example(3, start=10)])
    assert batch["input_ids"].tolist() == [[1, 2, 7, 7], [10, 11, 12, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert "labels" not in batch


def test_left_padding_puts_padding_before_the_tokens():
    collate = BucketCollator(pad_token_id=0, multiple_of=4, padding_side="left")
    batch = collate([example(2, labels=[5, 6]), example(3, labels=[7, 8, 9])])
    assert batch["input_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, -100, 5, 6], [-100, 7, 8, 9]]


def test_labels_are_padded_with_label_pad_id():
    batch = BucketCollator(0, multiple_of=4)([example(1, labels=[3]), example(2, labels=[4, 5])])
    assert batch["labels"].tolist() == [[3, -100, -100, -100], [4, 5, -100, -100]]
    custom = BucketCollator(0, multiple_of=4, label_pad_id=-1)([example(3, labels=[1, 2, 3])])
    assert custom["labels"].tolist() == [[1, 2, 3, -1]]


def test_given_attention_mask_is_kept_and_padded_with_zero():
    batch = BucketCollator(0, multiple_of=4)([example(3, attention_mask=[1, 0, 1])])
    assert batch["attention_mask"].tolist() == [[1, 0, 1, 0]]


def test_other_sequence_keys_are_padded_with_zero_and_scalars_stacked():
    examples = [
        example(2, token_type_ids=[1, 1], position_ids=torch.tensor([5, 6]), score=0.5, idx=torch.tensor(3)),
        example(3, token_type_ids=[1, 1, 1], position_ids=torch.tensor([0, 1, 2]), score=1.5, idx=torch.tensor(4)),
    ]
    batch = BucketCollator(0, multiple_of=4)(examples)
    assert batch["token_type_ids"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[5, 6, 0, 0], [0, 1, 2, 0]]
    assert batch["score"].tolist() == [0.5, 1.5]
    assert batch["idx"].tolist() == [3, 4]


def test_tensor_and_list_inputs_give_the_same_batch():
    as_lists = BucketCollator(0, multiple_of=8)([example(5, labels=[1, 2, 3, 4, 5])])
    as_tensors = BucketCollator(0, multiple_of=8)(
        [{"input_ids": torch.arange(1, 6), "labels": torch.arange(1, 6)}])
    for key in as_lists:
        assert torch.equal(as_lists[key], as_tensors[key]), key


def test_collator_works_as_dataloader_collate_fn():
    data = [example(n) for n in (3, 9, 17, 5)]
    loader = DataLoader(data, batch_size=2, collate_fn=BucketCollator(0, buckets=[8, 16, 32]))
    assert [batch["input_ids"].shape for batch in loader] == [(2, 16), (2, 32)]


# ---------------------------------------------------------------- bucket choice

@pytest.mark.parametrize("length, expected", [(1, 32), (32, 32), (33, 64), (100, 128)])
def test_multiple_of_pads_up_to_the_next_multiple(length, expected):
    assert pad_to_bucket(length, multiple_of=32) == expected
    assert BucketCollator(0, multiple_of=32)([example(length)])["input_ids"].shape == (1, expected)


@pytest.mark.parametrize("length, expected", [(1, 16), (16, 16), (17, 64), (64, 64), (65, 100)])
def test_buckets_pick_the_smallest_bucket_that_fits(length, expected):
    assert pad_to_bucket(length, buckets=[16, 64, 100]) == expected


def test_bucket_lengths_end_at_max_length():
    assert bucket_lengths(128, 32) == [32, 64, 96, 128]
    assert bucket_lengths(100, 32) == [32, 64, 96, 100]
    assert bucket_lengths(10, 32) == [10]


def test_max_length_caps_multiple_of_and_lists_the_lengths():
    collate = BucketCollator(0, multiple_of=32, max_length=100)
    assert collate.lengths == [32, 64, 96, 100]
    assert collate([example(97)])["input_ids"].shape == (1, 100)
    assert BucketCollator(0, multiple_of=32).lengths is None


def test_batch_longer_than_largest_bucket_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"length 70.*largest bucket \(64\).*truncate=True"):
        BucketCollator(0, buckets=[32, 64])([example(10), example(70)])
    with pytest.raises(ValueError, match=r"length 101.*largest bucket \(100\)"):
        BucketCollator(0, multiple_of=32, max_length=100)([example(101)])


def test_truncate_cuts_every_sequence_to_the_largest_bucket_keeping_the_first_tokens():
    collate = BucketCollator(0, buckets=[4, 8], truncate=True)
    batch = collate([example(10, labels=list(range(10)), token_type_ids=[1] * 10),
                     example(3, labels=[1, 2, 3], token_type_ids=[1, 1, 1])])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [list(range(8)), [1, 2, 3] + [-100] * 5]
    assert batch["attention_mask"].tolist() == [[1] * 8, [1, 1, 1] + [0] * 5]
    assert batch["token_type_ids"].tolist() == [[1] * 8, [1, 1, 1] + [0] * 5]


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of multiple_of.*neither"),
    ({"multiple_of": 8, "buckets": [8]}, "exactly one of multiple_of.*both"),
    ({"multiple_of": 0}, "multiple_of must be a positive int, got 0"),
    ({"multiple_of": -8}, "multiple_of must be a positive int, got -8"),
    ({"buckets": [64, 32]}, r"strictly increasing, got \[64, 32\].*\[32, 64\]"),
    ({"buckets": [32, 32]}, "strictly increasing"),
    ({"buckets": [0, 32]}, "bucket 0 .* not a positive int"),
    ({"buckets": []}, "non-empty"),
    ({"buckets": [32, 128], "max_length": 64}, "bucket 128 is longer than max_length=64"),
    ({"multiple_of": 8, "truncate": True}, "truncate=True needs a largest length.*max_length"),
    ({"multiple_of": 8, "padding_side": "middle"}, "padding_side must be 'right' or 'left', got 'middle'"),
])
def test_bad_settings_are_errors_that_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BucketCollator(0, **kwargs)


def test_empty_batch_is_an_error():
    with pytest.raises(ValueError, match="empty batch"):
        BucketCollator(0, multiple_of=8)([])


@pytest.mark.parametrize("key", ["labels", "attention_mask"])
def test_labels_or_mask_of_another_length_than_input_ids_is_an_error(key):
    with pytest.raises(ValueError, match=f"example 1: {key} has length 2 but input_ids has 3"):
        BucketCollator(0, multiple_of=8)([example(2, **{key: [1, 1]}), example(3, **{key: [1, 1]})])


@pytest.mark.parametrize("value", ["text", [1, 2], torch.ones(3, 2), None, [[1], [2], [3]]])
def test_key_that_is_neither_a_sequence_nor_a_scalar_is_a_type_error_naming_it(value):
    with pytest.raises(TypeError, match="cannot collate key 'extra'"):
        BucketCollator(0, multiple_of=8)([example(3, extra=value)])


def test_examples_with_different_keys_or_no_input_ids_are_errors():
    with pytest.raises(ValueError, match=r"example 1 has different keys.*missing: \['labels'\]"):
        BucketCollator(0, multiple_of=8)([example(2, labels=[1, 2]), example(2)])
    with pytest.raises(ValueError, match="no 'input_ids'"):
        BucketCollator(0, multiple_of=8)([{"ids": [1, 2]}])


# ---------------------------------------------------------------- padding is inert in a real model

def gpt2_loss(model, batch: dict) -> float:
    with torch.no_grad():
        return model(**batch, use_cache=False).loss.item()


def test_right_padded_gpt2_loss_equals_unpadded_loss():
    model = tiny_gpt2().eval()
    ids = torch.randint(1, 97, (13,)).tolist()
    unpadded = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}
    padded = BucketCollator(pad_token_id=0, multiple_of=32)([{"input_ids": ids, "labels": ids}])
    assert padded["input_ids"].shape == (1, 32)
    assert gpt2_loss(model, padded) == pytest.approx(gpt2_loss(model, unpadded), abs=1e-5)


def test_left_padded_gpt2_loss_equals_unpadded_with_positions_and_first_label_masked():
    model = tiny_gpt2().eval()
    ids = torch.randint(1, 97, (13,)).tolist()
    unpadded = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}
    collate = BucketCollator(pad_token_id=0, multiple_of=32, padding_side="left")
    padded = collate([{"input_ids": ids, "labels": [-100] + ids[1:], "position_ids": list(range(13))}])
    assert gpt2_loss(model, padded) == pytest.approx(gpt2_loss(model, unpadded), abs=1e-5)


# ---------------------------------------------------------------- buckets bound the graphs

def run_compiled_epoch(collate: BucketCollator, lengths: list[int]) -> tuple[int, int, int, set[int]]:
    """Forward passes of a regionally compiled tiny GPT-2 (aot_eager, dynamic=False), one example
    per batch; returns (graphs, compiled calls, block invocations, padded lengths seen)."""
    model = tiny_gpt2(layers=2).eval()
    kiln.compile_regions(model, backend="aot_eager", dynamic=False)
    invocations = 0

    def count(module, args):
        nonlocal invocations
        invocations += 1

    for block in model.transformer.h:
        block.register_forward_pre_hook(count)
    data = [{"input_ids": torch.randint(1, 97, (n,)).tolist()} for n in lengths]
    shapes = set()
    with torch.no_grad():
        for batch in DataLoader(data, batch_size=1, shuffle=True, collate_fn=collate):
            shapes.add(batch["input_ids"].shape[1])
            model(**batch, use_cache=False)
    (region,) = compiled_regions(model)
    return region.graphs, region.calls, invocations, shapes


# 20 lengths in [3, 63], none a multiple of 16, so every batch has padding (see the next test).
LENGTHS = [n for n in range(3, 64, 3) if n % 16][:20]


def test_buckets_compile_one_graph_per_bucket_used_and_nothing_runs_eagerly():
    graphs, calls, invocations, shapes = run_compiled_epoch(BucketCollator(0, multiple_of=16), LENGTHS)
    assert shapes == {16, 32, 48, 64}
    assert graphs <= len(shapes)
    assert calls == invocations  # every block call ran compiled code


def test_without_buckets_each_length_recompiles_until_the_limit_then_runs_eagerly():
    limit = torch._dynamo.config.recompile_limit
    graphs, calls, invocations, shapes = run_compiled_epoch(BucketCollator(0, multiple_of=1), LENGTHS)
    assert len(shapes) == len(LENGTHS) > limit
    assert graphs == limit
    # Past the limit Dynamo runs the block's forward eagerly: invocations without a compiled call.
    assert invocations - calls == 2 * (len(LENGTHS) - limit)


def test_batch_that_fills_its_bucket_exactly_adds_one_graph_in_transformers():
    # transformers 5.23 (SDPA) passes attention_mask=None to the blocks when a batch has no
    # padding, and None is a different graph from a mask tensor of the same length.
    graphs, calls, invocations, shapes = run_compiled_epoch(BucketCollator(0, multiple_of=16), [13, 16, 14])
    assert shapes == {16}
    assert graphs == 2 and calls == invocations
