"""Character-level text that every Python install has: the standard library's own documentation.

``pydoc_data.topics.topics`` (the text ``help("with")`` prints) is a dict of about 80 English
documents, some 460,000 characters on CPython 3.11. Nothing is downloaded. The topics are joined
in sorted order, every distinct character is a token, the first 90 % is the training split and the
last 10 % the validation split (nanoGPT's character-level Shakespeare is prepared the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["CharBlocks", "CharTokenizer", "load_splits", "load_text"]


def load_text() -> str:
    """The Python documentation's topics, joined in sorted order (the same text on every rank)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


class CharTokenizer:
    """One token per distinct character, numbered in sorted order."""

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = list(chars)
        self._index = {ch: i for i, ch in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary of this model.") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharBlocks(Dataset):
    """Map-style dataset of ``(x, y)`` pairs: ``block_size`` tokens and the same tokens shifted by one.

    Sample ``i`` starts at token ``i * stride``. With ``stride=1`` every position starts a sample:
    a shuffled epoch then draws contexts the way nanoGPT's random offsets do, without replacement.
    With ``stride=block_size`` the blocks tile the text, so an evaluation over the dataset scores
    (almost) every token exactly once.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, *, stride: int = 1) -> None:
        if block_size < 1 or stride < 1:
            raise ValueError(f"block_size and stride must be >= 1, got {block_size} and {stride}.")
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"{len(tokens)} tokens are too few for one block of {block_size} (+1 for the target)."
            )
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} blocks.")
        start = index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def load_splits(
    block_size: int, *, val_fraction: float = 0.1
) -> tuple[CharBlocks, CharBlocks, CharTokenizer]:
    """Training blocks (every offset), validation blocks (tiling the held-out tail), and the tokenizer."""
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    cut = int(len(tokens) * (1 - val_fraction))
    # Copies, not views: a dataset sent to the processes fit() starts pickles only its own split.
    train = CharBlocks(tokens[:cut].clone(), block_size, stride=1)
    val = CharBlocks(tokens[cut:].clone(), block_size, stride=block_size)
    return train, val, tokenizer
