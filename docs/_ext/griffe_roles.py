"""A griffe extension for the API reference: engine's docstrings, written for both ``help()``
and the docs site, read as Markdown there.

* Sphinx roles (``:class:`~engine.events.Save```, ``:func:`replay```, ``:meth:``, ``:mod:``,
  ``:data:``, ``:attr:``) become code spans of the name as written (the last dotted part under
  ``~``): the site names things, it does not link every mention.
* An ``Example:`` section is read as griffe's ``Examples:`` (doctest blocks rendered as code);
  the docstrings keep the singular for ``help()``.
* A doctest's ``...`` continuation lines stay code: nothing else changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def markdown(text: str) -> str:
    """``text`` with the roles as code spans and ``Example:`` as ``Examples:``.

    >>> markdown("Returns a :class:`~engine.events.Save` (see :func:`engine.replay`).")
    'Returns a `Save` (see `engine.replay`).'
    >>> markdown("Example:\\n    >>> 1 + 1\\n    2")
    'Examples:\\n    >>> 1 + 1\\n    2'
    """
    text = _ROLE.sub(_role, text)
    return re.sub(r"^(\s*)Example:\s*$", r"\1Examples:", text, flags=re.M)


class SphinxRoles(griffe.Extension):
    """Rewrite each docstring once the object tree is built (see the module's docstring)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
