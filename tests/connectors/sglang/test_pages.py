"""kvstore.connectors.sglang_pages without SGLang: pools shaped as SGLang's host pools (the shapes of
`MHATokenToKVPoolHost.init_kv_buffer` / `get_data_page` and their MLA twins) whose every value says which
K/V, layer, token, head and dim it is, so a page's blob view is checked against meaning, not against the
same index arithmetic; blobs laid out from strided views byte for byte as `encode_blob` lays out the
contiguous page; one copy each way (no page-sized allocation); keys."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from kvstore.connectors.sglang_pages import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    StridedBlob,
    geometry_of,
    load_into,
    page_keys,
)

from kvstore.blob import encode_blob, verify_blob
from kvstore.errors import ConfigError, CorruptBlob
from kvstore.keys import KVLayout, root_key

KEY = "ab" * 16


class Pool:
    """The host pool SGLang allocates for `layout` (MHA, or MLA with `row`), values f(k, l, token, h, d)."""

    def __init__(
        self, layout: str, *, page=4, pages=5, layers=3, heads=2, dim=4, row=0, dtype=torch.float32, fill=True
    ):
        self.layout, self.page_size, self.layer_num, self.dtype = layout, page, layers, dtype
        self.head_num, self.head_dim, size = heads, dim, page * pages
        self.mla = bool(row)
        if self.mla:
            self.kv_cache_dim = row
            dims = {"layer_first": (layers, size, 1, row), "page_first": (size, layers, 1, row)}
            dims["page_first_direct"] = (pages, layers, page, 1, row)
        else:
            dims = {"layer_first": (2, layers, size, heads, dim), "page_first": (2, size, layers, heads, dim)}
            dims["page_first_direct"] = (2, pages, layers, page, heads, dim)
            dims["page_head"] = (2, pages, heads, page, layers, dim)
        self.kv_buffer = torch.zeros(dims[layout], dtype=dtype)
        if not fill:  # a big one: random values
            self.kv_buffer.view(torch.uint8).copy_(
                torch.randint(0, 256, self.kv_buffer.view(torch.uint8).shape)
            )
            return
        for k in range(1 if self.mla else 2):
            for lay in range(layers):
                for t in range(size):
                    for h in range(1 if self.mla else heads):
                        for d in range(row or dim):
                            self._at(k, lay, t, h, d).fill_(value(k, lay, t, h, d))

    def _at(self, k: int, lay: int, t: int, h: int, d: int) -> torch.Tensor:
        p, i = divmod(t, self.page_size)
        b, layout = self.kv_buffer, self.layout
        if self.mla:  # one latent row per token and layer
            if layout == "layer_first":
                return b[lay, t, 0, d]
            return b[t, lay, 0, d] if layout == "page_first" else b[p, lay, i, 0, d]
        if layout == "layer_first":
            return b[k, lay, t, h, d]
        if layout == "page_first":
            return b[k, t, lay, h, d]
        return b[k, p, lay, i, h, d] if layout == "page_first_direct" else b[k, p, h, i, lay, d]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """SGLang's own slicing (pool_host/mha.py, pool_host/mla.py)."""
        b, p, n = self.kv_buffer, index // self.page_size, self.page_size
        if self.layout == "layer_first":
            page = b[:, index : index + n] if self.mla else b[:, :, index : index + n]
        elif self.layout == "page_first":
            page = b[index : index + n] if self.mla else b[:, index : index + n]
        else:
            page = b[p : p + 1] if self.mla else b[:, p : p + 1]
        return page.flatten() if flat else page


