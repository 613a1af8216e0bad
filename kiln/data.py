"""Prepared dataloaders: each process gets its own slice of every global batch, batches move to the
device, and the end of an epoch is announced one batch in advance.

Depends on torch and kiln.accumulation only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from kiln.accumulation import GradientState

# DataLoader arguments carried over when a loader is rebuilt around a sharded batch sampler.
_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device", "in_order")


class KilnResumeWarning(UserWarning):
    """A checkpoint was resumed with something mapped rather than restored as saved: a data
    position or an RNG state on another number of processes, a schedule stepped at another rate."""


def move_to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors in `value` (nested dicts, lists, tuples, batch encodings) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if hasattr(value, "to") and callable(value.to) and type(value).__name__ == "BatchEncoding":
        return value.to(device)
    if isinstance(value, Mapping):
        return type(value)({k: move_to_device(v, device, non_blocking) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move_to_device(v, device, non_blocking) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to_device(v, device, non_blocking) for v in value)
    return value


class ShardedBatchSampler:
    """Deals the batches of one epoch to the processes in turn: process r gets batches r, r+W, ...

    Every process computes the same batch list (the shuffle is seeded alike everywhere), so one
    global step covers W consecutive batches of the single-process order. The epoch is evened
    out so that every process gets the same number of full batches: with `drop_last` the trailing
    batches that do not fill a round are dropped; otherwise the last batch is completed, and
    rounds filled, with samples from the start of the epoch (`padded_samples` counts them, so
    `gather_for_metrics` can drop the duplicates).
    """

    def __init__(self, batch_sampler: Iterable[list[int]], batch_size: int, num_processes: int,
                 process_index: int, drop_last: bool, even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.padded_samples = 0

    def _epoch_batches(self) -> list[list[int]]:
        batches = [list(b) for b in self.batch_sampler]
        rounds, extra = divmod(len(batches), self.num_processes)
        # One process has nothing to even out: its last batch stays short, as in the plain loop
        # (padding it would train on repeated samples).
        if self.num_processes == 1 or not (self.drop_last or self.even_batches):
            self.padded_samples = 0
            return batches
        if self.drop_last or not batches:
            self.padded_samples = 0
            return batches[: rounds * self.num_processes]
        flat = [i for b in batches for i in b]
        want = (rounds + (1 if extra else 0)) * self.num_processes * self.batch_size
        if len(flat) < want:
            self.padded_samples = want - len(flat)
            cycle = (flat * (want // len(flat) + 1))[: self.padded_samples]
            flat = flat + cycle
        else:
            self.padded_samples = 0
        return [flat[i: i + self.batch_size] for i in range(0, want, self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._epoch_batches()
        yield from batches[self.process_index:: self.num_processes]

    def __len__(self) -> int:
        total = len(self.batch_sampler)
        if self.drop_last:
            return total // self.num_processes
        if not self.even_batches:
            return len(range(self.process_index, total, self.num_processes))
        return -(-total // self.num_processes)

    def set_epoch(self, epoch: int) -> None:
        sampler = getattr(self.batch_sampler, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


class ShardedIterable(IterableDataset):
    """A stream dealt to the processes the way ShardedBatchSampler deals batches: every process
    reads the whole stream, and of each round of W x B items process r keeps items r*B..(r+1)*B-1,
    so its batches are batches r, r+W, ... of the single-process order.

    A last partial round is dropped with `drop_last`, else filled with items from the start of
    the stream (`padded_samples` counts them). Items are samples, or whole batches when the
    loader does not batch (B = 1 then).
    """

    def __init__(self, dataset: IterableDataset, per_process: int, num_processes: int, process_index: int,
                 drop_last: bool, even_batches: bool = True) -> None:
        self.dataset = dataset
        self.per_process = per_process
        self.num_processes = num_processes
        self.process_index = process_index
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.padded_samples = 0

    def __iter__(self) -> Iterator[Any]:
        size = self.per_process * self.num_processes
        mine = slice(self.process_index * self.per_process, (self.process_index + 1) * self.per_process)
        self.padded_samples = 0
        first: list[Any] | None = None
        chunk: list[Any] = []
        for item in self.dataset:
            chunk.append(item)
            if len(chunk) == size:
                first = chunk if first is None else first
                yield from chunk[mine]
                chunk = []
        if chunk and not self.drop_last and not self.even_batches:
            yield from chunk[mine]  # the short last round: this process's part of it, maybe nothing
        elif chunk and not self.drop_last:
            pool = first if first is not None else chunk
            need = size - len(chunk)
            chunk = chunk + (pool * (need // len(pool) + 1))[:need]
            self.padded_samples = need
            yield from chunk[mine]


class SeededRandomSampler(RandomSampler):
    """A RandomSampler whose order depends on (seed, epoch) only, the same on every process."""

    def __init__(self, data_source: Any, seed: int, **kwargs: Any) -> None:
        super().__init__(data_source, generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()


def shard_dataloader(dataloader: DataLoader, num_processes: int, process_index: int, seed: int,
                     split_batches: bool = False,
                     even_batches: bool = True) -> tuple[DataLoader, ShardedBatchSampler | None]:
    """A DataLoader that yields this process's batches only; the user's loader is not changed.

    A shuffling loader is rebuilt even on one process: its order then depends on (seed, epoch)
    alone, so a run resumed mid-epoch sees the same order as the run it continues. With
    `split_batches` the loader's batch is the global one: each process gets 1/W of it, which is
    the same as dealing batches of B/W (W consecutive ones make up one batch of B).
    """
    reshuffle = type(dataloader.sampler) is RandomSampler and dataloader.generator is None
    if num_processes == 1 and not reshuffle:
        return dataloader, None
    per_process = dataloader.batch_size
    if split_batches and per_process is not None:
        if per_process % num_processes:
            raise ValueError(f"split_batches=True splits each batch of {per_process} over {num_processes} "
                             "processes: use a batch size that divides by the number of processes")
        per_process //= num_processes
    if isinstance(dataloader.dataset, IterableDataset):
        return _shard_iterable(dataloader, num_processes, process_index, per_process, even_batches)
    if dataloader.batch_size is None:
        raise ValueError("a DataLoader with a custom batch_sampler cannot be sharded yet; "
                         "give it batch_size= and a sampler instead")
    sampler = dataloader.sampler
    if reshuffle:
        sampler = SeededRandomSampler(dataloader.dataset, seed, replacement=sampler.replacement,
                                      num_samples=sampler._num_samples)
    batch_sampler = BatchSampler(sampler, per_process, drop_last=dataloader.drop_last)
    sharded = ShardedBatchSampler(batch_sampler, per_process, num_processes, process_index,
                                  drop_last=dataloader.drop_last, even_batches=even_batches)
    kwargs = {name: getattr(dataloader, name) for name in _LOADER_ARGS if hasattr(dataloader, name)}
    # The sampler carries its own seeded generator; the loader gets one too (reseeded each epoch by
    # PreparedDataLoader), so that iterating it never draws from the global RNG: a draw there would
    # shift dropout after a mid-epoch resume, which iterates the epoch once more.
    kwargs["generator"] = torch.Generator()
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    else:
        kwargs.pop("persistent_workers", None)
    return DataLoader(dataloader.dataset, batch_sampler=sharded, **kwargs), sharded


def _shard_iterable(dataloader: DataLoader, num_processes: int, process_index: int, per_process: int | None,
                    even_batches: bool) -> tuple[DataLoader, ShardedIterable | None]:
    if num_processes == 1:
        return dataloader, None
    if dataloader.num_workers > 0:
        # Each worker would read its own copy of the stream, and the padding count would stay in
        # the worker processes, where gather_for_metrics cannot see it.
        raise ValueError("an IterableDataset is sharded across processes in the main process: "
                         "prepare its DataLoader with num_workers=0 (or split the stream yourself)")
    sharded = ShardedIterable(dataloader.dataset, per_process or 1, num_processes, process_index,
                              drop_last=dataloader.drop_last, even_batches=even_batches)
    kwargs = {name: getattr(dataloader, name) for name in ("collate_fn", "pin_memory", "timeout")}
    return DataLoader(sharded, batch_size=per_process, drop_last=dataloader.drop_last, **kwargs), sharded


class PreparedDataLoader:
    """Iterates this process's batches, moving each to the device.

    It reads one batch ahead so that, while the last batch is being used, `sync_gradients`
    already knows the epoch is ending. It counts epochs (each complete pass is one; `set_epoch`
    sets it) and, when stateful, the batches of the current pass, for `save_state`. Other
    attributes are those of the user's DataLoader.
    """

    def __init__(self, dataloader: DataLoader, device: torch.device | None, gradient_state: GradientState,
                 num_processes: int = 1, process_index: int = 0, seed: int = 0, stateful: bool = False,
                 split_batches: bool = False, even_batches: bool = True, non_blocking: bool = False) -> None:
        self.base_dataloader = dataloader
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.end_of_dataloader = False
        # A ShardedBatchSampler, or a ShardedIterable for a stream; None when nothing is sharded.
        self.loader, self.sharded_sampler = shard_dataloader(dataloader, num_processes, process_index, seed,
                                                             split_batches, even_batches)
        self.stateful = stateful
        self.seed = seed
        self.num_processes = num_processes
        # Samples per global step, the unit a position is kept in when the number of processes changes.
        batch = dataloader.batch_size
        self.global_batch_size = None if batch is None else (batch if split_batches else batch * num_processes)
        self.resume_note: str | None = None  # how load_state_dict mapped a saved position, if it had to
        self.epoch = 0
        self.batches_yielded = 0  # in the current pass
        self.pending_skip = 0  # restored by load_state on a stateful loader; used by the next pass

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(skip=0)

    def iterate(self, skip: int) -> Iterator[Any]:
        """One pass over this process's batches of the current epoch, after `skip` batches."""
        if skip and self.pending_skip:
            raise ValueError(
                f"load_state restored this stateful dataloader's position ({self.pending_skip} batches in), "
                "and skip_first_batches asks to skip again: batches would be skipped twice. "
                "Iterate the dataloader itself after load_state."
            )
        skip, self.pending_skip = skip + self.pending_skip, 0
        self._apply_epoch()
        self.gradient_state.begin_dataloader(self)
        self.end_of_dataloader = False
        self.batches_yielded = skip
        try:
            iterator = self._start_pass()
            for _ in range(skip):
                next(iterator, None)
            try:
                current = next(iterator)
            except StopIteration:
                self._finish_epoch()
                return
            while True:
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    self.end_of_dataloader = True
                    self.gradient_state.end_of_dataloader = True
                    # The epoch ends as its last batch is handed out, whether or not the loop asks
                    # for more: a checkpoint saved now resumes at the next epoch.
                    self._finish_epoch()
                    yield self._place(current)
                    return
                self.batches_yielded += 1
                yield self._place(current)
                current = upcoming
        finally:
            self.gradient_state.end_dataloader(self)

    def _start_pass(self) -> Iterator[Any]:
        """`iter(self.loader)` without a draw from the global RNG (a DataLoader draws its workers' base
        seed from its generator, or from the global RNG when it has none): a run resumed mid-epoch
        iterates the epoch again, and that draw would shift its dropout from the uninterrupted run's."""
        generator = self.loader.generator
        if generator is not None and self.loader is not self.base_dataloader:
            generator.manual_seed(self.seed * 1_000_003 + self.epoch)  # ours: workers' seeds follow (seed, epoch)
        if generator is not None:
            return iter(self.loader)
        state = torch.get_rng_state()
        try:
            return iter(self.loader)
        finally:
            torch.set_rng_state(state)

    def _apply_epoch(self) -> None:
        dataset = self.base_dataloader.dataset
        stream = dataset if isinstance(dataset, IterableDataset) else None  # e.g. a streaming dataset's set_epoch
        for holder in (self.sharded_sampler, self.base_dataloader.sampler, stream):
            if holder is not None and hasattr(holder, "set_epoch"):
                holder.set_epoch(self.epoch)
                return

    def _finish_epoch(self) -> None:
        self.epoch += 1
        self.batches_yielded = 0

    def state_dict(self) -> dict[str, int | None]:
        """Where this loader is: its shuffle seed and epoch, and (stateful loaders) the batches
        already used in the current pass, with the global batch they were counted in."""
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded if self.stateful else 0,
                "seed": self._sampler_seed_holder().seed if self._sampler_seed_holder() else None,
                "global_batch_size": self.global_batch_size, "num_processes": self.num_processes}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        """Restore a position, also one saved on another number of processes: every process takes
        one batch per global step, so the count carries over unchanged when the global batch
        (processes x batch) is the same; otherwise the samples already used are converted into
        this run's global batches, with one warning that says how."""
        self.epoch = int(state["epoch"])
        position = int(state.get("batches_yielded") or 0) if self.stateful else 0
        saved_batch, self.resume_note = state.get("global_batch_size"), None
        if position and saved_batch and self.global_batch_size and saved_batch != self.global_batch_size:
            position = self._map_position(position, int(saved_batch), int(state.get("num_processes") or 1))
        self.pending_skip = position
        holder = self._sampler_seed_holder()
        if holder is not None and state.get("seed") is not None:
            holder.seed = int(state["seed"])

    def _map_position(self, steps: int, saved_batch: int, saved_processes: int) -> int:
        used = steps * saved_batch
        mapped, left_over = divmod(used, self.global_batch_size)
        self.resume_note = (
            f"the checkpoint's global batch was {saved_batch} samples ({saved_processes} process(es)), this "
            f"run's is {self.global_batch_size} ({self.num_processes}): the {used} samples already used in "
            f"epoch {self.epoch} are {mapped} of this run's batches"
            + (f"; the last {left_over} of them are used again" if left_over else ""))
        warnings.warn(f"resuming a dataloader: {self.resume_note}", KilnResumeWarning, stacklevel=4)
        return mapped

    def _sampler_seed_holder(self) -> SeededRandomSampler | None:
        sampler = getattr(self.loader.batch_sampler, "batch_sampler", None)
        sampler = getattr(sampler, "sampler", None)
        return sampler if isinstance(sampler, SeededRandomSampler) else None

    @contextlib.contextmanager
    def even_batches_set_to(self, even_batches: bool) -> Iterator[None]:
        """Deal this loader's epochs evenly or not for the duration of the block (join_uneven_inputs)."""
        if self.sharded_sampler is None:  # nothing is dealt out: every batch is this process's
            yield
            return
        before = self.sharded_sampler.even_batches
        self.sharded_sampler.even_batches = even_batches
        try:
            yield
        finally:
            self.sharded_sampler.even_batches = before

    @property
    def padded_samples(self) -> int:
        """Samples repeated at the end of this epoch to even out the processes."""
        return self.sharded_sampler.padded_samples if self.sharded_sampler is not None else 0

    def _place(self, batch: Any) -> Any:
        return batch if self.device is None else move_to_device(batch, self.device, self.non_blocking)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next pass uses (shuffling samplers reshuffle per epoch)."""
        self.epoch = epoch

    def __getattr__(self, name: str) -> Any:
        if name in ("base_dataloader", "loader"):  # not set yet (unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)


class SkippedDataLoader:
    """The rest of the current epoch of a prepared dataloader, after its first `num_batches` batches.

    Iterating it advances the prepared dataloader itself (epoch count, end of epoch), so the next
    epoch simply iterates the prepared dataloader again.
    """

    def __init__(self, dataloader: PreparedDataLoader, num_batches: int) -> None:
        self.dataloader = dataloader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Any]:
        return self.dataloader.iterate(skip=self.num_batches)

    def __len__(self) -> int:
        return max(0, len(self.dataloader) - self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)


def skip_first_batches(dataloader: PreparedDataLoader, num_batches: int) -> SkippedDataLoader:
    """The prepared dataloader, starting after `num_batches` of this process's batches (mid-epoch resume)."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise TypeError("skip_first_batches takes a dataloader returned by Accelerator.prepare")
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches must be an int >= 0, got {num_batches!r}")
    # A stream has no length to check against.
    if not isinstance(dataloader.dataset, IterableDataset) and num_batches > len(dataloader):
        warnings.warn(f"skipping {num_batches} batches of a {len(dataloader)}-batch epoch leaves "
                      "nothing to iterate", UserWarning, stacklevel=2)
    return SkippedDataLoader(dataloader, num_batches)
