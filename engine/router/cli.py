"""The `kvstore-engine router` command line."""

from __future__ import annotations

import argparse

from aiohttp import web
from kvstore.engine.gateway import add_front_door_args, front_door
from kvstore.engine.router import ROUTE_TOKENS
from kvstore.engine.router.scoring import POLICIES


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV-aware routing")
    g.add_argument("--engine", action="append", default=[], metavar="URL", help="an engine (repeatable)")
    g.add_argument("--engine-events", action="append", default=[], metavar="ENDPOINT",
                   help="that engine's KV events PUB endpoint, e.g. tcp://host:5557 (one per --engine, in order)")  # fmt: skip
    g.add_argument("--engine-replay", action="append", default=[], metavar="ENDPOINT",
                   help="that engine's replay endpoint, e.g. tcp://host:5558 (one per --engine)")  # fmt: skip
    g.add_argument("--store-events", action="append", default=[], metavar="ENDPOINT",
                   help="a kvstore-server's KV events endpoint (repeatable)")  # fmt: skip
    g.add_argument("--store-replay", action="append", default=[], metavar="ENDPOINT",
                   help="that kvstore-server's replay endpoint (one per --store-events)")  # fmt: skip
    g.add_argument("--policy", choices=POLICIES, default="ttft", help="default ttft")
    g.add_argument("--max-share", type=float, default=None,
                   help="ttft: also cap an engine at this times its fair share of recent requests (default: no "
                        "cap; a hot engine costs the queueing it adds)")  # fmt: skip
    g.add_argument("--model", default="smollm2",
                   help="the engines' model directory (tokenizer, chunk keys); requests may also name it as "
                        "their model: the router sends the engine's served name instead")  # fmt: skip
    g.add_argument("--chunk-size", type=int, default=256, help="the engines' KV connector chunk_size (256)")
    g.add_argument("--kv-namespace", default="", help="the engines' KV connector namespace")
    g.add_argument("--dtype", default="auto", help="the engines' --dtype (auto)")
    g.add_argument("--kv-cache-dtype", default="auto", help="the engines' --kv-cache-dtype (auto)")
    g.add_argument("--calibrate-interval", type=float, default=2.0,
                   help="seconds between reads of the engines' /metrics for the costs (0: never)")  # fmt: skip
    g.add_argument("--events-topic", default="", help="the publishers' topic")
    g.add_argument("--engine-events-token-file", metavar="FILE",
                   help="the engines' KV events token (their token_file): CURVE, only those publishers are read")  # fmt: skip
    g.add_argument("--store-events-token-file", metavar="FILE",
                   help="the kvstore-servers' KV events token (their --auth-token, or token_file): CURVE")  # fmt: skip
    g.add_argument("--events-max-frame-mib", type=float, default=4.0,
                   help="a publisher sending a larger KV events frame is disconnected (4)")  # fmt: skip
    g.add_argument("--index-max-blocks", type=int, default=262_144,
                   help="blocks indexed per engine; the oldest go first (262144)")  # fmt: skip
    g.add_argument("--index-max-store-keys", type=int, default=1_048_576,
                   help="chunk keys indexed per kvstore-server; the oldest go first (1048576)")  # fmt: skip
    g.add_argument("--events-check-interval", type=float, default=5.0,
                   help="seconds between checks of each publisher's replay endpoint (5; 0: never)")  # fmt: skip
    g.add_argument("--first-byte-timeout", type=float, default=30.0,
                   help="seconds an engine has to begin a streamed answer (its first token); then the request "
                        "goes to the next engine (504 when none is left) and the engine is passed over a while (30)")  # fmt: skip
    g.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health probes (GET /health) of each engine: one that does not answer "
                        "within --health-timeout is passed over till it does (2; 0: never)")  # fmt: skip
    g.add_argument("--route-tokens", type=int, default=ROUTE_TOKENS,
                   help=f"a prompt's leading tokens routed on; no more of it is tokenized ({ROUTE_TOKENS})")  # fmt: skip
    g.add_argument("--prep-workers", type=int, default=2,
                   help="threads parsing and tokenizing request bodies, off the event loop (2)")  # fmt: skip
    g.add_argument("--prep-queue", type=int, default=64,
                   help="request bodies waiting for them; beyond, a 503 (64)")  # fmt: skip
    g.add_argument("--max-body-bytes-in-flight", type=int, default=256 * 2**20,
                   help="request body bytes being read or routed at once (each counts twice); beyond, a 503")  # fmt: skip
    pd = p.add_argument_group("disaggregated prefill/decode (instead of --engine)")
    pd.add_argument("--prefill", action="append", help="prefill engine URL (repeatable)")
    pd.add_argument("--decode", action="append", help="decode engine URL (repeatable)")
    p.add_argument("--health-timeout", type=float, default=2.0,
                   help="seconds an engine has to answer its health probe (2)")  # fmt: skip
    add_front_door_args(p, 8200)


def build(ns: argparse.Namespace) -> web.Application:
    from kvstore.engine.errors import InvalidRequest  # noqa: PLC0415

    if ns.prefill or ns.decode:
        from kvstore.engine.proxy import ProxyConfig, build_app  # noqa: PLC0415

        if ns.engine:
            raise InvalidRequest(
                "give --engine (KV-aware routing) or --prefill/--decode (disaggregated), not both"
            )
        try:
            config = ProxyConfig(
                ns.prefill or [], ns.decode or [], ns.timeout, ns.health_timeout, ns.shutdown_timeout
            )
            return build_app(config, front_door(ns))
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
    from kvstore.engine.llm_engine import resolve_model_dir  # noqa: PLC0415
    from kvstore.engine.router.app import build_router_app  # noqa: PLC0415
    from kvstore.engine.router.router import RouterConfig  # noqa: PLC0415
    from kvstore.engine.router.subscriber import FeedOptions  # noqa: PLC0415
    from kvstore.engine.router.tokens import PromptTokens  # noqa: PLC0415

    from kvstore.settings import read_token  # noqa: PLC0415

    try:
        events = FeedOptions(
            read_token(None, ns.engine_events_token_file), read_token(None, ns.store_events_token_file),
            int(ns.events_max_frame_mib * 2**20), ns.index_max_blocks, ns.index_max_store_keys,
            ns.events_check_interval,
        )  # fmt: skip
    except ValueError as e:  # ConfigError too: an unreadable token file
        raise InvalidRequest(str(e)) from None
    try:
        config = RouterConfig(
            ns.engine, ns.engine_events, ns.engine_replay, ns.store_events, ns.store_replay, ns.policy,
            ns.max_share, calibrate_s=ns.calibrate_interval, timeout_s=ns.timeout, topic=ns.events_topic,
            model=ns.model, events=events, first_byte_timeout_s=ns.first_byte_timeout,
            health_interval_s=ns.health_interval, health_timeout_s=ns.health_timeout,
            prep_workers=ns.prep_workers, prep_queue=ns.prep_queue,
            body_budget_bytes=ns.max_body_bytes_in_flight, door=front_door(ns),
        )  # fmt: skip
        if ns.route_tokens < 1:
            raise ValueError("--route-tokens must be at least 1")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    tokens = PromptTokens(
        resolve_model_dir(ns.model),
        ns.chunk_size,
        ns.kv_namespace,
        ns.dtype,
        ns.kv_cache_dtype,
        ns.route_tokens,
    )
    return build_router_app(config, tokens)


def run_router(ns: argparse.Namespace) -> None:
    from kvstore.engine.gateway import serve  # noqa: PLC0415

    serve(build(ns), ns.host, ns.port, "router", ns.shutdown_timeout)
