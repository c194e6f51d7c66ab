"""The engine's CPU kernels (`cpu_kernels.c`): compiled with the system C compiler on first use, cached
under `$KVSTORE_CACHE_DIR/kernels` (default `~/.cache/kvstore/kernels`) and called through ctypes.

They need x86-64 with AVX-512F and a C compiler (`$CC`, `cc` or `gcc`); without either, or with
`KVSTORE_CPU_KERNELS=0`, `available()` is False and the layers keep their torch paths. Calls release
the GIL, so with more than one torch thread a call's rows are split over a small thread pool.

On CPUs with AMX (`amx_bf16`) the bf16 GEMMs run on the tile units (activations rounded to bf16, as
oneDNN does); without AMX but with `avx512_bf16` (Zen 4/5, Cooper Lake) they run on its dot-product
instruction, the activations rounded the same way. `KVSTORE_AMX=0` turns the tile units off (GEMMs and
attention), `KVSTORE_AVX512_BF16=0` the dot products; with neither, bf16 GEMMs widen the weights to
fp32 FMAs on fp32 activations (the exact kernel). The choice is made once per process, when the
kernels load, because it decides how `pack_weight` lays weights out.

Every wrapper takes fp32 activations contiguous in their last dimension (asserted).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno", "-std=c11")
PANEL = 32  # output columns per packed weight panel (NR in the C source)
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
W_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "gemm_w16": [_ptr, _i64, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64],
    "paged_decode_attention": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _int, _i64, _i64, _i64, _ptr, _ptr, _ptr,
                               _i64, _ptr, _ptr, _f32, _i64, _i64, _i64, _i64, _i64, _i64, _i64],
    "store_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64,
                 _i64],
    "rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _int, _f32, _ptr, _i64, _i64, _i64, _i64],
    "rope": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64],
    "amx_enable": [],
    "bf16_dot_enable": [],
    "gemm_kind": [],
    "gemm_layout": [_int, _i64],
    "attention_on_tiles": [_int, _i64, _i64, _i64, _i64, _i64],
    "decoder_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                      _ptr, _i64],
}  # fmt: skip
_RETURNS_INT = ("amx_enable", "bf16_dot_enable", "gemm_kind", "gemm_layout", "attention_on_tiles")
GEMM_KINDS = ("avx512", "avx512_bf16", "amx")  # gemm_kind(): how bf16 GEMMs with K % 32 == 0 run


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _supported() -> str | None:
    """Why the kernels cannot run here, or None."""
    if os.environ.get("KVSTORE_CPU_KERNELS", "1") == "0":
        return "KVSTORE_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if "avx512f" not in _cpu_flags().split():
        return "the CPU has no AVX-512F"
    return None


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (_SRC.read_text(), " ".join(_FLAGS), version, _cpu_flags()))
    ).hexdigest()[:16]
    root = os.environ.get("KVSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvstore")
    out = Path(root) / "kernels" / f"cpu_kernels-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        r = subprocess.run(
            [cc, *_FLAGS, str(_SRC), "-o", str(so), "-lm"], capture_output=True, text=True, timeout=300
        )
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr[-2000:]}")
        os.replace(so, out)  # atomic: a concurrent build by another process wins or loses whole
    logger.info("compiled %s", out)
    return out


@functools.cache
def _lib() -> ctypes.CDLL | None:
    reason = _supported()
    if reason is None:
        try:
            lib = ctypes.CDLL(str(_build()))
        except (OSError, subprocess.SubprocessError) as e:
            reason = f"cannot build them: {e}"
        else:
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, (_int if name in _RETURNS_INT else None)
            flags = _cpu_flags().split()
            if os.environ.get("KVSTORE_AMX", "1") != "0" and "amx_bf16" in flags:
                if not lib.amx_enable():
                    logger.warning("the kernel refused AMX tile state (ARCH_REQ_XCOMP_PERM): AVX-512 GEMMs")
            if (
                not lib.gemm_kind()
                and os.environ.get("KVSTORE_AVX512_BF16", "1") != "0"
                and "avx512_bf16" in flags
            ):
                lib.bf16_dot_enable()  # a no-op where the compiler does not target AVX512_BF16
            return lib
    logger.warning("engine CPU kernels off (%s): torch paths instead", reason)
    return None


def available() -> bool:
    return _lib() is not None


@functools.cache
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix="cpu-kernel")


def _split(fn, total: int, *args) -> None:
    """fn(*args, begin, end) over [0, total), split over torch's intra-op thread count."""
    n = min(torch.get_num_threads(), total)
    if n <= 1:
        fn(*args, 0, total)
        return
    bounds = [total * i // n for i in range(n + 1)]
    futures = [_pool(n).submit(fn, *args, bounds[i], bounds[i + 1]) for i in range(n)]
    for f in futures:
        f.result()


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_scales(hkv: int, fp8: bool | None, *scales: torch.Tensor | None) -> None:
    """fp8 scales: fp32, contiguous, one per KV head; with `fp8` given, present exactly for an fp8 cache."""
    for s in scales:
        assert fp8 is None or (s is not None) == fp8, "scales go with an fp8 cache, and only with one"
        assert s is None or (s.dtype == torch.float32 and s.is_contiguous() and s.numel() == hkv)


def _rows(t: torch.Tensor) -> None:
    assert t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1, (t.dtype, t.shape, t.stride())


# ---- memory -----------------------------------------------------------------------------------------
HUGE_PAGE = 2 << 20


def empty_huge_pages(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 buffer of `nbytes` on fresh, 2 MiB-aligned anonymous memory that the kernel
    backs with transparent huge pages when it is first touched (madvise; a no-op where THP is off).
    Fresh memory, not the allocator's: pages a process already touched stay 4 KiB. A decode step
    streams every weight and reads KV blocks scattered over the cache: with 4 KiB pages each costs a
    TLB walk per 4 KiB (SmolLM2 bf16 decode step at batch 4: -0.6 to -1 ms of ~10)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: shmem THP)
    base = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as any view of it
    offset = -base.data_ptr() % HUGE_PAGE
    length = nbytes // HUGE_PAGE * HUGE_PAGE  # whole huge pages only: the tail keeps 4 KiB pages
    if length and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, offset, length)
        except OSError as e:
            logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    return base[offset : offset + nbytes]


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on huge pages (`empty_huge_pages`)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return empty_huge_pages(nbytes).view(dtype).view(shape).zero_()


