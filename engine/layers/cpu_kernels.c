/* CPU kernels of the engine (AVX-512F), built and loaded on first use by engine/layers/cpu_lib.py;
 * called through cpu_ops.py (one kernel a call) and fused_layers.py (decoder_layers).
 *
 * Why: on CPUs without AVX-512 BF16 or AMX (e.g. Ice Lake), oneDNN/MKL run bf16 GEMMs by emulation,
 * 2x slower than fp32 at decode sizes. These kernels keep 16-bit weights in memory (half the bytes a
 * weight-bound decode step reads) and widen them in registers to fp32 FMAs; activations stay fp32.
 *
 * - gemm_w16: y[M,N] = x[M,K] @ W^T (+ bias), W bf16/fp16 packed as [ceil(N/32)][K][32] (see there);
 *   on CPUs with AMX (and when amx_enable() was called), bf16 weights with K % 32 == 0 are packed for the
 *   tile units instead and x is rounded to bf16 (what oneDNN does there): see gemm_amx; on CPUs with
 *   AVX512_BF16 but no AMX (bf16_dot_enable()), the same packing feeds VDPBF16PS: see gemm_dot;
 * - paged_decode_attention: one query token per sequence against its paged KV, read in place from
 *   the cache blocks (fp32, bf16, fp16, or fp8 e4m3 with a scale per KV head), GQA aware;
 * - store_kv: writes new K/V rows into their cache slots (rounding to the cache dtype);
 * - rms_norm (optionally fused with the residual add), rope (rotate_half layout), silu_and_mul.
 *
 * Every entry point works on rows [row_begin, row_end) or panels [p_begin, p_end) so the caller can
 * split work across threads. All activations are fp32, contiguous in their last dimension.
 */
#define _GNU_SOURCE /* syscall() */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { F32 = 0, BF16 = 1, F16 = 2, FP8_E4M3 = 3 };
#define NR 32 /* output columns per packed weight panel */
#define MR 8  /* rows of x per micro-kernel call */

/* ---- 16/8-bit to fp32 ------------------------------------------------------------------------- */
static inline __m512 cvt_bf16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline __m512 load16(const void* p, int type) {
    /* 16 values at p (element index already applied) as fp32; fp8 values still need x256 (see below) */
    switch (type) {
    case BF16: return cvt_bf16(_mm256_loadu_si256((const __m256i*)p));
    case F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    case FP8_E4M3: {
        /* e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000: the same value scaled by 2^-8 (exponent bias 7 vs
           15), subnormals included; the caller folds the 2^8 into its scale. */
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    }
    default: return _mm512_loadu_ps((const float*)p);
    }
}
static inline int64_t elem_size(int type) { return type == F32 ? 4 : (type == FP8_E4M3 ? 1 : 2); }
static inline float type_scale(int type) { return type == FP8_E4M3 ? 256.0f : 1.0f; }

/* ---- fp32 to 16-bit, round to nearest even ----------------------------------------------------- */
static inline __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); /* keep NaN a (quiet) NaN */
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* fp32 to e4m3 (the bias-7 fp8 of torch.float8_e4m3fn), round to nearest even: the caller has
 * clamped to +-448, the largest finite value (e4m3 has no infinities; NaN stays NaN, 0x7F). */
static inline uint8_t to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFF;
    if (u > 0x7F800000) return sign | 0x7F;
    float a;
    memcpy(&a, &u, 4);
    if (a < 0.015625f) /* below 2^-6: subnormal steps of 2^-9; 8 of them is the first normal, 0x08 */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    int32_t e = (int32_t)(u >> 23) - 127;
    uint32_t m = (u >> 20) & 7, rest = u & 0xFFFFF;
    if (rest > 0x80000 || (rest == 0x80000 && (m & 1))) m++;
    if (m == 8) m = 0, e++;
    return sign | (uint8_t)(((e + 7) << 3) | m);
}

/* ---- exp ------------------------------------------------------------------------------------- */
static inline __m512 exp512(__m512 x) {
    /* 2^n * p(r), r = x - n ln2, |r| <= ln2/2; relative error ~2e-7 */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* ---- GEMM with 16-bit weights ----------------------------------------------------------------- */
/* bf16 panels store their 32 columns interleaved (c0, c16, c1, c17, ...): one 64-byte load gives
 * columns 0-15 with a shift and columns 16-31 with a mask (half the conversion work of widening
 * two 16-lane halves). fp16 panels keep columns in order (cvtph widens 16 at a time). */
static inline __attribute__((always_inline)) void gemm_micro(const float* x, int64_t ldx, const uint16_t* w,
                                                             const int wtype, int64_t K, float* y, int64_t ldy,
                                                             const float* bias, const int mr, __mmask16 m0,
                                                             __mmask16 m1) {
    __m512 acc[MR][2];
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        /* one cache line of weights per k; the hardware prefetcher alone falls behind */
        _mm_prefetch((const char*)(w + (k + 128) * NR), _MM_HINT_T0);
        __m512 w0, w1;
        if (wtype == BF16) {
            const __m512i raw = _mm512_loadu_si512((const void*)(w + k * NR));
            w0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
            w1 = _mm512_castsi512_ps(_mm512_and_si512(raw, hi_mask));
        } else {
            w0 = load16(w + k * NR, F16);
            w1 = load16(w + k * NR + 16, F16);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
                acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            }
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_maskz_loadu_ps(m0, bias);
        b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (i < mr) {
            _mm512_mask_storeu_ps(y + i * ldy, m0, _mm512_add_ps(acc[i][0], b0));
            _mm512_mask_storeu_ps(y + i * ldy + 16, m1, _mm512_add_ps(acc[i][1], b1));
        }
    }
}

static inline __mmask16 lane_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* Rows of the row tile that starts at m, for M rows cut into ceil(M / MR) tiles as even as possible
 * (9 rows: 5 + 4, not 8 + 1, whose 1-row tile waits on its accumulators' latency). A row's sums do
 * not depend on its tile, so this changes no result. */
static inline int tile_rows(int64_t M, int64_t m) {
    const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, extra = M % tiles;
    return (int)(m < extra * (base + 1) ? base + 1 : base);
}

#define GEMM_CASE(T, R)                                                                                    \
    case R: gemm_micro(x + m * ldx, ldx, wp, T, K, y + m * ldy + n0, ldy, b, R, m0, m1); break;
#define GEMM_ROWS(T)                                                                                       \
    switch (tile_rows(M, m)) {                                                                             \
        GEMM_CASE(T, 1) GEMM_CASE(T, 2) GEMM_CASE(T, 3) GEMM_CASE(T, 4)                                    \
        GEMM_CASE(T, 5) GEMM_CASE(T, 6) GEMM_CASE(T, 7) GEMM_CASE(T, 8)                                    \
    }

/* ---- GEMM on the AMX tile units ---------------------------------------------------------------- */
/* A panel of 32 output columns is [K/2][32][2]: k-pairs of a column adjacent, as TDPBF16PS reads its B
 * tile (16 k-pairs x 16 columns x 2, rows of 64 bytes; the panel's two B tiles interleave with a
 * 128-byte stride). x is rounded to bf16 into rows of 16-row groups (zero rows pad the last). Each
 * output element accumulates its K in the same order (32 at a time, ascending) whatever M, so a row's
 * result does not depend on the rows beside it: chunked prefill, decode and a recomputation agree bit
 * for bit. Tiles: 0-3 C (2 x 2 blocks of 16 x 16 fp32), 4-5 A, 6-7 B. */
static int g_amx = 0;

/* Ask Linux for the tile-data state (once per process); 1 when the AMX kernel is in use from now on. */
int amx_enable(void) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (!g_amx) g_amx = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#endif
    return g_amx;
}

