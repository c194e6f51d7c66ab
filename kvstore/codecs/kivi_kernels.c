/* kivi4 / kivi2 decode on the CPU (kivi.py holds the format; built by kvstore/c_build.py).
 *
 * The float32 operations are kivi.py's torch decode's, one rounding each and in its order, so that
 * both agree bit for bit (tests/kvstore/test_codecs_kivi.py): 8bit metadata (q - zp / 16) *
 * (2^(-c/16) * ref), fp16 pairs q * scale + zero, values rotated back by Hadamard butterflies of
 * span 1, 2, 4, ... then times 1/sqrt(d) (common.hadamard_rows), rounded to the KV dtype to nearest
 * even. Built with -std=c11, which keeps gcc from fusing a multiply and an add (-ffp-contract=off).
 * Sections of a payload need not be aligned: 16-bit words are read byte by byte.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#define KIVI_AVX2 1 /* a target("avx2") path, taken where the CPU has it (checked at run time) */
/* each kernel compiled twice, for AVX2 and for the baseline; the loader picks one (an ifunc) */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

enum { KIND_F16 = 0, KIND_BF16 = 1, KIND_F32 = 2 };

static inline uint32_t ld16(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }
static inline float f32_from(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE half bits -> float32, exact (cpu_bits.f16_to_f32). */
static inline float f16_to_f32(uint32_t h) {
    uint32_t w = h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = f32_from((two_w >> 4) + (0xE0u << 23)) * f32_from(0x7800000u);
    float denormalized = f32_from((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_from(sign | bits_of(two_w < (1u << 27) ? denormalized : normalized));
}

/* float32 -> half bits, nearest even (cpu_bits.f32_to_f16; torch's cast). */
static inline uint16_t f32_to_f16(float x) {
    float base = (f32_from(bits_of(x) & 0x7FFFFFFFu) * f32_from(0x77800000u)) * f32_from(0x08800000u);
    uint32_t w = bits_of(x), shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    uint32_t b = bits_of(f32_from((bias >> 1) + 0x07800000u) + base);
    uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float32 -> bfloat16 bits, nearest even (finite inputs). */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t w = bits_of(x);
    return (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

static void store_row(const float *restrict buf, int64_t n, int kind, uint8_t *restrict out) {
    if (kind == KIND_BF16) {
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(buf[i]);
    } else if (kind == KIND_F16) {
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_f16(buf[i]);
    } else {
        memcpy(out, buf, (size_t)n * 4);
    }
}

/* b-bit codes (the first in the lowest bits) of n values -> float32. */
static void unpack(const uint8_t *restrict codes, int64_t n, int bits, float *restrict q) {
    if (bits == 4) {
        for (int64_t j = 0; j < n / 2; j++) {
            q[2 * j] = (float)(codes[j] & 15);
            q[2 * j + 1] = (float)(codes[j] >> 4);
        }
    } else {
        for (int64_t j = 0; j < n / 4; j++) {
            uint8_t b = codes[j];
            q[4 * j] = (float)(b & 3);
            q[4 * j + 1] = (float)((b >> 2) & 3);
            q[4 * j + 2] = (float)((b >> 4) & 3);
            q[4 * j + 3] = (float)(b >> 6);
        }
    }
}

#ifdef __SSE2__
/* The first three butterfly stages (spans 1, 2, 4) of each octet: a loop of 1 to 4 iterations does
 * not vectorise, so SSE2 does them in registers, two 4-float vectors at a time. */
static void butterflies_1_2_4(float *restrict buf, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        __m128 v = _mm_loadu_ps(buf + i), w = _mm_loadu_ps(buf + i + 4);
        __m128 e = _mm_shuffle_ps(v, w, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm_shuffle_ps(v, w, _MM_SHUFFLE(3, 1, 3, 1));
        __m128 s = _mm_add_ps(e, o), d = _mm_sub_ps(e, o); /* span 1: (x0+x1, x2+x3, ...), (x0-x1, ...) */
        v = _mm_unpacklo_ps(s, d);
        w = _mm_unpackhi_ps(s, d);
        __m128 vs = _mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)), ws = _mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 0, 3, 2));
        /* span 2: lanes 0, 1 take a + b (v + its swapped halves), lanes 2, 3 a - b (swapped - v) */
        v = _mm_shuffle_ps(_mm_add_ps(v, vs), _mm_sub_ps(vs, v), _MM_SHUFFLE(3, 2, 1, 0));
        w = _mm_shuffle_ps(_mm_add_ps(w, ws), _mm_sub_ps(ws, w), _MM_SHUFFLE(3, 2, 1, 0));
        _mm_storeu_ps(buf + i, _mm_add_ps(v, w)); /* span 4 */
        _mm_storeu_ps(buf + i + 4, _mm_sub_ps(v, w));
    }
}

/* The spans 8, 16, 32 of each 64-float block: an 8-point transform of rows of an 8 x 8 matrix, four
 * columns at a time in SSE2 registers (the same additions as the stage loop, in the same order). */
static void butterflies_8_16_32(float *restrict buf, int64_t n) {
    for (int64_t base = 0; base < n; base += 64)
        for (int64_t k = 0; k < 8; k += 4) {
            float *p = buf + base + k;
            __m128 x0 = _mm_loadu_ps(p), x1 = _mm_loadu_ps(p + 8), x2 = _mm_loadu_ps(p + 16);
            __m128 x3 = _mm_loadu_ps(p + 24), x4 = _mm_loadu_ps(p + 32), x5 = _mm_loadu_ps(p + 40);
            __m128 x6 = _mm_loadu_ps(p + 48), x7 = _mm_loadu_ps(p + 56);
            __m128 a0 = _mm_add_ps(x0, x1), a1 = _mm_sub_ps(x0, x1), a2 = _mm_add_ps(x2, x3), a3 = _mm_sub_ps(x2, x3);
            __m128 a4 = _mm_add_ps(x4, x5), a5 = _mm_sub_ps(x4, x5), a6 = _mm_add_ps(x6, x7), a7 = _mm_sub_ps(x6, x7);
            __m128 b0 = _mm_add_ps(a0, a2), b1 = _mm_add_ps(a1, a3), b2 = _mm_sub_ps(a0, a2), b3 = _mm_sub_ps(a1, a3);
            __m128 b4 = _mm_add_ps(a4, a6), b5 = _mm_add_ps(a5, a7), b6 = _mm_sub_ps(a4, a6), b7 = _mm_sub_ps(a5, a7);
            _mm_storeu_ps(p, _mm_add_ps(b0, b4));
            _mm_storeu_ps(p + 8, _mm_add_ps(b1, b5));
            _mm_storeu_ps(p + 16, _mm_add_ps(b2, b6));
            _mm_storeu_ps(p + 24, _mm_add_ps(b3, b7));
            _mm_storeu_ps(p + 32, _mm_sub_ps(b0, b4));
            _mm_storeu_ps(p + 40, _mm_sub_ps(b1, b5));
            _mm_storeu_ps(p + 48, _mm_sub_ps(b2, b6));
            _mm_storeu_ps(p + 56, _mm_sub_ps(b3, b7));
        }
}
#endif

#ifdef KIVI_AVX2
/* Spans 1, 2, 4 inside an 8-float register: a permute brings each b beside its a, a blend keeps a + b
 * where a sits and a - b where b sits. */
__attribute__((target("avx2"))) static inline __m256 octet_avx2(__m256 v) {
    __m256 s = _mm256_permute_ps(v, 0xB1);
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
    s = _mm256_permute_ps(v, 0x4E);
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
    s = _mm256_permute2f128_ps(v, v, 0x01);
    return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
}

/* One 64-float block whole in registers (row o of an 8 x 8 matrix in register o): spans 1, 2, 4 in
 * each, spans 8, 16, 32 across them, then times norm. */
__attribute__((target("avx2"))) static void fwht64_avx2(float *restrict p, float norm) {
    __m256 x0 = octet_avx2(_mm256_loadu_ps(p)), x1 = octet_avx2(_mm256_loadu_ps(p + 8));
    __m256 x2 = octet_avx2(_mm256_loadu_ps(p + 16)), x3 = octet_avx2(_mm256_loadu_ps(p + 24));
    __m256 x4 = octet_avx2(_mm256_loadu_ps(p + 32)), x5 = octet_avx2(_mm256_loadu_ps(p + 40));
    __m256 x6 = octet_avx2(_mm256_loadu_ps(p + 48)), x7 = octet_avx2(_mm256_loadu_ps(p + 56));
    __m256 a0 = _mm256_add_ps(x0, x1), a1 = _mm256_sub_ps(x0, x1), a2 = _mm256_add_ps(x2, x3);
    __m256 a3 = _mm256_sub_ps(x2, x3), a4 = _mm256_add_ps(x4, x5), a5 = _mm256_sub_ps(x4, x5);
    __m256 a6 = _mm256_add_ps(x6, x7), a7 = _mm256_sub_ps(x6, x7);
    __m256 b0 = _mm256_add_ps(a0, a2), b1 = _mm256_add_ps(a1, a3), b2 = _mm256_sub_ps(a0, a2);
    __m256 b3 = _mm256_sub_ps(a1, a3), b4 = _mm256_add_ps(a4, a6), b5 = _mm256_add_ps(a5, a7);
    __m256 b6 = _mm256_sub_ps(a4, a6), b7 = _mm256_sub_ps(a5, a7), k = _mm256_set1_ps(norm);
    _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_add_ps(b0, b4), k));
    _mm256_storeu_ps(p + 8, _mm256_mul_ps(_mm256_add_ps(b1, b5), k));
    _mm256_storeu_ps(p + 16, _mm256_mul_ps(_mm256_add_ps(b2, b6), k));
    _mm256_storeu_ps(p + 24, _mm256_mul_ps(_mm256_add_ps(b3, b7), k));
    _mm256_storeu_ps(p + 32, _mm256_mul_ps(_mm256_sub_ps(b0, b4), k));
    _mm256_storeu_ps(p + 40, _mm256_mul_ps(_mm256_sub_ps(b1, b5), k));
    _mm256_storeu_ps(p + 48, _mm256_mul_ps(_mm256_sub_ps(b2, b6), k));
    _mm256_storeu_ps(p + 56, _mm256_mul_ps(_mm256_sub_ps(b3, b7), k));
}

