"""A wheel carries every non-Python file the package reads at run time: the development install
(`pip install -e .`) reads them from the checkout, so a missing package-data pattern shows only
once someone installs the wheel."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_kernel_sources_and_the_key_bits_text_are_package_data():
    from pagedserve.engine.core import key_bits
    from pagedserve.kernels import _HEADERS, _SOURCES

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    needed = [*(_SOURCES + _HEADERS), Path(key_bits.__file__).with_name(key_bits.CALIBRATION_TEXT)]
    for path in needed:
        package = ".".join(path.parent.relative_to(ROOT).parts)
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns.get(package, [])), (package, path.name)