#define MAX_TILE_KV_HEADS 64 /* attend_amx keeps 1 / sum for 16 columns of each */

/* 1 when paged_decode_attention runs on the tile units for such a cache and layer (see attend_amx) */
int attention_on_tiles(int kv_type, int64_t Hkv, int64_t G, int64_t D, int64_t block_size, int64_t window) {
    return g_amx && (kv_type == BF16 || kv_type == FP8_E4M3) && D % 32 == 0 && G <= 16 && block_size % 16 == 0 && window <= 0 &&
           Hkv <= MAX_TILE_KV_HEADS;
}

/* ---- GEMM with AVX-512 BF16 dot products --------------------------------------------------------- */
/* Where the CPU has AVX512_BF16 but no AMX (Zen 4/5, Cooper Lake), bf16 weights use the AMX panels
 * ([K/2][32][2] k-pairs) and x rounded to bf16, as on the tiles: VDPBF16PS adds a k-pair's two exact
 * products to each fp32 lane, so one instruction does the work of two FMAs and no weight is widened
 * (2x the GEMM rate of gemm_micro here: ~480 vs ~245 GFLOP/s on one Zen 5 core). Each output element
 * sums its k-pairs in ascending order whatever M, so rows stay independent, as on the other paths. */
static int g_dot = 0;

/* 1 when bf16 GEMMs with K % 32 == 0 take the dot-product kernel from now on (AMX, if on, wins). */
int bf16_dot_enable(void) {
#if defined(__AVX512BF16__)
    g_dot = 1;
#endif
    return g_dot;
}

/* How gemm_w16 reads a weight of this type and K: 1 = k-pair panels (AMX or AVX-512 BF16 dot
 * products, x rounded to bf16), 0 = the AVX-512 panels (fp32 x, weights widened). */
int gemm_layout(int wtype, int64_t K) { return (g_amx || g_dot) && wtype == BF16 && K % 32 == 0; }

/* Which kernel bf16 GEMMs with K % 32 == 0 take: 2 = AMX tiles, 1 = AVX-512 BF16 dot products, 0 = gemm_micro. */
int gemm_kind(void) { return g_amx ? 2 : g_dot; }

/* x rounded to bf16 rows [mc rows, K] (zero rows up to mp): the A operand of both k-pair kernels. */
static inline void round_rows_bf16(const float* x, int64_t ldx, uint16_t* xb, int64_t mc, int64_t mp, int64_t K) {
    for (int64_t r = 0; r < mp; r++)
        for (int64_t e = 0; e < K; e += 16)
            _mm256_store_si256((__m256i*)(xb + r * K + e),
                               r < mc ? to_bf16(_mm512_loadu_ps(x + r * ldx + e)) : _mm256_setzero_si256());
}

/* A thread's reused bf16 copy of up to `rows` x K activations. */
static inline uint16_t* bf16_rows_buffer(int64_t rows, int64_t K) {
    static _Thread_local uint16_t* xb = 0;
    static _Thread_local int64_t cap = 0;
    if (rows * K > cap) {
        free(xb);
        cap = rows * K;
        xb = (uint16_t*)aligned_alloc(64, cap * 2);
    }
    return xb;
}

#define XB_CHUNK 256 /* rows of x per pass over the panels (their bf16 copy stays in L2) */

/* Panel p of a k-pair packed weight: where it lies, its output columns' lane masks and bias. */
typedef struct {
    const uint16_t* w;
    int64_t n0;
    __mmask16 k0, k1;
    __m512 b0, b1;
} KPairPanel;

static inline KPairPanel kpair_panel(const uint16_t* w, const float* bias, int64_t N, int64_t K, int64_t p) {
    KPairPanel q = {w + p * K * NR, p * NR, lane_mask(N - p * NR), lane_mask(N - p * NR - 16), _mm512_setzero_ps(),
                    _mm512_setzero_ps()};
    if (bias) {
        q.b0 = _mm512_maskz_loadu_ps(q.k0, bias + q.n0);
        q.b1 = _mm512_maskz_loadu_ps(q.k1, bias + q.n0 + 16);
    }
    return q;
}

/* A panel (32 output columns, K rows of 64 bytes) is read once per row tile of x. With one tile
 * (M <= MR) it streams from memory as the tile goes, prefetched `ahead` of its use. With several
 * (decode batches past MR rows, prompts) the later tiles compute from cache while memory would idle,
 * so then each tile prefetches its share of the NEXT panel instead (`next_lines` lines at `next`,
 * one per step of its k loop), and memory keeps streaming under the compute: SmolLM2's MLP weights
 * (30 layers, from memory) at 16 rows 8.3 -> 5.7 ms, a batch-16 decode step 17.5 -> 14.2 ms. The first
 * tile of the first panel still prefetches its own panel ahead. (gemm_micro needs none of this: at
 * more than MR rows its widening FMAs are slower than memory anyway.) */
typedef struct {
    int ahead;
    const char* next;
    int64_t next_lines;
} PanelPrefetch;

static inline PanelPrefetch panel_prefetch(const uint16_t* wp, int64_t K, int64_t p, int64_t p_begin, int64_t p_end,
                                           int64_t tiles, int64_t t) {
    PanelPrefetch pf = {tiles == 1 || (p == p_begin && t == 0), 0, 0};
    if (tiles > 1 && p + 1 < p_end) {
        const int64_t share = K / tiles; /* lines of the next panel per tile; the last takes the rest */
        pf.next = (const char*)(wp + K * NR) + t * share * 64;
        pf.next_lines = t + 1 == tiles ? K - t * share : share;
    }
    return pf;
}

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void gemm_dot_micro(const uint16_t* xb, int64_t K, const uint16_t* w,
                                                                 PanelPrefetch pf, float* y, int64_t ldy,
                                                                 __m512 b0, __m512 b1,
                                                                 const int mr, __mmask16 m0, __mmask16 m1) {
    __m512 acc[MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        if (pf.ahead) { /* two lines a k-pair, 64 k-pairs ahead */
            _mm_prefetch((const char*)(w + (k + 64) * NR), _MM_HINT_T0);
            _mm_prefetch((const char*)(w + (k + 64) * NR + 32), _MM_HINT_T0);
        }
        if (k / 2 < pf.next_lines) _mm_prefetch(pf.next + k / 2 * 64, _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + k * NR));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(w + k * NR + 32));
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                int32_t pair;
                memcpy(&pair, xb + i * K + k, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (i < mr) {
            _mm512_mask_storeu_ps(y + i * ldy, m0, _mm512_add_ps(acc[i][0], b0));
            _mm512_mask_storeu_ps(y + i * ldy + 16, m1, _mm512_add_ps(acc[i][1], b1));
        }
    }
}

