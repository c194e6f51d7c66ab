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

/* One decoding step of one lane: the symbol, the state renormalised from its own stream. */
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
            uint16_t w; /* arithmetic, not a select: gcc makes `need ? :` a branch, */    \
            memcpy(&w, p[l], 2); /* mispredicted on real codes (2x slower) */             \
            uint32_t need = v < LOW, sh = need << 4;                                      \
            v = (v << sh) | (w & (0u - need));                                            \
            p[l] += 2 * need;                                                             \
        }                                                                                 \
        x[l] = v;                                                                         \
    } while (0)

/* Decode n symbols of `bits` from the stream into codes (n * bits / 8 bytes, rounded up; a partial
 * last byte's unused bits are zero). Returns 0, or -1 for a damaged stream or a bad table. */
static inline __attribute__((always_inline)) int decode(const uint8_t *in, int64_t len, int64_t n,
                                                          const int bits, const uint16_t *freq, uint8_t *codes) {
    int nsym = 1 << bits, per = 8 / bits;
    uint32_t cum[256], lut[PROB_SCALE], x[LANES], sym[LANES] = {0};
    const uint8_t *p[LANES], *end[LANES];
    if (cumulate(freq, nsym, cum) || len < 4 * LANES) return -1;
    for (int s = 0; s < nsym; s++)
        for (uint32_t j = cum[s]; j < cum[s] + freq[s]; j++)
            lut[j] = (uint32_t)s | ((uint32_t)(freq[s] - 1) << 8) | (cum[s] << 20);
    int64_t pos = 4 * LANES;
    for (int l = 0; l < LANES; l++) {
        uint32_t m = rd32(in + 4 * l);
        if (m < 4 || (int64_t)m > len - pos) return -1;
        x[l] = rd32(in + pos);
        p[l] = in + pos + 4;
        end[l] = in + pos + m;
        pos += m;
    }
    if (pos != len) return -1;
    int64_t steps = n / LANES, k = 0;
    while (k < steps) { /* the bulk: 8 symbols a step, unchecked while every lane has 2 bytes a step */
        int64_t safe = steps - k;
        for (int l = 0; l < LANES; l++) {
            int64_t r = (end[l] - p[l]) / 2;
            safe = r < safe ? r : safe;
        }
        if (safe == 0) { /* a lane near its end: one checked step */
            for (int l = 0; l < LANES; l++) STEP(l, 1);
            safe = 1;
        } else {
            for (int64_t j = 0; j < safe; j++) {
                for (int l = 0; l < LANES; l++) STEP(l, 0);
                if (j + 1 < safe) { /* pack these 8 symbols, go on */
                    pack8(sym, codes, 8 * (k + j), bits);
                }
            }
            k += safe - 1; /* the last step of the run is packed below */
        }
        int64_t i = 8 * k;
        pack8(sym, codes, i, bits);
        k++;
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

static int ans_decode(const uint8_t *in, int64_t len, int64_t n, int bits, const uint16_t *freq, uint8_t *codes) {
    switch (bits) { /* one specialised copy per width */
    case 2: return decode(in, len, n, 2, freq, codes);
    case 4: return decode(in, len, n, 4, freq, codes);
    case 8: return decode(in, len, n, 8, freq, codes);
    default: return -1;
    }
}

/* A whole stream of segment records (ans.py documents them) in one call: segment i, ns[i] symbols,
 * decoded into out + offs[i] (the packed bytes of segments must not overlap). Returns 0, or -1
 * unless the stream is exactly such records, each one sound (the checks of ans.decode_segments). */
int ans_decode_stream(const uint8_t *s, int64_t len, const int64_t *ns, int64_t nseg, int bits, uint8_t *out,
                      const int64_t *offs) {
    if (bits != 2 && bits != 4 && bits != 8) return -1;
    int64_t nsym = 1 << bits, pos = 0;
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
        if (m > len - pos || ans_decode(s + pos, m, ns[i], bits, freq, out + offs[i])) return -1;
        pos += m;
    }
    return pos == len ? 0 : -1;
}