static int use_avx2 = -1; /* -1: as the CPU can */

static int have_avx2(void) {
    if (use_avx2 < 0) use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    return use_avx2;
}
#endif

/* 0 turns the AVX2 rotation off (tests take the SSE2 path with it; same bits), 1 back to what the CPU
 * has. Returns whether it is on. */
int kivi_simd(int on) {
#ifdef KIVI_AVX2
    use_avx2 = on ? -1 : 0;
    return have_avx2();
#else
    (void)on;
    return 0;
#endif
}

/* In place: the orthonormal Walsh-Hadamard transform of a power-of-two vector (its own inverse). */
static void fwht(float *restrict buf, int64_t n, float norm) {
    int64_t h = 1;
#ifdef KIVI_AVX2
    if (n == 64 && have_avx2()) {
        fwht64_avx2(buf, norm);
        return;
    }
#endif
#ifdef __SSE2__ /* without it, the stage loop below does every span */
    if (n >= 8) {
        butterflies_1_2_4(buf, n);
        h = 8;
    }
    if (n >= 64) {
        butterflies_8_16_32(buf, n);
        h = 64;
    }
#endif
    for (; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h) {
            float *restrict a = buf + i, *restrict b = buf + i + h;
            for (int64_t j = 0; j < h; j++) {
                float x = a[j], y = b[j];
                a[j] = x + y;
                b[j] = x - y;
            }
        }
    for (int64_t i = 0; i < n; i++) buf[i] *= norm;
}

