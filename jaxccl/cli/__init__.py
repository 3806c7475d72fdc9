"""The ``jaxccl`` command line: ``jaxccl demo``, ``jaxccl synth ...``, ``jaxccl sim ...``.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, adding its parser and setting ``func``. Modules are
listed in ``COMMAND_MODULES``; a missing optional module is skipped.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (group, module): group None registers a top-level command; otherwise under that group.
COMMAND_MODULES: tuple[tuple[str | None, str], ...] = (
    (None, "jaxccl.cli.demo"),
    ("synth", "jaxccl.cli.synth_allgather"),
    ("synth", "jaxccl.cli.synth_alltoall"),
    ("sim", "jaxccl.cli.sim"),
)

GROUP_HELP = {
    "synth": "synthesize schedules (and benchmark the synthesizers)",
    "sim": "run the flow-level simulator and the paper's experiments",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxccl", description=__doc__.splitlines()[0])
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
            gp = top.add_parser(group, help=GROUP_HELP.get(group, group))
            groups[group] = gp.add_subparsers(dest=f"{group}_command", metavar="WHAT")
        module.register(groups[group])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxccl`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
