"""Configuration dataclasses: `TorchDynamoPlugin` and the environment variables that fill it.

Depends on torch only; never imports the facade, a strategy or the compile package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

# Accelerate spells "compile off" as the backend "no"; scripts and config files carry it over.
DISABLED_BACKENDS = ("no", "none")
BOOLEAN_TRUE = ("1", "true", "yes", "on")
BOOLEAN_FALSE = ("0", "false", "no", "off")
TRISTATE_NONE = ("none", "auto", "")
RECOMPILE_POLICIES = ("warn", "error", "allow")
ENV_PREFIX = "KILN_DYNAMO_"


# Backends every torch since 2.0 registers: accepted without listing the registry, whose first
# listing imports AOTAutograd (about 0.5 s of a start-up, torch 2.13).
BUILTIN_BACKENDS = ("inductor", "eager", "aot_eager")


def known_backends() -> list[str]:
    """Every backend name `torch.compile` accepts here, debug and experimental ones included."""
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def known_modes() -> list[str]:
    """Every Inductor `mode` this torch understands."""
    return list(torch._inductor.list_mode_options().keys())


def parse_bool(value: str, name: str) -> bool:
    """Read a boolean environment value; anything but the usual spellings is an error."""
    lowered = value.strip().lower()
    if lowered in BOOLEAN_TRUE:
        return True
    if lowered in BOOLEAN_FALSE:
        return False
    raise ValueError(
        f"{name}={value!r} is not a boolean; use one of {', '.join(BOOLEAN_TRUE + BOOLEAN_FALSE)}"
    )


def parse_bool_or_word(value: str, name: str, words: tuple[str, ...]) -> bool | str:
    """Read a setting that is a boolean or one of `words` (lower case)."""
    lowered = value.strip().lower()
    if lowered in words:
        return lowered
    try:
        return parse_bool(value, name)
    except ValueError:
        choices = ", ".join(("true", "false", *words[:-1]))
        raise ValueError(f"{name}={value!r}: use {choices} or {words[-1]}") from None


def parse_outer_graph(value: str, name: str) -> bool | str:
    """Read an outer-graph setting: "background", "auto" or a boolean."""
    return parse_bool_or_word(value, name, ("background", "auto"))


def parse_precompile(value: str, name: str) -> bool | str:
    """Read a precompile setting: "auto" or a boolean."""
    return parse_bool_or_word(value, name, ("auto",))


def parse_tristate(value: str, name: str) -> bool | None:
    """Like `parse_bool`, but 'none'/'auto' (or empty) stands for None (let torch decide)."""
    if value.strip().lower() in TRISTATE_NONE:
        return None
    try:
        return parse_bool(value, name)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not a boolean or 'none'; use true, false or none"
        ) from None


def parse_workers(value: Any, name: str = "compile_workers") -> int | None:
    """`compile_workers` as given (an int >= 1, or None/"auto" for Kiln's choice); a clear error otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be a whole number >= 1 or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1 or None (Kiln chooses), got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (1 is a single helper process), got {value!r}; "
                         "leave it unset for one worker per free core")
    return value


def _env(name: str, environ: Mapping[str, str]) -> str | None:
    return environ.get(ENV_PREFIX + name)


