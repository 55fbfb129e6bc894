"""``pagedserve serve | grafana | serve-ray | gateway | generate | plan | simulate | bench``.

Each part registers its own subcommands (``add_parser(subparsers)`` in its ``cli.py``); this file
only wires them together, so each part owns its flags. A run of one command imports only the part
that owns it: registering ``bench`` imports every benchmark and with them torch (seconds), which
``pagedserve serve`` would otherwise pay before it starts loading anything. ``--help`` and
anything unrecognised get the whole parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (module, the top-level commands it registers) of each part, in the order --help lists them.
PARTS = [
    ("pagedserve.server.cli", ("serve",)),
    ("pagedserve.server.grafana", ("grafana",)),
    ("pagedserve.ray_serve.cli", ("serve-ray",)),  # imports Ray only when serve-ray runs
    ("pagedserve.gateway.cli", ("gateway",)),
    ("pagedserve.engine.frontend.generate_cli", ("generate",)),
    ("pagedserve.planner.cli", ("plan", "simulate")),
    ("pagedserve.bench.cli", ("bench",)),
]
# Sub-commands a higher part adds to a lower part's command: ``plan check`` runs the engine, which
# the planner (arithmetic only) must not import, so the benchmarks' part registers it.
# (The lower part's add_parser returns {command: its sub-command list}.)
EXTENSIONS = {"pagedserve.planner.cli": {"plan": "pagedserve.bench.plan_check"}}


def package_version() -> str:
    """The installed distribution's version (pyproject's), so it is never kept in two places."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from pagedserve import __version__

        return f"{__version__}+source"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: every part's commands, or only those of the part that owns ``command``."""
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="LLM serving with a paged KV cache: an engine, an OpenAI-compatible server, a tiered "
                    "gateway, a capacity planner and benchmarks.")
    parser.add_argument("--version", action="version", version=f"pagedserve {package_version()}",
                        help="print the installed pagedserve version and exit")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    owner = next((m for m, names in PARTS if command in names), None)
    for module, _ in PARTS:
        if owner is None or module == owner:
            registered = importlib.import_module(module).add_parser(sub)
            for name, extension in EXTENSIONS.get(module, {}).items():
                importlib.import_module(extension).add_parser(registered[name])
    return parser


def _command(argv: list[str]) -> str | None:
    """The command word of ``argv`` (after the top-level options), if it asks for no help at the top."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # e.g. --log-level without a value: the whole parser says what is wrong
        return None
    return known.command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command(argv)).parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