#define DOT_CASE(R)                                                                                        \
    case R: gemm_dot_micro(xb + m * K, K, q.w, pf, y + (m0 + m) * ldy + q.n0, ldy, q.b0, q.b1, R, q.k0, q.k1); break;

static void gemm_dot(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end) {
    uint16_t* xb = bf16_rows_buffer(M < XB_CHUNK ? M : XB_CHUNK, K);
    for (int64_t m0 = 0; m0 < M; m0 += XB_CHUNK) {
        const int64_t mc = M - m0 < XB_CHUNK ? M - m0 : XB_CHUNK;
        round_rows_bf16(x + m0 * ldx, ldx, xb, mc, mc, K);
        for (int64_t p = p_begin; p < p_end; p++) {
            const KPairPanel q = kpair_panel(w, bias, N, K, p);
            const int64_t tiles = (mc + MR - 1) / MR;
            for (int64_t m = 0, t = 0; m < mc; m += tile_rows(mc, m), t++) {
                const PanelPrefetch pf = panel_prefetch(q.w, K, p, p_begin, p_end, tiles, t);
                switch (tile_rows(mc, m)) {
                    DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
                }
            }
        }
    }
}
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void gemm_amx(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end) {
    uint16_t* xb = bf16_rows_buffer(M < XB_CHUNK ? (M + 15) / 16 * 16 : XB_CHUNK, K);
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    float c[4][16][16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += XB_CHUNK) {
        const int64_t mc = M - m0 < XB_CHUNK ? M - m0 : XB_CHUNK, mp = (mc + 15) / 16 * 16;
        round_rows_bf16(x + m0 * ldx, ldx, xb, mc, mp, K);
        for (int64_t p = p_begin; p < p_end; p++) {
            const KPairPanel q = kpair_panel(w, bias, N, K, p);
            const uint16_t* wp = q.w;
            for (int64_t m = 0; m < mp; m += 32) {
                const int two = mp - m > 16; /* a second 16-row block of A */
                const uint16_t* a = xb + m * K;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < K; kb += 32) {
                    _tile_loadd(4, a + kb, K * 2);
                    _tile_loadd(6, wp + kb * NR, 2 * NR * 2);
                    _tile_loadd(7, wp + kb * NR + 32, 2 * NR * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a + 16 * K + kb, K * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                if (two) {
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                }
                for (int64_t i = 0; i < 32 && m + i < mc; i++) {
                    float* out = y + (m0 + m + i) * ldy + q.n0;
                    const int t = i < 16 ? 0 : 2;
                    _mm512_mask_storeu_ps(out, q.k0, _mm512_add_ps(_mm512_load_ps(c[t][i & 15]), q.b0));
                    _mm512_mask_storeu_ps(out + 16, q.k1, _mm512_add_ps(_mm512_load_ps(c[t + 1][i & 15]), q.b1));
                }
            }
        }
    }
    _tile_release();
}
#endif

void gemm_w16(const float* x, int64_t ldx, const uint16_t* w, int wtype, const float* bias, float* y,
              int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (g_amx && gemm_layout(wtype, K)) {
        gemm_amx(x, ldx, w, bias, y, ldy, M, N, K, p_begin, p_end);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    if (gemm_layout(wtype, K)) {
        gemm_dot(x, ldx, w, bias, y, ldy, M, N, K, p_begin, p_end);
        return;
    }
#endif
    for (int64_t p = p_begin; p < p_end; p++) {
        const uint16_t* wp = w + p * K * NR;
        int64_t n0 = p * NR;
        __mmask16 m0 = lane_mask(N - n0), m1 = lane_mask(N - n0 - 16);
        const float* b = bias ? bias + n0 : 0;
        for (int64_t m = 0; m < M; m += tile_rows(M, m)) {
            if (wtype == BF16) {
                GEMM_ROWS(BF16)
            } else {
                GEMM_ROWS(F16)
            }
        }
    }
}

/* ---- paged decode attention ------------------------------------------------------------------- */
#define MAX_D16 16 /* head_dim up to 256 */
#define MAX_G 16   /* query heads per KV head */

/* The 16 horizontal sums of v[0..15] as one vector (element i = sum of v[i]): a transpose-and-add
 * tree, ~3 instructions per sum instead of the 8 of _mm512_reduce_add_ps. */
static inline __m512 hsum16(const __m512* v) {
    __m512 p[8], q[4];
    for (int i = 0; i < 8; i++)
        p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(p[2 * i]), b = _mm512_castps_pd(p[2 * i + 1]);
        q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x88), _mm512_shuffle_f32x4(q[0], q[1], 0xDD));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x88), _mm512_shuffle_f32x4(q[2], q[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

/* Softmax over scores s[0, n): the max (broadcast), and exp(s[t..t+16) - max) with lanes past n zero. */
static inline __m512 scores_max(const float* s, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16)
        m = _mm512_mask_max_ps(m, lane_mask(n - t), m, _mm512_maskz_loadu_ps(lane_mask(n - t), s + t));
    return _mm512_set1_ps(_mm512_reduce_max_ps(m));
}
static inline __m512 exp_shifted(const float* s, int64_t t, int64_t n, __m512 mx) {
    const __mmask16 mk = lane_mask(n - t);
    return _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + t), mx)));
}

typedef struct {
    const void *k_cache, *v_cache;
    int kv_type;
    int64_t s_block, s_tok, s_head, block_size, esz;
    const int32_t* table;
} PagedKV;

static inline const char* kv_row(const PagedKV* c, const void* base, int64_t pos, int64_t h) {
    return (const char*)base +
           (c->table[pos / c->block_size] * c->s_block + (pos % c->block_size) * c->s_tok + h * c->s_head) * c->esz;
}

/* The next block of a sequence lies anywhere in the cache, so the hardware prefetcher cannot run ahead
 * across the jump: each pass prefetches the next block's rows (all heads) while it works on a block, a
 * token's row at a time (a whole block at once overflows the core's miss queue; measured 2 blocks ahead
 * no better). 4 x 600-token decode attention over 30 layers from DRAM: 5.5 -> 3.1 ms. A decode row
 * (`cold`: its KV was not just read by the row before) also has pass 1 prefetch the V block pass 2 will
 * read, and pass 2 the K blocks of the next row's sequence (`next`), so both passes stream two blocks
 * per block computed and the second pass and the next row start warm: 4 x 500 tokens x 30 layers with
 * the weights streamed in between and blocks scattered as in a long-running engine 4.1 -> 3.0 ms. */
static inline const char* next_block_row(const PagedKV* c, const void* base, int64_t pos, int64_t t, int64_t n) {
    return t < n ? kv_row(c, base, pos, 0) : 0;
}
/* always_inline: a call inside the token loops would spill the q and accumulator registers */
static inline __attribute__((always_inline)) void prefetch_row(const char* next, int64_t j, int64_t tok) {
    if (next)
        for (int64_t off = 0; off < tok; off += 64) _mm_prefetch(next + j * tok + off, _MM_HINT_T0);
}

