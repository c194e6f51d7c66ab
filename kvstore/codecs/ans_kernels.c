/* rANS over quantised KV codes (kvstore/codecs/ans.py documents the stream; ans_ref.py is the same
 * algorithm in Python, and the two agree bit for bit).
 *
 * Symbols are `bits` wide (2, 4 or 8), packed as the codecs pack them: symbol i lives in byte
 * i * bits / 8, at bit (i % (8 / bits)) * bits. Probabilities are 12-bit (frequencies sum to 4096);
 * eight independent 32-bit states (lanes: symbol i belongs to lane i % 8), each with its own stream,
 * renormalised 16 bits at a time (states stay in [2^16, 2^32)): the lanes share no read pointer, so
 * their steps overlap in the CPU. Stream, little-endian: the eight lane lengths (uint32), then each
 * lane: its final encoder state (uint32) and its 16-bit words in the order the decoder reads them.
 *
 * The decoder never reads outside [in, in + len) (an unchecked step runs only while every lane has
 * the 2 bytes it may read), never writes past n symbols, runs n steps, and fails (returns -1)
 * unless each lane consumes exactly its stream and ends in the encoder's start state (2^16).
 *
 * ans_decode_stream decodes a blob's whole stream of segment records in one call. On a CPU with
 * AVX-512 (checked at run time; the file builds without -march) it decodes 4 segments at once, two
 * per 16-lane vector (gathers for the table and for each lane's next word, 4 bytes read
 * only where 2 more than needed are left in the lane): the same arithmetic, so the same bits; each
 * segment's last steps and checks are the scalar code's.
 */
#include <stdint.h>
#include <string.h>

#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define LOW (1u << 16)
#define LANES 8

