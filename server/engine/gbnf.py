"""GBNF (llama.cpp's grammar format) as llguidance's Lark, in time linear in the grammar.

llguidance reads GBNF in Python (``llguidance.gbnf_to_lark``): a parser, then a pass that makes
each rule built only of text (no rule that is not itself such) a terminal, the same text as one
lexeme. That pass repeats over all rules until nothing changes, which for a chain of rules is
once per rule: 1,000 chained rules of 40 literals took 7 s here, holding the GIL. This module
keeps llguidance's parser and output and does that pass once, counting for each rule how many
of the rules it refers to are not known to be terminals yet.

A text that already reads as Lark (``%llguidance`` or a ``start:`` rule) is left as it is, as
llguidance's own conversion does.
"""

from __future__ import annotations

import re

from llguidance import gbnf_to_lark as _gbnf

_CAMEL = re.compile(r"([a-z])([A-Z])")


class GbnfError(ValueError):
    """The text is not a GBNF grammar llguidance can take; the message says why."""


def to_lark(text: str) -> str:
    """``text`` (GBNF, or Lark as it is) as a Lark grammar for llguidance. Raises ``GbnfError``."""
    if _gbnf.is_lark_syntax(text):
        return text
    try:
        rules = _gbnf.GrammarParser().parse(text)
    except _gbnf.GbnfToLarkError as exc:
        raise GbnfError(f"cannot read the GBNF grammar: {exc}") from None
    if "root" not in rules:
        raise GbnfError("the GBNF grammar has no 'root' rule")
    refers = _link(rules)
    _mark_terminals(rules, refers)
    _rename(rules)
    out = ["%llguidance {}\n\n"]
    multiline = True
    for rule in sorted(rules.values(), key=lambda r: r.order):
        rendered = str(rule)
        if not multiline and "\n" in rendered:
            out.append("\n")
        multiline = "\n" in rendered
        out.append(rendered + ("\n\n" if multiline else "\n"))
    return "".join(out)


def _link(rules: dict[str, _gbnf.RuleNode]) -> dict[str, set[str]]:
    """Simplify each rule, point each reference at its rule; each rule's references, by name."""
    refers: dict[str, set[str]] = {}
    for order, rule in enumerate(rules.values()):
        rule.order = order
        rule.alternatives = rule.alternatives.simplify()
        names: set[str] = set()
        pending: list[_gbnf.ASTNode] = [rule.alternatives]
        while pending:
            node = pending.pop()
            if isinstance(node, _gbnf.RuleRefNode):
                target = rules.get(node.name)
                if target is None:
                    raise GbnfError(f"the GBNF grammar refers to a rule '{node.name}' it does not define")
                node.target = target
                names.add(node.name)
            pending.extend(node.children())
        refers[rule.name] = names
    return refers


def _mark_terminals(rules: dict[str, _gbnf.RuleNode], refers: dict[str, set[str]]) -> None:
    """Mark the rules that refer only to terminals (root never is one): a rule becomes one when
    the last rule it waits for does."""
    waiting = {name: len(names) for name, names in refers.items()}
    users: dict[str, list[str]] = {name: [] for name in rules}
    for name, names in refers.items():
        for target in names:
            users[target].append(name)
    ready = [name for name, count in waiting.items() if count == 0 and name != "root"]
    while ready:
        name = ready.pop()
        rules[name].rule_is_terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root":
                ready.append(user)


def _rename(rules: dict[str, _gbnf.RuleNode]) -> None:
    """Lark's names: root is start, terminals in capitals, other rules in snake case."""
    names = set(rules)
    for rule in rules.values():
        if rule.name == "root":
            name = "start"
        else:
            name = _CAMEL.sub(r"\1_\2", rule.name.replace("-", "_"))
            name = name.upper() if rule.rule_is_terminal else name.lower()
        if name == rule.name:
            continue
        if name in names:
            raise GbnfError(f"two GBNF rules have one name once written for Lark ({rule.name!r} and {name!r})")
        names.discard(rule.name)
        names.add(name)
        rule.name = name