/* One sequence, all its KV heads: query head h*G + g (G per KV head) attends to positions
 * [first, first + n). Two passes over the blocks (scores, then the weighted sum of V) with a softmax
 * in between. Each pass walks the blocks once and does every head inside a block before the next
 * block, so a block's rows (all heads, contiguous) are read together: the blocks of a sequence lie
 * anywhere in the cache, and a head-by-head walk re-streams every block once per head. Per query head
 * the arithmetic (and its order) is that of a head-at-a-time loop. G and D16 are compile-time
 * constants in the specialised copies below, so the head's q, accumulators and K/V rows stay in
 * registers. scores: [Hkv*G, n]; part: [Hkv*G, 16] and accs: [Hkv*G, D16] vectors of scratch. */
static inline __attribute__((always_inline)) void attend_seq(const PagedKV* c, const float* q, float* out,
                                                             int64_t Hkv, int64_t first, int64_t n,
                                                             const float* ks, const float* vs, float* scores,
                                                             __m512* part, __m512* accs, int cold,
                                                             const PagedKV* next, int64_t next_first,
                                                             int64_t next_n, const int G,
                                                             const int D16, const int kv_type) {
    const int64_t D = D16 * 16, bs = c->block_size, tok = c->s_tok * c->esz, head = c->s_head * c->esz;
    const int64_t h_more = Hkv > 1; /* the head whose token loop issues the extra prefetches (below) */
    /* pass 1: q.k per token, 16 tokens' partial vectors summed at once (hsum16) */
    for (int64_t t0 = 0, pos = first; t0 < n;) {
        const int64_t len = bs - pos % bs < n - t0 ? bs - pos % bs : n - t0;
        const char* row = kv_row(c, c->k_cache, pos, 0);
        const char* next_k = next_block_row(c, c->k_cache, pos + len, t0 + len, n);
        const char* this_v = cold ? kv_row(c, c->v_cache, pos, 0) : 0; /* the block pass 2 reads */
        for (int64_t h = 0; h < Hkv; h++) {
            __m512 qv[MAX_G][MAX_D16];
#pragma GCC unroll 16
            for (int g = 0; g < G; g++)
#pragma GCC unroll 16
                for (int d = 0; d < D16; d++)
                    qv[g][d] = _mm512_mul_ps(_mm512_loadu_ps(q + (h * G + g) * D + d * 16), _mm512_set1_ps(ks[h]));
            __m512* ph = part + h * G * 16;
            const char* kp = row + h * head;
            for (int64_t j = 0; j < len; j++, kp += tok) {
                const int64_t t = t0 + j;
                if (h == 0) prefetch_row(next_k, j, tok);
                if (h == h_more) prefetch_row(this_v, j, tok);
                __m512 kv[MAX_D16];
#pragma GCC unroll 16
                for (int d = 0; d < D16; d++) kv[d] = load16(kp + d * 16 * c->esz, kv_type);
                const int slot = (int)(t & 15);
#pragma GCC unroll 16
                for (int g = 0; g < G; g++) {
                    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
#pragma GCC unroll 16
                    for (int d = 1; d < D16; d++) acc = _mm512_fmadd_ps(qv[g][d], kv[d], acc);
                    ph[g * 16 + slot] = acc;
                }
                if (slot == 15 || t == n - 1) {
                    const int64_t base = t - slot;
                    const __mmask16 mk = lane_mask(slot + 1);
                    for (int g = 0; g < G; g++) {
                        for (int i = slot + 1; i < 16; i++) ph[g * 16 + i] = _mm512_setzero_ps();
                        _mm512_mask_storeu_ps(scores + (h * G + g) * n + base, mk, hsum16(ph + g * 16));
                    }
                }
            }
        }
        t0 += len;
        pos += len;
    }
    for (int64_t hg = 0; hg < Hkv * G; hg++) {
        float* s = scores + hg * n;
        const __m512 mx = scores_max(s, n);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            const __m512 e = exp_shifted(s, t, n, mx);
            _mm512_mask_storeu_ps(s + t, lane_mask(n - t), e);
            sum = _mm512_add_ps(sum, e);
        }
        const float inv = vs[hg / G] / _mm512_reduce_add_ps(sum);
        for (int d = 0; d < D16; d++) accs[hg * D16 + d] = _mm512_setzero_ps();
        part[hg] = _mm512_set1_ps(inv); /* pass 1 is done with part: it keeps the 1 / sums now */
    }
    /* pass 2: the probability-weighted sum of V, accumulators kept per head across blocks */
    for (int64_t t0 = 0, pos = first; t0 < n;) {
        const int64_t len = bs - pos % bs < n - t0 ? bs - pos % bs : n - t0;
        const char* row = kv_row(c, c->v_cache, pos, 0);
        const char* next_v = next_block_row(c, c->v_cache, pos + len, t0 + len, n);
        /* the next sequence's K block at the same index, for its pass 1 */
        const char* next_seq_k = next ? next_block_row(next, next->k_cache, next_first + t0, t0, next_n) : 0;
        for (int64_t h = 0; h < Hkv; h++) {
            __m512 acc[MAX_G][MAX_D16];
#pragma GCC unroll 16
            for (int g = 0; g < G; g++)
#pragma GCC unroll 16
                for (int d = 0; d < D16; d++) acc[g][d] = accs[(h * G + g) * D16 + d];
            const char* vp = row + h * head;
            const float* sh = scores + h * G * n;
            for (int64_t j = 0; j < len; j++, vp += tok) {
                const int64_t t = t0 + j;
                if (h == 0) prefetch_row(next_v, j, tok);
                if (h == h_more) prefetch_row(next_seq_k, j, tok);
                __m512 vv[MAX_D16];
#pragma GCC unroll 16
                for (int d = 0; d < D16; d++) vv[d] = load16(vp + d * 16 * c->esz, kv_type);
#pragma GCC unroll 16
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(sh[g * n + t]);
#pragma GCC unroll 16
                    for (int d = 0; d < D16; d++) acc[g][d] = _mm512_fmadd_ps(p, vv[d], acc[g][d]);
                }
            }
#pragma GCC unroll 16
            for (int g = 0; g < G; g++)
#pragma GCC unroll 16
                for (int d = 0; d < D16; d++) accs[(h * G + g) * D16 + d] = acc[g][d];
        }
        t0 += len;
        pos += len;
    }
    for (int64_t hg = 0; hg < Hkv * G; hg++)
        for (int d = 0; d < D16; d++) _mm512_storeu_ps(out + hg * D + d * 16, _mm512_mul_ps(accs[hg * D16 + d], part[hg]));
}

typedef void (*attend_fn)(const PagedKV*, const float*, float*, int64_t, int64_t, int64_t, const float*,
                          const float*, float*, __m512*, __m512*, int, const PagedKV*, int64_t, int64_t);
#define ATTEND_ARGS(G, D16) c, q, out, Hkv, first, n, ks, vs, scores, part, accs, cold, next, next_first, next_n, G, D16
#define ATTEND(G, D16)                                                                                     \
    static void attend_##G##_##D16(const PagedKV* c, const float* q, float* out, int64_t Hkv, int64_t first, \
                                   int64_t n, const float* ks, const float* vs, float* scores, __m512* part, \
                                   __m512* accs, int cold, const PagedKV* next, int64_t next_first,          \
                                   int64_t next_n) {                                                         \
        switch (c->kv_type) { /* the dtype is a constant inside each copy too */                             \
        case BF16: attend_seq(ATTEND_ARGS(G, D16), BF16); break;                                             \
        case F16: attend_seq(ATTEND_ARGS(G, D16), F16); break;                                               \
        case FP8_E4M3: attend_seq(ATTEND_ARGS(G, D16), FP8_E4M3); break;                                     \
        default: attend_seq(ATTEND_ARGS(G, D16), F32); break;                                                \
        }                                                                                                    \
    }
