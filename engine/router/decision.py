"""The router's decision core: what `kvstore-engine router` (router.Router) and the fleet simulator
(fleet_sim/sim.py's Fleet) both keep to choose an engine, and the one place either chooses.

    decider = Decider(["http://e0", "http://e1"], policy="ttft", share_window=64)
    choice = decider.decide(Request(prompt_tokens, store_tokens), costs, local=tokens_held_by, now=now)
    decider.add_load(choice)                                  # sent
    decider.computed(choice.engine, choice.compute_tokens)    # its first token
    decider.finished(choice.engine, choice.policy, True)      # over (True: answered, below 400)

It holds each engine's load (requests in flight, prompt tokens waiting to be computed, until when it
is passed over), per policy each engine's share of the recent work (its requests in flight plus those
it completed among the policy's last `share_window` x engines completions: a request that never
completes keeps counting against its engine) and the turn (the count of decisions: round robin's
position and the draw that breaks ties); `decide` scores the engines up with scoring.choose. No I/O
and no clock of its own: the caller gives `now` (the router its monotonic clock, the simulator its
simulated one), what each engine's cache holds of the prompt, and the costs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from kvstore.engine.router.scoring import Choice, Costs, EngineState, Request, choose


@dataclass
class EngineLoad:
    url: str  # the engine's name (the router's: its URL without credentials)
    in_flight: int = 0  # requests the router forwarded to it and not finished
    waiting_tokens: int = 0  # of those, prompt tokens it is to compute before their first token
    down_until: float = 0.0  # the caller's clock: not chosen till then (inf: till its health probe answers)
    down_why: str = ""  # what put it down last


class Decider:
    def __init__(
        self,
        engines: Iterable[str],
        policy: str = "ttft",
        share_window: int = 64,
        max_share: float | None = None,
    ) -> None:
        if share_window < 0:
            raise ValueError("share_window must be at least 0")
        self.policy = policy  # the default: a request may name its own
        self.max_share = max_share  # ttft: a share cap on top of the hot-spot cost (None: none)
        self.loads = {u: EngineLoad(u) for u in engines}
        self.window = share_window * len(self.loads)  # completions each policy looks back over
        self.turn = 0
        # per policy: the engines of its recent completions (oldest first), and each engine's count of
        # those plus its requests of the policy in flight
        self._recent: dict[str, tuple[deque[str], dict[str, int]]] = {}

    def _of(self, policy: str) -> tuple[deque[str], dict[str, int]]:
        got = self._recent.get(policy)
        if got is None:
            got = self._recent[policy] = (deque(), dict.fromkeys(self.loads, 0))
        return got

    def decide(
        self,
        request: Request,
        costs: Costs,
        local: Callable[[str], int] | None = None,
        policy: str | None = None,
        now: float = 0.0,
        among: Collection[str] | None = None,
    ) -> Choice:
        """The engine for `request` (of `among`, every engine by default; those passed over at `now`
        left out, unless that leaves none: then all of them), by `policy` (the default one if None).
        `local(engine)`: the leading prompt tokens its cache holds (None: none anywhere)."""
        policy = policy or self.policy
        recent = self._of(policy)[1]
        engines = [
            EngineState(url, local(url) if local else 0, load.in_flight, load.waiting_tokens, recent[url])
            for url, load in self.loads.items()
            if load.down_until <= now and (among is None or url in among)
        ] or [
            EngineState(url, recent=recent.get(url, 0)) for url in among or self.loads
        ]  # all down: try them all
        choice = choose(policy, engines, request, costs, self.max_share, self.turn)
        self.turn += 1
        return choice

    def add_load(self, choice: Choice) -> int:
        """`choice`'s request is sent: one more in flight on its engine (in its policy's share too), and
        its tokens to compute waiting (not those it loads from the store: a load runs beside the
        engine's steps, queueing no one). Returns the waiting tokens added, for `computed`."""
        load = self.loads[choice.engine]
        load.in_flight += 1
        load.waiting_tokens += choice.compute_tokens
        self._of(choice.policy)[1][choice.engine] += 1
        return choice.compute_tokens

    def computed(self, engine: str, tokens: int) -> None:
        """`tokens` of what `add_load` counted waiting on `engine` are no longer waiting (the request's
        first token came, or it is over)."""
        self.loads[engine].waiting_tokens -= tokens

    def finished(self, engine: str, policy: str, completed: bool) -> None:
        """A request of `policy` on `engine` is over: it leaves the engine's load; `completed` (an answer,
        not an error, a failover or a hang, which did no work worth counting) joins the policy's recent
        completions, where it counts until `share_window` x engines newer ones push it out."""
        self.loads[engine].in_flight -= 1
        done, counts = self._of(policy)
        if not completed:
            counts[engine] -= 1
            return
        done.append(engine)  # its count stays: no longer in flight, one of the recent completions
        if len(done) > self.window:
            counts[done.popleft()] -= 1

    def mark_down(self, engine: str, why: str, until: float, now: float) -> bool:
        """Pass `engine` over till `until` (inf: till `mark_up`), unless it is down longer already;
        whether it was up at `now`, and is down now."""
        load = self.loads[engine]
        if until <= load.down_until:
            return False
        was_up = load.down_until <= now
        load.down_until, load.down_why = until, why
        return was_up

    def mark_up(self, engine: str) -> bool:
        """Its probe answered: chosen again (a timed pass-over still runs out first); whether it was
        down till then."""
        load = self.loads[engine]
        if not math.isinf(load.down_until):
            return False
        load.down_until, load.down_why = 0.0, ""
        return True
