"""``pagedserve serve | grafana | gateway | generate | plan | simulate | bench``.

Each part registers its own subcommands (``add_parser(subparsers)`` in its ``cli.py``); this file
only wires them together, so ``pagedserve --help`` stays fast and each part owns its flags.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (module, description) of each part that adds subcommands, in the order --help lists them.
PARTS = [
    "pagedserve.server.cli",
    "pagedserve.server.grafana",
    "pagedserve.ray_serve.cli",  # imports Ray only when serve-ray runs
    "pagedserve.gateway.cli",
    "pagedserve.engine.generate_cli",
    "pagedserve.planner.cli",
    "pagedserve.bench.cli",
]


def package_version() -> str:
    """The installed distribution's version (pyproject's), so it is never kept in two places."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from pagedserve import __version__

        return f"{__version__}+source"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="LLM serving with a paged KV cache: an engine, an OpenAI-compatible server, a tiered "
                    "gateway, a capacity planner and benchmarks.")
    parser.add_argument("--version", action="version", version=f"pagedserve {package_version()}",
                        help="print the installed pagedserve version and exit")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in PARTS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