#define ATTEND_G(G) ATTEND(G, 1) ATTEND(G, 2) ATTEND(G, 4) ATTEND(G, 8)
ATTEND_G(1) ATTEND_G(2) ATTEND_G(3) ATTEND_G(4) ATTEND_G(5) ATTEND_G(6) ATTEND_G(7) ATTEND_G(8)
#define ROW(G) {attend_##G##_1, attend_##G##_2, 0, attend_##G##_4, 0, 0, 0, attend_##G##_8}
static const attend_fn ATTEND_TABLE[9][8] = {{0}, ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6), ROW(7), ROW(8)};

static void attend_generic(const PagedKV* c, const float* q, int64_t ldh, float* out, int64_t h, int64_t first,
                           int64_t n, float ks, float vs, float* scores, int G, int D16) {
    /* shapes without a specialised copy: one query head at a time (G = 1 per call) */
    for (int g = 0; g < G; g++) {
        float* s = scores;
        for (int64_t t = 0; t < n; t++) {
            const char* kp = kv_row(c, c->k_cache, first + t, h);
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < D16; d++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * ldh + d * 16), load16(kp + d * 16 * c->esz, c->kv_type), acc);
            s[t] = _mm512_reduce_add_ps(acc) * ks;
        }
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        for (int64_t t = 0; t < n; t++) sum += (s[t] = expf(s[t] - mx));
        for (int d = 0; d < D16; d++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(s[t]),
                                      load16(kv_row(c, c->v_cache, first + t, h) + d * 16 * c->esz, c->kv_type), acc);
            _mm512_storeu_ps(out + g * ldh + d * 16, _mm512_mul_ps(acc, _mm512_set1_ps(vs / sum)));
        }
    }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* ---- paged attention on the AMX tile units (bf16 and fp8 caches) ------------------------------ */
/* R query rows of one sequence (R = 1 for a decode row; up to 16 / G consecutive prompt rows, which
 * share the block table) against their contexts [0, ns[r]), every KV head h. A tile column is one
 * (row r, query head g) pair, j = r * G + g, J = R * G <= 16 of them.
 * - Scores: S^T[16 tokens, J] = K[16 tokens, D] . (q * scale)^T, K rows loaded as A tiles straight from
 *   a bf16 cache (16 tokens of one block, the cache's token stride), q * scale rounded to bf16. An fp8
 *   cache's 16 rows are widened to bf16 first: e4m3 values are exact in bf16 (as x 2^-8, see load16;
 *   the 2^8 and the fp8 scales are in q's and V's scales), so only the rounding of q * scale differs.
 * - Softmax per column in fp32 (max, exp, sum over its own context).
 * - O[J, D] = P[J, tokens] . V[tokens, D], P = bf16(exp(s - max)) with zeros past a column's context,
 *   V rewritten per 32 tokens into the B tile's token pairs (zeros past the longest context); O / sum.
 * Per element the tiles sum in a fixed order and the other columns only add exact zeros to it, so a
 * row's result does not depend on the rows it was grouped with: decode and prefill rows, however
 * chunked, agree bit for bit. Tiles: pass 1: 0-3 S^T of four KV heads, 4-5 K, 6-7 q^T; pass 2: 1 V
 * pairs, 3 P, 4-7 O (16 dims each). */
typedef struct {
    float* scores; /* [Hkv][16][cap] fp32: column j's scores */
    uint16_t* pb;  /* [Hkv][16][cap] bf16 P */
    uint16_t* qt;  /* [Hkv][D/32][16][32] bf16 q^T pairs (64-byte rows) */
    uint16_t* vt;  /* [4][16][32] bf16 V pairs: 32 tokens x 64 dims */
    uint16_t* kb;  /* fp8 caches: [cap][D] bf16 K rows of one KV head */
    float* cbuf;   /* [4][16][16] fp32 */
    int64_t cap;
} AmxScratch;

/* 32 cache values at p as bf16: a bf16 cache as is; e4m3 x 2^-8 (the value load16 gives, exact in
 * bf16) straight in 16-bit lanes: s.eeee.mmm -> s.(eeee + 112).mmm0000 for eeee > 0, and the eight
 * subnormals m x 2^-17 from a table (m = 0 -> 0). e4m3's NaN (0x7F) reads as 1.875, as in load16. */
static inline __m512i load32_bf16(const char* p, int kv_type) {
    if (kv_type == BF16) return _mm512_loadu_si512(p);
    static const uint16_t subnormal[32] __attribute__((aligned(64))) = {0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860};
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(112 << 7));
    r = _mm512_mask_permutexvar_epi16(r, _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78)), mag,
                                      _mm512_load_si512(subnormal));
    return _mm512_ternarylogic_epi32(r, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8); /* r | sign */
}

static void amx_attention_config(int J, int pass) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        const int narrow = pass == 1 ? (t < 4 || t >= 6) : (t >= 3); /* J columns / J rows */
        cfg.rows[t] = (uint8_t)(pass == 2 && narrow ? J : 16);
        cfg.colsb[t] = (uint16_t)(pass == 1 && narrow ? J * 4 : 64);
    }
    _tile_loadconfig(&cfg);
}

