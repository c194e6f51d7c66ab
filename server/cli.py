"""`kvstore-server`: serve a tiered KV-cache store over HTTP.

Flags override KVSTORE_* environment variables, which override `--config FILE` (YAML), which overrides
the defaults (tiers cpu,disk under ~/.cache/kvstore/data, 127.0.0.1:8100, no auth).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvstore.errors import KVStoreError
from server.config import load_configs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE", help="YAML file with store and server settings")
    s = p.add_argument_group("store")
    s.add_argument("--tiers", help="ordered tiers, any of gpu,cpu,disk,redis (default cpu,disk)")
    s.add_argument("--gpu-capacity", help="e.g. 4GiB")
    s.add_argument("--cpu-capacity", help="e.g. 8GiB")
    s.add_argument("--disk-capacity", help="e.g. 64GiB")
    s.add_argument("--disk-path", help="directory of the disk tier")
    s.add_argument("--redis-url", help="redis://host:port/db (Valkey works too)")
    s.add_argument(
        "--redis-cluster", action="store_true", default=None, help="the Redis URL is a Cluster node"
    )
    s.add_argument("--write-policy", choices=["through", "back"])
    s.add_argument("--ttl", type=float, help="seconds a blob lives (default: until evicted)")
    s.add_argument("--codec", help="default codec of tensors put through the local SDK (raw, fp8, int4)")
    s.add_argument("--max-blob-size", help="largest single blob accepted, e.g. 256MiB")
    h = p.add_argument_group("server")
    h.add_argument("--host", help="address to bind (default 127.0.0.1)")
    h.add_argument("--port", type=int, help="port to bind (default 8100; 0 picks a free one)")
    h.add_argument("--auth-token", help="require 'Authorization: Bearer TOKEN' (prefer --auth-token-file)")
    h.add_argument("--auth-token-file", help="file holding the bearer token")
    h.add_argument(
        "--allowed-hosts",
        help="without a token: host names clients may use besides IPs and localhost (comma list; * = any)",
    )
    h.add_argument("--tls-cert", help="PEM certificate; serve HTTPS")
    h.add_argument("--tls-key", help="PEM private key of --tls-cert")
    h.add_argument("--max-request-size", help="largest batch body accepted, e.g. 1GiB")
    h.add_argument(
        "--max-body-bytes-in-flight", help="request body bytes being received at once, e.g. 1GiB (then 503)"
    )
    h.add_argument("--max-connections", type=int, help="open connections (then a fast 503; default 1024)")
    h.add_argument("--header-timeout", type=float, help="seconds for a request's headers (default 10)")
    h.add_argument("--keepalive-timeout", type=float, help="seconds an idle connection stays (default 30)")
    h.add_argument("--sample-interval", type=float, help="seconds between dashboard samples (default 5)")
    h.add_argument("--shutdown-timeout", type=float, help="seconds in-flight requests get on SIGTERM")
    h.add_argument("--access-log", action="store_true", default=None, help="log every request")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING...")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level") and v is not None}
    try:
        store_config, config = load_configs(args.config, **overrides)
        config.token()  # fail early on an unreadable token file
        config.ssl_context()
    except KVStoreError as e:
        print(f"kvstore-server: {e}", file=sys.stderr)
        return 2

    from server.runner import install_uvloop, serve  # noqa: PLC0415 (after argument errors are reported)

    def ready(url: str) -> None:
        print(f"kvstore-server listening on {url}", flush=True)  # tests and scripts read the port here

    install_uvloop()
    try:
        asyncio.run(serve(store_config, config, on_ready=ready))
    except KVStoreError as e:
        print(f"kvstore-server: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port is taken
        print(f"kvstore-server: cannot serve: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