def to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU tensors, packed one after another (64-byte aligned) into one buffer on
    huge pages: one buffer, so that small tensors do not each round up to a 2 MiB page."""
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buf = empty_huge_pages(sum(sizes))
    out, at = [], 0
    for t, size in zip(tensors, sizes, strict=True):
        nbytes = t.numel() * t.element_size()
        view = buf[at : at + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        at += size
    return out


# ---- GEMM ------------------------------------------------------------------------------------------
# bf16 panels hold their columns as c0, c16, c1, c17, ... (the kernel splits one load into two halves)
_BF16_ORDER = torch.stack([torch.arange(PANEL // 2), torch.arange(PANEL // 2, PANEL)], 1).reshape(-1)


def gemm_kind() -> str:
    """How bf16 GEMMs with K % 32 == 0 run in this process: "amx" (tile units), "avx512_bf16" (dot
    products), both on activations rounded to bf16, or "avx512" (fp32 activations, weights widened)."""
    lib = _lib()
    return GEMM_KINDS[lib.gemm_kind() if lib is not None else 0]


def attention_on_tiles(
    kv_dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int, window: int | None
) -> bool:
    """Whether `paged_decode_attention` runs on the AMX tile units for this cache and layer (bf16 or
    fp8 cache, head_dim % 32 == 0, at most 16 query heads per KV head and 64 KV heads, block_size % 16
    == 0, no sliding window): q * scale (with an fp8 cache q * scale * k_scale * 2^8) and the softmax
    numerators are rounded to bf16 there."""
    lib = _lib()
    return (
        lib is not None
        and kv_dtype in KV_TYPES
        and bool(
            lib.attention_on_tiles(
                KV_TYPES[kv_dtype], num_kv_heads, group, head_dim, block_size, int(window or 0)
            )
        )
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16/fp16 -> [ceil(N/32), K, 32] (zero-padded panels of 32 output columns; bf16 ones
    interleaved, or for AMX and AVX-512 BF16 as [K/2, 32, 2] k-pairs: see cpu_kernels.c)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    if _lib().gemm_layout(W_TYPES[weight.dtype], k):
        return padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).reshape(panels, k, PANEL).contiguous()
    packed = padded.view(panels, PANEL, k).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        packed = packed[:, :, _BF16_ORDER]
    return packed.contiguous()


def gemm_w16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias fp32 [N]) -> [M, N] fp32, W packed by `pack_weight`."""
    _rows(x)
    m, k = x.shape
    assert packed.shape[1] == k and packed.dtype in (torch.bfloat16, torch.float16), packed.shape
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib = _lib()
        _split(lib.gemm_w16, packed.shape[0], x.data_ptr(), x.stride(0), packed.data_ptr(), W_TYPES[packed.dtype],
               _ptr_of(bias), y.data_ptr(), n, m, n, k)  # fmt: skip
    return y


