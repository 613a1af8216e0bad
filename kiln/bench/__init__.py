"""The compile benchmark behind `kiln bench`: eager, full and regional compile, Kiln's and Accelerate's.

Depends on torch, transformers and kiln.compile (in the measuring child processes); accelerate and
matplotlib only when installed. Never on Kiln's facade or a distributed strategy.

plan.py names what to measure, measure.py measures one row in a fresh process, run.py starts those
processes, report.py writes the table, the target ratios, the plots and the JSON lines.
"""

from kiln.bench.plan import METHODS, MODEL_SIZES, PLANS, Row, build_rows
from kiln.bench.report import load_rows, results_table, target_checks, write_results
from kiln.bench.run import run_rows

__all__ = ["METHODS", "MODEL_SIZES", "PLANS", "Row", "build_rows", "load_rows", "results_table",
           "run_rows", "target_checks", "write_results"]
