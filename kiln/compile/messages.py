"""Compiler errors and reasons shortened for warnings and the compile report, and the warning
category both halves of the compile package raise when code meant to run compiled ran eagerly.

Depends on nothing.
"""

from __future__ import annotations


class KilnFallbackWarning(UserWarning):
    """Code meant to run compiled ran eagerly (recompile limit hit, or nothing compiled at all)."""


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def guard_reason(text: str) -> str:
    """The failing guard out of torch's "GuardManager check failed, reason: GuardDebugInfo(...)"."""
    marker = "verbose_code_parts=["
    if marker in text:
        return text.split(marker, 1)[1].rsplit("]", 1)[0].strip()[:300]
    return first_line(text)