@dataclass
class TorchDynamoPlugin:
    """How Kiln calls `torch.compile`.

    Each field left as None is read from the matching `KILN_DYNAMO_*` environment variable,
    else takes the default shown. Bad values fail here, not deep inside `torch.compile`.

    >>> TorchDynamoPlugin(backend="inductor", mode="max-autotune", use_regional_compilation=True)
    """

    backend: str | Callable | None = None  # KILN_DYNAMO_BACKEND, default "inductor"
    mode: str | None = None  # KILN_DYNAMO_MODE, default: torch's ("default")
    # KILN_DYNAMO_USE_FULLGRAPH; default False, or True with precompile / compile_in_background
    fullgraph: bool | None = None
    dynamic: bool | None = None  # KILN_DYNAMO_USE_DYNAMIC; None lets torch decide
    options: dict[str, Any] | None = None
    disable: bool | None = None  # KILN_DYNAMO_DISABLE, default False
    use_regional_compilation: bool | None = None  # KILN_DYNAMO_USE_REGIONAL_COMPILATION, default False
    # The whole model one graph, each block class one shared subgraph (with use_regional_compilation,
    # JIT only): a full compile's steady steps for about twice a block's compile time
    # (kiln/compile/outer_graph.py). "background": per-block regions first, the outer graph once a
    # helper process has compiled it and checked it against eager (kiln/compile/tier_up.py). "auto"
    # (None: KILN_DYNAMO_OUTER_GRAPH, default "auto"): "background" where it is known to work (one
    # process, Inductor, a CPU model), else per-block regions alone, the reason in the report.
    outer_graph: bool | str | None = None
    # Regional compilation targets; None finds repeated blocks automatically.
    block_classes: tuple[type | str, ...] | None = None
    block_paths: tuple[str, ...] | None = None
    # What a recompile after the warm-up steps does: "warn", "error" or "allow".
    recompile: str | None = None  # KILN_DYNAMO_RECOMPILE, default "warn"
    warmup_steps: int = 1  # optimizer steps before the recompile policy applies
    # Warm starts: the compile cache (None: KILN_COMPILE_CACHE, default on) and its folder
    # (None: KILN_COMPILE_CACHE_DIR, default ~/.cache/kiln/compile).
    cache: bool | None = None
    cache_dir: str | None = None
    # Precompiled regions (None: KILN_DYNAMO_PRECOMPILE, default off; they need fullgraph=True and
    # static shapes): each call signature is compiled ahead of time into the cache folder, and
    # later runs load it without a Dynamo trace. "auto" with fullgraph left unset: each region is
    # tried as one whole graph ahead of time, and a region that graph-breaks (or that these settings
    # rule out) is JIT-compiled as torch.compile would, the reason in the report; no error, no warning.
    precompile: bool | str | None = None
    # Train while compiling (None: KILN_DYNAMO_COMPILE_IN_BACKGROUND, default off; implies
    # precompile): the first steps run the blocks eagerly while a helper process compiles them,
    # and each region switches to compiled code between steps once its artifact is ready.
    compile_in_background: bool | None = None
    # Compile side by side, blocking (None: KILN_DYNAMO_PARALLEL_COMPILE, default off; implies
    # compile_in_background): step 1 runs the blocks eagerly while the helpers compile every
    # region group at once; at its end training waits for them and runs compiled from step 2.
    parallel_compile: bool | None = None
    # The background compiler's helper processes (None: KILN_COMPILE_WORKERS, default one per core
    # training leaves free, every core with parallel_compile; 1 is a single helper).
    compile_workers: int | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, repr=False, compare=False)
    # Settings Kiln decided for the user (shown in the compile report), e.g. an implied fullgraph.
    notes: list[str] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        env = self.environ
        if self.backend is None:
            self.backend = _env("BACKEND", env) or "inductor"
        if self.mode is None:
            self.mode = _env("MODE", env) or None
        # fullgraph's source: "argument", "environment", or None while unset (it is then decided
        # in _validate, where precompile and compile_in_background imply True).
        self._fullgraph_from = "argument" if self.fullgraph is not None else None
        if self.fullgraph is None:
            raw = _env("USE_FULLGRAPH", env)
            if raw is not None:
                self.fullgraph = parse_bool(raw, ENV_PREFIX + "USE_FULLGRAPH")
                self._fullgraph_from = "environment"
        if self.dynamic is None:
            raw = _env("USE_DYNAMIC", env)
            self.dynamic = parse_tristate(raw, ENV_PREFIX + "USE_DYNAMIC") if raw is not None else None
        if self.disable is None:
            raw = _env("DISABLE", env)
            self.disable = parse_bool(raw, ENV_PREFIX + "DISABLE") if raw is not None else False
        if self.use_regional_compilation is None:
            raw = _env("USE_REGIONAL_COMPILATION", env)
            name = ENV_PREFIX + "USE_REGIONAL_COMPILATION"
            self.use_regional_compilation = parse_bool(raw, name) if raw is not None else False
        if self.outer_graph is None:
            raw = _env("OUTER_GRAPH", env)
            self.outer_graph = parse_outer_graph(raw, ENV_PREFIX + "OUTER_GRAPH") if raw is not None else "auto"
        if self.recompile is None:
            self.recompile = _env("RECOMPILE", env) or "warn"
        if self.compile_in_background is None:
            raw = _env("COMPILE_IN_BACKGROUND", env)
            name = ENV_PREFIX + "COMPILE_IN_BACKGROUND"
            self.compile_in_background = parse_bool(raw, name) if raw is not None else False
        if self.parallel_compile is None:
            raw = _env("PARALLEL_COMPILE", env)
            name = ENV_PREFIX + "PARALLEL_COMPILE"
            self.parallel_compile = parse_bool(raw, name) if raw is not None else False
        self._workers_from = "argument" if self.compile_workers is not None else None
        if self.compile_workers is None:
            self.compile_workers = parse_workers(env.get("KILN_COMPILE_WORKERS"), "KILN_COMPILE_WORKERS")
        if self.precompile is None:  # stays None (off) unless the variable is set
            raw = _env("PRECOMPILE", env)
            self.precompile = parse_precompile(raw, ENV_PREFIX + "PRECOMPILE") if raw is not None else None
        if self.block_classes is not None:
            self.block_classes = tuple(self.block_classes)
        if self.block_paths is not None:
            self.block_paths = tuple(self.block_paths)
        self._validate()

    def _validate(self) -> None:
        if self.fullgraph is not None and not isinstance(self.fullgraph, bool):
            raise TypeError(f"TorchDynamoPlugin.fullgraph must be a bool, got {self.fullgraph!r}")
        for name in ("disable", "use_regional_compilation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TorchDynamoPlugin.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dynamic not in (None, True, False):
            raise TypeError(f"TorchDynamoPlugin.dynamic must be None, True or False, got {self.dynamic!r}")
        self.backend = validate_backend(self.backend)
        if self.backend in DISABLED_BACKENDS:
            raise ValueError(
                f"backend {self.backend!r} means 'no compile'; to run without torch.compile, "
                "pass no dynamo_plugin (or TorchDynamoPlugin(disable=True))"
            )
        validate_mode_and_options(self.backend, self.mode, self.options)
        if self.recompile not in RECOMPILE_POLICIES:
            raise ValueError(f"unknown recompile policy {self.recompile!r}; choose one of: "
                             f"{', '.join(RECOMPILE_POLICIES)}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.cache is not None and not isinstance(self.cache, bool):
            raise TypeError(f"TorchDynamoPlugin.cache must be None or a bool, got {self.cache!r}")
        if not isinstance(self.compile_in_background, bool):
            raise TypeError(f"TorchDynamoPlugin.compile_in_background must be a bool, got "
                            f"{self.compile_in_background!r}")
        if not isinstance(self.parallel_compile, bool):
            raise TypeError(f"TorchDynamoPlugin.parallel_compile must be a bool, got {self.parallel_compile!r}")
        self.compile_workers = parse_workers(self.compile_workers, "TorchDynamoPlugin.compile_workers")
        if self.parallel_compile and not self.compile_in_background:
            self.compile_in_background = True  # the same helpers and switch, with a wait after step 1
            self.notes.append("compile_in_background=True, implied by parallel_compile=True")
        if self._workers_from == "argument" and not self.compile_in_background:
            raise ValueError(f"compile_workers={self.compile_workers} sizes the background compiler's helper "
                             "processes; set compile_in_background=True or parallel_compile=True to use them, "
                             "or leave compile_workers unset")
        self._precompile_asked = self.precompile is True  # by the user, not implied below
        if self.compile_in_background:
            if self.precompile is False:
                raise ValueError("compile_in_background=True loads what the helper precompiled; it cannot "
                                 "be used with precompile=False")
            self.precompile = True
        if self.precompile is not None and not isinstance(self.precompile, bool) and self.precompile != "auto":
            raise TypeError(f"TorchDynamoPlugin.precompile must be None, a bool or 'auto', got {self.precompile!r}")
        self._decide_fullgraph()
        if self.precompile is True:
            if self.dynamic is True:
                raise ValueError("precompile=True needs static shapes (dynamic=False or None): artifacts "
                                 "are made per input signature")
            if self.cache is False:
                raise ValueError("precompile=True keeps its artifacts in the compile cache folder; "
                                 "it cannot be used with cache=False")
        if not isinstance(self.outer_graph, bool) and self.outer_graph not in ("background", "auto"):
            raise TypeError(f"TorchDynamoPlugin.outer_graph must be a bool, 'background' or 'auto', got "
                            f"{self.outer_graph!r}")
        # "auto" is decided where the model is compiled (per-block regions alone beside precompile).
        asked = self.outer_graph_asked
        if asked and not self.use_regional_compilation:
            raise ValueError(f"outer_graph={self.outer_graph!r} compiles the model around its regions: set "
                             "use_regional_compilation=True with it")
        if asked and self.precompile == "auto":
            self.precompile = False
            self.notes.append(f"precompile='auto': off beside outer_graph={self.outer_graph!r}, which compiles the "
                              "blocks just in time inside the outer graph")
        if asked and self.precompile:
            cause = "compile_in_background=True" if self.compile_in_background else "precompile=True"
            raise ValueError(f"outer_graph={self.outer_graph!r} compiles the outer graph just in time, and {cause} "
                             "precompiles each block on its own: choose one of the two")
        if (self.block_classes or self.block_paths) and not self.use_regional_compilation:
            raise ValueError(
                "block_classes/block_paths choose the regions of a regional compile; "
                "set use_regional_compilation=True to use them"
            )

    def _decide_fullgraph(self) -> None:
        """Precompiled regions take whole graphs only: left unset, fullgraph becomes True with them
        or with training while compiling (a note for the compile report), else False. Set to False
        by the user beside precompile=True, it is an error naming both settings; beside training
        while compiling (or parallel_compile), the helpers fill the compile caches instead of
        compiling ahead of time, and training JIT-compiles each region warm (a note)."""
        wanted = ("compile_in_background=True" if self.compile_in_background
                  else "precompile=True" if self.precompile is True else None)
        if self.fullgraph is None and self.precompile == "auto":
            return  # left unset: each region is tried whole ahead of time, and JIT-compiled if it breaks
        if self.fullgraph is None:
            self.fullgraph = wanted is not None
            if wanted is not None:
                self.notes.append(f"fullgraph=True, implied by {wanted} (left unset)")
            return
        if self.compile_in_background and not self._precompile_asked and not self.fullgraph:
            flag = "parallel_compile=True" if self.parallel_compile else "compile_in_background=True"
            self.notes.append(f"fullgraph=False with {flag}: the helpers JIT-compile each region into the "
                              "compile caches (an ahead-of-time compile takes whole graphs only), and "
                              "training compiles it from them, warm, once they are done")
            return
        if self.compile_in_background and self._precompile_asked:
            wanted = "precompile=True"
        if wanted is not None and not self.fullgraph:
            where = ("fullgraph=False" if self._fullgraph_from == "argument"
                     else f"{ENV_PREFIX}USE_FULLGRAPH=false in the environment")
            raise ValueError(f"{wanted} needs whole graphs, but {where} was given: an ahead-of-time compile "
                             "takes whole graphs only. Set fullgraph=True (or leave it unset), or drop "
                             f"{wanted.split('=')[0]}")

    def precompile_by_default(self, where: str) -> None:
        """Left unset (argument and environment), precompile becomes "auto" where the strategy shares
        precompiled regions across processes (`where` names it, for the report): each region is
        tried as one whole graph ahead of time, compiled once for the job and loaded by the others,
        and a region that breaks is JIT-compiled as before. fullgraph, when the user left it unset
        too, goes back to unset, so a break is a fallback there, not an error."""
        if self.precompile is not None or not self.use_regional_compilation or self.outer_graph_asked:
            return
        self.precompile = "auto"
        if self._fullgraph_from is None:
            self.fullgraph = None
        self.notes.append(f"precompile='auto' (left unset, {where}): whole blocks are compiled ahead of time once "
                          "and shared; a block that breaks is JIT-compiled. precompile=False turns it off")

    @property
    def enabled(self) -> bool:
        return not self.disable

    @property
    def outer_graph_asked(self) -> bool:
        """An outer graph asked for by name (True or "background"), not left to "auto"."""
        return self.outer_graph is True or self.outer_graph == "background"

    def to_compile_kwargs(self) -> dict[str, Any]:
        """The keywords for `torch.compile` / `kiln.compile_regions`, exactly as validated."""
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options is not None:
            kwargs["options"] = dict(self.options)
        return kwargs


def validate_backend(backend: str | Callable) -> str | Callable:
    """Return the backend in the spelling torch wants; raise on names torch does not know."""
    if callable(backend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or a callable, got {backend!r}")
    lowered = backend.strip().lower()
    if lowered in DISABLED_BACKENDS or lowered in BUILTIN_BACKENDS:
        return lowered
    choices = known_backends()
    if lowered not in choices:
        raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(choices)}")
    return lowered


def validate_mode_and_options(backend: str | Callable, mode: str | None, options: Any) -> None:
    """`mode` and `options` are Inductor's; check them before torch sees them."""
    if mode is not None and options is not None:
        raise ValueError(
            f"mode={mode!r} and options={options!r} were both given; torch.compile takes one or the "
            "other (a mode is a preset of options): drop one"
        )
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict of Inductor settings, got {options!r}")
    if mode is not None:
        modes = known_modes()
        if mode not in modes:
            raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(modes)}")
        if backend != "inductor" and mode != "default":
            raise ValueError(
                f"mode={mode!r} is an Inductor setting but backend is {backend!r}; "
                "use backend='inductor' or drop the mode"
            )


@dataclass
class DataLoaderConfiguration:
    """How `prepare` treats dataloaders (Accelerate's fields).

    split_batches: the loader's batch size is the global batch, split over the processes (it must
    divide by their number), and a scheduler steps once per optimizer step; off (the default), each
    process gets whole batches of that size, and a prepared scheduler steps once per process per
    optimizer step, as in Accelerate. even_batches: every process gets as many batches as the
    others, the last round filled with samples from the epoch's start (`gather_for_metrics` drops
    them); off, the last round is left short and some processes get one batch fewer (a DDP model
    then needs `accelerator.join_uneven_inputs`). data_seed: the shuffle seed shared by every
    process (default: torch's initial seed, which `set_seed` sets). non_blocking: copy batches to
    the device asynchronously (with pinned memory). use_seedable_sampler: Kiln's shuffle always
    depends on (seed, epoch) only, so True and False behave alike. dispatch_batches: only None or
    False (every process reads its own share); the main process cannot dispatch batches.
    use_stateful_dataloader: `save_state` records how far into the epoch each dataloader is and
    `load_state` resumes there. Leave it off to resume with `skip_first_batches` instead (never
    both: batches would be skipped twice, and Kiln refuses that).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                     "use_stateful_dataloader"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DataLoaderConfiguration.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dispatch_batches:
            raise NotImplementedError("dispatch_batches=True is not supported: in Kiln every process reads the "
                                      "data and keeps its own share (streams too); leave dispatch_batches unset")
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise TypeError(f"data_seed must be an int, got {self.data_seed!r}")
