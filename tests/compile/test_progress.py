"""The live compile line (kiln/compile/progress.py): what it says, when it says it, and when it stays quiet."""

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin, compile_regions
from kiln.compile import backend, progress, regions, session
from kiln.compile.artifacts.cache import CompileCache
from kiln.compile.progress import CompileProgress
from toy_models import EncoderDecoder, tiny_llama

FAST = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
KEY = "ab" * 16


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def dynamo_args(trigger: str, compile_id: str = "0/0") -> SimpleNamespace:
    """What Dynamo hands its compile callbacks (CallbackArgs, torch >= 2.6)."""
    return SimpleNamespace(callback_trigger=SimpleNamespace(name=trigger), compile_id=compile_id)


@contextlib.contextmanager
def forward_compile(line: CompileProgress, clock: FakeClock, region: str, seconds: float, ticks=()):
    """One forward compile of `region` as the hooks report it: the region's entry, Dynamo's start,
    the backend's compile, Dynamo's end; the drawing thread's ticks come at `ticks` seconds in."""
    start = clock.now
    outer = line.enter(region)
    line._on_start(dynamo_args("DYNAMO"))
    with line.backend_compile(region):
        for at in ticks:
            clock.now = start + at
            line.tick()
        clock.now = start + seconds
        yield
    line._on_end(dynamo_args("DYNAMO"))
    line.region = outer


def backward_compile(line: CompileProgress, clock: FakeClock, seconds: float, ticks=()) -> None:
    start = clock.now
    line._on_start(dynamo_args("LAZY_BACKWARD"))
    for at in ticks:
        clock.now = start + at
        line.tick()
    clock.now = start + seconds
    line._on_end(dynamo_args("LAZY_BACKWARD"))


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def log():
    return io.StringIO()


@pytest.fixture
def line(clock, log):
    made = CompileProgress(clock=clock, stream=log, thread=False)  # the test ticks
    yield made
    made.close()


def test_log_line_names_region_phase_elapsed_and_graphs_done_every_ten_seconds(line, clock, log):
    with forward_compile(line, clock, "LlamaDecoderLayer", 13.0, ticks=(1.5, 2.5, 5.0, 12.0, 12.6)):
        pass
    backward_compile(line, clock, 3.0, ticks=(2.5,))
    assert log.getvalue().splitlines() == [
        "kiln compile: LlamaDecoderLayer forward graph, 2.5 s, 0 graphs done",
        "kiln compile: LlamaDecoderLayer forward graph, 12.6 s, 0 graphs done",
        "kiln compile: LlamaDecoderLayer forward graph, compiled in 13.0 s, 1 graph done",
        "kiln compile: LlamaDecoderLayer backward graph, 2.5 s, 1 graph done",
        "kiln compile: LlamaDecoderLayer backward graph, compiled in 3.0 s, 2 graphs done",
    ]


def test_compiles_shorter_than_the_threshold_print_nothing(line, clock, log):
    with forward_compile(line, clock, "Block", 1.9, ticks=(0.5, 1.0, 1.9)):
        pass
    backward_compile(line, clock, 0.4, ticks=(0.2,))
    assert log.getvalue() == ""
    assert [(e.phase, e.graphs) for e in line.finished] == [("forward", 1), ("backward", 1)]


def test_nothing_is_drawn_while_nothing_compiles(line, clock, log):
    with forward_compile(line, clock, "Block", 3.0):
        pass
    log.truncate(0)
    line.enter("Block")  # a steady call: the region runs, Dynamo starts nothing
    for _ in range(5):
        clock.now += 30
        line.tick()
    assert log.getvalue() == "" and line.active is None


def test_a_trace_that_compiles_no_graph_is_not_counted(line, clock, log):
    line.enter("Block")
    line._on_start(dynamo_args("DYNAMO"))
    clock.now += 5
    line._on_end(dynamo_args("DYNAMO"))
    assert line.finished == [] and log.getvalue() == ""


def test_compiles_outside_kiln_regions_are_not_shown(line, clock, log):
    line._on_start(dynamo_args("DYNAMO", "7/0"))  # the user's own torch.compile, no region running
    clock.now += 5
    line.tick()
    line._on_end(dynamo_args("DYNAMO", "7/0"))
    backward_compile(line, clock, 5.0, ticks=(3.0,))  # its backward: compile id 0/0 was never Kiln's
    assert log.getvalue() == "" and line.finished == []


