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


def _at_least(parse, low, strict: bool, what: str, doc: str):
    """An argparse type: ``parse(text)``, then ``> low`` (strict) or ``>= low``."""
    def check(text: str):
        v = parse(text)
        if v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    check.__doc__ = doc
    return check


positive_int = _at_least(_int, 1, False, "an integer >= 1", "An integer >= 1.")
non_negative_int = _at_least(_int, 0, False, "an integer >= 0", "An integer >= 0.")
positive_float = _at_least(_float, 0.0, True, "a finite number > 0", "A finite number > 0.")
non_negative_float = _at_least(_float, 0.0, False, "a finite number >= 0", "A finite number >= 0.")


def finite_float(text: str) -> float:
    """Any finite number."""
    return _float(text)


def existing_file(text: str) -> str:
    """The path of a file that exists now."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file {text!r}")
    return text
