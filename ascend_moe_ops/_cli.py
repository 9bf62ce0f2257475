"""Shared ``argparse`` value checks for the package's command lines.

Each function is an argparse ``type=``: it turns the text into a value or raises
``argparse.ArgumentTypeError``, so a bad value ends in argparse's own ``error:`` line naming the
flag, with exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def finite_float(text: str) -> float:
    """Any finite number."""
    return _float(text)


def existing_file(text: str) -> str:
    """The path of a file that exists now."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file {text!r}")
    return text
