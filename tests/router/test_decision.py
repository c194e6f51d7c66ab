"""The decision core (engine/router/decision.py) that `Router.decide` and the simulator's fleet share:
per-policy share windows, the turn, engines passed over."""

from __future__ import annotations

import math

from kvstore.engine.router.decision import Decider
from kvstore.engine.router.scoring import Choice, Costs, Request


def _sent(d: Decider, engine: str, policy: str = "ttft", compute: int = 10) -> Choice:
    choice = Choice(engine, policy, 0.0, 0, 0, compute)
    d.add_load(choice)
    return choice


def test_each_policy_counts_its_own_share_of_the_recent_work() -> None:
    """An engine's share: its requests of the policy in flight plus its completions among the policy's
    last share_window x engines (an error is no completion)."""
    d = Decider(["a", "b"], share_window=1)  # the last 2 completions per policy
    for _ in range(3):
        _sent(d, "a")
        d.finished("a", "ttft", True)
    _sent(d, "b", "prefix")  # in flight, for prefix only
    _sent(d, "b")
    d.computed("b", 10)  # its first token
    d.finished("b", "ttft", False)
    assert d._of("ttft")[1] == {"a": 2, "b": 0} and d._of("prefix")[1] == {"a": 0, "b": 1}
    assert (d.loads["a"].in_flight, d.loads["b"].in_flight, d.loads["b"].waiting_tokens) == (0, 1, 10)
    choice = d.decide(Request(1000), Costs(), policy="ttft")  # b queues 0.02 s; a's share costs 0.125 s
    assert choice.engine == "b", "a is hot"
    assert d.turn == 1


def test_the_turn_drives_round_robin_and_local_tokens_drive_prefix() -> None:
    d = Decider(["a", "b", "c"], policy="round_robin")
    assert [d.decide(Request(100), Costs()).engine for _ in range(4)] == ["a", "b", "c", "a"]
    held = {"c": 64}
    assert d.decide(Request(100), Costs(), lambda e: held.get(e, 0), "prefix").engine == "c"


def test_engines_passed_over_are_left_out_until_none_is_left() -> None:
    d = Decider(["a", "b"], policy="round_robin")
    assert d.mark_down("a", "refused", until=5.0, now=0.0)  # it was up
    assert not d.mark_down("a", "refused", until=4.0, now=1.0)  # down longer already
    assert {d.decide(Request(10), Costs(), now=1.0).engine for _ in range(4)} == {"b"}
    assert d.decide(Request(10), Costs(), now=5.0, among=["a"]).engine == "a"  # its pass-over ran out
    assert d.mark_down("b", "no probe answer", until=math.inf, now=6.0)
    assert not d.mark_up("a")  # a timed pass-over runs out by itself
    d.mark_down("a", "no probe answer", until=math.inf, now=6.0)
    both = {d.decide(Request(10), Costs(), now=7.0).engine for _ in range(4)}
    assert both == {"a", "b"}, "every engine down: try them all"
    assert d.mark_up("b") and d.loads["b"].down_why == ""
    assert {d.decide(Request(10), Costs(), now=7.0).engine for _ in range(4)} == {"b"}
