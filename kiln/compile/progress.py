"""The compile as it happens: one live line while a compile blocks a training step.

Depends on torch and kiln.plugins (its boolean parser) only; regions, the backend and the session call in.

The training thread is inside torch while a region compiles, so a small daemon thread draws the line
from what the compile hooks recorded: Dynamo's compile start/end callbacks (a forward graph's trace
and backend compile, and AOTAutograd's lazy backward compile), the region entry (which region is
running) and `TrackedBackend` (which region's graph the backend compiles). The thread sleeps on an
event while nothing compiles. Only the local main process draws; KILN_COMPILE_PROGRESS=0 turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TextIO

import torch

from kiln.plugins import parse_bool

ENV = "KILN_COMPILE_PROGRESS"
THRESHOLD_S = 2.0  # compiles shorter than this print nothing
LOG_INTERVAL_S = 10.0  # at most one plain line this often when stderr is not a terminal
TICK_S = 0.5  # how often the drawing thread looks while a compile runs
RECORD_VERSION = 1


@dataclass(eq=False)
class CompileEvent:
    """One compile the training thread waits for: a region's forward graph (Dynamo's trace and the
    backend's compile) or its backward graph (compiled at the first backward)."""

    phase: str  # "forward", "backward", or "forward and backward" (an ahead-of-time compile)
    region: str
    started: float
    compile_id: str | None = None
    ended: float | None = None
    graphs: int = 0  # graphs the backend compiled in it (a forward trace with none is no graph)
    graphs_before: int = 0  # Dynamo's count of graphs it made, at the start
    last_line: float | None = None  # when a plain line last said how it goes

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else self.started) - self.started