/* Keys: codes (L, N, C*b/8) per channel over groups of key_tokens tokens -> rows of C values at
 * out + layer * out_layer + t * C * itemsize. meta8: meta (L, G, C) uint16, ref (L, C) fp16 bits;
 * else meta holds fp16 (scale, zero) pairs (L, G, C, 2). Returns 0, or -1 without memory. */
CLONES int kivi_decode_keys(const uint8_t *codes, int64_t nl, int64_t n, int64_t nc, int bits, int64_t key_tokens,
                     int meta8, const uint8_t *meta, const uint8_t *ref, const float *pow_table, int kind,
                     uint8_t *out, int64_t out_layer) {
    int64_t isz = kind == KIND_F32 ? 4 : 2, row = nc * bits / 8, groups = (n + key_tokens - 1) / key_tokens;
    float *s = malloc(4 * (size_t)nc * 4);
    if (s == NULL) return -1;
    float *z = s + nc, *q = z + nc, *buf = q + nc;
    for (int64_t l = 0; l < nl; l++)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t c = 0; c < nc; c++) {
                if (meta8) {
                    uint32_t m = ld16(meta + 2 * ((l * groups + g) * nc + c));
                    s[c] = pow_table[m & 255] * f16_to_f32(ld16(ref + 2 * (l * nc + c)));
                    z[c] = (float)(m >> 8) / 16.0f;
                } else {
                    s[c] = f16_to_f32(ld16(meta + 4 * ((l * groups + g) * nc + c)));
                    z[c] = f16_to_f32(ld16(meta + 4 * ((l * groups + g) * nc + c) + 2));
                }
            }
            int64_t end = (g + 1) * key_tokens < n ? (g + 1) * key_tokens : n;
            for (int64_t t = g * key_tokens; t < end; t++) {
                unpack(codes + (l * n + t) * row, nc, bits, q);
                if (meta8)
                    for (int64_t c = 0; c < nc; c++) buf[c] = (q[c] - z[c]) * s[c];
                else
                    for (int64_t c = 0; c < nc; c++) buf[c] = q[c] * s[c] + z[c];
                store_row(buf, nc, kind, out + l * out_layer + t * nc * isz);
            }
        }
    free(s);
    return 0;
}

