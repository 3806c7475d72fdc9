"""Parsing XML from untrusted files: the one set of guards every XML reader of jaxccl applies.

MSCCL's schedule XML (:mod:`jaxccl.schedule.msccl_xml`) and NCCL's topology XML
(:mod:`jaxccl.topology.nccl_xml`) come from files a user did not write. :func:`parse` refuses what
Python's expat-based parser would otherwise accept at a cost: DOCTYPE and entity declarations
(entity expansion), elements nested deeper than :data:`jaxccl.util.strict.MAX_NESTING` (refused while
parsing: expat needs no recursion, but CPython frees and walks the tree it builds recursively, a crash
far from the file), text that is not UTF-8 and, where the reader sets one, text over a size limit. Each
refusal and each parse error raises the reader's own error class with a message that names the format
and, for a parse error, the line and column.

>>> from jaxccl.errors import ScheduleError
>>> parse("<a><b x='1'/></a>", what="test XML", error=ScheduleError).find("b").get("x")
'1'
>>> parse("<a><b></a>", what="test XML", error=ScheduleError)
Traceback (most recent call last):
...
jaxccl.errors.ScheduleError: malformed test XML: mismatched tag at line 1, column 9
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from jaxccl.errors import JaxcclError
from jaxccl.util import strict

__all__ = ["parse"]


class _DepthLimitedBuilder:
    """An ``ET.TreeBuilder`` that refuses elements nested deeper than ``strict.MAX_NESTING`` while parsing."""

    def __init__(self, what: str, error: type[JaxcclError], nesting_note: str, comments: bool) -> None:
        builder = ET.TreeBuilder(insert_comments=comments)
        self._start, self._end = builder.start, builder.end
        self.data, self.comment, self.close = builder.data, builder.comment, builder.close
        self._what, self._error, self._note = what, error, nesting_note
        self._depth = 0

    def start(self, tag: str, attrs: dict[str, str]) -> ET.Element:
        self._depth += 1
        if self._depth > strict.MAX_NESTING:
            raise self._error(
                f"{self._what}: elements nested too deeply (<{tag}> is more than {strict.MAX_NESTING} levels deep"
                f"{'; ' + self._note if self._note else ''})"
            )
        return self._start(tag, attrs)

    def end(self, tag: str) -> ET.Element:
        self._depth -= 1
        return self._end(tag)


def parse(
    text: str | bytes,
    *,
    what: str,
    error: type[JaxcclError],
    max_chars: int | None = None,
    nesting_note: str = "",
    comments: bool = False,
) -> ET.Element:
    """The root element of ``text``, or ``error`` naming why not.

    Args:
        text: the document (``bytes`` are decoded as UTF-8).
        what: the format's name for messages (``"MSCCL XML"``).
        error: the reader's error class (a :class:`jaxccl.errors.JaxcclError` subclass).
        max_chars: refuse a longer document (bytes before decoding, characters after).
        nesting_note: said after a too-deep element (e.g. how deep the format nests).
        comments: keep comments in the tree (``ET.Comment`` elements).
    """
    if isinstance(text, bytes):
        if max_chars is not None and len(text) > max_chars:
            raise error(f"{what} is {len(text)} bytes; at most {max_chars} are read")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8: {e}") from None
    if not isinstance(text, str):
        raise error(f"{what} must be a string, got {type(text).__name__}")
    if max_chars is not None and len(text) > max_chars:
        raise error(f"{what} is {len(text)} characters; at most {max_chars} are read")
    if re.search(r"<!(DOCTYPE|ENTITY)", text):
        raise error(f"{what} must not contain a DOCTYPE or entity declarations")
    parser = ET.XMLParser(target=_DepthLimitedBuilder(what, error, nesting_note, comments))
    try:
        parser.feed(text)
        return parser.close()
    except ET.ParseError as e:
        line, col = getattr(e, "position", (0, 0))
        raise error(f"malformed {what}: {str(e).split(':')[0]} at line {line}, column {col + 1}") from None
