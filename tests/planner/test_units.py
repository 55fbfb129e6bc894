"""Units for people: parsing what they type and formatting what they read."""

from __future__ import annotations

import math

import pytest

from pagedserve.planner import units


@pytest.mark.parametrize(("text", "expected"), [("9GiB", 9 * 2**30), ("640MiB", 640 * 2**20), ("16GB", 16e9),
                                                ("1234", 1234)])
def test_parse_size(text: str, expected: float) -> None:
    assert units.parse_size(text) == expected


@pytest.mark.parametrize(("text", "expected"), [("1008GB/s", 1008e9), ("3.35TB/s", 3.35e12), ("900GiB/s", 900 * 2**30)])
def test_parse_bandwidth(text: str, expected: float) -> None:
    assert units.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(("text", "expected"), [("8B", 8e9), ("989T", 989e12), ("1.5e12", 1.5e12), ("70G", 70e9),
                                                ("400TFLOPS", 400e12)])
def test_parse_si(text: str, expected: float) -> None:
    assert units.parse_si(text) == pytest.approx(expected)


@pytest.mark.parametrize(("text", "expected"), [("97ms", 0.097), ("0.5s", 0.5), ("250us", 250e-6), ("2min", 120.0),
                                                ("3", 3.0)])
def test_parse_duration(text: str, expected: float) -> None:
    assert units.parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["fast", "10 parsecs", ""])
def test_unparseable_values_are_value_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        units.parse_duration(bad)
    with pytest.raises(ValueError):
        units.parse_si(bad)


def test_formatting_picks_units_for_people() -> None:
    assert units.format_bytes(163840) == "160 KiB"
    assert units.format_bytes(6.25 * 2**30) == "6.25 GiB"
    assert units.format_bytes(187.5 * 2**20) == "187.5 MiB"
    assert units.format_bytes(16e9, binary=False) == "16 GB"
    assert units.format_duration(0.097) == "97 ms"
    assert units.format_duration(2.7) == "2.7 s"
    assert units.format_duration(math.inf) == "unbounded"
    assert units.format_duration(math.nan) == "-"
    assert units.format_rate(1.008e12, "B/s") == "1.01 TB/s"
    assert units.format_percent(1200 / 4096) == "29.3%"