static void attend_amx(const PagedKV* c, const float* const* qs, float* const* outs, const int64_t* ns, int R,
                       int64_t Hkv, const float* ks, const float* vs, AmxScratch* w, int G, int64_t D) {
    const int J = R * G;
    const int64_t nmax = ns[R - 1], npad = (nmax + 31) / 32 * 32, D32 = D / 32, tok = c->s_tok * c->esz;
    const int wide = c->kv_type == BF16; /* K tiles straight from the cache, else from w->kb */
    const int64_t ld = w->cap;
    for (int64_t h = 0; h < Hkv; h++) /* q^T: row k of chunk dc, column j = (q_j[32dc + 2k], q_j[32dc + 2k + 1]) */
        for (int64_t dc = 0; dc < D32; dc++) {
            uint16_t* qt = w->qt + (h * D32 + dc) * 16 * 32;
            const __m512 sc = _mm512_set1_ps(ks[h]);
            for (int j = 0; j < J; j++) {
                const float* qv = qs[j / G] + (h * G + j % G) * D + dc * 32;
                uint16_t tmp[32];
                _mm256_storeu_si256((__m256i*)tmp, to_bf16(_mm512_mul_ps(_mm512_loadu_ps(qv), sc)));
                _mm256_storeu_si256((__m256i*)(tmp + 16), to_bf16(_mm512_mul_ps(_mm512_loadu_ps(qv + 16), sc)));
                for (int k = 0; k < 16; k++) {
                    qt[k * 32 + j * 2] = tmp[2 * k];
                    qt[k * 32 + j * 2 + 1] = tmp[2 * k + 1];
                }
            }
        }
    const __m512i gidx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __m512i pair0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), pair1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    float inv[MAX_TILE_KV_HEADS * 16];
    amx_attention_config(J, 1);
    const int64_t kld = wide ? tok : D * 2; /* bytes between a K tile's rows */
    for (int64_t h = 0; h < Hkv; h++) {
        float* scores = w->scores + h * 16 * ld;
        /* fp8: the head's K rows widened first, all of them (tile loads right after the stores that
         * wrote their rows stall: 2x slower); rows past the context too, masked below as on bf16 */
        for (int64_t t0 = 0; !wide && t0 < nmax; t0 += 16) {
            const char* kp = kv_row(c, c->k_cache, t0, h);
            for (int r = 0; r < 16; r++)
                for (int64_t e = 0; e < D; e += 32)
                    _mm512_storeu_si512(w->kb + (t0 + r) * D + e, load32_bf16(kp + r * tok + e, c->kv_type));
        }
        for (int64_t t0 = 0; t0 < nmax; t0 += 64) { /* pass 1: four groups of 16 tokens in flight */
            const char* kp[4];
            int ng = 0;
            for (int64_t t = t0; t < nmax && ng < 4; t += 16)
                kp[ng++] = wide ? kv_row(c, c->k_cache, t, h) : (const char*)(w->kb + t * D);
            const uint16_t* qt = w->qt + h * D32 * 16 * 32;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
#define S_STEP(i, A, B)                                                                                    \
    _tile_loadd(A, kp[i] + dc * 64, kld);                                                                  \
    _tile_loadd(B, qt + dc * 16 * 32, 64);                                                                 \
    _tile_dpbf16ps(i, A, B);
            for (int64_t dc = 0; dc < D32; dc++) {
                S_STEP(0, 4, 6)
                if (ng > 1) { S_STEP(1, 5, 7) }
                if (ng > 2) { S_STEP(2, 4, 6) }
                if (ng > 3) { S_STEP(3, 5, 7) }
            }
#undef S_STEP
            _tile_stored(0, w->cbuf, 64);
            if (ng > 1) _tile_stored(1, w->cbuf + 256, 64);
            if (ng > 2) _tile_stored(2, w->cbuf + 512, 64);
            if (ng > 3) _tile_stored(3, w->cbuf + 768, 64);
            for (int i = 0; i < ng; i++) {
                const __mmask16 mk = lane_mask(nmax - t0 - 16 * i);
                for (int j = 0; j < J; j++)
                    _mm512_mask_storeu_ps(scores + j * ld + t0 + 16 * i, mk,
                                          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk,
                                                                   _mm512_add_epi32(gidx, _mm512_set1_epi32(j)),
                                                                   w->cbuf + i * 256, 4));
            }
        }
        for (int j = 0; j < J; j++) { /* softmax numerators as bf16 P, zero past the column's context */
            const int64_t n = ns[j / G];
            const float* sj = scores + j * ld;
            uint16_t* pb = w->pb + (h * 16 + j) * ld;
            const __m512 mx = scores_max(sj, n);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < npad; t += 16) {
                const __m512 e = exp_shifted(sj, t, n, mx);
                _mm256_storeu_si256((__m256i*)(pb + t), to_bf16(e));
                sum = _mm512_add_ps(sum, e);
            }
            inv[h * 16 + j] = vs[h] / _mm512_reduce_add_ps(sum);
        }
    }
    amx_attention_config(J, 2);
    for (int64_t h = 0; h < Hkv; h++) {
        const uint16_t* pbh = w->pb + h * 16 * ld;
        for (int64_t d0 = 0; d0 < D; d0 += 64) { /* pass 2, 64 dims (4 O tiles) at a time */
            const int64_t nd = D - d0 < 64 ? (D - d0) / 16 : 4;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t t0 = 0; t0 < nmax; t0 += 32) {
                const char* blk = 0; /* 16 tokens from token t0 + 16i lie in one block */
                for (int64_t pr = 0; pr < 16; pr++) { /* tokens t, t + 1 -> one 64-byte row per 16 dims */
                    const int64_t t = t0 + 2 * pr;
                    if ((pr & 7) == 0 && t < nmax) blk = kv_row(c, c->v_cache, t, h);
                    const char* va = t < nmax ? blk + (pr & 7) * 2 * tok + d0 * c->esz : 0;
                    for (int64_t s32 = 0; 2 * s32 < nd; s32++) {
                        const char* vs32 = va + s32 * 32 * c->esz;
                        const __m512i a = t < nmax ? load32_bf16(vs32, c->kv_type) : _mm512_setzero_si512();
                        const __m512i b = t + 1 < nmax ? load32_bf16(vs32 + tok, c->kv_type) : _mm512_setzero_si512();
                        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                        _mm512_storeu_si512(w->vt + (2 * s32 * 16 + pr) * 32, _mm512_permutex2var_epi64(lo, pair0, hi));
                        _mm512_storeu_si512(w->vt + ((2 * s32 + 1) * 16 + pr) * 32, _mm512_permutex2var_epi64(lo, pair1, hi));
                    }
                }
                _tile_loadd(3, pbh + t0, ld * 2);
                _tile_loadd(1, w->vt, 64);
                _tile_dpbf16ps(4, 3, 1);
                if (nd > 1) {
                    _tile_loadd(1, w->vt + 16 * 32, 64);
                    _tile_dpbf16ps(5, 3, 1);
                }
                if (nd > 2) {
                    _tile_loadd(1, w->vt + 2 * 16 * 32, 64);
                    _tile_dpbf16ps(6, 3, 1);
                }
                if (nd > 3) {
                    _tile_loadd(1, w->vt + 3 * 16 * 32, 64);
                    _tile_dpbf16ps(7, 3, 1);
                }
            }
            _tile_stored(4, w->cbuf, 64);
            if (nd > 1) _tile_stored(5, w->cbuf + 256, 64);
            if (nd > 2) _tile_stored(6, w->cbuf + 512, 64);
            if (nd > 3) _tile_stored(7, w->cbuf + 768, 64);
            for (int64_t s16 = 0; s16 < nd; s16++)
                for (int j = 0; j < J; j++)
                    _mm512_storeu_ps(outs[j / G] + (h * G + j % G) * D + d0 + s16 * 16,
                                     _mm512_mul_ps(_mm512_load_ps(w->cbuf + s16 * 256 + j * 16), _mm512_set1_ps(inv[h * 16 + j])));
        }
    }
}
#endif

/* Whether row r is the position after row r - 1 of the sequence whose table row `first` holds (the
 * rows of a prompt chunk): row r's context is one longer and its blocks are row first's. */
static inline int follows(const int32_t* tables, int64_t ld, const int32_t* lens, int64_t bs, int64_t first,
                          int64_t r) {
    return lens[r] == lens[r - 1] + 1 &&
           !memcmp(tables + r * ld, tables + first * ld, sizeof(int32_t) * ((lens[r] + bs - 1) / bs));
}

/* q: [*, Hq, D] rows `rows[b]` (or b); out: the same rows; caches: base pointers of K and V for this
 * layer with element strides per block, token and head; k_scale/v_scale: [Hkv] fp32 or NULL (= 1). */
