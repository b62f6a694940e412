"""A real (small) text corpus that ships with Python: The Zen of Python, as a character dataset.

Nothing is downloaded: the text is read from the standard library's ``this``
module (where it is stored ROT13-encoded; importing the module would print it,
so it is parsed instead). A character-level language model learns to continue
it, small enough to train on two CPU ranks in seconds.
"""

from __future__ import annotations

import ast
import codecs
import importlib.util
from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset


def zen_of_python() -> str:
    """Return the text of The Zen of Python (PEP 20) from the standard library."""
    spec = importlib.util.find_spec("this")
    if spec is None or spec.origin is None:
        raise RuntimeError("the standard library's 'this' module was not found in this Python.")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(node.value.value, "rot13")
    raise RuntimeError(f"{spec.origin} does not hold the encoded text 's' this module expects.")


@dataclass(frozen=True)
class CharVocab:
    """Map characters to token ids and back.

    Attributes:
        chars: the vocabulary, sorted; a character's id is its position.
    """

    chars: str

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        """Build the vocabulary of every distinct character in ``text``."""
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Return the int64 ids of ``text``'s characters."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.int64)
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary.") from None

    def decode(self, ids) -> str:
        """Return the text of a sequence of ids."""
        return "".join(self.chars[int(i)] for i in ids)


def char_dataset(text: str, block_size: int, vocab: CharVocab | None = None) -> TensorDataset:
    """Cut ``text`` into every window of ``block_size`` characters and its next-character targets.

    Args:
        text: the corpus.
        block_size: sequence length (the model's context).
        vocab: the vocabulary (default: built from ``text``).

    Returns:
        ``TensorDataset(x, y)``, both int64 (len(text) - block_size, block_size);
        ``y`` is ``x`` shifted by one character.
    """
    vocab = vocab or CharVocab.from_text(text)
    ids = vocab.encode(text)
    if len(ids) <= block_size:
        raise ValueError(f"the text has {len(ids)} characters; it needs more than "
                         f"block_size={block_size}.")
    windows = ids.unfold(0, block_size + 1, 1)  # (n, block_size + 1), a view: no copy
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
