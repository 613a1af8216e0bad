"""Experiment trackers behind `init_trackers` / `log`: JSON lines always, TensorBoard, Weights & Biases
and MLflow when their packages are installed.

Depends on the standard library; each tracker imports its own package only when it is started.
`TrackingAPI` is the Accelerator's side of it (init_trackers, log, get_tracker).
"""

from __future__ import annotations

import enum
import importlib.util
import json
import numbers
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class KilnTrackingWarning(UserWarning):
    """A logged value that a tracker cannot record (a string, a list): skipped, named once."""


class Tracker:
    """What every tracker shares: nested metrics flattened to `outer/inner`, and values that are not
    scalars skipped with one warning per key (the Accelerator's trackers share one record of keys).

    `tracker.tracker` is the tracker's own object (the SummaryWriter, the wandb run, the mlflow run),
    as in Accelerate, for what Kiln does not wrap (images, tables)."""

    name = "base"
    package: str | None = None  # the module that must be importable for this tracker
    requires_logging_directory = True  # False: the tracker's own default place when project_dir is None

    def __init__(self, warned: set[str] | None = None) -> None:
        self._warned = warned if warned is not None else set()

    @property
    def tracker(self) -> Any:
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        return is_scalar(value)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        log_to_trackers([self], values, step, {self.name: kwargs}, self._warned)

    def write(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass


class JSONLinesTracker(Tracker):
    """One JSON object per `log` call in `<logging_dir>/<run>/metrics.jsonl`, the config beside it."""

    name = "jsonl"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, config: dict[str, Any] | None = None,
                 warned: set[str] | None = None) -> None:
        super().__init__(warned)
        self.folder = Path(logging_dir) / run_name
        self.folder.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (self.folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._file = open(self.folder / "metrics.jsonl", "a", buffering=1)

    @property
    def tracker(self) -> Any:
        return self._file

    def write(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        self._file.write(json.dumps({"time": time.time(), "step": step, **values}) + "\n")

    def finish(self) -> None:
        self._file.close()


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, config: dict[str, Any] | None = None,
                 warned: set[str] | None = None, **writer_kwargs: Any) -> None:
        super().__init__(warned)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(logging_dir) / run_name), **writer_kwargs)
        if config is not None:
            self.writer.add_text("config", json.dumps(config, indent=2, default=str))

    @property
    def tracker(self) -> Any:
        return self.writer

    def write(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(Tracker):
    """A wandb run under `<logging_dir>`; online or offline as wandb's own settings say
    (WANDB_MODE=offline, or init_kwargs={"wandb": {"mode": "offline"}}). wandb media (wandb.Image,
    wandb.Table, ...) pass through `log` as they are."""

    name = "wandb"
    package = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None, config: dict[str, Any] | None = None,
                 warned: set[str] | None = None, **init_kwargs: Any) -> None:
        super().__init__(warned)
        import wandb

        self._media = wandb.sdk.data_types.base_types.wb_value.WBValue
        if logging_dir is not None:
            Path(logging_dir).mkdir(parents=True, exist_ok=True)
            init_kwargs.setdefault("dir", str(logging_dir))
        self.run = wandb.init(project=run_name, config=config, **init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def accepts(self, value: Any) -> bool:
        media = isinstance(value, self._media) or (
            isinstance(value, (list, tuple)) and value and all(isinstance(v, self._media) for v in value))
        return media or is_scalar(value)

    def write(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(Tracker):
    """An MLflow run in the experiment MLFLOW_EXPERIMENT_NAME, else the run's name. The tracking store
    is MLFLOW_TRACKING_URI when set, else MLflow's default kind (an SQLite file) placed in
    `<logging_dir>/mlflow.db` rather than the working folder. The config becomes the run's params."""

    name = "mlflow"
    package = "mlflow"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None, config: dict[str, Any] | None = None,
                 warned: set[str] | None = None, **start_run_kwargs: Any) -> None:
        super().__init__(warned)
        import mlflow

        self._mlflow = mlflow
        if logging_dir is not None and not os.environ.get("MLFLOW_TRACKING_URI"):
            Path(logging_dir).mkdir(parents=True, exist_ok=True)
            mlflow.set_tracking_uri(f"sqlite:///{Path(logging_dir).resolve() / 'mlflow.db'}")
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or run_name)
        self.run = mlflow.start_run(**start_run_kwargs)
        if config:
            params = {key: str(value)[:6000] for key, value in flatten_metrics(config).items()}
            names = list(params)
            for start in range(0, len(names), 100):  # MLflow takes at most 100 params per call
                mlflow.log_params({name: params[name] for name in names[start:start + 100]})

    @property
    def tracker(self) -> Any:
        return self.run

    def write(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        self._mlflow.log_metrics({k: float(v) for k, v in values.items()}, step=step, **kwargs)

    def finish(self) -> None:
        self._mlflow.end_run()


class BlankTracker:
    """What `get_tracker` gives a process other than the main one: every call does nothing."""

    tracker = None

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attribute: str) -> Any:
        return lambda *args, **kwargs: None


TRACKERS: dict[str, type[Tracker]] = {
    tracker.name: tracker for tracker in (JSONLinesTracker, TensorBoardTracker, WandBTracker, MLflowTracker)
}


