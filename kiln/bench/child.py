"""The measuring child's entry point: `python -m kiln.bench.child '<row json>'` measures the row with
its suite's `measure` and prints the result as its last stdout line.

Depends on the suite modules (measure, warm_start, startup, buckets, checkpointing,
host_overhead, nd_parallel), which never import it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

RESULT_PREFIX = "KILN_BENCH_RESULT "


def suite_measure(suite: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The child-side measurement of a suite; local-processes rows run the start-up suite's job on
    every process."""
    if suite == "warm-start":
        from kiln.bench.warm_start import measure
    elif suite in ("startup", "local-processes"):
        from kiln.bench.startup import measure
    elif suite == "buckets":
        from kiln.bench.buckets import measure
    elif suite == "checkpointing":
        from kiln.bench.checkpointing import measure
    elif suite == "host-overhead":
        from kiln.bench.host_overhead import measure
    elif suite == "nd-parallel":
        from kiln.bench.nd_parallel import measure
    elif suite == "compile":
        from kiln.bench.measure import measure
    else:
        raise ValueError(f"unknown benchmark suite {suite!r}")
    return measure


def main(argv: list[str]) -> int:
    """Measure the row given as JSON; print the result as the last stdout line (exit 1 on error)."""
    row = json.loads(argv[0])
    try:
        result = suite_measure(row.get("suite", "compile"))(row)
    except Exception as exc:  # the parent still gets a line, with the reason
        import traceback

        traceback.print_exc()
        result = dict(row, error=f"{type(exc).__name__}: {exc}"[:2000])
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
