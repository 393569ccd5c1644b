"""What a chat template's syntax tree says about how it reads messages. Pure.

Owns ``loops_over_content``: whether a jinja chat template iterates over a message's
``content``: ``{% for part in message.content %}`` (``message`` the target of a loop over
``messages`` or a variable assigned from it), a loop over a macro parameter that a message's
content is passed to, or a loop over a variable named ``content`` outside macros. vLLM decides
by the same question whether a template gets content as a string or as a list of parts
(``renderers/hf.py`` ``_detect_content_format``, vLLM 0.32.0); this is our own reading of the
tree, not a copy.
"""

from __future__ import annotations

from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """Parses HF's ``{% generation %}...{% endgeneration %}`` (assistant masks) as a block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _root(node: nodes.Node) -> nodes.Node:
    """The value under filters, tests and slices: ``messages[1:] | reverse`` -> ``messages``."""
    while True:
        sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        wrapped = isinstance(node, (nodes.Filter, nodes.Test)) or sliced
        inner: nodes.Node | None = node.node if wrapped else None  # type: ignore[attr-defined]
        if inner is None:
            return node
        node = inner


def _name(node: nodes.Node) -> str | None:
    node = _root(node)
    return node.name if isinstance(node, nodes.Name) else None


def _attr_of(node: nodes.Node, names: set[str], key: str) -> bool:
    """``node`` is ``X.key`` or ``X['key']`` for X in ``names`` (under filters and slices)."""
    node = _root(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _name(node.node) in names
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value == key and _name(node.node) in names
    return False


def _aliases(tree: nodes.Template, start: set[str]) -> set[str]:
    """``start`` and every variable assigned from one of them (transitively)."""
    names = set(start)
    changed = True
    while changed:
        changed = False
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if not isinstance(target, nodes.Name) or target.name in names:
                continue
            if _name(assign.node) in names:
                names.add(target.name)
                changed = True
    return names


def loops_over_content(template: str) -> bool:
    """True when the template loops over a message's content. Raises jinja2's
    TemplateSyntaxError for a template that does not parse."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    tree = env.parse(template)
    message_lists = _aliases(tree, {"messages"})
    messages: set[str] = set()
    for loop in tree.find_all(nodes.For):
        if _name(loop.iter) in message_lists and isinstance(loop.target, nodes.Name):
            messages.add(loop.target.name)
    macro_params: set[str] = set()
    for macro in tree.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and _attr_of(arg, messages, "content"):
                    macro_params.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and _attr_of(kw.value, messages, "content"):
                    macro_params.add(kw.key)
    in_macros = {id(loop) for m in tree.find_all(nodes.Macro) for loop in m.find_all(nodes.For)}
    for loop in tree.find_all(nodes.For):
        if _attr_of(loop.iter, messages, "content"):
            return True
        name = _name(loop.iter)
        if name is None:
            continue
        if id(loop) in in_macros:
            if name in macro_params:
                return True
        elif name == "content":
            return True
    return False


def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context (jinja's undeclared variables), the
    keyword arguments vLLM lets through to it. Empty for a template that does not parse."""
    return _template_variables(template)


@lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return frozenset()
