"""The top-level CLI registers only the part that owns the command being run (pagedserve/cli.py)."""

from __future__ import annotations

import subprocess
import sys

from pagedserve.cli import PARTS, _command, build_parser


def _commands(parser) -> set[str]:
    return set(parser._subparsers._group_actions[0].choices)  # the COMMAND sub-parsers action


def test_each_part_registers_exactly_the_commands_it_declares():
    everything = _commands(build_parser())
    assert everything == {name for _, names in PARTS for name in names}
    for _, names in PARTS:
        assert _commands(build_parser(names[0])) == set(names)


def test_the_command_word_is_found_after_the_top_level_options():
    assert _command(["serve", "--model", "m"]) == "serve"
    assert _command(["--log-level", "DEBUG", "bench", "decode"]) == "bench"
    assert _command(["--log-level=DEBUG", "plan", "kv"]) == "plan"
    assert _command(["--help"]) is None and _command(["--log-level"]) is None


def test_serve_does_not_import_torch_to_parse_its_flags():
    code = ("import sys; from pagedserve.cli import _command, build_parser; "
            "build_parser(_command(['serve'])).parse_args(['serve', '--model', 'm']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