# ---- attention -------------------------------------------------------------------------------------
def paged_decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor | None,
    scale: float,
    window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode rows of q [N, Hq, D] (`rows[b]` for sequence b, or row b) attend to their paged KV;
    results go to the same rows of `out`. Caches: [num_blocks, block_size, Hkv, D], any KV dtype of
    KV_TYPES; fp8 values are multiplied by `k_scale`/`v_scale` [Hkv] (fp32)."""
    n, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    assert (
        q.dtype == out.dtype == torch.float32
        and q.stride(2) == 1
        and q.stride(1) == d
        and out.is_contiguous()
    )
    assert dk == d and d % 16 == 0 and d <= 256 and hq % hkv == 0 and hq // hkv <= 16, (
        q.shape,
        k_cache.shape,
    )
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
    assert block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert rows is None or (rows.dtype == torch.int64 and rows.is_contiguous())
    _check_scales(hkv, None, k_scale, v_scale)
    b = context_lens.shape[0]
    sb, st, sh, _ = k_cache.stride()
    _split(_lib().paged_decode_attention, b, q.data_ptr(), q.stride(0), out.data_ptr(), hq * d, k_cache.data_ptr(),
           v_cache.data_ptr(), KV_TYPES[k_cache.dtype], sb, st, sh, _ptr_of(k_scale), _ptr_of(v_scale),
           block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), _ptr_of(rows), scale,
           int(window or 0), hq, hkv, d, bs)  # fmt: skip


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key/value [N, Hkv*D] fp32 rows into caches [num_blocks, block_size, Hkv, D] (fp32/bf16/fp16,
    rounded to nearest even; fp8 e4m3: x / scale per KV head [Hkv], saturated at +-448, as
    `paged_attention.quantize_kv`); a negative slot is skipped."""
    _rows(key)
    _rows(value)
    nb, bs, hkv, d = k_cache.shape
    assert k_cache.dtype in KV_TYPES and k_cache.dtype == v_cache.dtype
    _check_scales(hkv, k_cache.dtype == torch.float8_e4m3fn, k_scale, v_scale)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == d and k_cache.stride(3) == 1
    assert key.shape == value.shape and key.shape[1] == hkv * d and slots.dtype == torch.int64
    assert slots.is_contiguous() and slots.shape[0] == key.shape[0]
    sb, st = k_cache.stride(0), k_cache.stride(1)
    _lib().store_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                    v_cache.data_ptr(), KV_TYPES[k_cache.dtype], sb, st, slots.data_ptr(), bs, hkv * d,
                    _ptr_of(k_scale), _ptr_of(v_scale), d, 0, key.shape[0])  # fmt: skip


