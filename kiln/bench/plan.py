"""What the compile benchmark measures: model sizes, methods, and the named plans that combine them.

Depends on the standard library only (the parent process plans rows without importing torch).

A plan is a list of groups; each group is a cross product of models x workloads x batch sizes x
methods (x compile modes, x variants), so a plan can be small where a full cross product would not
fit the time. A group belongs to a suite: `compile` (cold compile and steady steps, kiln.bench.measure),
`warm-start` (kiln.bench.warm_start), `buckets` (kiln.bench.buckets), `checkpointing`
(kiln.bench.checkpointing), `host-overhead` (kiln.bench.host_overhead), `startup`
(kiln.bench.startup) or `local-processes` (kiln.bench.local_processes: the start-up job on 1 and 2
local processes); the variants are the suite's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable

# Llama-style configs with random weights (nothing is downloaded). tiny/1b/8b are the sizes of
# ../shared/tools/anchor_compile.py, so GPU numbers stay comparable with DESIGN.md's table;
# 3b is Llama 3.2 3B's shape; small/medium are CPU sizes whose compiles fit minutes on 2 cores.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # Thin layers where the host bounds a step (kiln bench --plan host-overhead): 8 and 24 of them.
    "host8": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "host24": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # issue 28's Llama: the start-up job's width, 6 layers (kiln bench --plan side-by-side)
    "small6": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "medium": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=12,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=2048),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}

# diffusers UNets with random weights (kiln.bench.diffusion): Stable Diffusion 1.5's block layout
# (4 down and 4 up blocks, 2 resnets a block, cross-attention at three levels) at small widths, and
# an unconditional UNet2DModel. A row's `seq` is the latent's side. Their blocks change width from
# level to level, so each block class splits into groups (kiln/compile/groups.py).
DIFFUSION_MODELS: dict[str, dict[str, Any]] = {
    "sd-unet": dict(in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64, 128, 128),
                    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                    norm_num_groups=16, cross_attention_dim=64, attention_head_dim=8),
    "unet2d": dict(in_channels=3, out_channels=3, layers_per_block=2, block_out_channels=(32, 64, 64, 128),
                   down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                   up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
                   norm_num_groups=16),
}
ALL_MODELS = (*MODEL_SIZES, *DIFFUSION_MODELS)

# DESIGN.md's H200 table: 256 tokens for inference, 512 for a training step.
GPU_SEQ = {"infer": 256, "train": 512}

KILN_METHODS = ("eager", "full", "regional")
ACCELERATE_METHODS = ("accelerate-full", "accelerate-regional")
# fp8 training as `Accelerator(mixed_precision="fp8")` sets it up: the linear layers become torchao's
# Float8Linear (kiln/fp8.py; needs torchao), then Kiln compiles whole or per block.
FP8_METHODS = ("full-fp8", "regional-fp8")
METHODS = KILN_METHODS + ACCELERATE_METHODS + FP8_METHODS
WORKLOADS = ("infer", "train")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Each suite's variants; kept here (not imported from the suite modules) so planning stays light.
SUITE_VARIANTS = {
    "compile": ("",),
    "warm-start": ("cold", "warm-inductor-dir-only", "warm-artifacts-only", "warm", "cold-precompile",
                   "warm-precompiled", "warm-precompiled-copy", "resume-fresh-machine",
                   "resume-fresh-machine-user-inductor-dir", "resume-fresh-machine-precompiled"),
    "buckets": ("static", "static-buckets", "dynamic", "dynamic-buckets"),
    "host-overhead": ("",),  # one row holds every variant (kiln.bench.host_overhead.VARIANTS)
    "checkpointing": ("eager", "eager-checkpointing", "eager-checkpointing-reentrant", "regional",
                      "regional-checkpointing", "regional-checkpointing-reentrant"),
    "startup": ("eager", "regional-cold", "regional-warm", "precompiled-cold", "precompiled-warm",
                "precompiled-warm-copy", "background-cold", "accelerate-regional", "busy-eager",
                "busy-regional-cold", "busy-background-cold", "full-cold", "parallel-cold", "default-cold",
                "parallel-default-cold", "outer-cold", "outer-background-cold"),
    "local-processes": ("eager", "regional-cold", "precompiled-cold", "default-cold", "precompiled-two-machines",
                        "default-two-machines"),
    "nd-parallel": ("ddp", "fsdp2", "hsdp", "tp-fsdp2", "cp-fsdp2"),  # kiln.bench.nd_parallel.layout
}


# The side-by-side and outer-graph plans' own start-up variants.
SIDE_BY_SIDE = ("full-cold", "parallel-cold", "default-cold", "parallel-default-cold", "outer-cold",
                "outer-background-cold")


@dataclass(frozen=True)
class Row:
    """One measurement: one fresh process, one model, one method, one batch shape."""

    model: str
    workload: str
    batch: int
    seq: int
    method: str
    mode: str = "default"
    backend: str = "inductor"
    device: str = "cpu"
    dtype: str = "float32"
    steps: int = 10
    warmup: int = 3
    seed: int = 0
    threads: int | None = None
    suite: str = "compile"
    variant: str = ""
    processes: int = 1  # local processes started by torch.distributed.run (local-processes suite)

    @property
    def label(self) -> str:
        """How progress lines and tables name the row: 'regional train b4', plus a non-default mode,
        or the suite and variant: 'warm-start warm small train b4'."""
        if self.suite != "compile":
            processes = f" x{self.processes} processes" if self.processes > 1 else ""
            return f"{self.suite} {self.variant} {self.model} {self.workload} b{self.batch}{processes}"
        mode = "" if self.mode == "default" else f" [{self.mode}]"
        return f"{self.method}{mode} {self.model} {self.workload} b{self.batch}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Group:
    """A cross product of rows; a plan is a list of these, measured in order."""

    models: list[str]
    workloads: list[str]
    batches: list[int]
    methods: list[str]
    modes: list[str] = field(default_factory=lambda: ["default"])
    seq: dict[str, int] = field(default_factory=lambda: {"infer": 64, "train": 64})
    # Steady steps are cheap next to a compile; the median of 30 damps a shared CPU's noise.
    steps: int = 30
    suite: str = "compile"
    variants: list[str] = field(default_factory=lambda: [""])
    backend: str | None = None  # the group's default backend, where the command line names none
    processes: list[int] = field(default_factory=lambda: [1])
    threads: int | None = None  # the group's torch threads, where the command line names none

    def rows(self, backend: str | None = None, **common: Any) -> list[Row]:
        backend = backend or self.backend or "inductor"
        if common.get("threads") is None and self.threads is not None:
            common = dict(common, threads=self.threads)
        return [Row(model=m, workload=w, batch=b, seq=self.seq[w], method=method, mode=mode,
                    steps=self.steps, suite=self.suite, variant=variant, backend=backend, processes=n, **common)
                for n in self.processes for m in self.models for w in self.workloads for b in self.batches
                for method in self.methods for mode in self.modes for variant in self.variants
                if not (method == "eager" and mode != "default")]


# The default CPU plan fits 10 minutes on a 2-core machine (about 7.5): Inductor's cold compile
# costs 10-35 s a row there (mostly gcc), so batch 1 and 16 are measured for inference only, a
# training step and Accelerate at batch 4, where the targets are checked, and a 12-layer model
# for inference at batch 4, to show how compile time grows with depth.
PLANS: dict[str, list[Group]] = {
    "cpu": [
        Group(["small"], ["infer"], [1, 4, 16], ["eager", "full", "regional"]),
        Group(["small"], ["infer"], [4], ["accelerate-full", "accelerate-regional"]),
        Group(["small"], ["train"], [4], ["eager", "full", "regional", "accelerate-regional"]),
        Group(["medium"], ["infer"], [4], ["eager", "full", "regional", "accelerate-regional"]),
    ],
    # Every method on every workload and batch size: about 30 rows, 15-20 minutes on 2 cores.
    "cpu-full": [
        Group(["small"], ["infer", "train"], [1, 4, 16], list(KILN_METHODS + ACCELERATE_METHODS)),
    ],
    # Logic checks in seconds with backend aot_eager; the GPU script's --device cpu path uses it.
    "tiny": [
        Group(["tiny"], ["infer", "train"], [2], list(KILN_METHODS + ACCELERATE_METHODS),
              seq={"infer": 32, "train": 32}, steps=3),
    ],
    # diffusers UNets: a training step compiled whole and regionally (the SD UNet's regions are the
    # blocks it declares, the UNet2DModel's those Kiln finds), about 6 minutes with Inductor on 2
    # cores; `--backend aot_eager` measures the same rows without code generation.
    "diffusion": [
        Group(["sd-unet", "unet2d"], ["train"], [2], ["eager", "full", "regional"],
              seq={"infer": 32, "train": 32}, steps=10),
    ],
    # Kiln's compile cache between job starts: a cold regional training step, then three fresh
    # processes starting from part or all of its cache folder (about 2 minutes on 2 cores).
    "warm-start": [
        Group(["small"], ["train"], [4], ["regional"], suite="warm-start",
              variants=list(SUITE_VARIANTS["warm-start"]), steps=5),
    ],
    # Whole training jobs from a fresh process: first step and time to 20/100/400/500 steps for
    # eager, Kiln's blocking, warm, precompiled and background starts, and Accelerate's regional
    # compile; the small Llama and the demo's GPT-2 (about 8 minutes on 2 cores).
    "startup": [
        Group(["small", "demo"], ["train"], [4], ["regional"], suite="startup",
              variants=[v for v in SUITE_VARIANTS["startup"] if not v.startswith("busy-") and v not in SIDE_BY_SIDE],
              steps=500),
        # The same job on a busy machine (a busy loop holds one core): 2000 steps each, small only.
        Group(["small"], ["train"], [4], ["regional"], suite="startup",
              variants=[v for v in SUITE_VARIANTS["startup"] if v.startswith("busy-")], steps=500),
    ],
    # Compiling side by side (issue 28): cold starts of the UNet2DModel whole, regional (serial JIT)
    # and parallel_compile (a pool of helpers), each with fullgraph=True (the helpers precompile)
    # and as most users leave it (fullgraph unset: the helpers fill the compile caches), and of a
    # 6-layer Llama beside Accelerate's regional compile; the first 20 steps each, compared at the
    # end of step 2. `--backend aot_eager` checks
    # the logic in a minute; the targets are Inductor's (about 11 minutes on 2 cores; 22 with --repeat 2).
    "side-by-side": [
        Group(["unet2d"], ["train"], [2], ["regional"], suite="startup", seq={"infer": 32, "train": 32},
              variants=["full-cold", "regional-cold", "parallel-cold", "default-cold", "parallel-default-cold"],
              steps=20),
        Group(["small6"], ["train"], [4], ["regional"], suite="startup",
              variants=["accelerate-regional", "regional-cold", "parallel-cold", "default-cold",
                        "parallel-default-cold"], steps=20),
    ],
    # The outer graph (compile_regions(outer_graph=True)) from a cold start beside per-block regions
    # and the whole model: the first step (its compile) and the steps after, the thin host8 Llama at
    # batch 1x16 on one thread (where the host bounds a step) and the start-up job's small6 at 4x64
    # (about 3 minutes on 2 cores).
    "outer-graph": [
        Group(["host8"], ["train"], [1], ["regional"], suite="startup", seq={"infer": 16, "train": 16},
              variants=["full-cold", "regional-cold", "outer-cold", "outer-background-cold"], steps=200, threads=1),
        Group(["small6"], ["train"], [4], ["regional"], suite="startup",
              variants=["full-cold", "regional-cold", "outer-cold", "outer-background-cold"], steps=100),
    ],
    # Cold starts of 1 and 2 local processes (torch.distributed.run): does each region compile once
    # per machine? The start-up job's first 20 steps, eager, JIT (every process compiles) and
    # precompiled (the first process compiles, the other loads); about 3 minutes on 2 cores.
    "local-processes": [
        Group(["small"], ["train"], [4], ["regional"], suite="local-processes",
              variants=list(SUITE_VARIANTS["local-processes"]), steps=20, processes=[1, 2]),
    ],
    # Shape buckets over one epoch of variable-length batches; aot_eager unless --backend says
    # otherwise (Inductor builds up to 8 graphs with gcc here: minutes per row).
    # Where the host bounds a step: every variant of one model in one process, stepped in turn, at
    # batch 1x16 on one thread (8 and 24 thin layers), then at 4x64 on two threads, where the
    # arithmetic weighs more (about 12 minutes with Inductor on 2 cores).
    "host-overhead": [
        Group(["host8", "host24"], ["infer", "train"], [1], ["regional"], suite="host-overhead",
              seq={"infer": 16, "train": 16}, steps=300, threads=1),
        Group(["host8"], ["infer", "train"], [4], ["regional"], suite="host-overhead",
              seq={"infer": 64, "train": 64}, steps=100, threads=2),
    ],
    # Parallel layouts on 4 local processes (DDP, FSDP2, HSDP, tensor parallel inside FSDP2), each a
    # training job with regional compile: tokens per second and model state per process (about 6
    # minutes with Inductor on 2 cores).
    "nd-parallel": [
        Group(["small"], ["train"], [8], ["regional"], suite="nd-parallel", seq={"infer": 64, "train": 64},
              variants=list(SUITE_VARIANTS["nd-parallel"]), steps=20, processes=[4], threads=1),
    ],
    # transformers' gradient checkpointing, eager and regionally compiled: activation memory held
    # for backward and step time (about 2 minutes with Inductor on 2 cores).
    "checkpointing": [
        Group(["small"], ["train"], [4], ["regional"], suite="checkpointing", seq={"infer": 128, "train": 128},
              variants=list(SUITE_VARIANTS["checkpointing"])),
    ],
    "buckets": [
        Group(["small"], ["train"], [4], ["regional"], suite="buckets", seq={"infer": 128, "train": 128},
              variants=list(SUITE_VARIANTS["buckets"]), backend="aot_eager"),
    ],
    # One H200 in about 8 minutes (benchmarks/gpu_bench.sh gives it a 420 s budget). Ordered by what
    # the targets need, so the budget cuts the least needed rows: 1B inference and training at
    # batch 4 with Accelerate beside Kiln, the fp8 training step beside the bf16 one (not yet measured:
    # one regional row, needs torchao, an error row without it), the CUDA-graphs batch-1 rows, 8B
    # inference, then the rest. Estimated from DESIGN.md's H200 rows (10-15 s of process start each):
    # about 500 s in all, so the last groups may be cut.
    "gpu": [
        Group(["1b"], ["infer"], [4], ["eager", "full", "regional", "accelerate-regional"], seq=GPU_SEQ, steps=20),
        Group(["1b"], ["train"], [4], ["eager", "full", "regional", "accelerate-regional"], seq=GPU_SEQ, steps=10),
        Group(["1b"], ["train"], [4], ["regional-fp8"], seq=GPU_SEQ, steps=10),
        Group(["1b"], ["infer"], [1], ["eager", "full", "regional"], modes=["default", "reduce-overhead"],
              seq=GPU_SEQ, steps=20),
        Group(["8b"], ["infer"], [16], ["eager", "full", "regional"], seq=GPU_SEQ, steps=10),
        Group(["1b"], ["infer"], [16], ["full", "regional"], seq=GPU_SEQ, steps=20),
        Group(["3b"], ["train"], [4], ["full", "regional"], seq=GPU_SEQ, steps=10),
        Group(["1b"], ["infer"], [4], ["accelerate-full"], seq=GPU_SEQ, steps=20),
    ],
}


def build_rows(
    plan: str,
    *,
    device: str,
    backend: str | None = None,
    models: Iterable[str] | None = None,
    workloads: Iterable[str] | None = None,
    batches: Iterable[int] | None = None,
    methods: Iterable[str] | None = None,
    modes: Iterable[str] | None = None,
    seq: int | None = None,
    steps: int | None = None,
    threads: int | None = None,
    variants: Iterable[str] | None = None,
    processes: Iterable[int] | None = None,
    with_accelerate: bool = True,
) -> list[Row]:
    """The rows of `plan`, with any list given here replacing that list in every group (variants
    only in groups of a suite that has them; process counts only in the local-processes suite's).
    `backend` None: each group's own, else inductor.

    Accelerate's methods are dropped when `with_accelerate` is False (the package is not installed).
    Duplicates (two groups naming the same row) are measured once.
    """
    if plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r}; choose one of: {', '.join(PLANS)}")
    dtype = "bfloat16" if device == "cuda" else "float32"  # bf16 as DESIGN.md's H200 table; CPU bf16 is slow
    rows: list[Row] = []
    for group in PLANS[plan]:
        group = replace(
            group,
            models=list(models or group.models),
            workloads=list(workloads or group.workloads),
            batches=list(batches or group.batches),
            methods=list(methods or group.methods),
            modes=list(modes or group.modes),
            seq={w: seq for w in WORKLOADS} if seq else group.seq,
            steps=steps or group.steps,
            variants=[v for v in variants if v in SUITE_VARIANTS[group.suite]] if variants else group.variants,
            processes=list(processes) if processes and group.suite == "local-processes" else group.processes,
        )
        for row in group.rows(backend=backend, device=device, dtype=dtype, threads=threads):
            if row.method in ACCELERATE_METHODS and not with_accelerate:
                continue
            if row not in rows:
                rows.append(row)
    return rows


def measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The result rows that hold a measurement: neither failed ("error") nor cut by the budget ("skipped")."""
    return [r for r in rows if "error" not in r and "skipped" not in r]


def check_choices(values: Iterable[str], choices: Iterable[str], what: str) -> list[str]:
    """`values` unchanged when each is one of `choices`, else a ValueError naming the bad ones."""
    values, choices = list(values), list(choices)
    unknown = [v for v in values if v not in choices]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(map(repr, unknown))}; choose from: {', '.join(choices)}")
    return values