/* Values: codes (L, T, C*b/8) per token in groups of `group` channels -> out (L, T, C), each head of
 * `head_dim` channels rotated back when `rotate`. meta8: meta (L, T, G) uint16, ref (L, G) fp16
 * bits; else meta holds fp16 (scale, zero) pairs (L, T, G, 2). Returns 0, or -1 without memory. */
CLONES int kivi_decode_values(const uint8_t *codes, int64_t nl, int64_t nt, int64_t nc, int bits, int64_t group,
                       int64_t head_dim, int rotate, float norm, int meta8, const uint8_t *meta, const uint8_t *ref,
                       const float *pow_table, int kind, uint8_t *out) {
    int64_t isz = kind == KIND_F32 ? 4 : 2, row = nc * bits / 8, ng = nc / group;
    float *q = malloc(2 * (size_t)nc * 4);
    if (q == NULL) return -1;
    float *buf = q + nc;
    for (int64_t l = 0; l < nl; l++)
        for (int64_t t = 0; t < nt; t++) {
            unpack(codes + (l * nt + t) * row, nc, bits, q);
            for (int64_t g = 0; g < ng; g++) {
                int64_t at = (l * nt + t) * ng + g;
                float *restrict b = buf + g * group;
                const float *restrict qg = q + g * group;
                if (meta8) {
                    uint32_t m = ld16(meta + 2 * at);
                    float sc = pow_table[m & 255] * f16_to_f32(ld16(ref + 2 * (l * ng + g)));
                    float zp = (float)(m >> 8) / 16.0f;
                    for (int64_t c = 0; c < group; c++) b[c] = (qg[c] - zp) * sc;
                } else {
                    float sc = f16_to_f32(ld16(meta + 4 * at)), zero = f16_to_f32(ld16(meta + 4 * at + 2));
                    for (int64_t c = 0; c < group; c++) b[c] = qg[c] * sc + zero;
                }
            }
            if (rotate)
                for (int64_t h = 0; h < nc; h += head_dim) fwht(buf + h, head_dim, norm);
            store_row(buf, nc, kind, out + (l * nt + t) * nc * isz);
        }
    free(q);
    return 0;
}
