"""The Zen of Python character dataset used by lesson 08."""

import pytest
import torch

from dpcourse.realdata import CharVocab, char_dataset, zen_of_python


def test_zen_text_is_read_without_printing(capsys):
    text = zen_of_python()
    assert text.startswith("The Zen of Python, by Tim Peters")
    assert "Beautiful is better than ugly." in text and text.count("\n") >= 19
    assert capsys.readouterr().out == ""  # `import this` would have printed it


def test_vocab_round_trip_and_windows():
    text = "abcabd"
    vocab = CharVocab.from_text(text)
    assert vocab.chars == "abcd" and len(vocab) == 4
    assert vocab.decode(vocab.encode(text)) == text
    x, y = char_dataset(text, 3, vocab).tensors
    assert x.tolist() == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert torch.equal(x[:, 1:], y[:, :-1]) and y[:, -1].tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        vocab.encode("z")
    with pytest.raises(ValueError, match="block_size"):
        char_dataset(text, 6)
