"""Whether a grammar accepts any finite text at all, checked before it is compiled.

A JSON schema `{"$ref": "#"}`, a `$ref` cycle `a -> b -> a` with no base case, or the EBNF
`root ::= root` compile fine in xgrammar, but nothing can ever satisfy them: the matcher allows no
token (or only ever more tokens), and the request would fail mid-generation. The test is the
textbook one: a rule is *productive* when some alternative of its body is made only of terminals
and productive rules; the grammar's language is empty exactly when its root rule is not productive.

The grammar is read from xgrammar's own serialisation (`Grammar.serialize_json`: its expression
table, in the `GrammarExprType` order of xgrammar's grammar_impl.h). Anything this module does not
recognise counts as productive, and a format it does not know skips the check, so it can only
ever accept too much, never refuse a grammar xgrammar could satisfy.
"""

from __future__ import annotations

import json
import logging
from collections import deque

import xgrammar as xgr

logger = logging.getLogger(__name__)

KNOWN_FORMATS = ("v16",)  # xgrammar's serialisation versions whose expression table this reads
# GrammarExprType values (xgrammar cpp/grammar_impl.h); every other type is a terminal here
_RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 4, 5, 6, 8


def unproductive_root(grammar: xgr.Grammar) -> str | None:
    """The name of the root rule when no finite text derives from it, else None."""
    spec = json.loads(grammar.serialize_json())
    if spec.get("__VERSION__") not in KNOWN_FORMATS:
        logger.debug(
            "xgrammar serialisation %s unknown: grammar emptiness not checked", spec.get("__VERSION__")
        )
        return None
    rules, data, indptr = spec["rules"], spec["grammar_expr_data"], spec["grammar_expr_indptr"]
    num_exprs = len(indptr)  # expression i is data[indptr[i]:indptr[i + 1]], the last one to the end
    ends = [*indptr[1:], len(data)]
    # nodes: expressions 0..num_exprs-1, then rules num_exprs..num_exprs+len(rules)-1
    parents: list[list[int]] = [[] for _ in range(num_exprs + len(rules))]
    missing = [0] * (num_exprs + len(rules))  # children still unproductive before the node is
    ready: deque[int] = deque()
    for i in range(num_exprs):
        start, end = indptr[i], ends[i]
        kind, payload = data[start], data[start + 2 : end]
        if data[start + 1] != end - start - 2:
            logger.debug("xgrammar expression %d has an unexpected layout: grammar emptiness not checked", i)
            return None
        if kind == _RULE_REF:
            children = [num_exprs + payload[0]]
        elif kind in (_SEQUENCE, _CHOICES):
            children = list(payload)
        elif kind == _REPEAT and payload[1] > 0:  # [rule, min, max]: min 0 matches the empty text
            children = [num_exprs + payload[0]]
        else:  # bytes, character classes, the empty string, tokens, regexes, tag dispatch
            children = []
        for child in children:
            parents[child].append(i)
        missing[i] = 1 if kind == _CHOICES and children else len(children)
        if missing[i] == 0:
            ready.append(i)
    for r, rule in enumerate(rules):
        parents[rule[1]].append(num_exprs + r)  # rule = [name, body_expr_id, ...]
        missing[num_exprs + r] = 1
    productive = [False] * len(missing)
    while ready:
        node = ready.popleft()
        if productive[node]:
            continue
        productive[node] = True
        for parent in parents[node]:
            missing[parent] -= 1
            if missing[parent] == 0:
                ready.append(parent)
    root = spec["root_rule_id"]
    return None if productive[num_exprs + root] else rules[root][0]
