"""Help texts for the command line: docstrings turned into plain text.

Docstrings use reST markup for the API reference (double backquotes,
roles such as ``:class:`` and ``:mod:``); a terminal shows the plain words.

Example:
    >>> plain("Runs ``jaxccl demo`` with :class:`~jaxccl.control.Controller`.")
    'Runs jaxccl demo with Controller.'
    >>> plain(":mod:`jaxccl.sim.experiments` and :func:`jaxccl.synth.allgather`")
    'jaxccl.sim.experiments and jaxccl.synth.allgather'
"""

from __future__ import annotations

import re

__all__ = ["plain", "summary"]

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^*\s][^*]*?)\*{1,2}(?![\w*])")


def _role(m: re.Match[str]) -> str:
    target = m.group(2)
    return target.rsplit(".", 1)[-1] if m.group(1) else target


def plain(text: str) -> str:
    """``text`` without reST roles, literals and emphasis markers.

    ``:role:`~a.b.C``` becomes ``C`` (the tilde's short form), ``:role:`a.b```
    becomes ``a.b``, double backquotes and ``*emphasis*`` lose their markers.

    >>> plain("*solve* and **total**")
    'solve and total'
    """
    text = _ROLE.sub(_role, text)
    text = _LITERAL.sub(r"\1", text)
    return _EMPHASIS.sub(r"\1", text)


def summary(doc: str | None) -> str:
    """The first line of a docstring, in plain text (empty for ``None``).

    >>> summary('''``jaxccl sim``: the simulator.
    ...
    ... More.''')
    'jaxccl sim: the simulator.'
    """
    return plain((doc or "").strip().splitlines()[0]) if (doc or "").strip() else ""