# ---- elementwise -----------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * norm(x), or with `residual` (updated in place to x + residual) weight * norm(x + residual)."""
    _rows(x)
    if residual is not None:
        _rows(residual)
        assert residual.shape == x.shape
    assert weight.is_contiguous() and weight.dtype in W_TYPES and weight.shape == (x.shape[1],)
    out = torch.empty_like(x)
    _split(_lib().rms_norm, x.shape[0], x.data_ptr(), x.stride(0), _ptr_of(residual),
           residual.stride(0) if residual is not None else 0, weight.data_ptr(), W_TYPES[weight.dtype], eps,
           out.data_ptr(), out.stride(0), x.shape[1])  # fmt: skip
    return out


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
    num_kv_heads: int,
) -> None:  # fmt: skip
    """In place on q [N, Hq*D] and k [N, Hk*D] (rows may be strided views of one qkv tensor)."""
    _rows(q)
    _rows(k)
    d = cos_sin.shape[1]
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and d % 2 == 0
    assert positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape[0] == q.shape[0]
    assert q.shape[1] == num_heads * d and k.shape[1] == num_kv_heads * d
    _split(_lib().rope, q.shape[0], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
           cos_sin.data_ptr(), num_heads, num_kv_heads, d)  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(x[:, :I]) * x[:, I:]"""
    _rows(x)
    i = x.shape[1] // 2
    out = torch.empty(x.shape[0], i, dtype=torch.float32)
    _split(_lib().silu_and_mul, x.shape[0], x.data_ptr(), x.stride(0), out.data_ptr(), i, i)
    return out


# ---- a step's decoder layers in one call ------------------------------------------------------------
class _DecodeLayer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "in_norm", "post_norm",
        "k_cache", "v_cache", "k_scale", "v_scale")] + [("window", ctypes.c_int64)]  # fmt: skip


class _DecodeShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "inter", "Hq", "Hkv", "D", "block_size", "s_block", "s_tok", "s_head", "wtype", "norm_type",
        "kv_type")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]  # fmt: skip


@dataclass
class DecodeLayerWeights:
    """What `decoder_layers` reads of one decoder layer: packed weights [panels, K, 32] with their fp32
    biases (or None), the two RMSNorm weights, the layer's K and V caches and its sliding window; an fp8
    cache's scales per KV head (fp32 [Hkv]; None for 16/32-bit caches)."""

    qkv: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int | None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class FusedLayers:
    """Every decoder layer of a step in one C call, running the same kernels in the same order as the
    layer-by-layer path with every row's attention in the kernel (bit-identical results), without its
    ~10 Python calls per layer. Single-threaded: use it when torch runs one intra-op thread."""

    def __init__(self, layers: list[DecodeLayerWeights], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, scale: float) -> None:  # fmt: skip
        first = layers[0]
        hidden = first.in_norm.shape[0]
        nb, bs, hkv, d = first.k_cache.shape
        assert hkv == num_kv_heads and d == head_dim and d % 16 == 0 and num_heads % num_kv_heads == 0
        assert first.k_cache.dtype in KV_TYPES
        fp8 = first.k_cache.dtype == torch.float8_e4m3fn
        self.sizes = (hidden, num_heads * head_dim, num_kv_heads * head_dim, intermediate_size)
        self._keep: list[torch.Tensor] = []  # every tensor the C side points into stays alive
        table = (_DecodeLayer * len(layers))()
        for entry, w in zip(table, layers, strict=True):
            assert (
                w.k_cache.stride() == first.k_cache.stride() and w.v_cache.stride() == first.k_cache.stride()
            )
            assert w.k_cache.dtype == w.v_cache.dtype == first.k_cache.dtype and w.in_norm.is_contiguous()
            for name in ("qkv", "o", "gate_up", "down"):
                packed, bias = getattr(w, name)
                assert packed.dtype == layers[0].qkv[0].dtype and packed.is_contiguous()
                assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
                setattr(entry, name, packed.data_ptr())
                setattr(entry, f"{name}_bias", _ptr_of(bias))
                self._keep += [packed] + ([bias] if bias is not None else [])
            entry.in_norm, entry.post_norm = w.in_norm.data_ptr(), w.post_norm.data_ptr()
            entry.k_cache, entry.v_cache = w.k_cache.data_ptr(), w.v_cache.data_ptr()
            entry.window = int(w.window or 0)
            _check_scales(hkv, fp8, w.k_scale, w.v_scale)
            entry.k_scale, entry.v_scale = _ptr_of(w.k_scale), _ptr_of(w.v_scale)
            self._keep += [s for s in (w.k_scale, w.v_scale) if s is not None]
            self._keep += [w.in_norm, w.post_norm, w.k_cache, w.v_cache]
        sb, st, sh, _ = first.k_cache.stride()
        self._shape = _DecodeShape(
            hidden, intermediate_size, num_heads, num_kv_heads, head_dim, bs, sb, st, sh,
            W_TYPES[first.qkv[0].dtype], W_TYPES[first.in_norm.dtype], KV_TYPES[first.k_cache.dtype], eps, scale,
        )  # fmt: skip
        self._table = table
        self.num_layers = len(layers)
        self._cache_ptrs = (first.k_cache.data_ptr(), _ptr_of(first.k_scale))

    def serves(self, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
        """Whether the table still points at this cache and these fp8 scales (the first layer's)."""
        return self._cache_ptrs == (k_cache.data_ptr(), _ptr_of(k_scale))

    def __call__(self, res: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """res [M, hidden] fp32 embeddings (becomes the residual stream, in place) -> (the last layer's
        MLP output, res); the model's final norm is of their sum. Row r's attention: `block_tables[r]`
        and `context_lens[r]` (AttentionPlan.per_row)."""
        _rows(res)
        m = res.shape[0]
        assert res.is_contiguous() and m == positions.shape[0] == slots.shape[0] == context_lens.shape[0]
        assert (
            positions.dtype == slots.dtype == torch.int64
            and positions.is_contiguous()
            and slots.is_contiguous()
        )
        assert block_tables.dtype == context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
        assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
        hidden, qs, kvs, inter = self.sizes
        x, normed = torch.empty(m, hidden), torch.empty(m, hidden)
        qkv, attn = torch.empty(m, qs + 2 * kvs), torch.empty(m, qs)
        gu, act = torch.empty(m, 2 * inter), torch.empty(m, inter)
        _lib().decoder_layers(ctypes.addressof(self._table), self.num_layers, ctypes.addressof(self._shape),
                             res.data_ptr(), x.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                             gu.data_ptr(), act.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(),
                             slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                             context_lens.data_ptr(), m)  # fmt: skip
        return x, res
