"""Dataloader sharding without processes: what process r of W would iterate, checked against one
process's order."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from kiln.accumulation import GradientState
from kiln.data import KilnResumeWarning, PreparedDataLoader


class Stream(IterableDataset):
    """0, 1, ..., n-1 as a stream without a length; counts set_epoch calls."""

    def __init__(self, n):
        self.n = n
        self.epochs = []

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32))

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def per_process(loader_factory, processes):
    """The batches of each process, from loaders prepared as process r of `processes`."""
    result = []
    for rank in range(processes):
        prepared = PreparedDataLoader(loader_factory(), None, GradientState(), processes, rank, seed=0)
        batches = [(batch[0] if isinstance(batch, (list, tuple)) else batch).tolist() for batch in prepared]
        result.append((batches, prepared.padded_samples))
    return result


@pytest.mark.parametrize("n, drop_last", [(12, False), (11, False), (11, True), (3, False)])
def test_a_stream_is_dealt_like_a_map_style_dataset(n, drop_last):
    stream = per_process(lambda: DataLoader(Stream(n), batch_size=2, drop_last=drop_last), 2)
    mapped = per_process(lambda: DataLoader(TensorDataset(torch.arange(n, dtype=torch.float32)), batch_size=2,
                                            drop_last=drop_last), 2)
    assert stream == mapped


def test_a_stream_gives_every_process_the_same_number_of_batches_and_counts_the_padding():
    (first, pad0), (second, pad1) = per_process(lambda: DataLoader(Stream(11), batch_size=2), 2)
    assert first == [[0, 1], [4, 5], [8, 9]] and second == [[2, 3], [6, 7], [10, 0]]
    assert pad0 == pad1 == 1  # sample 0 was repeated to fill the last round
    flat = sorted(x for batch in first + second for x in batch)
    assert flat[pad0:] == [float(i) for i in range(11)]


def test_a_stream_that_yields_whole_batches_is_dealt_batch_by_batch():
    class Batches(IterableDataset):
        def __iter__(self):
            return (torch.full((2,), float(i)) for i in range(5))

    (first, _), (second, pad) = per_process(lambda: DataLoader(Batches(), batch_size=None), 2)
    assert [b[0] for b in first] == [0, 2, 4] and [b[0] for b in second] == [1, 3, 0] and pad == 1


def test_a_stream_is_told_the_epoch():
    stream = Stream(4)
    prepared = PreparedDataLoader(DataLoader(stream, batch_size=2), None, GradientState(), 2, 0, seed=0)
    list(prepared)
    list(prepared)
    assert stream.epochs == [0, 1]


def test_a_stream_with_worker_processes_is_refused():
    with pytest.raises(ValueError, match="num_workers=0"):
        PreparedDataLoader(DataLoader(Stream(4), batch_size=2, num_workers=1), None, GradientState(), 2, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_iterating_a_prepared_loader_never_draws_from_the_global_rng(shuffle):
    """A draw there would shift dropout after a mid-epoch resume, which iterates the epoch again."""
    loader = PreparedDataLoader(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2, shuffle=shuffle),
                                None, GradientState(), seed=0)
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(1), expected)


def test_set_seed_after_the_accelerator_decides_the_shuffle():
    from kiln import Accelerator
    from kiln.utils import set_seed

    orders = []
    for seed in (1, 1, 2):
        acc = Accelerator()  # Accelerate scripts seed after making the Accelerator
        set_seed(seed)
        loader = acc.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=8, shuffle=True))
        orders.append(next(iter(loader))[0].tolist())
    assert orders[0] == orders[1] != orders[2]


def _stateful(batch_size, num_processes=1):
    data = TensorDataset(torch.arange(48.0))
    return PreparedDataLoader(DataLoader(data, batch_size=batch_size, shuffle=True), None, GradientState(),
                              num_processes=num_processes, seed=5, stateful=True)


def _first(loader):
    return next(iter(loader))[0]


@pytest.mark.parametrize("new_batch, skipped, again", [(6, 2, 0), (8, 1, 4)])
def test_a_position_saved_with_another_global_batch_is_mapped_in_samples(new_batch, skipped, again):
    saved = _stateful(4)
    batches = iter(saved)
    for _ in range(3):  # 12 samples used
        next(batches)
    state = saved.state_dict()
    assert (state["global_batch_size"], state["num_processes"]) == (4, 1)
    resumed = _stateful(new_batch)
    with pytest.warns(KilnResumeWarning, match=f"12 samples already used in epoch 0 are {skipped} of this run's batches"
                      + ("; the last 4 of them are used again" if again else "$")):
        resumed.load_state_dict(state)
    uninterrupted = list(_stateful(new_batch))
    assert torch.equal(_first(resumed), uninterrupted[skipped][0])


def test_a_position_saved_with_the_same_global_batch_on_other_processes_carries_over_silently():
    import warnings

    state = {"epoch": 1, "batches_yielded": 3, "seed": 5, "global_batch_size": 8, "num_processes": 2}
    resumed = _stateful(8)  # one process, batches of 8: the global batch of 2 processes at 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
    assert resumed.pending_skip == 3 and resumed.resume_note is None


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_process_keeps_the_short_last_batch_of_the_plain_loop(shuffle):
    """A shuffled loader is rebuilt on one process too (its order then depends on seed and epoch);
    its last batch stays short, each sample seen once, as the plain loop's: nothing to even out."""
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4, shuffle=shuffle)
    [(batches, padded)] = per_process(lambda: loader, 1)
    assert [len(batch) for batch in batches] == [4, 4, 2] and padded == 0
    assert sorted(i for batch in batches for i in batch) == [float(i) for i in range(10)]
