"""Units for people: parse sizes, rates and durations from the command line; format them back.

Sizes follow the usual split: ``GiB`` is 1024³ bytes, ``GB`` is 1000³. Bandwidths and FLOP/s
are decimal (``1008GB/s``, ``989T``) because that is how card vendors quote them.
"""

from __future__ import annotations

import math
import re

from pagedserve.config import parse_bytes

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_DURATION = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60.0, "h": 3600.0}


def parse_size(value: int | float | str) -> int:
    """A memory size in bytes from ``9GiB``, ``640MiB``, ``16GB`` or a plain count."""
    return parse_bytes(value)


def parse_bandwidth(value: int | float | str) -> float:
    """Bytes per second from ``1008GB/s``, ``3.35TB/s``, ``900GiB/s`` or a plain number."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    return float(parse_bytes(text))


def parse_si(value: int | float | str, what: str = "value") -> float:
    """A plain number with an optional SI suffix: ``8B`` (billion), ``989T``, ``1.5e12``, ``70G``.

    ``B`` is read as billion here (``8B`` parameters), which is how model sizes are written.
    """
    if isinstance(value, (int, float)):
        return float(value)
    text = re.sub(r"(?i)\s*flop(?:/s|s)?\s*$", "", value)  # "400 TFLOP/s" and "400TFLOPS" mean 400T
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m:
        raise ValueError(f"cannot parse {what} {value!r}: use e.g. 8B, 989T, 1.5e12")
    suffix = m.group(2).lower()
    if suffix == "b":  # billions, as in "8B parameters"
        suffix = "g"
    if suffix not in _SI:
        raise ValueError(f"cannot parse {what} {value!r}: unknown suffix {m.group(2)!r}")
    return float(m.group(1)) * _SI[suffix]


def parse_duration(value: int | float | str) -> float:
    """Seconds from ``97ms``, ``0.5s``, ``250us``, ``2min`` or a plain number of seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Zµ]*)\s*", value)
    if not m or m.group(2).lower() not in _DURATION:
        raise ValueError(f"cannot parse duration {value!r}: use e.g. 97ms, 0.5s, 250us")
    return float(m.group(1)) * _DURATION[m.group(2).lower()]


def format_bytes(num_bytes: float, binary: bool = True) -> str:
    """``163840`` → ``160 KiB``; ``6.25 * 2**30`` → ``6.25 GiB``; ``binary=False`` gives GB."""
    if math.isinf(num_bytes):
        return "inf"
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else \
        (1000.0, ["B", "kB", "MB", "GB", "TB", "PB"])
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    unit = units[0]
    for unit in units:
        if value < base or unit == units[-1]:
            break
        value /= base
    return f"{sign}{_trim(value)} {unit}"


def format_duration(seconds: float) -> str:
    """``0.097`` → ``97 ms``; ``1.5`` → ``1.5 s``; ``inf`` → ``unbounded``; ``nan`` (no sample) → ``-``."""
    if math.isnan(seconds):
        return "-"
    if math.isinf(seconds):
        return "unbounded"
    if seconds == 0:
        return "0 ms"
    if abs(seconds) < 1e-3:
        return f"{_trim(seconds * 1e6)} µs"
    if abs(seconds) < 1.0:
        return f"{_trim(seconds * 1e3)} ms"
    if abs(seconds) < 120:
        return f"{_trim(seconds)} s"
    return f"{_trim(seconds / 60)} min"


def format_rate(value: float, unit: str) -> str:
    """``1.008e12, 'B/s'`` → ``1.01 TB/s``: decimal SI prefixes for throughputs."""
    if math.isinf(value):
        return "inf"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{_trim(value / scale)} {prefix}{unit}"
    return f"{_trim(value)} {unit}"


def format_percent(fraction: float) -> str:
    """``0.29296875`` → ``29.3%``."""
    if math.isinf(fraction):
        return "inf"
    return f"{fraction * 100:.1f}%"


def _trim(value: float) -> str:
    """Three significant figures, without a trailing ``.0``: ``160``, ``6.25``, ``2.34``."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        text = f"{value:.0f}" if abs(value - round(value)) < 0.05 or abs(value) >= 1000 else f"{value:.1f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    if "." in text and "e" not in text:
        text = text.rstrip("0").rstrip(".")
    return text