static inline unsigned get_sym(const uint8_t *codes, int64_t i, int bits) {
    int per = 8 / bits;
    return (codes[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1);
}

/* The cumulative frequencies of a table; -1 unless the table sums to PROB_SCALE. */
static int cumulate(const uint16_t *freq, int nsym, uint32_t *cum) {
    uint32_t c = 0;
    for (int s = 0; s < nsym; s++) {
        cum[s] = c;
        c += freq[s];
    }
    return c == PROB_SCALE ? 0 : -1;
}

/* Encode n symbols into out (capacity cap >= 2 * n + 64 always suffices); returns the stream's
 * length, or -1 for a bad table, a symbol of frequency 0, or too small a buffer. */
int64_t ans_encode(const uint8_t *codes, int64_t n, int bits, const uint16_t *freq, uint8_t *out, int64_t cap) {
    int nsym = 1 << bits;
    uint32_t cum[256];
    if (cumulate(freq, nsym, cum) || cap < 8 * LANES) return -1;
    int64_t pos = 4 * LANES; /* the lane lengths come first */
    for (int l = 0; l < LANES; l++) {
        uint32_t x = LOW;
        uint8_t *p = out + cap; /* this lane's words grow down from the end, last read first */
        int64_t last = n - 1 - ((n - 1 - l) % LANES + LANES) % LANES;
        for (int64_t i = last; i >= l; i -= LANES) {
            unsigned s = get_sym(codes, i, bits);
            uint32_t f = freq[s];
            if (f == 0) return -1;
            if ((uint64_t)x >= ((uint64_t)(LOW >> PROB_BITS) << 16) * f) { /* 2^32 for f = 4096 */
                if (p - out < pos + 4 + 2) return -1;
                p -= 2;
                p[0] = (uint8_t)x;
                p[1] = (uint8_t)(x >> 8);
                x >>= 16;
            }
            x = ((x / f) << PROB_BITS) + (x % f) + cum[s];
        }
        int64_t words = out + cap - p;
        if (cap - pos < 4 + words) return -1;
        memmove(out + pos + 4, p, (size_t)words);
        for (int b = 0; b < 4; b++) out[pos + b] = (uint8_t)(x >> (8 * b));
        uint32_t len = (uint32_t)(4 + words);
        for (int b = 0; b < 4; b++) out[4 * l + b] = (uint8_t)(len >> (8 * b));
        pos += len;
    }
    return pos;
}

static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* A segment being decoded: each lane's state, read pointer and end; `k` steps (8 symbols each) done. */
typedef struct {
    uint32_t x[LANES];
    const uint8_t *p[LANES], *end[LANES];
    int64_t k, n;
    uint8_t *codes;
} Segment;

/* The decoding table of a frequency table (symbol | (freq - 1) << 8 | cum << 20 per slot); -1 unless
 * the table sums to PROB_SCALE. */
static int build_lut(const uint16_t *freq, int nsym, uint32_t *lut) {
    uint32_t cum[256];
    if (cumulate(freq, nsym, cum)) return -1;
    for (int s = 0; s < nsym; s++)
        for (uint32_t j = cum[s]; j < cum[s] + freq[s]; j++)
            lut[j] = (uint32_t)s | ((uint32_t)(freq[s] - 1) << 8) | (cum[s] << 20);
    return 0;
}

/* The lane table of a rANS stream [in, in + len); -1 unless the lanes fill it exactly. */
static int start(const uint8_t *in, int64_t len, int64_t n, uint8_t *codes, Segment *g) {
    if (len < 4 * LANES) return -1;
    int64_t pos = 4 * LANES;
    for (int l = 0; l < LANES; l++) {
        uint32_t m = rd32(in + 4 * l);
        if (m < 4 || (int64_t)m > len - pos) return -1;
        g->x[l] = rd32(in + pos);
        g->p[l] = in + pos + 4;
        g->end[l] = in + pos + m;
        pos += m;
    }
    g->k = 0, g->n = n, g->codes = codes;
    return pos == len ? 0 : -1;
}

/* The 8 symbols of one step (i % 8 == 0) into their packed bytes. */
static inline __attribute__((always_inline)) void pack8(const uint32_t *sym, uint8_t *codes, int64_t i, const int bits) {
    if (bits == 8)
        for (int l = 0; l < LANES; l++) codes[i + l] = (uint8_t)sym[l];
    else if (bits == 4)
        for (int l = 0; l < LANES; l += 2) codes[i / 2 + l / 2] = (uint8_t)(sym[l] | sym[l + 1] << 4);
    else
        for (int l = 0; l < LANES; l += 4)
            codes[i / 4 + l / 4] = (uint8_t)(sym[l] | sym[l + 1] << 2 | sym[l + 2] << 4 | sym[l + 3] << 6);
}

/* One decoding step of one lane: the symbol, the state renormalised from its own stream. Unchecked,
 * it reads 2 bytes at p[l] whether it needs them or not, and renormalises by arithmetic, not a
 * select: gcc makes `need ? :` a branch, mispredicted on real codes (2x slower). */
#define STEP(l, checked)                                                                  \
    do {                                                                                  \
        uint32_t v = x[l], slot = v & (PROB_SCALE - 1), e = lut[slot];                    \
        sym[l] = e & 255;                                                                 \
        v = (((e >> 8) & (PROB_SCALE - 1)) + 1) * (v >> PROB_BITS) + slot - (e >> 20);    \
        if (checked) {                                                                    \
            if (v < LOW) {                                                                \
                if (end[l] - p[l] < 2) return -1;                                         \
                v = (v << 16) | (uint32_t)p[l][0] | (uint32_t)p[l][1] << 8;               \
                p[l] += 2;                                                                \
            }                                                                             \
        } else {                                                                          \
            uint16_t w;                                                                   \
            memcpy(&w, p[l], 2);                                                          \
            uint32_t need = v < LOW, sh = need << 4;                                      \
            v = (v << sh) | (w & (0u - need));                                            \
            p[l] += 2 * need;                                                             \
        }                                                                                 \
        x[l] = v;                                                                         \
    } while (0)

/* The steps of a started segment from its k-th on, then its last n % 8 symbols (a partial last
 * byte's unused bits are zero). Returns 0, or -1 for a damaged stream: every lane must consume
 * exactly its stream and end in the encoder's start state. */
static inline __attribute__((always_inline)) int finish(Segment *g, const int bits, const uint32_t *lut) {
    int per = 8 / bits;
    int64_t n = g->n, steps = n / LANES, k = g->k;
    uint32_t x[LANES], sym[LANES] = {0}; /* copies: stores to codes may alias g, these cannot */
    const uint8_t *p[LANES], *end[LANES];
    uint8_t *codes = g->codes;
    memcpy(x, g->x, sizeof x), memcpy(p, g->p, sizeof p), memcpy(end, g->end, sizeof end);
    while (k < steps) { /* the bulk: 8 symbols a step, unchecked while every lane has 2 bytes a step */
        int64_t safe = steps - k;
        for (int l = 0; l < LANES; l++) {
            int64_t r = (end[l] - p[l]) / 2;
            safe = r < safe ? r : safe;
        }
        if (safe == 0) { /* a lane near its end: one checked step */
            for (int l = 0; l < LANES; l++) STEP(l, 1);
            pack8(sym, codes, 8 * k++, bits);
            continue;
        }
        for (int64_t j = 0; j < safe; j++, k++) {
            for (int l = 0; l < LANES; l++) STEP(l, 0);
            pack8(sym, codes, 8 * k, bits);
        }
    }
    int64_t i = steps * LANES;
    memset(codes + i / per, 0, (size_t)((n * bits + 7) / 8 - i / per));
    for (int l = 0; i < n; i++, l++) { /* the last n % 8 symbols */
        STEP(l, 1);
        codes[i / per] |= (uint8_t)(sym[l] << ((i % per) * bits));
    }
    for (int l = 0; l < LANES; l++)
        if (p[l] != end[l] || x[l] != LOW) return -1;
    return 0;
}

static int finish_any(Segment *g, int bits, const uint32_t *lut) {
    switch (bits) { /* one specialised copy per width */
    case 2: return finish(g, 2, lut);
    case 4: return finish(g, 4, lut);
    default: return finish(g, 8, lut);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NVEC 2 /* 16-lane vectors in flight */
#define GROUP (2 * NVEC) /* segments decoded together by the AVX-512 path, 2 per vector */

/* `steps` unchecked steps of GROUP segments at once, all at the same step k: no more steps than any
 * of them has left, and each lane holds at least 2 bytes more than `steps` words (so the 4-byte
 * gathers stay inside it). Exactly the scalar steps' arithmetic (uint32, wrapping alike), so the same
 * bits. `lut` holds the GROUP tables back to back. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void bulk_avx512(Segment *g, const uint32_t *lut,
                                                                              int64_t steps, int bits,
                                                                              const uint8_t *base) {
    __m512i x[NVEC], off[NVEC], tab[NVEC];
    for (int v = 0; v < NVEC; v++) {
        uint32_t xs[16];
        int32_t os[16], ts[16];
        for (int j = 0; j < 16; j++) {
            Segment *s = &g[2 * v + j / 8];
            xs[j] = s->x[j % 8];
            os[j] = (int32_t)(s->p[j % 8] - base);
            ts[j] = (2 * v + j / 8) * (int32_t)PROB_SCALE;
        }
        x[v] = _mm512_loadu_si512(xs), off[v] = _mm512_loadu_si512(os), tab[v] = _mm512_loadu_si512(ts);
    }
    const __m512i mslot = _mm512_set1_epi32(PROB_SCALE - 1), m8 = _mm512_set1_epi32(255),
                  m16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2),
                  low = _mm512_set1_epi32(LOW);
    const __m128i lo8 = _mm_set1_epi16(0xFF);
    int64_t k = g[0].k;
    for (int64_t j = 0; j < steps; j++, k++) {
        for (int v = 0; v < NVEC; v++) {
            __m512i slot = _mm512_and_si512(x[v], mslot);
            __m512i e = _mm512_i32gather_epi32(_mm512_add_epi32(slot, tab[v]), (const void *)lut, 4);
            __m512i f = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 8), mslot), one);
            __m512i y = _mm512_mullo_epi32(f, _mm512_srli_epi32(x[v], PROB_BITS));
            y = _mm512_sub_epi32(_mm512_add_epi32(y, slot), _mm512_srli_epi32(e, 20));
            __mmask16 need = _mm512_cmplt_epu32_mask(y, low);
            __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), need, off[v], (const void *)base, 1);
            w = _mm512_and_si512(w, m16);
            x[v] = _mm512_mask_or_epi32(y, need, _mm512_slli_epi32(y, 16), w);
            off[v] = _mm512_mask_add_epi32(off[v], need, off[v], two);
            __m128i b = _mm512_cvtepi32_epi8(_mm512_and_si512(e, m8)); /* 8 symbols of each segment */
            uint8_t *ca = g[2 * v].codes, *cb = g[2 * v + 1].codes;
            if (bits == 8) {
                _mm_storel_epi64((__m128i *)(ca + 8 * k), b);
                _mm_storel_epi64((__m128i *)(cb + 8 * k), _mm_unpackhi_epi64(b, b));
                continue;
            }
            if (bits == 2) /* symbol pairs into nibbles, then as for 4 */
                b = _mm_packus_epi16(_mm_and_si128(_mm_or_si128(b, _mm_srli_epi16(b, 6)), lo8), _mm_setzero_si128());
            b = _mm_packus_epi16(_mm_and_si128(_mm_or_si128(b, _mm_srli_epi16(b, 4)), lo8), _mm_setzero_si128());
            uint64_t q = (uint64_t)_mm_cvtsi128_si64(b);
            if (bits == 4) {
                uint32_t a = (uint32_t)q, c = (uint32_t)(q >> 32);
                memcpy(ca + 4 * k, &a, 4), memcpy(cb + 4 * k, &c, 4);
            } else {
                uint16_t a = (uint16_t)q, c = (uint16_t)(q >> 16);
                memcpy(ca + 2 * k, &a, 2), memcpy(cb + 2 * k, &c, 2);
            }
        }
    }
    for (int v = 0; v < NVEC; v++) {
        uint32_t xs[16];
        int32_t os[16];
        _mm512_storeu_si512(xs, x[v]), _mm512_storeu_si512(os, off[v]);
        for (int j = 0; j < 16; j++) {
            Segment *s = &g[2 * v + j / 8];
            s->x[j % 8] = xs[j], s->p[j % 8] = base + os[j];
        }
    }
    for (int s = 0; s < GROUP; s++) g[s].k = k;
}