def value(k: int, lay: int, t: int, h: int, d: int) -> float:
    return float((((k * 8 + lay) * 64 + t) * 8 + h) * 16 + d)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_an_mha_page_is_k_then_v_by_layer_token_head_dim(layout: str) -> None:
    pool = Pool(layout)
    geo = geometry_of(pool)
    assert geo.shape == (2, 3, 4, 2, 4) and geo.kind == "mha"
    for start in (0, 8, 16):
        view = geo.canonical(pool.get_data_page(start, flat=False))
        assert view.untyped_storage().data_ptr() == pool.kv_buffer.untyped_storage().data_ptr()  # no copy
        want = torch.tensor(
            [[[[[value(k, lay, start + t, h, d) for d in range(4)] for h in range(2)] for t in range(4)]
              for lay in range(3)] for k in range(2)]
        )  # fmt: skip
        assert torch.equal(view, want)
        flat = pool.get_data_page(start, flat=True)  # the generic path's flat page, in the pool's order
        assert torch.equal(geo.flat_view(flat.contiguous()), want)


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_an_mla_page_is_its_latent_row_in_two_halves(layout: str) -> None:
    pool = Pool(layout, row=6)
    geo = geometry_of(pool)
    assert geo.shape == (2, 3, 4, 1, 3) and geo.kind == "mla"
    view = geo.canonical(pool.get_data_page(4, flat=False))
    for half in range(2):
        for lay in range(3):
            for t in range(4):
                assert view[half, lay, t, 0].tolist() == [
                    value(0, lay, 4 + t, 0, half * 3 + j) for j in range(3)
                ]


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_a_strided_blob_is_byte_for_byte_the_blob_of_the_page(layout: str) -> None:
    pool = Pool(layout, dtype=torch.bfloat16)
    view = geometry_of(pool).canonical(pool.get_data_page(8, flat=False))
    want = encode_blob(view.contiguous(), key=KEY)
    blob = StridedBlob(view, KEY)
    assert blob.nbytes == len(want) and blob.to_bytes() == want and b"".join(map(bytes, blob.parts())) == want
    out = bytearray(blob.nbytes)
    blob.write_into(out)
    assert bytes(out) == want
    verify_blob(out, key=KEY)


@pytest.mark.parametrize(
    ("src_layout", "dst_layout"), [("page_first", "layer_first"), ("page_head", "page_first")]
)
def test_a_raw_blob_loads_into_a_page_of_another_layout_and_nowhere_else(
    src_layout: str, dst_layout: str
) -> None:
    src, dst = Pool(src_layout, dtype=torch.bfloat16), Pool(dst_layout, dtype=torch.bfloat16)
    dst.kv_buffer.zero_()
    blob = StridedBlob(geometry_of(src).canonical(src.get_data_page(12, flat=False)), KEY).to_bytes()
    geo = geometry_of(dst)
    load_into(geo.canonical(dst.get_data_page(4, flat=False)), memoryview(blob), None, KEY)
    want = geometry_of(src).canonical(src.get_data_page(12, flat=False))
    assert torch.equal(geo.canonical(dst.get_data_page(4, flat=False)), want)
    for other in (0, 8, 12, 16):
        assert not geo.canonical(dst.get_data_page(other, flat=False)).any()


def test_one_copy_each_way_no_page_sized_allocation() -> None:
    """Backing a 4 MiB page up and loading it back allocates nothing near its size (numpy's and Python's
    allocations are traced; a `.contiguous()` or a decoded tensor of the page would be one)."""
    pool = Pool("page_first", page=64, pages=2, layers=32, heads=8, dim=64, dtype=torch.bfloat16, fill=False)
    geo = geometry_of(pool)
    page = geo.canonical(pool.get_data_page(0, flat=False))
    assert geo.nbytes == 4 * 2**20
    blob = StridedBlob(page, KEY)  # its header (msgpack's packer takes a 256 KiB buffer of its own)
    out = bytearray(blob.nbytes)
    tracemalloc.start()
    try:
        blob.write_into(out)
        load_into(geo.canonical(pool.get_data_page(64, flat=False)), memoryview(out), None, KEY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    bits = pool.kv_buffer.view(torch.int16)  # random bits: NaNs among them
    assert torch.equal(bits[:, :64], bits[:, 64:])


def test_a_lossy_blob_is_decoded_into_the_page() -> None:
    pytest.importorskip("numba")
    pool = Pool("page_first", dtype=torch.bfloat16)
    geo = geometry_of(pool)
    src = geo.canonical(pool.get_data_page(0, flat=False))
    blob = encode_blob(src.contiguous(), codec="fp8", key=KEY)
    dst = geo.canonical(pool.get_data_page(4, flat=False))
    load_into(dst, memoryview(blob), None, KEY)
    assert torch.allclose(dst.float(), src.float(), rtol=0.1, atol=2.0) and not torch.equal(dst, src)


def test_a_blob_of_another_shape_or_key_is_corrupt() -> None:
    pool = Pool("page_first", dtype=torch.bfloat16)
    dst = geometry_of(pool).canonical(pool.get_data_page(0, flat=False))
    other = encode_blob(torch.ones(2, 3, 4, 2, 2, dtype=torch.bfloat16), key=KEY)
    with pytest.raises(CorruptBlob):
        load_into(dst, memoryview(other), None, KEY)
    with pytest.raises(CorruptBlob):
        load_into(dst, memoryview(encode_blob(dst.contiguous(), key="cd" * 16)), None, KEY)


def test_pools_it_does_not_store_are_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="uint8"):
        geometry_of(Pool("page_first", dtype=torch.uint8, fill=False))
    with pytest.raises(ConfigError, match="split in two"):
        geometry_of(Pool("page_first", row=5))
    pool = Pool("page_first")
    pool.layout = "page_unified"
    with pytest.raises(ConfigError, match="page_unified"):
        geometry_of(pool)


