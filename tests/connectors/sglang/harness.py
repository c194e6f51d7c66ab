"""An SGLang "engine" on CPU, as far as HiCache's storage tier goes (run in the SGLang venv only).

SGLang's own classes: a device KV pool (`MHATokenToKVPool` / `MLATokenToKVPool` with device="cpu"),
its host pool (`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`, pin_memory=False), the paged allocator
and the real `HiCacheController` with its backup, prefetch and I/O threads, the storage backend built
by SGLang's factory (`dynamic` for kvstore, `file` for SGLang's own), over a one-rank gloo group. What
SGLang's scheduler and radix tree would do around it is what `Engine` does: put KV in host pages and
ask for a backup (`write_storage`), run a hit query and hand the hit's host pages to the prefetch
(`prefetch`, `prefetch_buffer`), and read the acknowledgements.
"""

from __future__ import annotations

import os
import threading
import time
from queue import Empty
from typing import Any

from tests.connectors.sglang.sglang_env import import_sglang

import_sglang()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

WAIT_S = 30.0  # an acknowledgement that takes longer is a failure (bounded loops)
BACKEND = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang"}
BACKEND["class_name"] = "KVStoreHiCacheStorage"


def init_process(port: int) -> None:
    """One rank of one, on gloo, and the parallel widths SGLang's launcher would publish."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    get_parallel().override_permanently(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
        attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0,
    )  # fmt: skip


class Engine:
    """Device pool, host pool, allocator and HiCacheController with a storage backend attached."""

    def __init__(
        self,
        extra: dict[str, Any] | None = None,
        *,
        backend: str = "dynamic",
        layout: str = "page_first",
        page: int = 16,
        layers: int = 4,
        heads: int = 2,
        head_dim: int = 64,
        mla: bool = False,
        tp: tuple[int, int] = (0, 1),
        dtype: torch.dtype = torch.bfloat16,
        device_tokens: int = 256,
        host_ratio: float = 8.0,
        model: str = "test-model",
        pools: Engine | None = None,
        hybrid: bool = False,
    ) -> None:
        """`pools`: another engine whose device pool, host pool and allocator this one shares (a second
        controller over the very same host memory: the benchmark's backends). `hybrid`: the controller an
        SGLang server builds for a plain MHA/MLA model (`build_kv_only_stack`: a HybridCacheController over
        a host pool group whose one entry is the KV pool) instead of the base HiCacheController."""
        self.page = page
        if pools is not None:
            kv, host, alloc = pools.kv, pools.host, pools.alloc
        elif mla:
            kv = MLATokenToKVPool(device_tokens, page, dtype, head_dim, 16, layers, "cpu", False, 0, layers)
            info = kv.get_device_pool_infos()[0].buffer_info
            host = MLATokenToKVPoolHost(
                info, host_ratio, 0, page, layout, pin_memory=False, device="cpu",
                override_kv_cache_dim=kv.kv_cache_dim, device_capacity_tokens=kv.size, start_layer=0,
                end_layer=layers, target_layer_num=layers,
            )  # fmt: skip
        else:
            kv = MHATokenToKVPool(
                device_tokens,
                page,
                dtype,
                heads,
                head_dim,
                layers,
                "cpu",
                False,
                start_layer=0,
                end_layer=layers,
            )
            info = kv.get_device_pool_infos()[0].buffer_info
            host = MHATokenToKVPoolHost(
                info, host_ratio, 0, page, layout, pin_memory=False, device="cpu",
                device_capacity_tokens=kv.size, start_layer=0, end_layer=layers,
            )  # fmt: skip
        if pools is None:
            alloc = PagedTokenToKVPoolAllocator(device_tokens, page, dtype, "cpu", kv, need_sort=False)
        self.kv, self.host, self.alloc = kv, host, alloc
        self.hybrid = hybrid
        config = dict(extra or {}) if backend == "dynamic" else extra
        with get_parallel().override(tp_rank=tp[0], tp_size=tp[1], attn_tp_rank=tp[0], attn_tp_size=tp[1]):
            if hybrid:  # as hybrid_pool_assembler.build_kv_only_stack does
                same_layers = {i: i for i in range(layers)}
                entry = build_pool_entry(
                    name=PoolName.KV, host_pool=host, device_pool=kv, layer_mapping=same_layers,
                    transfer_layer_id_max=layers, is_anchor=True,
                )  # fmt: skip
                self.ctrl = HybridCacheController(
                    alloc, HostPoolGroup([entry]), page, dist.group.WORLD, load_cache_event=threading.Event(),
                    io_backend="direct", storage_backend=backend, model_name=model,
                    storage_backend_extra_config=config, transfer_layer_id_max=layers,
                )  # fmt: skip
            else:
                self.ctrl = HiCacheController(
                    alloc, host, page, dist.group.WORLD, threading.Event(), io_backend="direct",
                    storage_backend=backend, model_name=model, storage_backend_extra_config=config,
                )  # fmt: skip
        self.backend = self.ctrl.storage_backend
        self._rid = 0

    # ---- what the scheduler and the radix tree do ----------------------------------------------
    def hashes(self, tokens: list[int]) -> list[str]:
        return get_storage_hash_str(tokens, None, page_size=self.page)

    def fill(self, n_pages: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """n host pages of random KV; their indices and a copy of each page as the pool holds it."""
        idx = self.host.alloc(n_pages * self.page)
        assert idx is not None, "host pool full"
        gen = torch.Generator().manual_seed(seed)
        pages = []
        for i in range(n_pages):
            view = self.host.get_data_page(int(idx[i * self.page]), flat=False)
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
            pages.append(view.clone())
        return idx, pages

    def backup(self, tokens: list[int], seed: int = 0) -> dict[str, Any]:
        """Back up len(tokens) / page pages of random KV through the controller's backup thread."""
        n = len(tokens) // self.page
        idx, pages = self.fill(n, seed)
        hashes = self.hashes(tokens)
        t0 = time.monotonic()
        self.ctrl.write_storage(idx, tokens, hash_value=hashes)
        op = self.ctrl.ack_backup_queue.get(timeout=WAIT_S)
        return {"tokens": op.completed_tokens, "seconds": time.monotonic() - t0, "pages": pages}

    def prefetch(self, tokens: list[int], hang: Any = None) -> dict[str, Any]:
        """The hit query, then (on a hit) the prefetch into fresh host pages; what landed there.
        `hang()` runs between the two (a test stops the server there)."""
        self._rid += 1
        t0 = time.monotonic()
        rid = f"r{self._rid}"
        op = self.ctrl.prefetch(CacheRequestHandle(rid, 0) if self.hybrid else rid, tokens)
        hit_op = self.ctrl.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit_op is op
        hit, query_s = op.storage_hit_count, time.monotonic() - t0
        out = {"hit": hit, "query_seconds": query_s, "tokens": 0, "pages": [], "prefetch_seconds": 0.0}
        if hang is not None:
            hang()
        if not hit:
            return out
        idx = self.host.alloc(hit)
        assert idx is not None, "host pool full"
        before = [self.host.get_data_page(int(idx[i]), flat=False).clone() for i in range(0, hit, self.page)]
        op.host_indices = idx
        t1 = time.monotonic()
        self.ctrl.prefetch_buffer.put(op)
        done = 0
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                ack = self.ctrl.ack_prefetch_queue.get(timeout=1)
            except Empty:
                continue
            if ack.completed_tokens is not None:
                done = max(done, ack.completed_tokens)
            if ack.completed_req:
                break
        else:
            raise AssertionError("no completed prefetch acknowledgement")
        out.update(tokens=done, prefetch_seconds=time.monotonic() - t1, before=before)
        out["pages"] = [
            self.host.get_data_page(int(idx[i]), flat=False).clone() for i in range(0, hit, self.page)
        ]
        return out

    def close(self) -> None:
        self.ctrl.detach_storage_backend()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (compares the bits, so a NaN equals itself)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x.view(bits[x.element_size()]), y.view(bits[y.element_size()]))
        for x, y in zip(a, b, strict=True)
    )


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n,), generator=gen).tolist()
