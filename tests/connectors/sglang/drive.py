"""Scenarios of the kvstore HiCache backend driven by SGLang's own HiCacheController (run in the SGLang
venv by test_hicache.py). Each scenario prints one line `RESULT <name> <json>`; a scenario that raises
prints its traceback as `{"error": ...}` and the others still run.

    .venv/sglang/bin/python -m tests.connectors.sglang.drive --url URL [--codec-url URL]
        [--fault-url URL --fault-pid PID] SCENARIO...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.connectors.sglang.harness import BACKEND, Engine, init_process, same, tokens

PAGE = 16


def extra(url: str, v1: bool = True, **more: Any) -> dict[str, Any]:
    return {**BACKEND, "url": url, "interface_v1": int(v1), **more}


def canonical_blob_matches(engine: Engine, hashes: list[str], pages: list) -> bool:
    """The stored blob of each page, read with the backend's SDK store, is the page as [2, L, T, H, D]."""
    backend = engine.backend
    got = backend.handle.store.batch_get(backend._keys(hashes))
    return all(
        g is not None and same([g], [backend.geometry.canonical(p)]) for g, p in zip(got, pages, strict=True)
    )


def roundtrip(url: str, v1: bool, seed: int, hybrid: bool = False) -> dict[str, Any]:
    """Engine A backs up 6 pages; a prompt of 8 pages, 6 of them A's, hits 6 and prefetches them bit-exact;
    engine B (a new controller and new pools, another host layout) does the same from A's pages."""
    a = Engine(extra(url, v1), hybrid=hybrid)
    b = None
    try:
        stored = tokens(6 * PAGE, seed)
        prompt = stored + tokens(2 * PAGE, seed + 100)
        up = a.backup(stored, seed)
        p = a.prefetch(prompt)
        out = {
            "backup_tokens": up["tokens"], "hit": p["hit"], "done": p["tokens"],
            "exact": same(p["pages"], up["pages"]),
            "blobs_canonical": canonical_blob_matches(a, a.hashes(stored), up["pages"]),
        }  # fmt: skip
        b = Engine(extra(url, v1), layout="layer_first", hybrid=hybrid)
        q = b.prefetch(prompt)
        # B's host layout differs: compare pages as blobs ([2, L, T, H, D])
        mine = [b.backend.geometry.canonical(x) for x in q["pages"]]
        theirs = [a.backend.geometry.canonical(x) for x in up["pages"]]
        out.update(engine2_hit=q["hit"], engine2_done=q["tokens"], engine2_exact=same(mine, theirs))
        out["stats"] = a.backend.stats()
        out["stats2"] = b.backend.stats()
        return out
    finally:
        a.close()
        if b is not None:
            b.close()


def tp_ranks(url: str) -> dict[str, Any]:
    """TP rank 0 and rank 1 of 2 of one model back up the same prompt: neither reads the other's pages."""
    stored = tokens(4 * PAGE, 7)
    r0 = Engine(extra(url), tp=(0, 2))
    r1 = Engine(extra(url), tp=(1, 2))
    try:
        up0 = r0.backup(stored, seed=1)
        hit_before = r1.prefetch(stored)["hit"]
        up1 = r1.backup(stored, seed=2)
    finally:
        r0.close()
        r1.close()
    n0, n1 = Engine(extra(url), tp=(0, 2)), Engine(extra(url), tp=(1, 2))
    try:
        g0, g1 = n0.prefetch(stored), n1.prefetch(stored)
    finally:
        n0.close()
        n1.close()
    return {
        "rank1_hit_before_own_backup": hit_before, "backups": [up0["tokens"], up1["tokens"]],
        "hits": [g0["hit"], g1["hit"]], "done": [g0["tokens"], g1["tokens"]],
        "rank0_gets_rank0": same(g0["pages"], up0["pages"]),
        "rank1_gets_rank1": same(g1["pages"], up1["pages"]),
        "rank0_gets_rank1": same(g0["pages"], up1["pages"]),
    }  # fmt: skip


def stored_keys(url: str) -> int:
    from kvstore.sdk import Store  # noqa: PLC0415

    with Store.connect(url) as store:
        return sum(t["keys"] for t in store.stats()["tiers"])


def mla(url: str, hybrid: bool = False, seed: int = 11) -> dict[str, Any]:
    """An MLA model under TP 2: rank 0 stores each page once; rank 1 (not a writer) stores nothing and
    loads rank 0's pages."""
    stored = tokens(6 * PAGE, seed)
    before = stored_keys(url)
    r0 = Engine(extra(url), mla=True, tp=(0, 2), head_dim=64, hybrid=hybrid)
    r1 = Engine(extra(url), mla=True, tp=(1, 2), head_dim=64, hybrid=hybrid)
    try:
        up0 = r0.backup(stored, seed=3)
        up1 = r1.backup(stored, seed=4)
        after = stored_keys(url)
        g1 = r1.prefetch(stored)
        return {
            "backups": [up0["tokens"], up1["tokens"]], "new_blobs": after - before,
            "pages": len(up0["pages"]), "rank1_hit": g1["hit"], "rank1_done": g1["tokens"],
            "rank1_gets_rank0": same(g1["pages"], up0["pages"]),
            "saved": [r0.backend.stats()["saved"], r1.backend.stats()["saved"]],
            "geometry": [r0.backend.geometry.shape, list(r0.backend.geometry.host_shape)],
        }  # fmt: skip
    finally:
        r0.close()
        r1.close()


