"""Command-line argument checks: a wrong value is refused in one line, before anything runs.

Each ``type=`` function below raises ``argparse.ArgumentTypeError`` with what
is allowed; :class:`Parser` prints argparse's error as a single line and exits
with status 2. Checks that need more than one argument (a world size against
the GPUs present) raise :class:`UsageError`, which ``dpcourse`` reports the same
way. Standard library only: ``dpcourse --help`` must not import torch.
"""

from __future__ import annotations

import argparse
import math
import os


class UsageError(ValueError):
    """A command-line value that is not allowed; reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``prog: error: what is wrong``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _checked(text: str, convert, allowed, what: str, unreadable: str = "") -> int | float:
    """Return ``convert(text)`` if ``allowed`` accepts it; else say it ``must be {what}``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {unreadable or what}, got {text!r}") from None
    if not allowed(value):  # a comparison with nan is False: nan is refused too
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (ranks, iterations, batch size)."""
    return _checked(text, int, lambda v: v >= 1, "a whole number >= 1")


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (warm-up calls)."""
    return _checked(text, int, lambda v: v >= 0, "a whole number >= 0")


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (timeouts)."""
    return _checked(text, float, lambda v: 0 < v < math.inf, "a finite number of seconds > 0",
                    unreadable="a number")


def nonnegative_mib(text: str) -> float:
    """A bucket cap in MiB: a number >= 0 (0: one bucket per parameter)."""
    return _checked(text, float, lambda v: v >= 0,
                    "a number of MiB >= 0 (0: one bucket per parameter)", unreadable="a number")


def comma_list(item, allowed: tuple[str, ...] | None = None):
    """Return a ``type=`` for a comma-separated list of ``item`` values, each among ``allowed``."""
    def parse(text: str) -> list:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if allowed is not None:
            wrong = [v for v in values if v not in allowed]
            if wrong:
                raise argparse.ArgumentTypeError(
                    f"unknown {', '.join(map(repr, wrong))}: choose from {', '.join(allowed)}")
        return values
    parse.__name__ = getattr(item, "__name__", "list")
    return parse


def notebook_path(text: str) -> str:
    """An existing ``.ipynb`` file or a folder (of notebooks)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist: give a .ipynb file or a folder")
    if not os.path.isdir(text) and not text.endswith(".ipynb"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a notebook: give a .ipynb file or a folder")
    return text