void paged_decode_attention(const float* q, int64_t ldq, float* out, int64_t ldo, const void* k_cache,
                            const void* v_cache, int kv_type, int64_t s_block, int64_t s_tok, int64_t s_head,
                            const float* k_scale, const float* v_scale, const int32_t* block_tables,
                            int64_t ld_table, const int32_t* context_lens, const int64_t* rows, float scale,
                            int64_t window, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                            int64_t b_begin, int64_t b_end) {
    const int G = (int)(Hq / Hkv), D16 = (int)(D / 16);
    const attend_fn fn = G <= 8 && D16 <= 8 ? ATTEND_TABLE[G][D16 - 1] : 0;
    const float tscale = type_scale(kv_type);
    PagedKV c = {k_cache, v_cache, kv_type, s_block, s_tok, s_head, block_size, elem_size(kv_type), 0};
    /* per KV head: the score scale (fp8 scale x 2^8 x softmax scale) and V's scale; then scratch */
    float* ks = (float*)malloc(sizeof(float) * 2 * Hkv);
    float* vs = ks + Hkv;
    for (int64_t h = 0; h < Hkv; h++) {
        ks[h] = (k_scale ? k_scale[h] : 1.0f) * tscale * scale;
        vs[h] = (v_scale ? v_scale[h] : 1.0f) * tscale;
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (attention_on_tiles(kv_type, Hkv, G, D, block_size, window)) {
        AmxScratch w = {0};
        w.qt = (uint16_t*)aligned_alloc(64, Hkv * (D / 32) * 1024);
        w.vt = (uint16_t*)aligned_alloc(64, 4 * 1024);
        w.cbuf = (float*)aligned_alloc(64, 4 * 1024);
        const int max_rows = 16 / G;
        for (int64_t b = b_begin; b < b_end;) {
            /* rows b, b+1, ... of one sequence at consecutive positions (the same table, contexts + 1)
             * go together; a decode batch's rows are one sequence each */
            int R = 1;
            while (R < max_rows && b + R < b_end && follows(block_tables, ld_table, context_lens, block_size, b, b + R))
                R++;
            const float* qs[16];
            float* outs[16];
            int64_t ns[16];
            for (int r = 0; r < R; r++) {
                const int64_t row = rows ? rows[b + r] : b + r;
                qs[r] = q + row * ldq;
                outs[r] = out + row * ldo;
                ns[r] = context_lens[b + r];
            }
            const int64_t need = (ns[R - 1] + 31) / 32 * 32;
            if (need > w.cap) {
                free(w.scores);
                free(w.pb);
                free(w.kb);
                w.cap = need + 256;
                w.kb = kv_type == BF16 ? 0 : (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * w.cap * D);
                w.scores = (float*)aligned_alloc(64, sizeof(float) * Hkv * 16 * w.cap);
                w.pb = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * Hkv * 16 * w.cap);
            }
            c.table = block_tables + b * ld_table;
            attend_amx(&c, qs, outs, ns, R, Hkv, ks, vs, &w, G, D);
            b += R;
        }
        _tile_release();
        free(w.scores);
        free(w.pb);
        free(w.qt);
        free(w.vt);
        free(w.cbuf);
        free(w.kb);
        free(ks);
        return;
    }
#endif
    __m512* part = (__m512*)aligned_alloc(64, sizeof(__m512) * Hq * (16 + D16));
    __m512* accs = part + Hq * 16;
    float* scores = 0;
    int64_t cap = 0;
    int cold = 1; /* row b's KV was not just read by the row before (see below) */
    for (int64_t b = b_begin; b < b_end; b++) {
        const int64_t ctx = context_lens[b], row = rows ? rows[b] : b;
        const int64_t first = window > 0 && ctx > window ? ctx - window : 0, n = ctx - first;
        if (n * Hq > cap) {
            free(scores);
            cap = n * Hq + 1024;
            scores = (float*)malloc(sizeof(float) * cap);
        }
        c.table = block_tables + b * ld_table;
        const float* qs = q + row * ldq;
        float* os = out + row * ldo;
        /* A decode row's KV comes from DRAM: pass 1 also prefetches the V blocks pass 2 reads, and pass 2
         * the K blocks of the next row's pass 1. The rows of a prompt chunk (one sequence, positions +1,
         * the same blocks) find their KV in cache after the first: no extra prefetches for them. */
        PagedKV nc = c;
        int64_t next_first = 0, next_n = 0;
        const int next = b + 1 < b_end && !follows(block_tables, ld_table, context_lens, block_size, b, b + 1);
        if (next) {
            nc.table = block_tables + (b + 1) * ld_table;
            const int64_t nctx = context_lens[b + 1];
            next_first = window > 0 && nctx > window ? nctx - window : 0;
            next_n = nctx - next_first;
        }
        if (fn) fn(&c, qs, os, Hkv, first, n, ks, vs, scores, part, accs, cold, next ? &nc : 0, next_first, next_n);
        else
            for (int64_t h = 0; h < Hkv; h++)
                attend_generic(&c, qs + h * G * D, D, os + h * G * D, h, first, n, ks[h], vs[h], scores, G, D16);
        cold = next; /* row b + 1 follows this one unless it starts another sequence */
    }
    free(scores);
    free(part);
    free(ks);
}

/* ---- KV store --------------------------------------------------------------------------------- */
/* k/v: [N, Hkv*D] fp32 rows; slot s goes to block s / block_size, token s % block_size; a negative
 * slot is skipped. Cache types F32, BF16, F16, and FP8_E4M3 with k_scale/v_scale [Hkv] (the cache
 * holds clamp(x / scale, +-448) rounded to e4m3, as paged_attention.quantize_kv); head_dim D. */
void store_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, void* k_cache, void* v_cache,
              int kv_type, int64_t s_block, int64_t s_tok, const int64_t* slots, int64_t block_size,
              int64_t row_elems, const float* k_scale, const float* v_scale, int64_t D, int64_t n_begin,
              int64_t n_end) {
    const int64_t esz = elem_size(kv_type);
    for (int64_t i = n_begin; i < n_end; i++) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        const int64_t off = ((s / block_size) * s_block + (s % block_size) * s_tok) * esz;
        for (int which = 0; which < 2; which++) {
            const float* src = which ? v + i * ldv : k + i * ldk;
            char* dst = (char*)(which ? v_cache : k_cache) + off;
            if (kv_type == F32) {
                memcpy(dst, src, row_elems * 4);
                continue;
            }
            if (kv_type == FP8_E4M3) {
                const float* sc = which ? v_scale : k_scale;
                for (int64_t e = 0; e < row_elems; e++) {
                    const float y = src[e] / sc[e / D];
                    ((uint8_t*)dst)[e] = to_e4m3(y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y));
                }
                continue;
            }
            for (int64_t e = 0; e < row_elems; e += 16) {
                __mmask16 mk = lane_mask(row_elems - e);
                __m512 x = _mm512_maskz_loadu_ps(mk, src + e);
                __m256i h = kv_type == BF16 ? to_bf16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
                _mm256_mask_storeu_epi16(dst + e * 2, mk, h);
            }
        }
    }
}

/* ---- RMSNorm, RoPE, SiLU ---------------------------------------------------------------------- */
/* out = weight * x / rms(x); with residual: residual += x first and the norm is of the sum (the
 * pre-norm pattern; x is left as is). weight: fp32 or 16-bit (wtype). */
