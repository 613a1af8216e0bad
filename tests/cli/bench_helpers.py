"""What the `kiln bench` tests share: the tiny plan's flags and reading a results file."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
TINY = ["--device", "cpu", "--plan", "tiny", "--backend", "aot_eager", "--steps", "2", "--no-plots"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
