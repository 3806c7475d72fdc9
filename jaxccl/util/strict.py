"""Strict reading of numbers from user files (schedule JSON, MSCCL XML, topology JSON).

Python's own conversions are generous: ``int("1_0") == 10``, ``int("١٠") == 10``
(Arabic-Indic digits), ``int(8.7) == 8``, ``True == 1``, ``float("inf")``. A
file that says any of those is malformed, and these helpers say so with the
caller's error type and a message naming the field.

Example:
    >>> from jaxccl.errors import ScheduleError
    >>> integer(8, "num_ranks", ScheduleError)
    8
    >>> integer(True, "num_ranks", ScheduleError)
    Traceback (most recent call last):
    ...
    jaxccl.errors.ScheduleError: num_ranks must be an integer, got True
    >>> integer_text("1_0", "cnt", ScheduleError)
    Traceback (most recent call last):
    ...
    jaxccl.errors.ScheduleError: cnt must be an integer written in ASCII digits, got '1_0'
    >>> real(400e9, "algbw", ScheduleError, positive=True)
    400000000000.0
    >>> real(10**400, "capacity", ScheduleError)
    Traceback (most recent call last):
    ...
    jaxccl.errors.ScheduleError: capacity must be finite and fit a float (|x| <= 1.798e+308), got a 401-digit integer
    >>> load_json("[" * 100_000, "schedule JSON", ScheduleError)
    Traceback (most recent call last):
    ...
    jaxccl.errors.ScheduleError: malformed schedule JSON: nested too deeply (more than Python's recursion limit)
"""

from __future__ import annotations

import json
import math
import numbers
import re
import sys
from typing import Any

__all__ = ["MAX_NESTING", "integer", "integer_text", "load_json", "nesting", "real", "real_text"]

_INTEGER = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# Integers in files are counts, offsets, ranks and ids: they must fit the int64 words they end up in.
_INT64 = 1 << 63
# Free-form parts of a file (a topology's meta, a schedule's info) may nest lists and objects this deep;
# JSON's encoder and decoder recurse once per level, so deeper data fails later, far from the file.
MAX_NESTING = 100
_SHOWN = 40  # characters of a bad value a message quotes
_FLOAT_MAX = sys.float_info.max


def _shown(value: Any) -> str:
    """``repr(value)``, cut to ``_SHOWN`` characters (a 400-digit number is not a message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {_digits(value)}-digit integer"
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def _digits(value: int) -> int:
    """Decimal digits of ``abs(value)`` without ``str()`` (which refuses more than 4300 digits)."""
    n = abs(value)
    digits = max(1, int(n.bit_length() * math.log10(2)))
    while 10**digits <= n:
        digits += 1
    while digits > 1 and 10 ** (digits - 1) > n:
        digits -= 1
    return digits


def integer(value: Any, what: str, error: type[Exception], *, minimum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float), else ``error`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{what} must be an integer, got {_shown(value)}")
    value = int(value)
    if not -_INT64 <= value < _INT64:
        raise error(f"{what} does not fit 64 bits, got {_shown(value)}")
    if minimum is not None and value < minimum:
        raise error(f"{what} must be >= {minimum}, got {value}")
    return value


def integer_text(text: str, what: str, error: type[Exception], *, minimum: int | None = None) -> int:
    """The integer ``text`` spells in ASCII digits (optional sign, surrounding blanks allowed)."""
    stripped = text.strip(" \t\r\n")
    if not _INTEGER.fullmatch(stripped):
        raise error(f"{what} must be an integer written in ASCII digits, got {_shown(text)}")
    if len(stripped.lstrip("+-").lstrip("0")) > 19:  # int() refuses more than 4300 digits; int64 has 19
        raise error(f"{what} does not fit 64 bits, got {_shown(text)}")
    return integer(int(stripped), what, error, minimum=minimum)


def real(value: Any, what: str, error: type[Exception], *, positive: bool = False) -> float:
    """``value`` as a finite float (an int or float, not a bool); ``positive`` also requires > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {_shown(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer (or fraction) beyond the largest float
        raise error(f"{what} must be finite and fit a float (|x| <= {_FLOAT_MAX:.4g}), got {_shown(value)}") from None
    if not math.isfinite(value):
        raise error(f"{what} must be finite, got {value!r}")
    if positive and not value > 0:
        raise error(f"{what} must be positive, got {value!r}")
    return value


def real_text(text: str, what: str, error: type[Exception], *, positive: bool = False) -> float:
    """The finite number ``text`` spells in ASCII (decimal or exponent notation)."""
    stripped = text.strip(" \t\r\n")
    if not _REAL.fullmatch(stripped):
        raise error(f"{what} must be a number written in ASCII, got {_shown(text)}")
    value = float(stripped)  # a number beyond the largest float reads as inf, refused as not finite
    if not math.isfinite(value):
        raise error(f"{what} must be finite and fit a float (|x| <= {_FLOAT_MAX:.4g}), got {_shown(text)}")
    return real(value, what, error, positive=positive)


def load_json(text: Any, what: str, error: type[Exception]) -> Any:
    """``json.loads(text)``; whatever it refuses raises ``error`` naming ``what`` and the problem.

    Besides malformed text that is: nesting deeper than the decoder's recursion allows
    (``RecursionError``) and integers of more than 4300 digits (``ValueError``); a number beyond the
    largest float reads as ``inf``, refused where a number is read (:func:`real`).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"malformed {what}: nested too deeply (more than Python's recursion limit)") from None
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise error(f"malformed {what}: {type(e).__name__}: {e}") from None


def nesting(value: Any, what: str, error: type[Exception], *, limit: int = MAX_NESTING) -> None:
    """Raises ``error`` if lists and dicts in ``value`` nest more than ``limit`` deep (walked without recursion).

    >>> nesting({"a": [[1]]}, "info", ValueError, limit=3)
    >>> nesting({"a": [[[1]]]}, "info", ValueError, limit=3)
    Traceback (most recent call last):
    ...
    ValueError: info nests lists and objects more than 3 levels deep
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= limit:
                raise error(f"{what} nests lists and objects more than {limit} levels deep")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, (list, tuple, dict)))
