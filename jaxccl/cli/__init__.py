"""The ``jaxccl`` command line: ``jaxccl demo``, ``jaxccl synth ...``, ``jaxccl sim ...``, ``jaxccl info``.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, adding its parser and setting ``func``. Modules are
listed in ``COMMAND_MODULES``; a missing optional module is skipped.

User errors (bad arguments, a missing or malformed topology file, input a
jaxccl function rejects) print one line on stderr and exit with status 2;
set ``JAXCCL_TRACEBACK=1`` to see the traceback instead.

Example:
    >>> main(["synth", "allgather", "--topology", "rail:2x"])  # the one-line error goes to stderr
    2
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from jaxccl.cli.args import UsageError
from jaxccl.cli.info import version_line
from jaxccl.cli.text import plain
from jaxccl.errors import JaxcclError

__all__ = ["COMMAND_MODULES", "UsageError", "build_parser", "main"]

# (group, module): group None registers a top-level command; otherwise under that group.
COMMAND_MODULES: tuple[tuple[str | None, str], ...] = (
    (None, "jaxccl.cli.demo"),
    ("synth", "jaxccl.cli.synth_allgather"),
    ("synth", "jaxccl.cli.synth_alltoall"),
    ("sim", "jaxccl.cli.sim"),
    (None, "jaxccl.cli.bench"),
    (None, "jaxccl.cli.info"),
    ("topology", "jaxccl.cli.topology"),
)

GROUP_HELP = {
    "synth": "synthesize schedules (and benchmark the synthesizers)",
    "sim": "run the flow-level simulator and the paper's experiments",
    "topology": "topologies from the machine: measure the fabric",
}

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2) and whose help is plain text."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        return plain(super().format_help())


def build_parser() -> Parser:
    """The parser of every subcommand (subparsers are :class:`Parser` too)."""
    parser = Parser(
        prog="jaxccl",
        description="jaxccl: topology-aware collectives for JAX that re-synthesize themselves when links degrade.",
        epilog="User errors print one line and exit with status 2; JAXCCL_TRACEBACK=1 shows the traceback.",
    )
    parser.add_argument(
        "--version", action="version", version=version_line(), help="print the version and the native modules built"
    )
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for group, module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue
            raise
        if group is None:
            module.register(top)
            continue
        if group not in groups:
            text = GROUP_HELP.get(group, group)
            gp = top.add_parser(group, help=text, description=text)
            gp.set_defaults(func=lambda _args, gp=gp: _usage(gp))
            groups[group] = gp.add_subparsers(dest=f"{group}_command", metavar="WHAT")
        module.register(groups[group])
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _command_name(args: argparse.Namespace) -> str:
    words = ["jaxccl"]
    if getattr(args, "command", None):
        words.append(args.command)
        sub = getattr(args, f"{args.command}_command", None)
        if sub:
            words.append(sub)
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxccl`` command; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and argparse's own errors
        return 0 if e.code is None else e.code if isinstance(e.code, int) else EXIT_USAGE
    func = getattr(args, "func", None)
    if func is None:
        return _usage(parser)
    try:
        return int(func(args) or 0)
    except (JaxcclError, ValueError, OSError) as e:
        # Only input the user gave reaches here as these types; JAXCCL_TRACEBACK=1 shows the rest of the story.
        if os.environ.get("JAXCCL_TRACEBACK"):
            raise
        kind = "error" if isinstance(e, UsageError) else type(e).__name__
        print(f"{_command_name(args)}: {kind}: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    return text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