def tier_codec(url: str) -> dict[str, Any]:
    """A server whose cpu tier keeps fp8: the pages come back decoded (close, not bit-exact)."""
    stored = tokens(4 * PAGE, 13)
    e = Engine(extra(url))
    try:
        up = e.backup(stored, seed=5)
        p = e.prefetch(stored)
        err = max(
            float((x.float() - y.float()).abs().max()) for x, y in zip(p["pages"], up["pages"], strict=True)
        )
        scale = max(float(y.float().abs().max()) for y in up["pages"])
        return {
            "hit": p["hit"],
            "done": p["tokens"],
            "exact": same(p["pages"], up["pages"]),
            "rel_err": err / scale,
        }
    finally:
        e.close()


def faults(url: str, pid: int) -> dict[str, Any]:
    """A server that hangs (SIGSTOP), hangs between the hit query and the prefetch, holds a page of the
    wrong shape, and is killed: bounded delays and misses, never an exception out of the backend, never
    bytes other than the stored ones; the controller's threads live on."""
    out: dict[str, Any] = {}
    stored = tokens(6 * PAGE, 17)

    def stop() -> None:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.7)  # past the arena index's heartbeat (0.5 s): every read is a request now

    e = Engine(extra(url, timeout_s=1.0, lookup_timeout_s=0.25, unreachable_backoff_s=1.0))
    try:
        healthy = e.backup(stored, seed=6)
        out["healthy_backup"], pages = healthy["tokens"], healthy["pages"]
        stop()
        try:
            out["hung"] = probe(e, stored)  # the first failure opens the breaker: the rest are instant
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.2)  # the backoff
        # hung between the hit query and the prefetch: the query hits, the load misses in bounded time
        p = e.prefetch(stored, hang=stop)
        os.kill(pid, signal.SIGCONT)
        out["hang_mid_prefetch"] = {
            "hit": p["hit"], "done": p["tokens"], "seconds": p["prefetch_seconds"],
            "untouched": same(p["pages"], p["before"]),
        }  # fmt: skip
        time.sleep(1.2)
        p = e.prefetch(stored)
        out["recovered"] = {"hit": p["hit"], "done": p["tokens"], "exact": same(p["pages"], pages)}
        # a page of another shape under page 3's key: a miss there, the leading 3 pages load
        import torch  # noqa: PLC0415
        from kvstore.sdk import Store  # noqa: PLC0415

        with Store.connect(url) as store:
            store.put(
                e.backend._keys(e.hashes(stored))[3], torch.ones(2, 1, PAGE, 1, 8, dtype=torch.bfloat16)
            )
        p = e.prefetch(stored)
        out["foreign_page"] = {
            "hit": p["hit"], "done": p["tokens"], "corrupt": e.backend.stats()["corrupt"],
            "exact_prefix": same(p["pages"][:3], pages[:3]),
        }  # fmt: skip
        out["stats"] = e.backend.stats()
    finally:
        e.close()
    # no breaker (backoff 0): every call meets the hung server, each within its own deadline
    e = Engine(extra(url, timeout_s=1.0, lookup_timeout_s=0.25, unreachable_backoff_s=0.0))
    try:
        stop()
        try:
            out["hung_every_call"] = probe(e, stored)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        e.close()
    e = Engine(extra(url, timeout_s=1.0, lookup_timeout_s=0.25, unreachable_backoff_s=1.0))
    try:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        out["down"] = probe(e, stored)
        threads = (e.ctrl.prefetch_thread, e.ctrl.backup_thread, e.ctrl.prefetch_io_aux_thread)
        out["threads_alive"] = all(t.is_alive() for t in threads)
    finally:
        e.close()
    return out


