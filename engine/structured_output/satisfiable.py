"""Whether a grammar accepts any finite text at all, checked before it is compiled.

A JSON schema `{"$ref": "#"}`, a `$ref` cycle `a -> b -> a` with no base case, or the EBNF
`root ::= root` compile fine in xgrammar, but nothing can ever satisfy them: the matcher allows no
token (or only ever more tokens), and the request would fail mid-generation. The test is the
textbook one: a rule is *productive* when some alternative of its body is made only of terminals
and productive rules. The grammar's language is empty exactly when its root rule is not productive;
a reachable rule that is not makes an answer that enters it unable to end, so it is refused too.

The grammar is read from xgrammar's own serialisation (`Grammar.serialize_json`: its expression
table, in the `GrammarExprType` order of xgrammar's grammar_impl.h). Anything this module does not
recognise counts as productive, and a format it does not know skips the check: it may let a bad
grammar through, never refuse one whose every reachable rule can complete.
"""

from __future__ import annotations

import json
import logging
from collections import deque

import xgrammar as xgr

logger = logging.getLogger(__name__)

KNOWN_FORMATS = ("v16",)  # xgrammar's serialisation versions whose expression table this reads
# GrammarExprType values (xgrammar cpp/grammar_impl.h); every other type is a terminal here
_CHAR_CLASS, _RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 1, 4, 5, 6, 8
MAX_CODEPOINT = 0x10FFFF


def _matches_nothing(payload: list[int]) -> bool:
    """Whether a character class `[negated, lo, hi, lo, hi, ...]` matches no character at all (`[^\\d\\D]`,
    `[^\\x00-\\U0010FFFF]`): its ranges cover every code point when negated, none when not."""
    negated, bounds = payload[0], payload[1:]
    ranges = sorted((lo, hi) for lo, hi in zip(bounds[::2], bounds[1::2], strict=True) if lo <= hi)
    if not negated:
        return not ranges
    covered = -1  # every code point up to here is in some range
    for lo, hi in ranges:
        if lo > covered + 1:
            return False
        covered = max(covered, hi)
    return covered >= MAX_CODEPOINT


def unproductive_rule(grammar: xgr.Grammar) -> str | None:
    """The name of a rule the grammar can reach that no finite text derives from, or whose body has
    such a part (the root first), else None. Past such a part the matcher allows either nothing or
    never an end."""
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
    num_nodes = num_exprs + len(rules)
    uses: list[list[int]] = [[] for _ in range(num_nodes)]  # what each node refers to
    parents: list[list[int]] = [[] for _ in range(num_nodes)]  # who needs each node to be productive
    missing = [0] * num_nodes  # children still unproductive before the node is
    ready: deque[int] = deque()
    for i in range(num_exprs):
        start, end = indptr[i], ends[i]
        kind, payload = data[start], data[start + 2 : end]
        if data[start + 1] != end - start - 2:
            logger.debug("xgrammar expression %d has an unexpected layout: grammar emptiness not checked", i)
            return None
        needs: list[int] = []
        if kind == _RULE_REF:
            uses[i] = needs = [num_exprs + payload[0]]
        elif kind in (_SEQUENCE, _CHOICES):
            uses[i] = needs = list(payload)
        elif kind == _REPEAT:  # [rule, min, max]: min 0 matches the empty text
            uses[i] = [num_exprs + payload[0]]
            needs = uses[i] if payload[1] > 0 else []
        # else bytes, character classes, the empty string, tokens, regexes, tag dispatch: terminals
        for child in needs:
            parents[child].append(i)
        missing[i] = 1 if kind == _CHOICES and needs else len(needs)
        if kind == _CHAR_CLASS and _matches_nothing(list(payload)):
            missing[i] = 1  # a terminal no character matches: never productive
        if missing[i] == 0:
            ready.append(i)
    for r, rule in enumerate(rules):  # rule = [name, body_expr_id, ...]
        uses[num_exprs + r] = [rule[1]]
        parents[rule[1]].append(num_exprs + r)
        missing[num_exprs + r] = 1
    productive = [False] * num_nodes
    while ready:
        node = ready.popleft()
        if productive[node]:
            continue
        productive[node] = True
        for parent in parents[node]:
            missing[parent] -= 1
            if missing[parent] == 0:
                ready.append(parent)
    root = num_exprs + spec["root_rule_id"]
    # breadth first: the root, then the rules nearest to it; then, where every reachable rule is
    # productive, an unproductive part of one (`x|y[^\\d\\D]`): an answer that takes it never ends
    for rules_only in (True, False):
        seen, queue = {root}, deque([(root, rules[spec["root_rule_id"]][0])])
        while queue:
            node, rule = queue.popleft()
            if node >= num_exprs:
                rule = rules[node - num_exprs][0]
            if not productive[node] and (node >= num_exprs or not rules_only):
                return rule
            for used in uses[node]:
                if used not in seen:
                    seen.add(used)
                    queue.append((used, rule))
    return None
