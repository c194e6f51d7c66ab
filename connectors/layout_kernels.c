/* vLLM's CPU attention cache <-> the canonical chunk, all layers of a chunk in one call
 * (connectors/layout_c.py; the torch path in connectors/layouts.py does the same, more slowly).
 *
 * Per layer, the cache is [num_blocks, H, block_size, 2*D], contiguous; each (block, head) slab of
 * 2*bs*D elements is K transposed, [D, bs], then V, [bs, D]. The chunk is [2, L, T, H, D], contiguous.
 * Block j of the call is cache block ids[j] and chunk tokens (first + j) * bs ... + bs.
 * Elements are moved as 2- or 4-byte words (bf16, fp16, fp32: no conversion). The caller checks
 * shapes and block ids; nothing here can fail.
 */
#include <stdint.h>
#include <string.h>

#define TILE 16

#define TRANSPOSE(T)                                                                              \
    /* K: cache slab [d][t] <-> chunk row t (stride H*D) element d */                             \
    static void k_in_##T(T *restrict slab, const T *restrict rows, int64_t stride, int bs, int D) { \
        for (int t0 = 0; t0 < bs; t0 += TILE)                                                     \
            for (int d0 = 0; d0 < D; d0 += TILE)                                                  \
                for (int d = d0; d < d0 + TILE && d < D; d++)                                     \
                    for (int t = t0; t < t0 + TILE && t < bs; t++)                                \
                        slab[(int64_t)d * bs + t] = rows[t * stride + d];                         \
    }                                                                                             \
    static void k_out_##T(T *restrict rows, const T *restrict slab, int64_t stride, int bs, int D) { \
        for (int t0 = 0; t0 < bs; t0 += TILE)                                                     \
            for (int d0 = 0; d0 < D; d0 += TILE)                                                  \
                for (int t = t0; t < t0 + TILE && t < bs; t++)                                    \
                    for (int d = d0; d < d0 + TILE && d < D; d++)                                 \
                        rows[t * stride + d] = slab[(int64_t)d * bs + t];                         \
    }

TRANSPOSE(uint16_t)
TRANSPOSE(uint32_t)

#ifdef __SSE2__
#include <emmintrin.h>

/* r[i] = row i of an 8x8 tile of 16-bit words -> r[j] = column j */
static inline void tr8x8(__m128i r[8]) {
    __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    r[0] = _mm_unpacklo_epi64(b0, b4), r[1] = _mm_unpackhi_epi64(b0, b4);
    r[2] = _mm_unpacklo_epi64(b1, b5), r[3] = _mm_unpackhi_epi64(b1, b5);
    r[4] = _mm_unpacklo_epi64(b2, b6), r[5] = _mm_unpackhi_epi64(b2, b6);
    r[6] = _mm_unpacklo_epi64(b3, b7), r[7] = _mm_unpackhi_epi64(b3, b7);
}

/* dst[j * dstride + i] = src[i * sstride + j] for an (8*ni) x (8*nj) block of 16-bit words */
static void tr16(uint16_t *restrict dst, int64_t dstride, const uint16_t *restrict src, int64_t sstride, int ni,
                 int nj) {
    __m128i r[8];
    for (int i0 = 0; i0 < 8 * ni; i0 += 8)
        for (int j0 = 0; j0 < 8 * nj; j0 += 8) {
            for (int i = 0; i < 8; i++) r[i] = _mm_loadu_si128((const __m128i *)(src + (i0 + i) * sstride + j0));
            tr8x8(r);
            for (int j = 0; j < 8; j++) _mm_storeu_si128((__m128i *)(dst + (j0 + j) * dstride + i0), r[j]);
        }
}
#define HAVE_TR16 1
#endif

static void move(char *chunk, char *const *caches, const int64_t *ids, int n, int first, int L, int T,
                 int H, int D, int bs, int esize, int out) {
    const int64_t row = (int64_t)H * D;              /* elements per token of one layer's K or V */
    const int64_t half = (int64_t)L * T * row;       /* the V half starts here */
    const int64_t slab = 2LL * bs * D;
    const size_t vrow = (size_t)D * esize;
    for (int l = 0; l < L; l++) {
        for (int j = 0; j < n; j++) {
            const int64_t tok = (int64_t)(first + j) * bs;
            for (int h = 0; h < H; h++) {
                char *s = caches[l] + ((ids[j] * H + h) * slab) * esize;
                char *k = chunk + (((int64_t)l * T + tok) * row + (int64_t)h * D) * esize;
                char *v = chunk + (half + ((int64_t)l * T + tok) * row + (int64_t)h * D) * esize;
                char *sv = s + (int64_t)bs * D * esize;
                if (esize == 2) {
#ifdef HAVE_TR16
                    if (bs % 8 == 0 && D % 8 == 0) {
                        if (out) tr16((uint16_t *)k, row, (const uint16_t *)s, bs, D / 8, bs / 8);
                        else tr16((uint16_t *)s, bs, (const uint16_t *)k, row, bs / 8, D / 8);
                    } else
#endif
                    if (out) k_out_uint16_t((uint16_t *)k, (const uint16_t *)s, row, bs, D);
                    else k_in_uint16_t((uint16_t *)s, (const uint16_t *)k, row, bs, D);
                } else {
                    if (out) k_out_uint32_t((uint32_t *)k, (const uint32_t *)s, row, bs, D);
                    else k_in_uint32_t((uint32_t *)s, (const uint32_t *)k, row, bs, D);
                }
                for (int t = 0; t < bs; t++) {
                    char *a = sv + (int64_t)t * vrow, *b = v + (int64_t)t * row * esize;
                    if (out) memcpy(b, a, vrow);
                    else memcpy(a, b, vrow);
                }
            }
        }
    }
}

void vllm_cpu_scatter(const void *chunk, void *const *caches, const int64_t *ids, int n, int first, int L,
                      int T, int H, int D, int bs, int esize) {
    move((char *)chunk, (char *const *)caches, ids, n, first, L, T, H, D, bs, esize, 0);
}

void vllm_cpu_gather(void *chunk, void *const *caches, const int64_t *ids, int n, int L, int H, int D, int bs,
                     int esize) {
    move((char *)chunk, (char *const *)caches, ids, n, 0, L, n * bs, H, D, bs, esize, 1);
}