def probe(e: Engine, stored: list[int]) -> dict[str, Any]:
    """Each data-path call of the backend, directly and through the controller, against a bad server:
    its result, its time, and whether it raised."""
    be, res = e.backend, {}
    hashes = e.hashes(stored)
    idx, _ = e.fill(2, seed=99)
    page = e.host.get_data_page(int(idx[0]), flat=True)
    calls: dict[str, Callable[[], Any]] = {
        "batch_exists": lambda: be.batch_exists(hashes),
        "exists": lambda: be.exists(hashes[0]),
        "batch_get_v1": lambda: be.batch_get_v1(hashes[:2], idx),
        "batch_set_v1": lambda: be.batch_set_v1(["f" * 64, "e" * 64], idx),
        "get": lambda: be.get(hashes[0], page.clone()) is not None,
        "set": lambda: be.set("d" * 64, page),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            res[name] = {"result": call(), "seconds": time.monotonic() - t0}
        except Exception as err:  # noqa: BLE001 (what the test checks: none)
            res[name] = {"raised": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - t0}
    p = e.prefetch(stored)
    res["controller_query"] = {"hit": p["hit"], "seconds": p["query_seconds"]}
    up = e.backup(tokens(2 * PAGE, 1234), seed=7)
    res["controller_backup"] = {"tokens": up["tokens"], "seconds": up["seconds"]}
    return res


def fleet(urls: str, events: str) -> dict[str, Any]:
    """Two kvstore-servers sharing one Valkey (tiers cpu,redis): engine A backs up through the first,
    engine B finds and loads the pages through the second; the first server's KV events name each page's
    key as stored in its cpu and redis tiers."""
    import zmq  # noqa: PLC0415

    from kvstore.events import decode_batch  # noqa: PLC0415

    url_a, url_b = urls.split(",")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    time.sleep(0.5)  # the subscription reaches the publisher
    stored = tokens(4 * PAGE, 31)
    a, b = Engine(extra(url_a)), Engine(extra(url_b))
    try:
        up = a.backup(stored, seed=8)
        got = b.prefetch(stored)
        keys = {bytes.fromhex(k) for k in a.backend._keys(a.hashes(stored))}
        seen: dict[str, set] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(keys <= seen.get(m, set()) for m in ("CPU", "REDIS")):
            if sub.poll(200):
                for event in decode_batch(sub.recv_multipart()[2]).events:
                    if type(event).__name__ == "BlockStored":
                        seen.setdefault(event.medium, set()).update(event.block_hashes)
        return {
            "backup": up["tokens"], "hit": got["hit"], "done": got["tokens"],
            "exact": same(got["pages"], up["pages"]), "pages": len(keys),
            "events": {m: len(keys & hashes) for m, hashes in seen.items()},
        }  # fmt: skip
    finally:
        a.close()
        b.close()
        sub.close()


def config(url: str) -> dict[str, Any]:
    """What is refused at start (a typo in the extra config, a pool other than KV), and SGLang's storage
    metrics from get_stats()."""
    from kvstore.connectors.sglang import KVStoreHiCacheStorage  # noqa: PLC0415
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: PLC0415

    from kvstore.errors import ConfigError  # noqa: PLC0415

    def make(**more: Any) -> KVStoreHiCacheStorage:
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=True, is_page_first_layout=True, model_name="m",
            extra_config=extra(url, **more),
        )  # fmt: skip
        return KVStoreHiCacheStorage(cfg, {})

    out: dict[str, Any] = {}
    try:
        make(urll="http://127.0.0.1:1").close()
        out["typo"] = "accepted"
    except ConfigError as err:
        out["typo"] = str(err)
    e = Engine(extra(url))
    be = make()
    try:
        be.register_mem_pool_host(e.host)
        be.register_mem_host_pool_v2(e.host, PoolName.KV)
        try:
            be.register_mem_host_pool_v2(e.host, PoolName.MAMBA)
            out["mamba"] = "accepted"
        except ConfigError as err:
            out["mamba"] = str(err)
        idx, _ = e.fill(3, seed=21)
        hashes = e.hashes(tokens(3 * PAGE, 21))
        out["set"] = be.batch_set_v1(hashes, idx)
        out["get"] = be.batch_get_v1(hashes, idx)
        m = be.get_stats()
        out["metrics"] = {
            "type": type(m).__name__,
            "backup_pgs": m.backup_pgs,
            "prefetch_pgs": m.prefetch_pgs,
        }
        out["metrics_drained"] = be.get_stats().backup_pgs
        be.clear()  # deletes what this process stored
        out["after_clear"] = be.batch_exists(hashes)
    finally:
        be.close()
        e.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--codec-url")
    ap.add_argument("--fault-url")
    ap.add_argument("--fault-pid", type=int)
    ap.add_argument("--fleet-urls", help="two servers sharing one Valkey: URL,URL")
    ap.add_argument("--fleet-events", help="the first one's KV events endpoint")
    ap.add_argument("scenarios", nargs="+")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    init_process(free_port())
    scenarios: dict[str, Callable[[], Any]] = {
        "v1": lambda: roundtrip(args.url, True, 1),
        "generic": lambda: roundtrip(args.url, False, 2),
        "local_v1": lambda: roundtrip("local", True, 3),
        "local_generic": lambda: roundtrip("local", False, 4),
        "tp": lambda: tp_ranks(args.url),
        "mla": lambda: mla(args.url),
        "hybrid_v1": lambda: roundtrip(args.url, True, 5, hybrid=True),
        "hybrid_generic": lambda: roundtrip(args.url, False, 6, hybrid=True),
        "hybrid_mla": lambda: mla(args.url, hybrid=True, seed=12),
        "tier_codec": lambda: tier_codec(args.codec_url),
        "faults": lambda: faults(args.fault_url, args.fault_pid),
        "config": lambda: config(args.url),
        "fleet": lambda: fleet(args.fleet_urls, args.fleet_events),
    }
    for name in args.scenarios:
        try:
            result = scenarios[name]()
        except Exception:  # noqa: BLE001
            result = {"error": traceback.format_exc()}
        print(f"RESULT {name} {json.dumps(result, default=str)}", flush=True)


if __name__ == "__main__":
    main()
