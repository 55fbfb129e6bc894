"""Fixtures for the planner's tests: run its CLI in-process, exactly as ``pagedserve`` wires it."""

from __future__ import annotations

import argparse
from typing import Callable

import pytest

from pagedserve.planner.cli import add_parser


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """``run_cli("plan", "kv", ...)`` → (exit code, stdout, stderr) through the planner's own parsers."""

    def run(*argv: str) -> tuple[int, str, str]:
        parser = argparse.ArgumentParser(prog="pagedserve")
        add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(list(argv))
        code = args.func(args)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
