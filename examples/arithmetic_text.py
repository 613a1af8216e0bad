"""Generated training text: short arithmetic sentences in words ("three plus four is seven.").

Depends on the standard library only. A small language model learns its structure in a few
hundred steps, so the demo's loss falls visibly without any download.
"""

from __future__ import annotations

import random

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen"]


def sentence(rng: random.Random) -> str:
    a, b = rng.randrange(10), rng.randrange(10)
    if rng.random() < 0.5 or a < b:
        return f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    return f"{NUMBERS[a]} minus {NUMBERS[b]} is {NUMBERS[a - b]}."


def generate_text(characters: int, seed: int = 0) -> str:
    """About `characters` characters of sentences separated by spaces, the same for the same seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < characters:
        parts.append(sentence(rng))
        length += len(parts[-1]) + 1
    return " ".join(parts)


class CharTokenizer:
    """One id per character of the text it was built from."""

    def __init__(self, text: str) -> None:
        self.alphabet = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)