def test_previous_compile_of_the_same_job_gives_total_and_estimates(line, clock, log):
    record = {"version": 1, "events": [
        {"region": "LlamaDecoderLayer", "phase": "forward", "graphs": 1, "seconds": 9.8},
        {"region": "LlamaDecoderLayer", "phase": "backward", "graphs": 1, "seconds": 6.5},
    ]}
    line.follow(KEY, ["LlamaDecoderLayer"], record)
    with forward_compile(line, clock, "LlamaDecoderLayer", 8.0, ticks=(2.0,)):
        pass
    backward_compile(line, clock, 7.0, ticks=(4.0,))
    assert log.getvalue().splitlines() == [
        "kiln compile: LlamaDecoderLayer forward graph, 2.0 s, 0/2 graphs done, last time 9.8 s",
        "kiln compile: LlamaDecoderLayer forward graph, compiled in 8.0 s, 1/2 graphs done, last time 9.8 s",
        "kiln compile: LlamaDecoderLayer backward graph, 4.0 s, 1/2 graphs done, last time 6.5 s",
        "kiln compile: LlamaDecoderLayer backward graph, compiled in 7.0 s, 2/2 graphs done, last time 6.5 s",
    ]
    assert line.record(KEY) == {"version": 1, "events": [
        {"region": "LlamaDecoderLayer", "phase": "forward", "graphs": 1, "seconds": 8.0},
        {"region": "LlamaDecoderLayer", "phase": "backward", "graphs": 1, "seconds": 7.0},
    ]}


def test_more_graphs_than_last_time_show_the_count_only(line, clock, log):
    line.follow(KEY, ["Block"], {"version": 1, "events": [{"region": "Block", "phase": "forward", "seconds": 4.0}]})
    for _ in range(2):
        with forward_compile(line, clock, "Block", 5.0):
            pass
    assert log.getvalue().splitlines() == [
        "kiln compile: Block forward graph, compiled in 5.0 s, 1/1 graph done, last time 4.0 s",
        "kiln compile: Block forward graph, compiled in 5.0 s, 2 graphs done",
    ]


@pytest.mark.parametrize("record", [None, {"version": 99, "events": []}, {"version": 1, "events": [{"seconds": "x"}]},
                                    ["not", "a", "record"]])
def test_missing_or_unreadable_record_shows_graphs_done_only(line, clock, log, record):
    line.follow(KEY, ["Block"], record)
    with forward_compile(line, clock, "Block", 3.0):
        pass
    assert log.getvalue() == "kiln compile: Block forward graph, compiled in 3.0 s, 1 graph done\n"


def test_terminal_gets_one_line_redrawn_in_place_and_cleared(clock):
    terminal = Terminal()
    line = CompileProgress(clock=clock, stream=terminal, thread=False)
    with forward_compile(line, clock, "Block", 4.0, ticks=(2.5, 3.0, 3.5)):
        drawn = terminal.getvalue()
    line.close()
    assert "\n" not in terminal.getvalue()  # redrawn in place, never scrolled
    for seconds in ("2.5", "3.0", "3.5"):
        assert f"\rkiln compile: Block forward graph, {seconds} s, 0 graphs done" in drawn
    assert terminal.getvalue()[len(drawn):].strip(" \r") == ""  # cleared at the end: no history line


def test_only_the_main_process_prints(clock, log):
    line = CompileProgress(clock=clock, stream=log)
    line.is_main = False
    with forward_compile(line, clock, "Block", 30.0, ticks=(3.0, 15.0)):
        pass
    assert log.getvalue() == "" and line._thread is None  # no drawing thread either
    assert len(line.finished) == 1  # still counted, for the record the writer saves


def test_without_dynamo_callbacks_the_backend_compile_is_shown(line, clock, log, monkeypatch):
    monkeypatch.setattr(progress, "_callback_handler", lambda: None)
    line.watch()
    line.enter("Block")
    with line.backend_compile("Block"):
        clock.now += 3.0
        line.tick()
    assert log.getvalue().splitlines() == ["kiln compile: Block forward graph, 3.0 s, 0 graphs done",
                                           "kiln compile: Block forward graph, compiled in 3.0 s, 1 graph done"]