void rms_norm(const float* x, int64_t ldx, float* residual, int64_t ldr, const void* weight, int wtype,
              float eps, float* out, int64_t ldo, int64_t H, int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; r++) {
        const float* src = x + r * ldx;
        float* h = residual ? residual + r * ldr : (float*)src;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t e = 0; e < H; e += 16) {
            __mmask16 mk = lane_mask(H - e);
            __m512 v = _mm512_maskz_loadu_ps(mk, src + e);
            if (residual) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, h + e));
                _mm512_mask_storeu_ps(h + e, mk, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps);
        const __m512 iv = _mm512_set1_ps(inv);
        for (int64_t e = 0; e < H; e += 16) {
            __mmask16 mk = lane_mask(H - e);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, h + e), iv);
            __m512 w;
            if (wtype == F32) w = _mm512_maskz_loadu_ps(mk, (const float*)weight + e);
            else {
                const __m256i raw = _mm256_maskz_loadu_epi16(mk, (const uint16_t*)weight + e);
                w = wtype == BF16 ? cvt_bf16(raw) : _mm512_cvtph_ps(raw);
            }
            _mm512_mask_storeu_ps(out + r * ldo + e, mk, _mm512_mul_ps(v, w));
        }
    }
}

/* In place on q [N, Hq*D] and k [N, Hk*D] rows: x * cos + rotate_half(x) * sin, with cos/sin from
 * `cos_sin` [max_pos, D] ([cos | sin] halves of D/2 each, the two halves of a head share them). */
void rope(float* q, int64_t ldq, float* k, int64_t ldk, const int64_t* positions, const float* cos_sin,
          int64_t Hq, int64_t Hk, int64_t D, int64_t r_begin, int64_t r_end) {
    const int64_t half = D / 2;
    for (int64_t r = r_begin; r < r_end; r++) {
        const float* c = cos_sin + positions[r] * D;
        const float* s = c + half;
        for (int which = 0; which < 2; which++) {
            float* base = which ? k + r * ldk : q + r * ldq;
            const int64_t heads = which ? Hk : Hq;
            for (int64_t hd = 0; hd < heads; hd++) {
                float* x = base + hd * D;
                for (int64_t e = 0; e < half; e += 16) {
                    __mmask16 mk = lane_mask(half - e);
                    __m512 x1 = _mm512_maskz_loadu_ps(mk, x + e), x2 = _mm512_maskz_loadu_ps(mk, x + half + e);
                    __m512 cv = _mm512_maskz_loadu_ps(mk, c + e), sv = _mm512_maskz_loadu_ps(mk, s + e);
                    /* HF: [x1, x2] * cos + [-x2, x1] * sin */
                    _mm512_mask_storeu_ps(x + e, mk, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)));
                    _mm512_mask_storeu_ps(x + half + e, mk, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)));
                }
            }
        }
    }
}

/* out[r, :I] = silu(x[r, :I]) * x[r, I:2I] */
void silu_and_mul(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t I, int64_t r_begin,
                  int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; r++) {
        const float* g = x + r * ldx;
        const float* u = g + I;
        for (int64_t e = 0; e < I; e += 16) {
            __mmask16 mk = lane_mask(I - e);
            __m512 gv = _mm512_maskz_loadu_ps(mk, g + e);
            __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                         exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_mask_storeu_ps(out + r * ldo + e, mk, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(mk, u + e)));
        }
    }
}

/* ---- a step's decoder layers in one call ------------------------------------------------------- */
/* The same kernels, in the same order, as the per-layer Python path (LlamaDecoderLayer.forward with
 * every row's attention in paged_decode_attention), so the results are bit-identical; what it saves is
 * ~10 Python calls per layer (measured: ~15 ms of a ~45 ms SmolLM2 batch-1 decode step on this CPU).
 * One thread: the caller's. */
typedef struct {
    const uint16_t *qkv, *o, *gate_up, *down; /* packed 16-bit weights (pack_weight) */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* fp32 or NULL */
    const void *in_norm, *post_norm; /* RMSNorm weights, type norm_type */
    void *k_cache, *v_cache;         /* this layer's [num_blocks, block_size, Hkv, D] caches */
    const float *k_scale, *v_scale;  /* fp8 caches: [Hkv] fp32 (NULL otherwise) */
    int64_t window;                  /* sliding window, 0 = none */
} DecodeLayer;

typedef struct {
    int64_t hidden, inter, Hq, Hkv, D, block_size, s_block, s_tok, s_head;
    int64_t wtype, norm_type, kv_type;
    float eps, scale;
} DecodeShape;

static void gemm_all(const float* x, int64_t ldx, const uint16_t* w, int wtype, const float* bias, float* y,
                     int64_t M, int64_t N, int64_t K) {
    gemm_w16(x, ldx, w, wtype, bias, y, N, M, N, K, 0, (N + NR - 1) / NR);
}

/* res [M, hidden]: the embeddings in, the residual stream out; x [M, hidden]: the last layer's MLP
 * output (the model's final norm takes norm(x + res)). Scratch: normed [M, hidden], qkv [M, q + 2kv],
 * attn [M, q], gu [M, 2 inter], act [M, inter]. Row r stores its K/V at slots[r], then attends to the
 * first context_lens[r] positions of the blocks in block_tables[r] (its position + 1). */
void decoder_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeShape* s, float* res, float* x,
                   float* normed, float* qkv, float* attn, float* gu, float* act, const int64_t* positions,
                   const float* cos_sin, const int64_t* slots, const int32_t* block_tables, int64_t ld_table,
                   const int32_t* context_lens, int64_t M) {
    const int64_t H = s->hidden, I = s->inter, qs = s->Hq * s->D, kvs = s->Hkv * s->D, ldqkv = qs + 2 * kvs;
    const int wt = (int)s->wtype, nt = (int)s->norm_type, kt = (int)s->kv_type;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer* L = layers + l;
        if (l == 0) rms_norm(res, H, 0, 0, L->in_norm, nt, s->eps, normed, H, H, 0, M);
        else rms_norm(x, H, res, H, L->in_norm, nt, s->eps, normed, H, H, 0, M);
        gemm_all(normed, H, L->qkv, wt, L->qkv_bias, qkv, M, ldqkv, H);
        rope(qkv, ldqkv, qkv + qs, ldqkv, positions, cos_sin, s->Hq, s->Hkv, s->D, 0, M);
        store_kv(qkv + qs, ldqkv, qkv + qs + kvs, ldqkv, L->k_cache, L->v_cache, kt, s->s_block, s->s_tok, slots,
                 s->block_size, kvs, L->k_scale, L->v_scale, s->D, 0, M);
        paged_decode_attention(qkv, ldqkv, attn, qs, L->k_cache, L->v_cache, kt, s->s_block, s->s_tok, s->s_head,
                               L->k_scale, L->v_scale, block_tables, ld_table, context_lens, 0, s->scale, L->window,
                               s->Hq, s->Hkv, s->D, s->block_size, 0, M);
        gemm_all(attn, qs, L->o, wt, L->o_bias, x, M, H, qs);
        rms_norm(x, H, res, H, L->post_norm, nt, s->eps, normed, H, H, 0, M);
        gemm_all(normed, H, L->gate_up, wt, L->gate_up_bias, gu, M, 2 * I, H);
        silu_and_mul(gu, 2 * I, act, I, I, 0, M);
        gemm_all(act, I, L->down, wt, L->down_bias, x, M, H, I);
    }
}
