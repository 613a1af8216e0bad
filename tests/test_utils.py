import logging
import random

import torch

from kiln.logging import get_logger
from kiln.utils import set_seed


def test_set_seed_makes_runs_repeat():
    set_seed(7)
    first = (random.random(), torch.rand(3))
    set_seed(7)
    second = (random.random(), torch.rand(3))
    assert first[0] == second[0] and torch.equal(first[1], second[1])


def test_logger_speaks_on_main_process_only_by_default(monkeypatch, caplog):
    logger = get_logger("kiln.test", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="kiln.test"):
        logger.info("from rank 0")
        monkeypatch.setenv("RANK", "1")
        logger.info("hidden on rank 1")
        logger.info("everyone", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["from rank 0", "everyone"]
