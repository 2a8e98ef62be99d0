"""A griffe extension for the API reference: engine's docstrings, written for both ``help()``
and the docs site, read as Markdown there.

* Sphinx roles (``:class:`~engine.events.Save```, ``:func:`replay```, ``:meth:``, ``:mod:``,
  ``:data:``, ``:attr:``) become links to the entry they name on the API pages (mkdocs-autorefs'
  optional ``<autoref>``), the text the name as written (the last dotted part under ``~``). A
  name is looked up as written, then relative to the docstring's module and class, then under
  ``engine``, then by its last part among the documented entries; one that names no documented
  entry (a private helper, torch's) stays a code span, so no link is ever broken.
* Module docstrings are rewritten too (the package's own, on the ``engine`` page).
* An ``Example:`` section is read as griffe's ``Examples:`` (doctest blocks rendered as code);
  the docstrings keep the singular for ``help()``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc):`(~?)([^`]+)`")
_API_PAGES = Path(__file__).resolve().parent.parent / "api"


def markdown(text: str, link: Callable[[str], str | None] = lambda name: None) -> str:
    """``text`` with the roles as links (``link(name)``: the entry's identifier, or ``None``
    for a code span) and ``Example:`` as ``Examples:``.

    >>> markdown("Returns a :class:`~engine.events.Save` (see :func:`engine.replay`).")
    'Returns a `Save` (see `engine.replay`).'
    >>> markdown("a :class:`~engine.events.Save`", lambda name: "engine.Save")
    'a <autoref identifier="engine.Save" optional><code>Save</code></autoref>'
    >>> markdown("Example:\\n    >>> 1 + 1\\n    2")
    'Examples:\\n    >>> 1 + 1\\n    2'
    """

    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2)
        shown = f"`{target.rsplit('.', 1)[-1] if short else target}`"
        identifier = link(target)
        if not identifier:
            return shown
        # optional: an entry the pages do not render after all (an attrs field, a function a
        # submodule of the same name shadows) stays a code span instead of a broken link
        code = shown.strip("`")
        return f'<autoref identifier="{identifier}" optional><code>{code}</code></autoref>'


    text = _ROLE.sub(role, text)
    return re.sub(r"^(\s*)Example:\s*$", r"\1Examples:", text, flags=re.M)


def _documented_modules() -> list[str]:
    """The modules the API pages render (``::: engine.optim`` lines)."""
    found = []
    for page in sorted(_API_PAGES.glob("*.md")):
        for line in page.read_text().splitlines():
            if line.startswith("::: "):
                found.append(line[4:].strip())
    return found


def _walk(obj: Any) -> Iterator[Any]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxRoles(griffe.Extension):
    """Rewrite each docstring once the package is loaded (see the module's docstring)."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        if pkg.path != "engine":
            return
        rendered: set[str] = set()  # the identifiers the API pages give an entry
        by_target: dict[str, str] = {}  # an object's own path -> its documented identifier
        by_name: dict[str, set[str]] = {}
        for module_path in _documented_modules():
            try:
                module = pkg.modules_collection[module_path]
            except KeyError:
                continue
            rendered.add(module_path)
            by_target.setdefault(module_path, module_path)
            for name in module.exports or []:
                name = str(name)
                if name.startswith("_") or name not in module.members:
                    continue
                member = module.members[name]
                identifier = f"{module_path}.{name}"
                rendered.add(identifier)
                target = member.target_path if member.is_alias else member.path
                by_target.setdefault(target, identifier)
                by_name.setdefault(name, set()).add(identifier)
                try:
                    resolved = member.final_target if member.is_alias else member
                except Exception:  # an alias to something outside the package (torch's)
                    continue
                if resolved.is_class:
                    for attr in resolved.members:
                        if attr.startswith("_"):
                            continue
                        rendered.add(f"{identifier}.{attr}")
                        by_target.setdefault(f"{target}.{attr}", f"{identifier}.{attr}")
                        by_name.setdefault(attr, set()).add(f"{identifier}.{attr}")

        def resolver(obj: Any) -> Callable[[str], str | None]:
            scopes = [obj.path] if obj.is_class else []
            if obj.parent is not None and obj.parent.is_class:
                scopes.append(obj.parent.path)
            module = obj if obj.is_module else obj.module
            scopes += [module.path, "engine"]

            def link(target: str) -> str | None:
                candidates = [target] + [f"{scope}.{target}" for scope in scopes]
                for candidate in candidates:
                    if candidate in rendered:
                        return candidate
                    if candidate in by_target:
                        return by_target[candidate]
                named = by_name.get(target.rsplit(".", 1)[-1], set())
                return next(iter(named)) if len(named) == 1 else None

            return link

        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = markdown(obj.docstring.value, resolver(obj))