def test_page_keys_depend_on_the_layout_the_shard_and_the_page() -> None:
    layout = KVLayout("m", "", 3, 2, 4, "bfloat16", chunk_size=4)
    root, h = root_key(layout), ["0" * 64, "1" * 64]
    keys = page_keys(root, "", h)
    assert keys == page_keys(root, "", h) and len(set(keys)) == 2 and all(len(k) == 32 for k in keys)
    assert page_keys(root, "pp1/2", h)[0] != keys[0]
    rank1 = KVLayout("m", "", 3, 2, 4, "bfloat16", chunk_size=4, tp_rank=1, tp_world_size=2)
    assert page_keys(root_key(rank1), "", h)[0] != keys[0]
    assert page_keys(root_key(KVLayout("m", "", 3, 2, 4, "bfloat16", chunk_size=8)), "", h)[0] != keys[0]


def test_page_keys_are_pinned() -> None:
    """A change of the derivation changes every stored page's key: a new key version."""
    root = root_key(KVLayout("m", "", 3, 2, 4, "bfloat16", chunk_size=4))
    assert page_keys(root, "", ["0" * 64]) == [PINNED]


PINNED = "fb5bc89121153a277ccf00733d629947"


@pytest.mark.parametrize("transport", ["shm", "tcp", "http"])
def test_a_strided_blob_goes_through_every_transport(shared_server, transport: str) -> None:
    """The SDK takes it as the PreparedBlob it is: laid out in the shared-memory segment (shm), sent as
    header and payload (tcp, http); the server verifies it and serves the page back."""
    from kvstore.sdk import Store  # noqa: PLC0415

    pool = Pool("page_head", dtype=torch.bfloat16)
    geo = geometry_of(pool)
    pages = [geo.canonical(pool.get_data_page(i, flat=False)) for i in (0, 4, 8)]
    keys = [f"{transport}{i}".encode().hex().ljust(32, "0") for i in range(3)]
    with Store.connect(shared_server.url, transport=transport) as store:
        store.put(keys[0], StridedBlob(pages[0], keys[0]))
        store.batch_put([(k, StridedBlob(p, k)) for k, p in zip(keys[1:], pages[1:], strict=True)])
        got = store.batch_get(keys)
    assert all(torch.equal(g, p) for g, p in zip(got, pages, strict=True))


def test_the_layout_names_the_model_its_config_the_page_size_and_the_tp_rank(tmp_path) -> None:
    from types import SimpleNamespace  # noqa: PLC0415

    from kvstore.connectors.sglang_pages import page_layout, shard_of  # noqa: PLC0415

    model = tmp_path / "Llama-3-8B"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 3, "transformers_version": "5"}')
    cfg = SimpleNamespace(
        model_name=str(model), is_mla_model=False, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1
    )
    geo = geometry_of(Pool("page_first", dtype=torch.bfloat16))
    layout = page_layout(geo, cfg)
    assert (layout.model_name, layout.chunk_size, layout.tp_rank, layout.tp_world_size) == (
        "Llama-3-8B",
        4,
        1,
        2,
    )
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.kv_dtype) == (3, 2, 4, "bfloat16")
    assert layout.model_config_hash and page_layout(geo, cfg, model_path="other").model_config_hash == ""
    mla = page_layout(
        geometry_of(Pool("page_first", row=6)), SimpleNamespace(**{**vars(cfg), "is_mla_model": True})
    )
    assert (mla.tp_rank, mla.tp_world_size, mla.num_kv_heads) == (0, 1, 1), "one copy for every TP rank"
    assert shard_of(cfg) == "" and shard_of(SimpleNamespace(pp_rank=1, pp_size=2, attn_cp_size=1)) == "pp1/2"