def test_bad_env_value_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("KILN_COMPILE_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match="KILN_COMPILE_PROGRESS='sometimes' is not a boolean"):
        compile_regions(EncoderDecoder(), **FAST)


def test_drawing_thread_starts_at_a_compile_and_stops_on_close(clock):
    line = CompileProgress(clock=clock, stream=io.StringIO())
    with forward_compile(line, clock, "Block", 0.1):
        thread = line._thread
        assert thread is not None and thread.daemon and thread.is_alive() and line._busy.is_set()
    assert thread.is_alive() and not line._busy.is_set()  # asleep until the next compile
    line.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and line._thread is None


def test_compile_records_round_trip_through_the_cache_folder(tmp_path):
    record = {"version": 1, "events": [{"region": "Block", "phase": "forward", "graphs": 1, "seconds": 2.5}]}
    assert CompileCache(tmp_path, is_writer=False).write_record(KEY, record) is False
    assert CompileCache(tmp_path).read_record(KEY) is None
    assert CompileCache(tmp_path).write_record(KEY, record) is True
    assert CompileCache(tmp_path).read_record(KEY) == record
    (tmp_path / "progress" / f"{KEY}.json").write_text("{not json")
    assert CompileCache(tmp_path).read_record(KEY) is None
    CompileCache(tmp_path).clear()
    assert not (tmp_path / "progress").exists()


# ----- real compiles (aot_eager): the hooks in regions.py, backend.py and session.py ---------------

def use_fresh_progress(monkeypatch) -> CompileProgress:
    """A progress line at threshold 0 in place of the process's one, writing to sys.stderr."""
    fresh = CompileProgress(threshold=0.0)
    for module in (progress, backend, regions, session):
        monkeypatch.setattr(module, "PROGRESS", fresh)
    return fresh


@pytest.fixture
def live(monkeypatch):
    fresh = use_fresh_progress(monkeypatch)
    yield fresh
    fresh.close()


def train_steps(steps: int, seed: int = 0) -> list[str]:
    """Train tiny Llama regionally compiled (aot_eager) through the Accelerator; what each step
    wrote to stderr."""
    torch.manual_seed(seed)
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(use_regional_compilation=True, **FAST))
    model = tiny_llama(2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 97, (2, 12))
    written = []
    for _ in range(steps):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        written.append(err.getvalue())
    accelerator.end_training()
    return written


def progress_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("kiln compile:")]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same job twice in one process: a cold run of two steps, then a second run that finds the
    first one's record (graphs and seconds) in the warm-start cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_COMPILE_CACHE_DIR", str(tmp_path_factory.mktemp("kiln-cache")))
        fresh = use_fresh_progress(patch)
        try:
            yield train_steps(2), train_steps(1)
        finally:
            fresh.close()


def test_regional_compile_shows_region_forward_backward_and_graphs_done(two_runs):
    (first, steady), _ = two_runs
    done = [line for line in progress_lines(first) if "compiled in" in line]
    assert [line.split(", ")[0] for line in done] == ["kiln compile: LlamaDecoderLayer forward graph",
                                                       "kiln compile: LlamaDecoderLayer backward graph"]
    assert done[0].endswith("1 graph done") and done[1].endswith("2 graphs done")
    assert progress_lines(steady) == []  # a steady step compiles nothing and says nothing


def test_second_run_of_the_same_job_shows_total_and_last_time(two_runs):
    _, (second,) = two_runs
    done = [line for line in progress_lines(second) if "compiled in" in line]
    assert len(done) == 2
    assert "1/2 graphs done, last time " in done[0] and "2/2 graphs done, last time " in done[1]


def test_progress_off_prints_nothing(live, monkeypatch):
    monkeypatch.setenv("KILN_COMPILE_PROGRESS", "0")
    model = compile_regions(tiny_llama(2), **FAST)
    ids = torch.randint(0, 97, (2, 12))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert progress_lines(err.getvalue()) == []
    assert [(e.region, e.phase) for e in live.finished] == [("LlamaDecoderLayer", "forward"),
                                                            ("LlamaDecoderLayer", "backward")]
    assert live._thread is None  # no drawing thread was started


def test_line_survives_a_dynamo_reset_between_compile_and_first_call(live):
    # torch._dynamo.reset() clears Dynamo's compile callbacks (torch 2.13); the region's entry hooks in again.
    model = compile_regions(EncoderDecoder(), **FAST)
    torch._dynamo.reset()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        model(torch.randn(2, 5, 8)).sum().backward()
    done = [line.split(", ")[0] for line in progress_lines(err.getvalue()) if "compiled in" in line]
    assert sorted(done) == ["kiln compile: DecoderBlock backward graph", "kiln compile: DecoderBlock forward graph",
                            "kiln compile: EncoderBlock backward graph", "kiln compile: EncoderBlock forward graph"]


def test_a_non_main_process_compiles_without_a_line(live):
    session.CompileSession(TorchDynamoPlugin(**FAST), is_writer=False, is_local_main=False)
    model = compile_regions(EncoderDecoder(), **FAST)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        model(torch.randn(2, 5, 8)).sum().backward()
    assert progress_lines(err.getvalue()) == [] and live._thread is None
    assert len(live.finished) == 4  # counted all the same: forward and backward of both block classes
