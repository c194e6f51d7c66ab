"""`kvstore-server`: serve a tiered KV-cache store over HTTP.

Flags override KVSTORE_* environment variables, which override `--config FILE` (YAML; default
$KVSTORE_CONFIG), which overrides the defaults (tiers cpu,disk under ~/.cache/kvstore/data/disk,
127.0.0.1:8100, no auth). Every setting has a flag: `--cpu-capacity 8GiB` is `cpu_capacity: 8GiB` in
YAML and KVSTORE_CPU_CAPACITY=8GiB in the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pydantic import BaseModel

from kvstore import __version__
from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError
from kvstore.settings import check_port_free
from server.config import ServerConfig, load_configs

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# the flags users reach for, with their help; every other setting gets a flag from its field name below
STORE_FLAGS = {
    "tiers": "ordered tiers, any of gpu,cpu,disk,redis (default cpu,disk)",
    "cpu_capacity": "e.g. 8GiB (default 4GiB)",
    "disk_capacity": "e.g. 64GiB (default)",
    "gpu_capacity": "e.g. 4GiB (default)",
    "disk_path": "directory of the disk tier (default ~/.cache/kvstore/data/disk)",
    "redis_url": "redis://host:port/db (Valkey works too); for a Cluster, any node plus --redis-cluster",
    "write_policy": "through (default): lower tiers before the ack; back: a background queue",
    "ttl": "seconds a blob lives (default: until evicted)",
    "codec": "default codec of tensors put through the local SDK (raw, fp8, int4)",
    "max_blob_size": "largest single blob accepted, e.g. 256MiB (default)",
    "redis_prefix": "prefix of every Redis key (default kvstore:)",
    "redis_cluster": "the Redis URL names Cluster nodes",
    "state_dir": "directory for what must survive a restart: deletes/replaces a Redis outage left to replay "
    "(default ~/.cache/kvstore/data/state)",
    "write_back_queue": "blobs waiting for lower tiers (write_policy back) before writes to them drop (default 256)",
    "admission_hits": "a blob reaches lower tiers only after this many hits (default 0: always)",
    "lz4": "lz4 after the codec, for tensors put through the local SDK (rarely pays on KV)",
    "miss_log_keys": "recently written keys remembered to tell evicted/expired misses apart (default 65536)",
}
SERVER_FLAGS = {
    "host": "address to bind (default 127.0.0.1)",
    "port": "port to bind (default 8100; 0 picks a free one)",
    "auth_token_file": "file holding the bearer token clients must send (make one: openssl rand -hex 32 > token)",
    "auth_token": "the bearer token itself (prefer --auth-token-file: flags show in `ps`)",
    "tls_cert": "PEM certificate: serve HTTPS",
    "tls_key": "PEM private key of --tls-cert",
    "allowed_hosts": "without a token: host names clients may use besides IPs and localhost (comma list; * = any)",
    "engine_metrics": "an engine's URL whose /metrics the dashboard reads (repeatable or comma list)",
    "sample_interval": "seconds between dashboard samples (default 5)",
    "shutdown_timeout": "seconds in-flight requests get on SIGTERM (default 30)",
    "max_request_size": "largest batch body accepted, e.g. 1GiB (default)",
    "max_body_bytes_in_flight": "request body bytes being received at once, e.g. 1GiB (then 503)",
    "max_connections": "open connections (then a fast 503; default 1024)",
    "header_timeout": "seconds for a request's headers (default 10)",
    "keepalive_timeout": "seconds an idle connection stays (default 30)",
    "body_timeout": "seconds to receive a whole body (default 30)",
    "history_size": "dashboard samples kept (default 720: an hour at 5 s)",
    "store_threads": "threads for store calls that may touch disk or Redis (default 4)",
    "metrics_auth": "/metrics needs the token too (default; --no-metrics-auth opens it)",
    "access_log": "log every request",
    "dataplane": "the binary data plane on the port, for the SDK (default; --no-dataplane: HTTP only)",
    "shm_budget": "shared memory for clients on this host, all segments together, e.g. 1GiB (0: off)",
    "shm_max_segment": "largest shared-memory segment one client gets (default 512MiB)",
    "kv_events_config": "publish every tier's stored/evicted chunks as vLLM KV events (off by default), vLLM's "
    'KVEventsConfig JSON: \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
    '"replay_endpoint": "tcp://*:5558"}\'',
    "poll_us": "µs the loop polls for a same-host client's next request before sleeping (default 200; 0: off)",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_model_flags(group: argparse._ArgumentGroup, model: type[BaseModel], helps: dict[str, str]) -> None:
    """One flag per field of `model`, in the order of `helps`, then the rest; all default to None so the
    YAML and environment layers show through."""
    for name in [*helps, *(n for n in model.model_fields if n not in helps)]:
        field = model.model_fields[name]
        default = field.default if field.default_factory is None else field.default_factory()
        help_text = helps.get(name) or f"{name} (default {default!r})"
        if field.annotation in (bool, "bool"):
            group.add_argument(
                _flag(name), action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif name == "engine_metrics":
            group.add_argument(_flag(name), action="append", metavar="URL", help=help_text)
        else:
            group.add_argument(_flag(name), metavar=name.split("_")[-1].upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--config", metavar="FILE", help="YAML file of store and server settings (default $KVSTORE_CONFIG)"
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    _add_model_flags(p.add_argument_group("store"), StoreConfig, STORE_FLAGS)
    _add_model_flags(p.add_argument_group("server"), ServerConfig, SERVER_FLAGS)
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
        check_port_free(config.host, config.port)  # before the disk tier is opened and indexed
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
    except OSError as e:  # e.g. the port was taken between the check and the bind
        print(f"kvstore-server: cannot serve: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
