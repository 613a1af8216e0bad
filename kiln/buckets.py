"""Shape buckets: a collate function that pads each batch's sequence length up to one of a few lengths.

Depends on torch only; never on the facade, a strategy or the compile package.

Why: with `dynamic=False` every new sequence length compiles a new graph until Dynamo's recompile
limit (8 per code object, torch 2.13), after which the block silently runs eagerly; with the
default `dynamic=None` torch recompiles once with a symbolic length and runs slower, more general
kernels. Padding every batch to one of a few fixed lengths bounds the graphs to the number of
buckets, and the attention mask plus `label_pad_id` labels keep the padding out of the loss.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

# Keys whose padding value is not the generic 0; they also get specific length checks.
INPUT_IDS, ATTENTION_MASK, LABELS = "input_ids", "attention_mask", "labels"


def bucket_lengths(max_length: int, multiple_of: int) -> list[int]:
    """The lengths a batch can be padded to: multiples of `multiple_of` up to `max_length`.

    `max_length` itself is the last bucket even when it is not a multiple, so nothing is ever
    padded past it.

    >>> bucket_lengths(100, 32)
    [32, 64, 96, 100]
    """
    _check_positive_int(multiple_of, "multiple_of")
    _check_positive_int(max_length, "max_length")
    lengths = list(range(multiple_of, max_length + 1, multiple_of))
    if not lengths or lengths[-1] != max_length:
        lengths.append(max_length)
    return lengths


def pad_to_bucket(
    length: int,
    *,
    multiple_of: int | None = None,
    buckets: Sequence[int] | None = None,
    max_length: int | None = None,
    truncate: bool = False,
) -> int:
    """The padded length for a batch whose longest sequence has `length` tokens.

    With `multiple_of`, the next multiple of it (never above `max_length`); with `buckets`, the
    smallest bucket >= `length`. A length above the largest allowed one (`max_length`, else the
    largest bucket) is a ValueError unless `truncate=True`, which returns that largest length.

    >>> pad_to_bucket(40, multiple_of=32), pad_to_bucket(40, buckets=[16, 64, 128])
    (64, 64)
    """
    allowed = _check_bucket_choice(multiple_of, buckets, max_length)
    _check_positive_int(length, "length")
    limit = allowed[-1] if allowed else None
    if truncate and limit is None:
        raise ValueError(f"truncate=True needs a largest length to cut to; with multiple_of={multiple_of} "
                         "pass max_length as well")
    if limit is not None and length > limit:
        if truncate:
            return limit
        raise ValueError(
            f"batch has a sequence of length {length}, longer than the largest bucket ({limit}); "
            f"add a bucket of at least {length}, raise max_length, or pass truncate=True to cut "
            f"sequences to {limit} tokens"
        )
    if multiple_of is not None:
        padded = math.ceil(length / multiple_of) * multiple_of
        return padded if limit is None else min(padded, limit)
    return next(b for b in allowed if b >= length)


class BucketCollator:
    """Collate function that pads a batch's sequences to a bucketed length, for steady shapes.

    Give exactly one of `multiple_of` (pad the longest sequence up to a multiple of it) or
    `buckets` (pad up to the smallest listed length that fits). `max_length` caps the padded
    length (it is the last bucket); a batch longer than the cap is a ValueError unless
    `truncate=True`, which keeps the first tokens of every sequence.

    Each example is a mapping with `input_ids` (list of ints or a 1-D tensor) and optionally
    `attention_mask`, `labels` and other keys. Sequence keys as long as `input_ids` are padded:
    `input_ids` with `pad_token_id`, `attention_mask` with 0, `labels` with `label_pad_id` (so
    padding never reaches the loss), anything else (`token_type_ids`, `position_ids`, ...) with 0.
    Scalar keys are stacked. `attention_mask` is built when absent; `labels` only appear when given.

    Right padding leaves a causal LM's loss exactly as on the unpadded examples. With
    `padding_side="left"` the loss shifts by one, so the first real label is predicted from a
    padding position: set that label to -100, and pass `position_ids` in the examples, since GPT-2
    style models number positions from the first column, padding included.

    Graphs per block: one per bucket used, plus one for a bucket that some batch fills exactly.
    transformers (5.23, SDPA attention) hands the blocks `attention_mask=None` when a batch has
    no padding at all, and None against a mask tensor is a different graph.

    >>> loader = DataLoader(dataset, batch_size=8,
    ...                     collate_fn=BucketCollator(pad_token_id=0, multiple_of=32, max_length=512))
    """

    def __init__(
        self,
        pad_token_id: int,
        *,
        multiple_of: int | None = None,
        buckets: Sequence[int] | None = None,
        max_length: int | None = None,
        truncate: bool = False,
        label_pad_id: int = -100,
        padding_side: Literal["right", "left"] = "right",
    ) -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral):
            raise TypeError(f"pad_token_id must be an int, got {pad_token_id!r}")
        if isinstance(label_pad_id, bool) or not isinstance(label_pad_id, numbers.Integral):
            raise TypeError(f"label_pad_id must be an int, got {label_pad_id!r}; -100 is what "
                            "torch's cross_entropy ignores by default")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        allowed = _check_bucket_choice(multiple_of, buckets, max_length)
        if truncate and not allowed:
            raise ValueError(f"truncate=True needs a largest length to cut to; with multiple_of="
                             f"{multiple_of} pass max_length as well")
        self.pad_token_id = int(pad_token_id)
        self.multiple_of = multiple_of
        self.buckets = None if buckets is None else [int(b) for b in buckets]
        self.max_length = max_length
        self.truncate = truncate
        self.label_pad_id = int(label_pad_id)
        self.padding_side = padding_side

    @property
    def lengths(self) -> list[int] | None:
        """Every length a batch can be padded to; None when only `multiple_of` bounds it."""
        return _check_bucket_choice(self.multiple_of, self.buckets, self.max_length) or None

    def __repr__(self) -> str:
        choice = f"multiple_of={self.multiple_of}" if self.multiple_of else f"buckets={self.buckets}"
        return (f"BucketCollator(pad_token_id={self.pad_token_id}, {choice}, max_length={self.max_length}, "
                f"truncate={self.truncate}, padding_side={self.padding_side!r})")

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest sequence has `longest` tokens is padded (or cut) to."""
        return pad_to_bucket(longest, multiple_of=self.multiple_of, buckets=self.buckets,
                             max_length=self.max_length, truncate=self.truncate)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not isinstance(examples, Sequence) or isinstance(examples, (str, bytes, Mapping)):
            raise TypeError(f"BucketCollator takes a list of examples (dicts), got {type(examples).__name__}")
        if len(examples) == 0:
            raise ValueError("BucketCollator got an empty batch; a DataLoader never sends one, so check "
                             "the sampler or the code calling the collator")
        keys = _check_same_keys(examples)
        sequences: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, list[torch.Tensor]] = {}
        for index, example in enumerate(examples):
            ids = _as_sequence(example[INPUT_IDS])
            if ids is None:
                raise TypeError(f"example {index}: input_ids must be a list of ints or a 1-D tensor, "
                                f"got {_describe(example[INPUT_IDS])}")
            if ids.is_floating_point():
                raise TypeError(f"example {index}: input_ids must hold integers, got dtype {ids.dtype}")
            if ids.numel() == 0:
                raise ValueError(f"example {index} has empty input_ids; drop empty examples before batching")
            sequences.setdefault(INPUT_IDS, []).append(ids)
            for key in keys:
                if key == INPUT_IDS:
                    continue
                value = example[key]
                as_seq = _as_sequence(value)
                if as_seq is not None and as_seq.numel() == ids.numel():
                    sequences.setdefault(key, []).append(as_seq)
                elif key in (ATTENTION_MASK, LABELS) and as_seq is not None:
                    raise ValueError(f"example {index}: {key} has length {as_seq.numel()} but input_ids "
                                     f"has {ids.numel()}; they must match token for token")
                elif key not in (ATTENTION_MASK, LABELS) and _is_scalar(value):
                    scalars.setdefault(key, []).append(torch.as_tensor(value))
                else:
                    raise TypeError(
                        f"example {index}: cannot collate key {key!r} ({_describe(value)}); BucketCollator "
                        f"pads 1-D sequences as long as input_ids ({ids.numel()}) and stacks scalars. "
                        "Remove the key or collate it yourself"
                    )
        for key in set(sequences) & set(scalars):
            raise TypeError(f"key {key!r} is a sequence in some examples and a scalar in others; "
                            "give it the same form in every example")
        return self._pad(sequences, scalars)

    def _pad(self, sequences: dict[str, list[torch.Tensor]],
             scalars: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(ids.numel() for ids in sequences[INPUT_IDS])
        length = self.padded_length(longest)
        if ATTENTION_MASK not in sequences:
            sequences[ATTENTION_MASK] = [torch.ones(ids.numel(), dtype=torch.long) for ids in sequences[INPUT_IDS]]
        fill = {INPUT_IDS: self.pad_token_id, LABELS: self.label_pad_id}
        order = [INPUT_IDS, ATTENTION_MASK] + [k for k in sequences if k not in (INPUT_IDS, ATTENTION_MASK)]
        batch: dict[str, torch.Tensor] = {}
        for key in order:
            rows = sequences[key]
            dtype = torch.long if key in (INPUT_IDS, ATTENTION_MASK) else rows[0].dtype
            out = torch.full((len(rows), length), fill.get(key, 0), dtype=dtype)
            for i, row in enumerate(rows):
                row = row[:length]  # only shorter when truncating: keep the first tokens
                if self.padding_side == "right":
                    out[i, : row.numel()] = row
                else:
                    out[i, length - row.numel():] = row
            batch[key] = out
        for key, values in scalars.items():
            batch[key] = torch.stack(values)
        return batch


def _check_bucket_choice(multiple_of: int | None, buckets: Sequence[int] | None,
                         max_length: int | None) -> list[int]:
    """Validate the bucket settings; return the sorted allowed lengths ([] when unbounded)."""
    if (multiple_of is None) == (buckets is None):
        given = "both" if multiple_of is not None else "neither"
        raise ValueError(f"give exactly one of multiple_of= (e.g. 32) or buckets= (e.g. [128, 256, 512]); "
                         f"got {given}")
    if max_length is not None:
        _check_positive_int(max_length, "max_length")
    if multiple_of is not None:
        _check_positive_int(multiple_of, "multiple_of")
        return [] if max_length is None else bucket_lengths(max_length, multiple_of)
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or len(buckets) == 0:
        raise ValueError(f"buckets must be a non-empty list of increasing lengths, got {buckets!r}")
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
            raise ValueError(f"bucket {b!r} in {list(buckets)} is not a positive int; buckets are token counts")
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"buckets must be strictly increasing, got {list(buckets)}; "
                         f"sorted and deduplicated: {sorted(set(buckets))}")
    allowed = [int(b) for b in buckets]
    if max_length is not None:
        if allowed[-1] > max_length:
            raise ValueError(f"bucket {allowed[-1]} is longer than max_length={max_length}; "
                             "drop it or raise max_length")
        if allowed[-1] < max_length:
            allowed.append(max_length)
    return allowed


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_same_keys(examples: Sequence[Any]) -> list[str]:
    first = examples[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"example 0 is a {type(first).__name__}; BucketCollator takes dicts with input_ids")
    if INPUT_IDS not in first:
        raise ValueError(f"example 0 has no 'input_ids' (keys: {sorted(first)}); every example needs one")
    keys = list(first)
    for index, example in enumerate(examples[1:], 1):
        if not isinstance(example, Mapping):
            raise TypeError(f"example {index} is a {type(example).__name__}; BucketCollator takes dicts")
        if set(example) != set(keys):
            missing = sorted(set(keys) - set(example))
            extra = sorted(set(example) - set(keys))
            raise ValueError(f"example {index} has different keys from example 0 (missing: {missing}, "
                             f"extra: {extra}); every example in a batch needs the same keys")
    return keys


def _as_sequence(value: Any) -> torch.Tensor | None:
    """`value` as a 1-D tensor when it is a list/tuple of numbers or a 1-D tensor/array, else None."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.dim() == 1 else None
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, numbers.Number) and not isinstance(v, complex) for v in value):
            return None
        return torch.tensor(value) if value else torch.empty(0, dtype=torch.long)
    if type(value).__name__ == "ndarray" and getattr(value, "ndim", None) == 1:
        return torch.as_tensor(value)
    return None


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    if type(value).__name__ == "ndarray":
        return getattr(value, "ndim", None) == 0
    return isinstance(value, numbers.Number) and not isinstance(value, complex)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"
