"""The strategy interface, and the strategy for one process (which changes nothing).

Depends on torch only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


class Strategy:
    """Wraps a model for its processes, and knows how to skip a gradient sync and how to unwrap."""

    name = "base"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Called by `prepare` after compile and precision: returns what the user trains."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever `wrap_model` returned."""
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Gradients computed inside are not synchronised yet (accumulation)."""
        yield


class SingleProcess(Strategy):
    name = "single"
