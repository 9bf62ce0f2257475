"""Shared ``argparse`` value checks for the package's command lines.

Each function is an argparse ``type=``: it turns the text into a value or raises
``argparse.ArgumentTypeError``, so a bad value ends in argparse's own ``error:`` line naming the
flag, with exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
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


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def output_dir(text: str) -> str:
    """A folder to write into: an existing folder, or one that can be created (no part of the path
    is an existing file, and the nearest existing folder above it is writable)."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create folder {text!r}: {str(base)!r} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {str(base)!r} (for {text!r}): permission denied")
    return text


def output_file(text: str) -> str:
    """A file to write: not an existing folder, in an existing folder this process may write in."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file name")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {str(parent)!r} to write {text!r} in")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text