class CompileProgress:
    """One per process (`PROGRESS`): what compiles now, what compiled before, and the line about it.

    `clock`, `threshold`, `log_interval`, `stream` and `thread` are there for tests: `stream=None`
    writes to the `sys.stderr` of the moment; `thread=False` leaves the ticks to the caller.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, threshold: float = THRESHOLD_S,
                 log_interval: float = LOG_INTERVAL_S, tick_seconds: float = TICK_S,
                 stream: TextIO | None = None, thread: bool = True) -> None:
        self.clock, self.threshold, self.log_interval, self.tick_seconds = clock, threshold, log_interval, tick_seconds
        self.stream, self.use_thread = stream, thread
        self.enabled = True
        self.is_main = os.environ.get("LOCAL_RANK", "0") == "0"  # the session says so when it knows
        self.region: str | None = None  # the Kiln region whose forward runs on the training thread
        self.active: CompileEvent | None = None
        self.finished: list[CompileEvent] = []
        self._regions_by_compile_id: dict[str, str] = {}
        # job key -> (its regions, the previous compile's events or None, index in `finished` where it began)
        self._keys: dict[str, tuple[set[str], list[dict[str, Any]] | None, int]] = {}
        self._lock = threading.RLock()
        self._busy = threading.Event()  # set while a compile runs: the drawing thread waits on it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None
        self._exit_hook = False
        self._handler = _callback_handler()
        # Bound once: `in` on Dynamo's callback list then finds them by identity (0.1 us a call).
        self._start_callback, self._end_callback = self._on_start, self._on_end

    # ----- hooks: regions.py, backend.py, Dynamo's callbacks ---------------------------------
    def watch(self) -> None:
        """Read KILN_COMPILE_PROGRESS and hook into Dynamo's compile callbacks; regions call this
        when they are compiled, so a bad value is an error there and not inside a compile."""
        value = os.environ.get(ENV)
        self.enabled = True if value is None else parse_bool(value, ENV)
        self._install_callbacks()

    def enter(self, region: str) -> str | None:
        """A region's forward starts on this thread; returns the region it replaces (for `region = ...`
        when it returns). Re-hooks Dynamo's callbacks, which `torch._dynamo.reset()` clears."""
        outer, self.region = self.region, region
        handler = self._handler
        if handler is not None and self._start_callback not in handler.start_callbacks:
            self._install_callbacks()
        return outer

    @contextlib.contextmanager
    def backend_compile(self, region: str, phase: str = "forward") -> Iterator[None]:
        """Around `TrackedBackend`'s compile of one of `region`'s graphs: names the compile Dynamo
        started, or, where Dynamo's callbacks are missing, is the compile. Torch 2.13's ahead-of-time
        compile (`aot_compile`, precompiled.py) runs no callbacks: around it, this is the compile
        (phase "forward and backward": AOTAutograd compiles both there)."""
        compile_id = _current_compile_id()
        own = False
        with self._lock:
            if compile_id is not None:
                self._regions_by_compile_id[compile_id] = region
            if self.active is None:  # Dynamo's callbacks are missing (or were cleared mid-compile)
                self._start(phase, region, compile_id)
                own = True
            self.active.graphs += 1
        try:
            yield
        finally:
            if own:
                self._end()

    def _on_start(self, args: Any = None) -> None:
        # Dynamo's callbacks take CallbackArgs(callback_trigger, compile_id) in torch >= 2.6 and
        # nothing before; without a trigger, a start inside a region is taken as its forward.
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        compile_id = getattr(args, "compile_id", None)
        with self._lock:
            if trigger == "DYNAMO" and self.region is not None:
                if compile_id is not None:
                    self._regions_by_compile_id[compile_id] = self.region
                self._start("forward", self.region, compile_id)
            elif trigger == "LAZY_BACKWARD" and compile_id in self._regions_by_compile_id:
                self._start("backward", self._regions_by_compile_id[compile_id], compile_id, graphs=1)

    def _on_end(self, args: Any = None) -> None:
        self._end()

    def _install_callbacks(self) -> None:
        handler = self._handler = _callback_handler()
        if handler is None:  # TrackedBackend's hook still shows the backend's forward compiles
            return
        with self._lock:
            if self._start_callback not in handler.start_callbacks:
                handler.register_start_callback(self._start_callback)
            if self._end_callback not in handler.end_callbacks:
                handler.register_end_callback(self._end_callback)

    # ----- events -----------------------------------------------------------------------------
    def _start(self, phase: str, region: str, compile_id: str | None, graphs: int = 0) -> None:
        if self.active is not None:
            return  # one compile at a time blocks the step; an inner one is part of it
        self.active = CompileEvent(phase, region, self.clock(), compile_id, graphs=graphs,
                                   graphs_before=_dynamo_graphs())
        if self.enabled and self.is_main and self.use_thread:
            self._ensure_thread()
            self._busy.set()

    def _end(self) -> None:
        with self._lock:
            event, self.active = self.active, None
            self._busy.clear()
            if event is None:
                return
            event.ended = self.clock()
            if event.phase == "forward":  # Dynamo made graphs no TrackedBackend saw
                event.graphs = max(event.graphs, _dynamo_graphs() - event.graphs_before)
            if self._bar is not None:
                self._bar.close()  # the live line goes; the compile report keeps the history
                self._bar = None
            if event.graphs == 0:
                return  # a frame Dynamo looked at and left to Python: no graph, nothing to count
            self.finished.append(event)
            if self.enabled and self.is_main and event.seconds >= self.threshold and not self._is_tty():
                self._write(self.render(event, event.ended, done=True))  # a log keeps how long it took

    def tick(self) -> None:
        """Draw the line for the compile running now, if it has run past the threshold."""
        with self._lock:
            event = self.active
            if event is None or not (self.enabled and self.is_main):
                return
            now = self.clock()
            if now - event.started < self.threshold:
                return
            line = self.render(event, now)
            if self._is_tty():
                self._draw_bar(line)
            elif event.last_line is None or now - event.last_line >= self.log_interval:
                event.last_line = now
                self._write(line)

    # ----- what the line says -------------------------------------------------------------------
    def render(self, event: CompileEvent, now: float, done: bool = False) -> str:
        """'kiln compile: LlamaDecoderLayer backward graph, 6.2 s, 1/2 graphs done, last time 6.5 s'."""
        graphs_done, total = self.graphs_done(), self.total_graphs()
        if total is not None and graphs_done <= total:
            count = f"{graphs_done}/{total} graph{'s' if total != 1 else ''} done"
        else:
            count = f"{graphs_done} graph{'s' if graphs_done != 1 else ''} done"
        parts = [f"kiln compile: {event.region} {event.phase} graph",
                 f"compiled in {_seconds(now - event.started)}" if done else _seconds(now - event.started),
                 count]
        estimate = self.estimate(event)
        if estimate is not None:
            parts.append(f"last time {_seconds(estimate)}")
        return ", ".join(parts)

    def graphs_done(self) -> int:
        """Graphs compiled so far for the jobs being followed (in this process, if none is)."""
        if not self._keys:
            return sum(e.graphs for e in self.finished)
        return sum(e.graphs for key in self._keys for e in self._finished_for(key))

    def total_graphs(self) -> int | None:
        """Graphs the previous compile of every followed job compiled; None if one has no record."""
        if not self._keys or any(events is None for _, events, _ in self._keys.values()):
            return None
        return sum(int(e.get("graphs", 1)) for _, events, _ in self._keys.values() for e in events)

    def estimate(self, event: CompileEvent) -> float | None:
        """Seconds the same graph (region, phase, and how many of those came before) took last time."""
        for key, (regions, events, _) in self._keys.items():
            if events is None or event.region not in regions:
                continue
            same = [e["seconds"] for e in events if (e.get("region"), e.get("phase")) == (event.region, event.phase)]
            earlier = [e for e in self._finished_for(key) if (e.region, e.phase) == (event.region, event.phase)]
            before = next((i for i, e in enumerate(earlier) if e is event), len(earlier))
            return float(same[before]) if before < len(same) else None
        return None

    def _finished_for(self, key: str) -> list[CompileEvent]:
        regions, _, first = self._keys[key]
        return [e for e in self.finished[first:] if e.region in regions]

    # ----- records of a job (saved in the warm-start cache) ---------------------------------------
    def follow(self, key: str, regions: list[str], record: dict[str, Any] | None) -> None:
        """Count the compiles of `regions` for the job `key`; `record` is what `record(key)` gave
        for the same key in an earlier process (from the warm-start cache), or None."""
        events = record.get("events") if isinstance(record, dict) and record.get("version") == RECORD_VERSION else None
        readable = isinstance(events, list) and all(
            isinstance(e, dict) and isinstance(e.get("seconds"), (int, float)) for e in events)
        if not readable:
            events = None  # unreadable or from another Kiln: the line shows graphs done only
        with self._lock:
            self._keys[key] = (set(regions), events, len(self.finished))

    def record(self, key: str) -> dict[str, Any] | None:
        """The graphs compiled so far for job `key` and their seconds, for the next run's estimate."""
        if key not in self._keys:
            return None
        events = [{"region": e.region, "phase": e.phase, "graphs": e.graphs, "seconds": round(e.seconds, 3)}
                  for e in self._finished_for(key)]
        return {"version": RECORD_VERSION, "events": events} if events else None

    # ----- drawing -------------------------------------------------------------------------------
    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty and isatty())

    def _write(self, line: str) -> None:
        out = self._out()
        out.write(line + "\n")
        out.flush()

    def _draw_bar(self, line: str) -> None:
        if self._bar is None:
            self._bar = _new_bar(self._out())
        self._bar.set_description_str(line)

    # ----- the drawing thread -----------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kiln-compile-progress", daemon=True)
        self._thread.start()
        if not self._exit_hook:
            atexit.register(self.close)  # before the interpreter tears stderr down
            self._exit_hook = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._busy.wait()  # no wake-ups while nothing compiles
            if self._stop.is_set():
                return
            self.tick()
            self._stop.wait(self.tick_seconds)

    def close(self, keys: Iterable[str] = ()) -> None:
        """Stop the drawing thread and clear a live line (the next compile starts it again), and stop
        following the jobs `keys` (their session ended)."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)
        self._stop.set()
        self._busy.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.tick_seconds + 1)
        self._busy.clear()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class _CarriageLine:
    """The live line without tqdm: rewritten in place with a carriage return, erased at the end."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def set_description_str(self, line: str) -> None:
        self.out.write("\r" + line + "\x1b[K")
        self.out.flush()

    def close(self) -> None:
        self.out.write("\r\x1b[K")
        self.out.flush()


def _new_bar(out: TextIO) -> Any:
    """A tqdm line (it keeps clear of the user's own tqdm bars), else a plain carriage-return line."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _CarriageLine(out)

    class Line(tqdm):
        monitor_interval = 0  # this thread already refreshes it; no tqdm monitor thread

    return Line(file=out, bar_format="{desc}", leave=False, dynamic_ncols=True, mininterval=0)


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(int(value), 60)
    return f"{minutes} min {seconds:02d} s"


def _callback_handler() -> Any:
    """Dynamo's compile start/end callbacks (`torch._dynamo.callback_handler`, torch >= 2.4;
    triggers, among them the lazy backward compile, since 2.6); None where it is missing."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    needed = ("register_start_callback", "register_end_callback", "start_callbacks", "end_callbacks")
    return handler if handler is not None and all(hasattr(handler, n) for n in needed) else None


def _dynamo_graphs() -> int:
    """Graphs Dynamo made in this process (its `unique_graphs` counter, torch 2.x)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _current_compile_id() -> str | None:
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except (AttributeError, RuntimeError):
        return None
    return str(compile_id) if compile_id is not None else None


PROGRESS = CompileProgress()