class LoggerType(str, enum.Enum):
    """Tracker names, as Accelerate spells them (`log_with=LoggerType.TENSORBOARD`)."""

    ALL = "all"
    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"


def is_installed(name: str) -> bool:
    package = TRACKERS[name].package
    return package is None or importlib.util.find_spec(package) is not None


def check_log_with(log_with: str | LoggerType | list[str | LoggerType] | None) -> list[str]:
    """The tracker names asked for: "all" is every supported tracker whose package is installed;
    an unknown name, or one whose package is missing, is an error that says what to do."""
    if log_with is None:
        return []
    asked = [log_with] if isinstance(log_with, (str, LoggerType)) else list(log_with)
    names: list[str] = []
    for entry in asked:
        if not isinstance(entry, str):
            raise TypeError(f"log_with takes tracker names, got {entry!r}; choose from: {', '.join(TRACKERS)}, all")
        name = LoggerType(entry).value if isinstance(entry, LoggerType) else entry.strip().lower()
        if name == "all":
            names.extend(n for n in TRACKERS if is_installed(n))
        elif name not in TRACKERS:
            raise ValueError(f"unknown tracker {entry!r}; choose from: {', '.join(TRACKERS)}, all")
        elif not is_installed(name):
            raise ValueError(f"log_with={name!r} needs the {TRACKERS[name].package} package: "
                             f"pip install {TRACKERS[name].package}")
        else:
            names.append(name)
    return list(dict.fromkeys(names))  # each once, in the order asked


def log_to_trackers(trackers: list[Tracker], values: Mapping[str, Any], step: int | None,
                    log_kwargs: Mapping[str, dict[str, Any]], warned: set[str]) -> None:
    """Each tracker gets the leaves of `values` it can record; a leaf some tracker cannot record is
    named in one warning, the first time its key is seen (`warned` remembers the keys)."""
    flat = flatten_metrics(values)
    for key, value in flat.items():
        refused = [tracker.name for tracker in trackers if not tracker.accepts(value)]
        if refused and key not in warned:
            warned.add(key)
            warnings.warn(f"not logging {key!r} to {', '.join(refused)}: a {type(value).__name__} is not a scalar "
                          "(log numbers, 0-d tensors or numpy scalars; nested dicts become 'outer/inner')",
                          KilnTrackingWarning, stacklevel=3)
    for tracker in trackers:
        kept = {key: value for key, value in flat.items() if tracker.accepts(value)}
        if kept:
            tracker.write(kept, step, **log_kwargs.get(tracker.name, {}))


def flatten_metrics(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become `outer/inner` keys; 0-d tensors and numpy scalars become Python numbers."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, f"{name}/"))
        else:
            flat[name] = _as_number(value)
    return flat


def is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, complex)


def _as_number(value: Any) -> Any:
    """A one-element tensor or numpy scalar as a Python number; anything else as it is."""
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and callable(getattr(value, "item", None)):
        return value.item()
    return value


class TrackingAPI:
    """Needs `log_with`, `logging_dir` and `is_main_process`; `_init_tracking` sets up its own state."""

    def _init_tracking(self, log_with: Any) -> None:
        self.log_with = check_log_with(log_with)
        self.trackers: list[Any] = []
        self._tracking_warned: set[str] = set()  # keys already named in a skipped-value warning

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the trackers named by `log_with` (main process only), writing under `logging_dir`
        (the project_dir unless ProjectConfiguration says otherwise).

        init_kwargs: per tracker name, the keywords for its start, as in Accelerate
        (`{"wandb": {"mode": "offline"}}` goes to `wandb.init`, "tensorboard" to `SummaryWriter`,
        "mlflow" to `mlflow.start_run`)."""
        init_kwargs = dict(init_kwargs or {})
        stray = sorted(set(init_kwargs) - set(self.log_with))
        if stray:
            raise ValueError(f"init_kwargs names tracker(s) {stray} that log_with did not ask for "
                             f"(log_with: {self.log_with})")
        if "jsonl" in init_kwargs:
            raise ValueError("the jsonl tracker takes no init_kwargs")
        missing_dir = [name for name in self.log_with if TRACKERS[name].requires_logging_directory]
        if missing_dir and self.logging_dir is None:
            raise ValueError(f"the {', '.join(missing_dir)} tracker(s) write files: pass project_dir= (or "
                             "ProjectConfiguration(logging_dir=)), the folder they write into")
        if self.is_main_process:
            self.trackers = [TRACKERS[name](project_name, self.logging_dir, config, self._tracking_warned,
                                            **init_kwargs.get(name, {})) for name in self.log_with]

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Send `values` to every tracker, from the main process (no-op without trackers). Nested dicts
        are logged leaf by leaf as `outer/inner`; a value that is not a scalar is skipped with one
        warning naming its key. log_kwargs: per tracker name, extra keywords for its log call."""
        log_to_trackers(self.trackers, values, step, log_kwargs or {}, self._tracking_warned)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (`unwrap=True`: its own object, e.g. the SummaryWriter)."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process and name in self.log_with:
            return BlankTracker(name)  # trackers run on the main process; elsewhere every call does nothing
        raise ValueError(f"no tracker {name!r} was started; started: {[t.name for t in self.trackers]}")