/* GROUP started segments (their tables in lut): the bulk 4 at a time while every lane of every
 * segment has room and every segment steps left, then each finished alone. */
static int decode_group(Segment *g, const uint32_t *lut, int bits, const uint8_t *base) {
    for (;;) {
        int64_t safe = INT64_MAX;
        for (int s = 0; s < GROUP; s++)
            for (int l = 0; l < LANES; l++) {
                int64_t left = g[s].n / LANES - g[s].k;
                safe = left < safe ? left : safe;
                int64_t r = (g[s].end[l] - g[s].p[l]) / 2 - 1;
                safe = r < safe ? r : safe;
            }
        if (safe < 64) break;
        if (bits == 2) bulk_avx512(g, lut, safe, 2, base);
        else if (bits == 4) bulk_avx512(g, lut, safe, 4, base);
        else bulk_avx512(g, lut, safe, 8, base);
    }
    for (int s = 0; s < GROUP; s++)
        if (finish_any(&g[s], bits, lut + s * PROB_SCALE)) return -1;
    return 0;
}

static int have_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
#else
#define GROUP 1
static int have_avx512(void) { return 0; }
static int decode_group(Segment *g, const uint32_t *lut, int bits, const uint8_t *base) { /* never called */
    (void)g, (void)lut, (void)bits, (void)base;
    return -1;
}
#endif

/* A whole stream of segment records (ans.py documents them) in one call: segment i, ns[i] symbols,
 * decoded into out + offs[i] (the packed bytes of segments must not overlap). Returns 0, or -1
 * unless the stream is exactly such records, each one sound (the checks of ans.decode_segments).
 * With simd (and an AVX-512 CPU) every GROUP coded segments in a row decode together. */
int ans_decode_stream(const uint8_t *s, int64_t len, const int64_t *ns, int64_t nseg, int bits, uint8_t *out,
                      const int64_t *offs, int simd) {
    if (bits != 2 && bits != 4 && bits != 8) return -1;
    int nsym = 1 << bits, pending = 0; /* started segments waiting for a full group */
    int vec = simd && GROUP > 1 && len < ((int64_t)1 << 31) - 8 && have_avx512();
    uint32_t lut[GROUP * PROB_SCALE];
    Segment g[GROUP];
    int64_t pos = 0;
    for (int64_t i = 0; i < nseg; i++) {
        int64_t size = (ns[i] * bits + 7) / 8;
        if (pos >= len) return -1;
        uint8_t mode = s[pos++];
        if (mode == 0) {
            if (size > len - pos) return -1;
            memcpy(out + offs[i], s + pos, (size_t)size);
            pos += size;
            continue;
        }
        if (mode != 1 || 2 * nsym + 4 > len - pos) return -1;
        uint16_t freq[256];
        memcpy(freq, s + pos, (size_t)(2 * nsym));
        int64_t m = rd32(s + pos + 2 * nsym);
        pos += 2 * nsym + 4;
        if (m > len - pos) return -1;
        uint32_t *t = lut + pending * PROB_SCALE;
        if (build_lut(freq, nsym, t) || start(s + pos, m, ns[i], out + offs[i], &g[pending])) return -1;
        pos += m;
        if (!vec) {
            if (finish_any(&g[0], bits, t)) return -1;
        } else if (++pending == GROUP) {
            if (decode_group(g, lut, bits, s)) return -1;
            pending = 0;
        }
    }
    for (int j = 0; j < pending; j++)
        if (finish_any(&g[j], bits, lut + j * PROB_SCALE)) return -1;
    return pos == len ? 0 : -1;
}
