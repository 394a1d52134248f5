/*
 * Products with weights kept in GGUF's block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of
 * 32 inputs with a float16 scale, and an offset for _1) and the K-quants Q4_K, Q5_K, Q6_K (super-
 * blocks of 256 with a float16 scale and small integer scales per sub-block). The weights stay in
 * their bits; the kernel unpacks them in registers. Prototypes and layouts: blocks.h.
 *
 * Every format reads as w = D_g * u - M_g over a sub-block g of one output column: u an
 * unsigned integer of 4, 5, 6 or 8 bits (Q8_0: a signed byte), D_g and M_g floats of the block
 * (Q4_0: d and 8 d; Q4_K: d * sc_g and dmin * m_g; Q6_K: d * sc_g and 32 d * sc_g over 16
 * values). Activations come in blocks of 32 values a = e * p, p an integer in -127..127, with
 * the integer sums P of p over each 16. For one row, one column and one block of 32,
 *
 *   sum_j w_j a_j = e * (D * S - M * P),   S = sum_j u_j p_j   (an exact int32)
 *
 * The integer sums are exact, whatever instruction computes them; the float work after them is
 * one fixed sequence per output (cvt, mul, fma in the order of the blocks), done lane by lane.
 * So a row's result never depends on the other rows of the call, on the thread count, or on the
 * instruction set: the AVX2 and the AVX512-VNNI paths below run the same code over vectors of 8
 * or 16 columns and give the same float32 results, bit for bit (and so does the AMX-INT8 path
 * that takes the K-quants' products of many rows, see "many rows" below).
 *
 * Why 8-bit activations per block of 32 (llama.cpp's Q8_0): measured on Qwen2.5-Coder-0.5B's
 * Q4_K_M file (2,000 tokens of the quality text against the float32 model of the dequantized
 * blocks, kvserve/bench/blocks_bench.py --quality): every layer's products through these
 * kernels, perplexity -0.08% and 98.9% of next tokens equal (12 bits: +0.00%, 99.95%);
 * emulated in float, blocks of 32 -0.07% and 98.75%, blocks of 256 (Q8_K) -0.06% and 98.55%.
 * Eight bits cost one multiply per weight and input. On SmolLM2-135M's Q4_1 file 8 bits
 * lose a near-tied greedy answer ("Paris"), as the q4 path found; the finer form (a 4-bit rest
 * beside each int8, see quantize_blocks_row) keeps it, for a second multiply: 1.5x the time at
 * 8-32 rows on AVX2 (2x for Q8_0), 1.1-1.3x at one row.
 *
 * The K-quants take the 8-bit form with one scale e per 256 values (llama.cpp's Q8_K; the
 * quantizer gives it whenever k is whole 256s, each block of 32 carrying its 256's e). Then
 * e is the super-block's and its sub-block scales, small integers, multiply the exact sums
 * as integers (vpmulld, or AVX2's vpmaddwd widening the int16 pair sums): one float update
 * per row, column and 256 inputs instead of one per 32 (16 for Q6_K) with its scale products.
 * Measured on the AVX512 machine (kvserve/bench/blocks_bench.py, 8 of the 1.5B's layers,
 * alternating with blocks of 32): one row 7.5-7.7 ms against 7.6-12.2 (94-100% of the read
 * bandwidth against 63-79%), 32 rows 53-55 ms against 59-62, 4 and 8 rows within the noise;
 * the cost, on Qwen2.5-Coder-1.5B's Q4_K_M file (1,024 tokens of the quality text against
 * the float32 model): perplexity +0.10% (blocks of 32: +0.02%), next token 98.2% (99.2%).
 *
 * The integer sums, per 32-bit lane (one output column, 4 consecutive inputs):
 *   AVX2: vpmaddubsw (unsigned u times signed p, pairs summed into int16), then vpmaddwd by ones
 *         into int32. vpmaddubsw saturates only past 32767; |p| <= 127 and u <= 63 keep a pair
 *         within 2 * 63 * 127 = 16002, so the int16 pair sums of G consecutive 4-input steps
 *         may be added before widening while G * 2 * umax * 127 <= 32767: G = 8 for 4 bits
 *         (30480), 4 for 5 bits (31496), 2 for 6 bits (32004), 1 for Q8_0 (|w| <= 128 enters as
 *         |w| with its sign moved onto p: 2 * 128 * 127 = 32512). No saturation can occur, so
 *         the sums are the exact ones.
 *   AVX512-VNNI (and AVX-VNNI): vpdpbusd, the same unsigned-by-signed products summed into
 *         int32 without any intermediate rounding: the same exact sums.
 * The layout is the same for every instruction set (panels of 16 columns). AVX512 takes a
 * panel in one vector; AVX2 in two, side by side for tiles of 1-2 rows, or in two passes for
 * tiles of 4 rows (whose sums fill its 16 registers).
 * Tiles: up to 4 rows on AVX2, 8 on AVX512 (4 for the K-quants' finer form); each weight
 * record is unpacked once per tile, so at 8-32 rows the unpacking is shared by 4-8 rows. On
 * AVX2 the K-quants' 8-bit form of 32 rows and more goes record by record instead, each record
 * expanded once for all the rows ("many rows on AVX2" below).
 * Measured on the shared AVX2 machine (kvserve/bench/blocks_bench.py, the
 * 1.5B's products of a decode step in Q4_K and Q6_K, 4 layers, against kvserve_int8_gemm on
 * the same shapes): at 32 rows 1.0x (2 threads) to 1.4x (1 thread) int8's speed, at 8 rows
 * 1.3-1.9x, at 1 row 2.6-2.8x (the blocks' fewer bytes).
 *
 * Packed layout, per panel of 16 output columns and per block (a record, contiguous):
 *   nibbles [4][16][4] per 32 inputs: quarter h, column c, byte b: low nibble = u[8h + b] & 15,
 *            high nibble = u[8h + 4 + b] & 15 (one 64-byte vector is 2 steps of 4 inputs of
 *            16 columns, unpacked by a mask and a shift);
 *   high bits (5-bit formats) [16][4] per 32: bit t of byte (c, b) = bit 4 of u[4t + b];
 *   high pairs (Q6_K) [2][16][4] per 32: bits 2t, 2t+1 of byte (v, c, b) = bits 4, 5 of
 *            u[16v + 4t + b];
 *   bytes (Q8_0) [8][16][4]: byte (s, c, b) = w[4s + b];
 *   then the block's floats and small scales per column (see `FORMATS` below for the
 *   offsets): d [16] float16 (and m [16] for _1); K-quants: d, dmin [16] float16, sc, m
 *   [8][16] uint8 (Q6_K: d [16], sc [16][16] int8).
 * Records run over blocks, then panels: [panels][blocks][record bytes]. Each record is the
 * file's bytes for 16 columns, rearranged: as many bytes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_K)
 * or 2-3% more (Q4_K, Q5_K: the 6-bit scales kept as bytes).
 */
#define _GNU_SOURCE /* syscall(): the tile unit's permission (kvserve_blocks_amx) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Loops start on 64-byte lines: the tiles' times moved by up to 25% with the code's placement
 * alone (one row 5.0-7.0 ms, 4 rows 9.5-11.0 ms in kvserve/bench/blocks_bench.py for the same
 * tile code, AVX512 machine); aligned, both sit at the low end. */
#pragma GCC optimize("align-loops=64")
#include "blocks.h"
#include "common.h"
#include "task_ranges.h"

#define ALWAYS static inline __attribute__((always_inline))

/* ---- formats -------------------------------------------------------------------------------- */

typedef struct {
    int64_t format, values, gguf_bytes, record;
    int64_t high, d, dmin, sc, mn; /* offsets in a record (-1: absent) */
} format_info;

static const format_info FORMATS[] = {
    {KVSERVE_BLOCKS_Q4_0, 32, 18, 288, -1, 256, -1, -1, -1},
    {KVSERVE_BLOCKS_Q4_1, 32, 20, 320, -1, 256, 288, -1, -1}, /* dmin: m */
    {KVSERVE_BLOCKS_Q5_0, 32, 22, 352, 256, 320, -1, -1, -1},
    {KVSERVE_BLOCKS_Q5_1, 32, 24, 384, 256, 320, 352, -1, -1},
    {KVSERVE_BLOCKS_Q8_0, 32, 34, 544, -1, 512, -1, -1, -1},
    {KVSERVE_BLOCKS_Q4_K, 256, 144, 2368, -1, 2048, 2080, 2112, 2240},
    {KVSERVE_BLOCKS_Q5_K, 256, 176, 2880, 2048, 2560, 2592, 2624, 2752},
    {KVSERVE_BLOCKS_Q6_K, 256, 210, 3360, 2048, 3072, -1, 3104, -1},
};
#define NUM_FORMATS ((int)(sizeof FORMATS / sizeof FORMATS[0]))

/* The index of `format` in FORMATS: a constant where `format` is one (the tile instances). */
ALWAYS int format_slot(int64_t format) {
    switch (format) {
    case KVSERVE_BLOCKS_Q4_0: return 0;
    case KVSERVE_BLOCKS_Q4_1: return 1;
    case KVSERVE_BLOCKS_Q5_0: return 2;
    case KVSERVE_BLOCKS_Q5_1: return 3;
    case KVSERVE_BLOCKS_Q8_0: return 4;
    case KVSERVE_BLOCKS_Q4_K: return 5;
    case KVSERVE_BLOCKS_Q5_K: return 6;
    case KVSERVE_BLOCKS_Q6_K: return 7;
    default: return -1;
    }
}

static const format_info *find_format(int64_t format) {
    for (int i = 0; i < NUM_FORMATS; i++)
        if (FORMATS[i].format == format) return &FORMATS[i];
    return NULL;
}

int64_t kvserve_blocks_block_values(int64_t format) {
    const format_info *f = find_format(format);
    return f ? f->values : 0;
}

int64_t kvserve_blocks_gguf_bytes(int64_t format) {
    const format_info *f = find_format(format);
    return f ? f->gguf_bytes : 0;
}

int64_t kvserve_blocks_record_bytes(int64_t format) {
    const format_info *f = find_format(format);
    return f ? f->record : 0;
}

/* ---- packing -------------------------------------------------------------------------------- */

#define PANEL KVSERVE_BLOCKS_PANEL

static inline uint16_t load16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void store16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* IEEE half to float, subnormals included (no F16C needed: packing runs anywhere). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            mantissa <<= 1;
        } while (!(mantissa & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* K-quants' 6-bit scale and min of sub-block j from their 12 packed bytes (ggml's layout). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/*
 * Packing works on 8 bytes at a time (x86 is little-endian: byte i of a word is value i): a
 * word of 8 integers is masked, shifted and merged at once. Measured on the AVX2 machine, one
 * thread, the 1.5B's gate|up (Q4_K) and down (Q6_K) weights: 0.28 and 0.41 GB/s of blocks value
 * by value, 0.77 and 1.32 GB/s this way (the first touch of the new packed pages included);
 * every layer weight of Qwen2.5-Coder-0.5B's Q4_K_M file (247 MB, mostly Q5_0) in 0.34 s, each
 * format's loop compiled on its own (0.63 s through one loop that asks the format per block).
 */
static inline uint64_t word(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline void put_word(uint8_t *p, uint64_t w) { memcpy(p, &w, 8); }

static inline uint32_t word32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

static inline void put_word32(uint8_t *p, uint32_t w) { memcpy(p, &w, 4); }

#define BYTES_OF(c) (0x0101010101010101ull * (uint8_t)(c))

/* u[0..n) = (src[i] >> shift) & 15 for n a multiple of 8 */
static inline void nibbles_of(const uint8_t *src, int shift, int n, uint8_t *u) {
    for (int i = 0; i < n; i += 8) put_word(u + i, (word(src + i) >> shift) & BYTES_OF(0x0F));
}

/* u[0..n) |= ((src[i] >> shift) & mask) << 4 */
static inline void high_of(const uint8_t *src, int shift, uint8_t mask, int n, uint8_t *u) {
    for (int i = 0; i < n; i += 8)
        put_word(u + i, word(u + i) | (((word(src + i) >> shift) & BYTES_OF(mask)) << 4));
}

/* the 8 bits of `bits` as 8 bytes 0 / 1 (bit i in byte i) */
static inline uint64_t spread_bits(uint8_t bits) {
    uint64_t x = bits;
    x = (x | (x << 28)) & 0x0000000F0000000Full;
    x = (x | (x << 14)) & 0x0003000300030003ull;
    return (x | (x << 7)) & 0x0101010101010101ull;
}

/* One GGUF block of one column: its integers u[values] and its float16 fields (bit patterns). */
typedef struct {
    uint8_t u[256];
    uint16_t d, dmin; /* dmin: m for Q4_1 / Q5_1 */
    uint8_t sc[16], mn[8];
} column_block;

ALWAYS void read_block(const int64_t format, const uint8_t *b, column_block *out) {
    switch (format) {
    case KVSERVE_BLOCKS_Q4_0:
    case KVSERVE_BLOCKS_Q4_1:
    case KVSERVE_BLOCKS_Q5_0:
    case KVSERVE_BLOCKS_Q5_1: {
        /* values j < 16: low nibbles of qs[j]; j >= 16: high nibbles of qs[j - 16]; the 5-bit
         * formats' bit 4 of value j is bit j of qh */
        const int asym = format == KVSERVE_BLOCKS_Q4_1 || format == KVSERVE_BLOCKS_Q5_1;
        const int five = format == KVSERVE_BLOCKS_Q5_0 || format == KVSERVE_BLOCKS_Q5_1;
        const uint8_t *qs = b + (asym ? 4 : 2) + (five ? 4 : 0);
        out->d = load16(b);
        out->dmin = asym ? load16(b + 2) : 0;
        nibbles_of(qs, 0, 16, out->u);
        nibbles_of(qs, 4, 16, out->u + 16);
        if (five) {
            const uint8_t *qh = b + (asym ? 4 : 2);
            for (int i = 0; i < 4; i++)
                put_word(out->u + 8 * i, word(out->u + 8 * i) | (spread_bits(qh[i]) << 4));
        }
        break;
    }
    case KVSERVE_BLOCKS_Q8_0:
        out->d = load16(b);
        memcpy(out->u, b + 2, 32);
        break;
    case KVSERVE_BLOCKS_Q4_K:
    case KVSERVE_BLOCKS_Q5_K: {
        /* sub-block s: nibbles (s % 2) of qs[32 (s / 2) + l]; Q5_K's bit 4: bit s of qh[l] */
        const int five = format == KVSERVE_BLOCKS_Q5_K;
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        out->d = load16(b);
        out->dmin = load16(b + 2);
        for (int j = 0; j < 8; j++) scale_min_k4(j, b + 4, &out->sc[j], &out->mn[j]);
        for (int sub = 0; sub < 8; sub++) {
            nibbles_of(qs + 32 * (sub / 2), 4 * (sub % 2), 32, out->u + 32 * sub);
            if (five) high_of(qh, sub, 0x01, 32, out->u + 32 * sub);
        }
        break;
    }
    case KVSERVE_BLOCKS_Q6_K: {
        /* value 128 a + 64 h + l: nibble h of ql[64 a + l]; value 128 a + 32 t + l: bits 4, 5
         * from bits 2t, 2t + 1 of qh[32 a + l] */
        const uint8_t *ql = b, *qh = b + 128;
        for (int a = 0; a < 2; a++) {
            uint8_t *u = out->u + 128 * a;
            for (int h = 0; h < 2; h++) nibbles_of(ql + 64 * a, 4 * h, 64, u + 64 * h);
            for (int t = 0; t < 4; t++) high_of(qh + 32 * a, 2 * t, 0x03, 32, u + 32 * t);
        }
        memcpy(out->sc, b + 192, 16);
        out->d = load16(b + 208);
        break;
    }
    default:
        break;
    }
}

/* Writers of one column c of a record's parts, for 32 inputs u[0..31]. */
static inline void put_nibbles(uint8_t *nib, int c, const uint8_t *u) {
    for (int h = 0; h < 4; h++) { /* bytes b: u[8h + b] | u[8h + 4 + b] << 4 */
        const uint64_t w = word(u + 8 * h) & BYTES_OF(0x0F);
        put_word32(nib + (16 * h + c) * 4, (uint32_t)w | ((uint32_t)(w >> 32) << 4));
    }
}

static inline void put_high_bits(uint8_t *high, int c, const uint8_t *u) {
    uint32_t bits = 0; /* byte b, bit t: bit 4 of u[4t + b] */
    for (int t = 0; t < 8; t++) bits |= ((word32(u + 4 * t) >> 4) & 0x01010101u) << t;
    put_word32(high + 4 * c, bits);
}

static inline void put_high_pairs(uint8_t *high, int c, const uint8_t *u) {
    for (int v = 0; v < 2; v++) { /* byte (v, b), bits 2t, 2t+1: bits 4, 5 of u[16v + 4t + b] */
        uint32_t pairs = 0;
        for (int t = 0; t < 4; t++)
            pairs |= ((word32(u + 16 * v + 4 * t) >> 4) & 0x03030303u) << (2 * t);
        put_word32(high + 64 * v + 4 * c, pairs);
    }
}

static inline void put_bytes(uint8_t *q, int c, const uint8_t *u) {
    for (int s = 0; s < 8; s++) memcpy(q + 64 * s + 4 * c, u + 4 * s, 4);
}

ALWAYS void write_column(const format_info *f, uint8_t *rec, int c, const column_block *cb) {
    const int64_t subs = f->values / 32;
    for (int64_t s = 0; s < subs; s++) {
        const uint8_t *u = cb->u + 32 * s;
        if (f->format == KVSERVE_BLOCKS_Q8_0) {
            put_bytes(rec, c, u);
            continue;
        }
        put_nibbles(rec + 256 * s, c, u);
        if (f->format == KVSERVE_BLOCKS_Q6_K)
            put_high_pairs(rec + f->high + 128 * s, c, u);
        else if (f->high >= 0)
            put_high_bits(rec + f->high + 64 * s, c, u);
    }
    store16(rec + f->d + 2 * c, cb->d);
    if (f->dmin >= 0) store16(rec + f->dmin + 2 * c, cb->dmin);
    if (f->format == KVSERVE_BLOCKS_Q6_K) {
        for (int g = 0; g < 16; g++) rec[f->sc + 16 * g + c] = cb->sc[g];
    } else if (f->sc >= 0) {
        for (int g = 0; g < 8; g++) {
            rec[f->sc + 16 * g + c] = cb->sc[g];
            rec[f->mn + 16 * g + c] = cb->mn[g];
        }
    }
}

/* Panels [first, last) of a weight, for one format (a constant: each format's own code). */
ALWAYS void pack_panels(const int64_t format, const uint8_t *raw, int64_t n, int64_t blocks,
                        uint8_t *packed, int64_t first, int64_t last) {
    const format_info *f = &FORMATS[format_slot(format)];
    const int64_t row_bytes = blocks * f->gguf_bytes;
    column_block cb;
    for (int64_t p = first; p < last; p++) {
        const int64_t columns = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t g = 0; g < blocks; g++) {
            uint8_t *rec = packed + (p * blocks + g) * f->record;
            /* columns past n: zero scales, zero products */
            if (columns < PANEL) memset(rec, 0, (size_t)f->record);
            for (int c = 0; c < columns; c++) {
                read_block(format, raw + (p * PANEL + c) * row_bytes + g * f->gguf_bytes, &cb);
                write_column(f, rec, c, &cb);
            }
        }
    }
}

#define DEFINE_PACK(NAME, FORMAT)                                                                  \
    static void pack_##NAME(const uint8_t *raw, int64_t n, int64_t blocks, uint8_t *packed,       \
                            int64_t first, int64_t last) {                                        \
        pack_panels(FORMAT, raw, n, blocks, packed, first, last);                                 \
    }

DEFINE_PACK(q4_0, KVSERVE_BLOCKS_Q4_0)
DEFINE_PACK(q4_1, KVSERVE_BLOCKS_Q4_1)
DEFINE_PACK(q5_0, KVSERVE_BLOCKS_Q5_0)
DEFINE_PACK(q5_1, KVSERVE_BLOCKS_Q5_1)
DEFINE_PACK(q8_0, KVSERVE_BLOCKS_Q8_0)
DEFINE_PACK(q4_k, KVSERVE_BLOCKS_Q4_K)
DEFINE_PACK(q5_k, KVSERVE_BLOCKS_Q5_K)
DEFINE_PACK(q6_k, KVSERVE_BLOCKS_Q6_K)

int kvserve_blocks_pack(int64_t format, const uint8_t *raw, int64_t n, int64_t k, uint8_t *packed,
                        int num_threads) {
    const format_info *f = find_format(format);
    if (!f || k <= 0 || k % f->values || n <= 0) return -1;
    void (*pack)(const uint8_t *, int64_t, int64_t, uint8_t *, int64_t, int64_t) =
        format == KVSERVE_BLOCKS_Q4_0   ? pack_q4_0
        : format == KVSERVE_BLOCKS_Q4_1 ? pack_q4_1
        : format == KVSERVE_BLOCKS_Q5_0 ? pack_q5_0
        : format == KVSERVE_BLOCKS_Q5_1 ? pack_q5_1
        : format == KVSERVE_BLOCKS_Q8_0 ? pack_q8_0
        : format == KVSERVE_BLOCKS_Q4_K ? pack_q4_k
        : format == KVSERVE_BLOCKS_Q5_K ? pack_q5_k
                                        : pack_q6_k;
    const int64_t blocks = k / f->values, panels = (n + PANEL - 1) / PANEL;
    /* threads for 1 MB of records and more: below that their start costs more than it saves */
    const int parallel = panels > 1 && panels * blocks * f->record >= (1 << 20);
    const int64_t step = 8; /* panels a task */
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (parallel)")
    for (int64_t p = 0; p < panels; p += step)
        pack(raw, n, blocks, packed, p, p + step < panels ? p + step : panels);
    return 0;
}

/* ---- unpacking (float32, ggml's arithmetic) ----------------------------------------------- */

static inline int unpacked_u(const format_info *f, const uint8_t *rec, int c, int j) {
    const int s = j / 32, i = j % 32;
    if (f->format == KVSERVE_BLOCKS_Q8_0) return (int8_t)rec[64 * (i / 4) + 4 * c + i % 4];
    const int h = i / 8, b = i % 4;
    const uint8_t byte = rec[256 * s + (16 * h + c) * 4 + b];
    int u = (i % 8) < 4 ? (byte & 15) : (byte >> 4);
    if (f->format == KVSERVE_BLOCKS_Q6_K) {
        const int step = i / 4, v = step / 4, t = step % 4;
        u |= ((rec[f->high + 128 * s + 64 * v + 4 * c + b] >> (2 * t)) & 3) << 4;
    } else if (f->high >= 0) {
        u |= ((rec[f->high + 64 * s + 4 * c + b] >> (i / 4)) & 1) << 4;
    }
    return u;
}

int kvserve_blocks_unpack(int64_t format, const uint8_t *packed, int64_t n, int64_t k, float *out,
                          int num_threads) {
    const format_info *f = find_format(format);
    if (!f || k <= 0 || k % f->values || n <= 0) return -1;
    const int64_t blocks = k / f->values;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (n > 16)")
    for (int64_t col = 0; col < n; col++) {
        const int64_t p = col / PANEL;
        const int c = (int)(col % PANEL);
        for (int64_t g = 0; g < blocks; g++) {
            const uint8_t *rec = packed + (p * blocks + g) * f->record;
            float *o = out + col * k + g * f->values;
            const float d = half_to_float(load16(rec + f->d + 2 * c));
            const float m = f->dmin >= 0 ? half_to_float(load16(rec + f->dmin + 2 * c)) : 0.f;
            for (int j = 0; j < f->values; j++) {
                const int u = unpacked_u(f, rec, c, j);
                switch (format) {
                case KVSERVE_BLOCKS_Q4_0: o[j] = d * (float)(u - 8); break;
                case KVSERVE_BLOCKS_Q5_0: o[j] = d * (float)(u - 16); break;
                case KVSERVE_BLOCKS_Q8_0: o[j] = d * (float)u; break;
                case KVSERVE_BLOCKS_Q4_1:
                case KVSERVE_BLOCKS_Q5_1: o[j] = d * (float)u + m; break;
                case KVSERVE_BLOCKS_Q6_K: {
                    const float scale = d * (float)(int8_t)rec[f->sc + 16 * (j / 16) + c];
                    o[j] = scale * (float)(u - 32);
                    break;
                }
                default: { /* Q4_K, Q5_K */
                    const float scale = d * (float)rec[f->sc + 16 * (j / 32) + c];
                    const float low = m * (float)rec[f->mn + 16 * (j / 32) + c];
                    o[j] = scale * (float)u - low;
                    break;
                }
                }
            }
        }
    }
    return 0;
}

/* ---- requantizing to Q4_0 ------------------------------------------------------------------- */

/* float to IEEE half bits, round to nearest even (ggml's portable conversion; F16C's where the
 * build has it): the same bits as numpy's float16. */
#if defined(__F16C__)
#include <immintrin.h>
#endif
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * to_inf) * to_zero;
    uint32_t w, bias_bits, bits;
    memcpy(&w, &f, sizeof w);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    bias_bits = shl1 & 0xFF000000u;
    if (bias_bits < 0x71000000u) bias_bits = 0x71000000u;
    bias_bits = (bias_bits >> 1) + 0x07800000u;
    float bias;
    memcpy(&bias, &bias_bits, sizeof bias);
    base = bias + base;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

/*
 * Rows x [rows][k] (k a multiple of 32) as GGUF Q4_0 rows raw [rows][k / 32 * 18], with ggml's
 * reference rounding (quantize_row_q4_0_ref, as gguf-py's quantize): per block, d = v / -8 for
 * the value v of the largest magnitude, u = min(15, trunc(x / d + 8.5)), d stored as float16.
 */
int kvserve_blocks_quantize_q4_0(const float *x, int64_t rows, int64_t k, uint8_t *raw,
                                 int num_threads) {
    if (rows < 0 || k <= 0 || k % 32) return -1;
    const int64_t blocks = k / 32;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows * k >= (1 << 20))")
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * k + 32 * b;
            uint8_t *out = raw + (r * blocks + b) * 18;
            float top = 0.f, value = 0.f;
            for (int j = 0; j < 32; j++)
                if (fabsf(v[j]) > top) {
                    top = fabsf(v[j]);
                    value = v[j];
                }
            const float d = value / -8.f, inverse = d != 0.f ? 1.f / d : 0.f;
            store16(out, float_to_half(d));
            for (int j = 0; j < 16; j++) {
                const float low = truncf(v[j] * inverse + 8.5f);
                const float high = truncf(v[j + 16] * inverse + 8.5f);
                const int lo = low < 15.f ? (int)low : 15, hi = high < 15.f ? (int)high : 15;
                out[2 + j] = (uint8_t)((lo < 0 ? 0 : lo) | (hi < 0 ? 0 : hi) << 4);
            }
        }
    }
    return 0;
}

/* ---- activations ---------------------------------------------------------------------------- */

/* The 8-bit form of a row (quantize_blocks_row without `rest`): each span's values in one
 * pass, then the sums of 16 from the bytes. As one loop a block of 32 that also summed each 16
 * values, the compiler reduced 4 values at a time: on the Zen 4 machine a row of 8,960 took
 * 12.4 us on one thread (now 3.7), 1,025 such rows 6.6 ms on two (now 1.9), 1,025 of 1,536
 * 0.95 ms (now 0.18); the same bytes, scales and sums. (The sums by vpsadbw: 5% more.) */
static inline void quantize_blocks_8(const float *v, int64_t k, int8_t *q, float *scales,
                                     int32_t *sums) {
    const int64_t span = k % 256 == 0 ? 256 : 32; /* values sharing a scale */
    for (int64_t b = 0; b < k; b += span) {
        const float top = abs_max(v + b, span);
        const float inverse = top > 0.f ? 127.f / top : 0.f, e = top / 127.f;
        _Pragma("omp simd") for (int64_t i = b; i < b + span; i++) q[i] =
            (int8_t)(int32_t)nearbyintf(v[i] * inverse);
        for (int64_t j = b / 32; j < (b + span) / 32; j++) scales[j] = e;
    }
    for (int64_t g = 0; g < k / 16; g++) {
        int32_t total = 0;
        for (int i = 0; i < 16; i++) total += q[16 * g + i];
        sums[g] = total;
    }
}

/*
 * Blocks of 32 as llama.cpp's Q8_0, with a float32 scale: e = max|v| / 127 (a block of zeros:
 * e = 0), p = round-to-nearest-even(v * 127 / max|v|) in -127..127, and the sum of p over each
 * 16 values (Q6_K's sub-blocks; two of them make a block's).
 *
 * With `rest` (the finer form, 12 bits): also r = round((v - e p) * 16 / e) in -8..8, so that
 * v ~= (e / 16) * (16 p + r) within e / 32; the scale stored is e / 16 and the sums are those
 * of 16 p + r. The small model's near-tied greedy choices need it (SmolLM2-135M's "capital of
 * France" answer turns to "L'Etoile..." with 8 bits and stays "Paris" with 12; the q4 path
 * found the same); the product then pays a second multiply per weight and input.
 */
static inline void quantize_blocks_row(const float *v, int64_t k, int8_t *q, int8_t *rest,
                                       float *scales, int32_t *sums) {
    if (!rest) {
        quantize_blocks_8(v, k, q, scales, sums);
        return;
    }
    for (int64_t b = 0; b < k; b += 32) {
        const float top = abs_max(v + b, 32);
        const float inverse = top > 0.f ? 127.f / top : 0.f, e = top / 127.f;
        for (int part = 0; part < 2; part++) {
            int32_t total = 0;
            const int64_t first = b + 16 * part;
            _Pragma("omp simd reduction(+ : total)") for (int64_t i = first; i < first + 16; i++) {
                const float p = nearbyintf(v[i] * inverse);
                float r = nearbyintf((v[i] - e * p) * inverse * 16.f);
                r = r > 8.f ? 8.f : (r < -8.f ? -8.f : r);
                q[i] = (int8_t)p;
                rest[i] = (int8_t)r;
                total += 16 * (int32_t)p + (int32_t)r;
            }
            sums[b / 16 + part] = total;
        }
        scales[b / 32] = e / 16.f;
    }
}

#define DEFINE_QUANTIZE(NAME, T, LOAD)                                                             \
    void NAME(const T *x, int64_t rows, int64_t k, int64_t row_stride, int8_t *q, int8_t *rest,   \
              float *scales, int32_t *sums, int num_threads) {                                    \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            float v[k];                                                                           \
            const T *xr = x + r * row_stride;                                                     \
            _Pragma("omp simd") for (int64_t i = 0; i < k; i++) v[i] = LOAD(xr[i]);               \
            quantize_blocks_row(v, k, q + r * k, rest ? rest + r * k : NULL,                      \
                                scales + r * (k / 32), sums + r * (k / 16));                      \
        }                                                                                         \
    }

DEFINE_QUANTIZE(kvserve_blocks_quantize_f32, float, float_identity)
DEFINE_QUANTIZE(kvserve_blocks_quantize_bf16, uint16_t, bf16_to_float)

void kvserve_blocks_add_rmsnorm(float *x, const float *delta, const float *weight, int64_t rows,
                                int64_t hidden, float eps, int8_t *q, int8_t *rest, float *scales,
                                int32_t *sums, int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        float sum = 0.f;
        if (delta) {
            const float *dr = delta + r * hidden;
            _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) {
                xr[i] += dr[i];
                sum += xr[i] * xr[i];
            }
        } else {
            _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) sum +=
                xr[i] * xr[i];
        }
        if (!q) continue;
        const float scale = 1.f / sqrtf(sum / (float)hidden + eps);
        float v[hidden];
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) v[i] = xr[i] * scale * weight[i];
        quantize_blocks_row(v, hidden, q + r * hidden, rest ? rest + r * hidden : NULL,
                            scales + r * (hidden / 32), sums + r * (hidden / 16));
    }
}

void kvserve_blocks_silu_mul(const float *gate_up, int64_t rows, int64_t width, int8_t *q,
                             int8_t *rest, float *scales, int32_t *sums, int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float v[width];
        _Pragma("omp simd") for (int64_t i = 0; i < width; i++) v[i] =
            gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
        quantize_blocks_row(v, width, q + r * width, rest ? rest + r * width : NULL,
                            scales + r * (width / 32), sums + r * (width / 16));
    }
}

/* ---- the product ---------------------------------------------------------------------------- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define BLOCKS_ISA 3
#define VW 16 /* columns per vector */
#define MR 8  /* rows per tile at most (the K-quants' finer form: 4, see K_FINE_ROWS) */
typedef __m512i vi;
typedef __m512 vf;

ALWAYS vi vi_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
ALWAYS vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
ALWAYS vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
ALWAYS vi vi_bytes(int c) { return _mm512_set1_epi8((char)c); }
ALWAYS vi vi_zero(void) { return _mm512_setzero_si512(); }
ALWAYS vi vi_sll16(vi a, int n) { return _mm512_slli_epi16(a, (unsigned)n); }
ALWAYS vi vi_srl16(vi a, int n) { return _mm512_srli_epi16(a, (unsigned)n); }
ALWAYS vi vi_set32(int32_t v) { return _mm512_set1_epi32(v); }
ALWAYS vi vi_add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
ALWAYS vi vi_sll32(vi a, int n) { return _mm512_slli_epi32(a, (unsigned)n); }
ALWAYS vi vi_sub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
ALWAYS vi vi_abs8(vi a) { return _mm512_abs_epi8(a); }
/* x where w >= 0, -x where w < 0 (vpsignb's zero for w == 0 is not needed: |w| is 0 there) */
ALWAYS vi vi_sign8(vi x, vi w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
/* partial sums of products: int32 lanes, the products of 4 bytes added exactly */
typedef __m512i vsum;
ALWAYS vsum vsum_zero(void) { return _mm512_setzero_si512(); }
ALWAYS vsum vsum_step(vsum s, vi u, vi x) { return _mm512_dpbusd_epi32(s, u, x); }
ALWAYS vi vi_add_sum(vi acc, vsum s) { return _mm512_add_epi32(acc, s); }
/* s + the products of u and the 4 bytes at p in every lane: vpdpbusd's embedded broadcast, one
 * instruction (the compiler does not fold the broadcast into it) */
ALWAYS vsum vsum_step_at(vsum s, vi u, const int8_t *p) {
    __asm__("vpdpbusd %[x]%{1to16%}, %[u], %[s]"
            : [s] "+v"(s)
            : [u] "v"(u), [x] "m"(*(const int32_t *)p));
    return s;
}
/* a sub-block's scales as the multipliers of its sums: one int32 per column */
ALWAYS vi vi_scales(const uint8_t *p, int sign) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}
/* acc + s * scale, exact (|s * scale| < 2^31 by the bounds in the header comment) */
ALWAYS vi vi_add_scaled(vi acc, vsum s, vi scale) {
    return _mm512_add_epi32(acc, _mm512_mullo_epi32(s, scale));
}
/* bytes a[c], b[c] of 16 columns as int16 pairs (a[c], b[c]) in column c's lane */
ALWAYS vi vi_pairs(const uint8_t *a, const uint8_t *b, int sign) {
    const __m128i x = _mm_loadu_si128((const __m128i *)a), y = _mm_loadu_si128((const __m128i *)b);
    const __m256i z = _mm256_set_m128i(_mm_unpackhi_epi8(x, y), _mm_unpacklo_epi8(x, y));
    return sign ? _mm512_cvtepi8_epi16(z) : _mm512_cvtepu8_epi16(z);
}
/* acc + a.b over each lane's two int16 pairs */
ALWAYS vi vi_add_pairs(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
ALWAYS vf vf_cvt(vi a) { return _mm512_cvtepi32_ps(a); }
ALWAYS vf vf_zero(void) { return _mm512_setzero_ps(); }
ALWAYS vf vf_set(float f) { return _mm512_set1_ps(f); }
ALWAYS vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
ALWAYS vf vf_half(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
ALWAYS vf vf_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
ALWAYS vf vf_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
ALWAYS vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VW 8
#define MR 4
typedef __m256i vi;
typedef __m256 vf;

ALWAYS vi vi_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
ALWAYS vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
ALWAYS vi vi_bytes(int c) { return _mm256_set1_epi8((char)c); }
ALWAYS vi vi_zero(void) { return _mm256_setzero_si256(); }
ALWAYS vi vi_sll16(vi a, int n) { return _mm256_slli_epi16(a, n); }
ALWAYS vi vi_srl16(vi a, int n) { return _mm256_srli_epi16(a, n); }
ALWAYS vi vi_set32(int32_t v) { return _mm256_set1_epi32(v); }
ALWAYS vi vi_add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
ALWAYS vi vi_sll32(vi a, int n) { return _mm256_slli_epi32(a, n); }
ALWAYS vi vi_sub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
ALWAYS vi vi_abs8(vi a) { return _mm256_abs_epi8(a); }
ALWAYS vi vi_sign8(vi x, vi w) { return _mm256_sign_epi8(x, w); }
ALWAYS vi vi_scale_bytes(const uint8_t *p, int sign) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
#if defined(__AVXVNNI__)
#define BLOCKS_ISA 2
typedef __m256i vsum;
ALWAYS vsum vsum_zero(void) { return _mm256_setzero_si256(); }
ALWAYS vsum vsum_step(vsum s, vi u, vi x) { return _mm256_dpbusd_avx_epi32(s, u, x); }
ALWAYS vi vi_add_sum(vi acc, vsum s) { return _mm256_add_epi32(acc, s); }
ALWAYS vi vi_scales(const uint8_t *p, int sign) { return vi_scale_bytes(p, sign); }
ALWAYS vi vi_add_scaled(vi acc, vsum s, vi scale) {
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(s, scale));
}
#else
#define BLOCKS_ISA 1
/* int16 lanes: pair sums of vpmaddubsw, added while the bound in the header comment holds */
typedef __m256i vsum;
ALWAYS vsum vsum_zero(void) { return _mm256_setzero_si256(); }
ALWAYS vsum vsum_step(vsum s, vi u, vi x) {
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x));
}
ALWAYS vi vi_add_sum(vi acc, vsum s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
}
/* the scale in both int16 halves of its column's lane: vpmaddwd then widens and scales the
 * pair sums at once (|pair sum| <= 32767, |scale| <= 128: within int32) */
ALWAYS vi vi_scales(const uint8_t *p, int sign) {
    const vi x = vi_scale_bytes(p, sign);
    return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)),
                           _mm256_slli_epi32(x, 16));
}
ALWAYS vi vi_add_scaled(vi acc, vsum s, vi scale) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, scale));
}
#endif
ALWAYS vi vi_pairs(const uint8_t *a, const uint8_t *b, int sign) {
    const __m128i z = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a),
                                        _mm_loadl_epi64((const __m128i *)b));
    return sign ? _mm256_cvtepi8_epi16(z) : _mm256_cvtepu8_epi16(z);
}
ALWAYS vi vi_add_pairs(vi acc, vi a, vi b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
ALWAYS vf vf_cvt(vi a) { return _mm256_cvtepi32_ps(a); }
ALWAYS vf vf_zero(void) { return _mm256_setzero_ps(); }
ALWAYS vf vf_set(float f) { return _mm256_set1_ps(f); }
ALWAYS vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
ALWAYS vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
ALWAYS vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
ALWAYS vf vf_half(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS vf vf_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
ALWAYS vf vf_i8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
ALWAYS vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }

#else
#define BLOCKS_ISA 0
#endif

int kvserve_blocks_isa(void) { return BLOCKS_ISA; }

/* whether the K-quants' 8-bit form of many rows goes record by record (below) */
#define BLOCKS_WIDE (BLOCKS_ISA == 1 || BLOCKS_ISA == 3)

#if BLOCKS_ISA

ALWAYS vi vi_bcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
#if BLOCKS_ISA == 3
    return _mm512_set1_epi32(four);
#else
    return _mm256_set1_epi32(four);
#endif
}

#if BLOCKS_ISA != 3
ALWAYS vsum vsum_step_at(vsum s, vi u, const int8_t *p) { return vsum_step(s, u, vi_bcast4(p)); }
#endif

/* A thread's buffer `slot` of at least `bytes` (64-byte aligned), grown as needed and kept for
 * the thread's life; NULL when memory runs out. Slots: the tile unit's 0 (a unit's expanded
 * weights), 1 (its float sums), 2 (the call's activation tiles); the record-by-record path's
 * 4 (a unit's float sums), 5 (its expanded records); the call's offset pairs 3 (Q4_K, Q5_K)
 * and 6 (Q6_K), made by the calling thread for every path, and 7 (Q6_K's folded offsets, the
 * record-by-record path with VNNI). */
static inline void *thread_scratch(int slot, size_t bytes) {
    static _Thread_local void *buffer[8];
    static _Thread_local size_t size[8];
    if (size[slot] < bytes) {
        free(buffer[slot]);
        bytes = (bytes + 4095) & ~(size_t)4095;
        buffer[slot] = aligned_alloc(64, bytes);
        size[slot] = buffer[slot] ? bytes : 0;
    }
    return buffer[slot];
}

static inline int32_t pair16(int32_t a, int32_t b) {
    return (int32_t)((uint32_t)(uint16_t)a | ((uint32_t)(uint16_t)b << 16));
}

/* The K-quants' offsets in the 8-bit form: the pair (P_2t, P_2t+1) of a row's super-block
 * (s: its sums of 16) that multiplies the pair of sub-block multipliers t (Q4_K, Q5_K: the
 * mins m_g of sub-blocks of 32, t < 4; Q6_K: the scales sc_g of sub-blocks of 16, t < 8).
 * |P| <= 32 * 127: an int16. */
ALWAYS int32_t offset_pair32(const int six, const int32_t *s, int t) {
    const int32_t p0 = six ? s[2 * t] : s[4 * t] + s[4 * t + 1];
    const int32_t p1 = six ? s[2 * t + 1] : s[4 * t + 2] + s[4 * t + 3];
    return pair16(p0, p1);
}
ALWAYS vi offset_pair(const int six, const int32_t *s, int t) {
    return vi_set32(offset_pair32(six, s, t));
}

/* acc + a.b over each lane's two int16 pairs, b the pair at p in every lane (AVX512: broadcast
 * inside vpdpwssd) */
ALWAYS vi vi_add_pairs_at(vi acc, vi a, const int32_t *p) {
#if BLOCKS_ISA == 3
    __asm__("vpdpwssd %[x]%{1to16%}, %[a], %[s]" : [s] "+v"(acc) : [a] "v"(a), [x] "m"(*p));
    return acc;
#else
    return vi_add_pairs(acc, a, vi_set32(*p));
#endif
}

/* The offset pairs of `rows` rows for every super-block, once for all the columns of a
 * product: pairs + (row * (k / 256) + b) * (six ? 8 : 4) holds row's for super-block b. */
static inline void offset_pairs(const int six, const int32_t *sums, int64_t k, int64_t rows,
                                int32_t *pairs) {
    const int count = six ? 8 : 4;
    for (int64_t row = 0; row < rows; row++)
        for (int64_t b = 0; b < k / 256; b++) {
            const int32_t *s = sums + row * (k / 16) + 16 * b;
            int32_t *o = pairs + (row * (k / 256) + b) * count;
            for (int t = 0; t < count; t++) o[t] = offset_pair32(six, s, t);
        }
}

/* Q6_K's offsets folded (the record-by-record path with VNNI): -32 P_g for every row and
 * sub-block of 16, folds + row * (k / 16) + g. Each sub-block's int32 sums start from them
 * instead of zero, so the sums give sc_g (S_g - 32 P_g) and A - 32 B of kquant_update without
 * the pairs' vpdpwssd (the same integer). 1,024 rows of the 1.5B's down products (8 layers,
 * AMD Zen 4, 2 threads, alternated, min) 496 / 459 -> 449 / 446 ms. */
static inline void offset_folds(const int32_t *sums, int64_t k, int64_t rows, int32_t *folds) {
    for (int64_t i = 0; i < rows * (k / 16); i++) folds[i] = -32 * sums[i];
}

/* The K-quants' float update of a row's super-block in the 8-bit form, e the row's scale for
 * it: A = sum_g sc_g S_g, B = sum_g m_g P_g (Q4_K, Q5_K: res = fma(cvt(A), D e, res - cvt(B)
 * dmin e)) or sum_g sc_g P_g (Q6_K: res = fma(cvt(A - 32 B), D e, res)). Every path that
 * takes these products ends a super-block here, so they give the same floats. */
ALWAYS vf kquant_update(const int six, vi a, vi b, vf d, vf dmin, vf ev, vf before) {
    if (six) return vf_fma(vf_cvt(vi_sub32(a, vi_sll32(b, 5))), vf_mul(d, ev), before);
    return vf_fma(vf_cvt(a), vf_mul(d, ev), vf_fnma(vf_cvt(b), vf_mul(dmin, ev), before));
}

/* The tasks of a many-row product (the tile unit's, AVX2's record by record): the K-quant
 * parts' panels in units of `per` panels, the other parts' one panel a unit, all the rows a
 * task. first_unit[p]: part p's first unit; returns the number of units. */
ALWAYS int64_t unit_table(const kvserve_blocks_weight *parts, int64_t num_parts, int per,
                          int64_t *first_unit) {
    first_unit[0] = 0;
    for (int64_t p = 0; p < num_parts; p++) {
        const int64_t panels = (parts[p].n + PANEL - 1) / PANEL;
        const int grouped = kvserve_blocks_block_values(parts[p].format) == 256;
        first_unit[p + 1] = first_unit[p] + (grouped ? (panels + per - 1) / per : panels);
    }
    return first_unit[num_parts];
}

/* Unit `unit` of the table: its part, and its panels [first, first + count) (a part that is
 * not a K-quant: count 0, its one panel `first`). */
typedef struct {
    int64_t part, first;
    int count;
} unit_panels;

ALWAYS unit_panels unit_at(const kvserve_blocks_weight *parts, const int64_t *first_unit, int per,
                           int64_t unit) {
    int64_t p = 0;
    while (first_unit[p + 1] <= unit) p++;
    const int64_t local = unit - first_unit[p];
    if (kvserve_blocks_block_values(parts[p].format) != 256) return (unit_panels){p, local, 0};
    const int64_t panels = (parts[p].n + PANEL - 1) / PANEL, first = local * per;
    return (unit_panels){p, first, panels - first < per ? (int)(panels - first) : per};
}

/* `v` as it is, in a register: the integer sums are associative, and without this the compiler
 * regroups a tile's chains of additions into trees that hold every product at once (measured:
 * about 20 of the 16 vector registers spilled per block for 4 rows on AVX2). */
ALWAYS vi keep(vi v) {
    __asm__("" : "+v"(v));
    return v;
}

/* The rows of a tile: row i's values at q + i * k (and their rests at r + i * k in the finer
 * form, else r is NULL), its scales at e + i * (k / 32), its sums of 16 at s + i * (k / 16). */
typedef struct {
    const int8_t *q, *r;
    const float *e;
    const int32_t *s;
    int64_t k;
    /* the K-quants' offset pairs (offset_pairs), row i's for super-block b at
     * p4 + (i * (k / 256) + b) * 4 (Q4_K, Q5_K) or p8 + ... * 8 (Q6_K); NULL: made from s */
    const int32_t *p4, *p8;
} tile_rows;

/* Bit t of each byte of `high` moved to bit 4 (bits 2t', 2t'+1 to bits 4, 5 for pairs), the
 * other bits left for the caller's mask. A 16-bit shift by at most 4 moves no bit onto bit 4
 * (or 5) from the neighbouring byte. */
ALWAYS vi to_bit4(vi high, int t) {
    return t < 4 ? vi_sll16(high, 4 - t) : (t == 4 ? high : vi_srl16(high, t - 4));
}

/*
 * Vectors of columns a tile covers: on AVX2 a tile of 1 or 2 rows takes the panel's 16 columns
 * in one pass (2 vectors), so that each record is read once, as it streams from memory, and
 * the activation broadcasts and scalar work are shared; a tile of 4 rows goes in two passes of
 * 8 columns (its sums fill the registers). AVX512's one vector is the panel.
 */
#define NV_FOR(rows) (VW == 8 && (rows) <= 2 ? 2 : 1)
#define LANES (4 * VW) /* bytes of one vector's columns in a 64-byte vector of the layout */

/*
 * acc[i][v] = sum over 16 * chunks inputs (32, or 16 for Q6_K's sub-blocks) of u * p for the
 * MR_ rows of the tile and its NV vectors of columns. nib: the nibbles at the tile's first
 * columns; high: the high bits (bits 1) or the one vector of high pairs of these 16 inputs
 * (bits 2). group: 4-input steps whose int16 pair sums may be added before widening (AVX2, see
 * above).
 */
ALWAYS void block_sums(const int MR_, const int NV, const int fine, const int bits,
                       const int group, const int chunks, const uint8_t *nib, const uint8_t *high,
                       const tile_rows *rows, int64_t offset, const vi *scale, vi acc[][2]) {
    const vi low4 = vi_bytes(0x0F);
    const vi mask = vi_bytes(bits == 2 ? 0x30 : 0x10);
    vi h0[2];
    /* one row: its even and odd 4-input steps in two chains (the rests' registers, unused
     * then): one row 6-9% faster on the AVX512 machine (its one chain is latency-bound),
     * unchanged on the AVX2 path (measured there with -mno-avx512f) */
    const int split = !fine && MR_ == 1;
    vsum sums[MR][2], rests[MR][2];
    for (int v = 0; v < NV; v++) h0[v] = bits ? vi_load(high + LANES * v) : vi_zero();
    for (int i = 0; i < MR_; i++)
        for (int v = 0; v < NV; v++) {
            if (!scale) acc[i][v] = vi_zero();
            sums[i][v] = rests[i][v] = vsum_zero();
        }
    _Pragma("GCC unroll 4") for (int h = 0; h < chunks; h++) {
        vi u0[2], u1[2];
        _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
            const vi w = vi_load(nib + 64 * h + LANES * v);
            u0[v] = vi_and(w, low4);
            u1[v] = vi_and(vi_srl16(w, 4), low4);
            if (bits == 1) { /* steps 2h, 2h + 1: bits 2h, 2h + 1 */
                u0[v] = vi_or(u0[v], vi_and(to_bit4(h0[v], 2 * h), mask));
                u1[v] = vi_or(u1[v], vi_and(to_bit4(h0[v], 2 * h + 1), mask));
            } else if (bits == 2) { /* steps 2h, 2h + 1 of the 4: pairs 2h, 2h + 1 */
                u0[v] = vi_or(u0[v], vi_and(to_bit4(h0[v], 2 * (2 * h)), mask));
                u1[v] = vi_or(u1[v], vi_and(to_bit4(h0[v], 2 * (2 * h + 1)), mask));
            }
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
            const int8_t *p = rows->q + i * rows->k + offset + 8 * h;
            /* tiles of several rows: each step's 4 row bytes broadcast inside vpdpbusd (AVX512;
             * 4 and 8 rows 12-15% faster); one row keeps the broadcasts apart (faster there)
             * and, in the 8-bit form, a second chain: the first's latency is not waited for */
            if (MR_ == 1) {
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                    sums[i][v] = keep(vsum_step(sums[i][v], u0[v], vi_bcast4(p)));
                    if (split)
                        rests[i][v] = keep(vsum_step(rests[i][v], u1[v], vi_bcast4(p + 4)));
                    else
                        sums[i][v] = keep(vsum_step(sums[i][v], u1[v], vi_bcast4(p + 4)));
                }
            } else {
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                    sums[i][v] = keep(vsum_step_at(sums[i][v], u0[v], p));
                    sums[i][v] = keep(vsum_step_at(sums[i][v], u1[v], p + 4));
                }
            }
            if (fine) { /* the rests, |r| <= 8: far inside the same bounds */
                const int8_t *pr = rows->r + i * rows->k + offset + 8 * h;
                const vi r0 = vi_bcast4(pr), r1 = vi_bcast4(pr + 4);
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                    rests[i][v] = keep(vsum_step(rests[i][v], u0[v], r0));
                    rests[i][v] = keep(vsum_step(rests[i][v], u1[v], r1));
                }
            }
        }
        if ((2 * h + 2) % group == 0) {
            _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++)
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                    if (fine) { /* sum of u (16 p + r), exact: |.| < 32 * 63 * 2040 */
                        const vi coarse = vi_add_sum(vi_zero(), sums[i][v]);
                        acc[i][v] = vi_add32(acc[i][v], vi_sll32(coarse, 4));
                        acc[i][v] = keep(vi_add_sum(acc[i][v], rests[i][v]));
                        rests[i][v] = vsum_zero();
                    } else if (scale) {
                        acc[i][v] = keep(vi_add_scaled(acc[i][v], sums[i][v], scale[v]));
                        if (split) {
                            acc[i][v] = keep(vi_add_scaled(acc[i][v], rests[i][v], scale[v]));
                            rests[i][v] = vsum_zero();
                        }
                    } else {
                        acc[i][v] = keep(vi_add_sum(acc[i][v], sums[i][v]));
                        if (split) {
                            acc[i][v] = keep(vi_add_sum(acc[i][v], rests[i][v]));
                            rests[i][v] = vsum_zero();
                        }
                    }
                    sums[i][v] = vsum_zero();
                }
        }
    }
}

/* Q8_0: signed bytes; |w| is unpacked once, and the sign moves onto each row's bytes. */
ALWAYS void block_sums8(const int MR_, const int NV, const int fine, const uint8_t *bytes,
                        const tile_rows *rows, int64_t offset, vi acc[][2]) {
    for (int i = 0; i < MR_; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = vi_zero();
    _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
        vi w[2], u[2];
        for (int v = 0; v < NV; v++) {
            w[v] = vi_load(bytes + 64 * s + LANES * v);
            u[v] = vi_abs8(w[v]);
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
            const vi x = vi_bcast4(rows->q + i * rows->k + offset + 4 * s);
            _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                vi part = vi_add_sum(vi_zero(), vsum_step(vsum_zero(), u[v], vi_sign8(x, w[v])));
                if (fine) {
                    const vi r = vi_bcast4(rows->r + i * rows->k + offset + 4 * s);
                    part = vi_add_sum(vi_sll32(part, 4),
                                      vsum_step(vsum_zero(), u[v], vi_sign8(r, w[v])));
                }
                acc[i][v] = keep(vi_add32(acc[i][v], part));
            }
        }
    }
}

/* How far ahead (bytes) the record stream of a panel is prefetched, and how: prefetcht0, but
 * prefetchnta (non-temporal: a record is read once) on AMD's cores, where kernel_build defines
 * KVSERVE_PREFETCH_NTA. Measured on the AMD AVX2 machine (one row, the 1.5B's products streamed
 * from memory, 2 threads, best of 6 rounds): none 11.9 GB/s, prefetchnta 1.5 KB 14.1, 3 KB 13.6,
 * prefetcht0 1.5 KB 13.1, 3 KB 13.1, 6 KB 12.3, against 20.1 GB/s for sums over a buffer. On an
 * Intel Xeon (Sapphire Rapids, AVX512; kvserve/bench/blocks_bench.py, 8 layers, ms for 1 / 4 /
 * 32 rows): prefetchnta 23.2 / 24.1 / 107.5, none 19.4 / 23.3 / 61.8, prefetcht0 15.0 / 16.0 /
 * 54.8 (at 768 B or 3 KB the same, prefetcht1 the same): there 81% of the 1-row product's
 * samples waited at the prefetchnta. */
/*
 * The K-quants' 8-bit form spreads its prefetches over the record instead: each sub-block
 * prefetches its share of the lines, 1.5 KB ahead for tiles of 1-2 rows (AVX512: 4.5 KB, below)
 * and 3 KB for 4-8 (Q6_K: further, below). All of a record's 37-53 lines asked at once fill the
 * core's line-fill buffers, and the 8-row tile then waited at the prefetch (42% of its samples
 * on the instruction after it) while its sums had nothing in flight to overlap. Measured on the
 * Sapphire Rapids machine (the 1.5B's products of a decode step, 28 layers, 2 threads, 14
 * alternated rounds, min): 8 rows 68.2 ms at 1.5 KB, 62.4 at 3 KB (the burst: 70.2); 1, 2 and 4
 * rows within the noise of the burst; the AVX2 build unchanged (1, 4, 8 rows).
 */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1536
#endif
/* On AVX512 tiles of 1 and 2 rows go 4.5 KB ahead: on the AMD Zen 4 machine (the 1.5B's
 * products of a decode step, 28 layers, 2 threads, alternated in one process, min of 12-16)
 * 1 row 26.9 -> 25.6-25.9 ms, 2 rows 29.9 -> 26.2 (3 KB about the same), where
 * the 1-row tile's samples had waited on the first loads of each record (its scales, d) */
/* Q6_K's tiles of 4-8 rows go 2 records and 2 KB ahead (8,768 bytes; its records are 3,360
 * bytes, 3 KB was less than one): on the Zen 4 machine the 1.5B's down products (Q6_K, 28
 * layers, 2 threads, alternated in one process, min of 8-10) 8 rows 14.6-15.0 -> 13.7-14.0 ms,
 * 4 rows 10.8 -> 10.1; in its AVX2 build 4 rows 13.9 -> 13.1-13.3, 8 rows 24.5-24.6 -> 24.2-24.3.
 * Q4_K's 3 KB stays: its gate|up at 8 rows 19.3 -> 19.6-21.3 ms with 2 records and 2 KB, and
 * asking for the next records' scales and d early (they end each record) gained nothing. */
#define SPREAD_AHEAD(rows, six, record)                                                            \
    ((rows) >= 4 ? ((six) ? 2 * (record) + 2048 : 3072) : (BLOCKS_ISA == 3 ? 4608 : 1536))
#ifdef KVSERVE_PREFETCH_NTA
#define PREFETCH_LOCALITY 0
#else
#define PREFETCH_LOCALITY 3
#endif

/*
 * res[i][v] += the products of the panel's records [0, records) with the tile's rows, for the
 * NV vectors of columns from byte offset `lane` of each 64-byte vector on. The float sequence
 * per output is fixed: per block of 32 (Q6_K: 16) in order, res = fma(cvt(S'), D * e, res'),
 * where S' is the exact integer sum (less z * P for Q4_0 / Q5_0 / Q6_K's offsets) and res' is
 * res less the block's M * (e * P) for the formats with an offset per block.
 */
ALWAYS void tile_products(const int format, const int MR_, const int NV, const int fine,
                          const uint8_t *panel, int64_t records, int64_t lane,
                          const tile_rows *rows, vf res[][2], float *held) {
    const format_info *f = &FORMATS[format_slot(format)];
    vi acc[MR][2];
    for (int64_t r = 0; r < records; r++) {
        const uint8_t *rec = panel + r * f->record;
        const int spread = f->values == 256 && !fine; /* prefetched sub-block by sub-block */
        if (lane == 0 && !spread)
            for (int64_t at = 0; at < f->record; at += 64)
                __builtin_prefetch(rec + PREFETCH_AHEAD + at, 0, PREFETCH_LOCALITY);
        vf d[2];
        /* offsets of this vector's columns in arrays of 16 float16 and of 16 bytes */
#define HALFS(v) ((lane + LANES * (v)) / 2)
#define BYTES(v) ((lane + LANES * (v)) / 4)
        for (int v = 0; v < NV; v++) d[v] = vf_half(rec + f->d + HALFS(v));
        if (f->values == 32) {
            const int64_t block = r;
            if (format == KVSERVE_BLOCKS_Q8_0) {
                block_sums8(MR_, NV, fine, rec + lane, rows, 32 * block, acc);
            } else {
                const int bits = f->high >= 0 ? 1 : 0;
                block_sums(MR_, NV, fine, bits, bits ? 4 : 8, 4, rec + lane, rec + f->high + lane,
                           rows, 32 * block, NULL, acc);
            }
            vf m[2] = {vf_zero(), vf_zero()};
            if (f->dmin >= 0)
                for (int v = 0; v < NV; v++) m[v] = vf_half(rec + f->dmin + HALFS(v));
            const int32_t z =
                format == KVSERVE_BLOCKS_Q4_0 ? 8 : (format == KVSERVE_BLOCKS_Q5_0 ? 16 : 0);
            _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
                const float e = rows->e[i * (rows->k / 32) + block];
                const int32_t *s = rows->s + i * (rows->k / 16) + 2 * block;
                const int32_t sum = s[0] + s[1];
                const vf ev = vf_set(e), ep = vf_set(e * (float)sum);
                const vi zp = vi_set32(z * sum);
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                    vi total = acc[i][v];
                    vf base = res[i][v];
                    if (z) total = vi_sub32(total, zp);
                    if (f->dmin >= 0) base = vf_fma(m[v], ep, base);
                    res[i][v] = vf_fma(vf_cvt(total), vf_mul(d[v], ev), base);
                }
            }
        } else if (!fine) {
            /* K-quants and 8-bit activations: one scale e per 256 values (the super-block's),
             * so the sub-block scales multiply the exact sums as integers and the float work
             * is one update per super-block: res = fma(cvt(A), D * e, res') with
             * A = sum_g sc_g S_g (Q6_K: less 32 sum_g sc_g P_g), res' = res - cvt(B) * (dmin * e),
             * B = sum_g m_g P_g (Q4_K, Q5_K). */
            const int six = format == KVSERVE_BLOCKS_Q6_K;
            const int bits = six ? 2 : (f->high >= 0 ? 1 : 0);
            const int subs = six ? 16 : 8, chunks = six ? 2 : 4;
            /* AVX2 widens (and scales) the int16 pair sums while they are in bounds; the VNNI
             * sums are int32 already: one scaling per sub-block */
            const int group = BLOCKS_ISA >= 2 ? 2 * chunks : (six ? 2 : (bits ? 4 : 8));
            for (int i = 0; i < MR_; i++)
                for (int v = 0; v < NV; v++) acc[i][v] = vi_zero();
            _Pragma("GCC unroll 1") for (int j = 0; j < subs; j++) {
                if (lane == 0 && spread) {
                    const int64_t from = f->record * j / subs / 64 * 64;
                    const int64_t to =
                        j == subs - 1 ? f->record : f->record * (j + 1) / subs / 64 * 64;
                    for (int64_t at = from; at < to; at += 64)
                        __builtin_prefetch(rec + SPREAD_AHEAD(MR_, six, f->record) + at, 0,
                                           PREFETCH_LOCALITY);
                }
                vi scale[2];
                for (int v = 0; v < NV; v++)
                    scale[v] = vi_scales(rec + f->sc + 16 * j + BYTES(v), six);
                if (six)
                    block_sums(MR_, NV, 0, 2, group, 2,
                               rec + 256 * (j / 2) + 128 * (j % 2) + lane,
                               rec + f->high + 64 * j + lane, rows, 16 * (16 * r + j), scale,
                               acc);
                else
                    block_sums(MR_, NV, 0, bits, group, 4, rec + 256 * j + lane,
                               rec + f->high + 64 * j + lane, rows, 32 * (8 * r + j), scale, acc);
            }
            /* the offsets' integer sums, two sub-blocks a step: B (m_g P_g) or sum_g sc_g P_g */
            vi off[MR][2];
            for (int i = 0; i < MR_; i++)
                for (int v = 0; v < NV; v++) off[i][v] = vi_zero();
            const int64_t at = six ? f->sc : f->mn;
            _Pragma("GCC unroll 1") for (int t = 0; t < subs / 2; t++) {
                vi m[2];
                for (int v = 0; v < NV; v++)
                    m[v] = vi_pairs(rec + at + 32 * t + BYTES(v), rec + at + 32 * t + 16 + BYTES(v),
                                    six);
                const int32_t *made = six ? rows->p8 : rows->p4;
                _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
                    if (made) {
                        const int32_t *pair = made + (i * (rows->k / 256) + r) * (subs / 2) + t;
                        _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) off[i][v] =
                            vi_add_pairs_at(off[i][v], m[v], pair);
                        continue;
                    }
                    const vi pv = offset_pair(six, rows->s + i * (rows->k / 16) + 16 * r, t);
                    _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) off[i][v] =
                        vi_add_pairs(off[i][v], m[v], pv);
                }
            }
            vf dmin[2];
            for (int v = 0; v < NV; v++)
                dmin[v] = six ? vf_zero() : vf_half(rec + f->dmin + HALFS(v));
            _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
                const vf ev = vf_set(rows->e[i * (rows->k / 32) + 8 * r]);
                _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                    /* the first super-block starts the held results */
                    const vf before =
                        held ? (r ? vf_load(held + (2 * i + v) * VW) : vf_zero()) : res[i][v];
                    const vf after =
                        kquant_update(six, acc[i][v], off[i][v], d[v], dmin[v], ev, before);
                    if (held)
                        vf_store(held + (2 * i + v) * VW, after);
                    else
                        res[i][v] = after;
                }
            }
            if (held) __asm__ volatile("" : : "r"(held) : "memory");
        } else if (format == KVSERVE_BLOCKS_Q6_K) {
            /* sub-blocks of 16, each finished (float update) before the next: one sum a row */
            _Pragma("GCC unroll 1") for (int j = 0; j < 16; j++) {
                const int64_t block = 8 * r + j / 2;
                block_sums(MR_, NV, fine, 2, 2, 2, rec + 256 * (j / 2) + 128 * (j % 2) + lane,
                           rec + f->high + 64 * j + lane, rows, 16 * (16 * r + j), NULL, acc);
                vf scale[2];
                for (int v = 0; v < NV; v++)
                    scale[v] = vf_mul(d[v], vf_i8(rec + f->sc + 16 * j + BYTES(v)));
                _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
                    const float e = rows->e[i * (rows->k / 32) + block];
                    const int32_t sum = rows->s[i * (rows->k / 16) + 16 * r + j];
                    const vf ev = vf_set(e);
                    const vi zp = vi_set32(32 * sum);
                    _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                        const vi total = vi_sub32(acc[i][v], zp);
                        res[i][v] = vf_fma(vf_cvt(total), vf_mul(scale[v], ev), res[i][v]);
                    }
                }
            }
        } else { /* Q4_K, Q5_K */
            vf dmin[2];
            for (int v = 0; v < NV; v++) dmin[v] = vf_half(rec + f->dmin + HALFS(v));
            const int bits = f->high >= 0 ? 1 : 0;
            _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
                const int64_t block = 8 * r + j;
                block_sums(MR_, NV, fine, bits, bits ? 4 : 8, 4, rec + 256 * j + lane,
                           rec + f->high + 64 * j + lane, rows, 32 * block, NULL, acc);
                vf scale[2], low[2];
                for (int v = 0; v < NV; v++) {
                    scale[v] = vf_mul(d[v], vf_u8(rec + f->sc + 16 * j + BYTES(v)));
                    low[v] = vf_mul(dmin[v], vf_u8(rec + f->mn + 16 * j + BYTES(v)));
                }
                _Pragma("GCC unroll 8") for (int i = 0; i < MR_; i++) {
                    const float e = rows->e[i * (rows->k / 32) + block];
                    const int32_t *s = rows->s + i * (rows->k / 16) + 2 * block;
                    const vf ev = vf_set(e), ep = vf_set(e * (float)(s[0] + s[1]));
                    _Pragma("GCC unroll 2") for (int v = 0; v < NV; v++) {
                        const vf base = vf_fnma(low[v], ep, res[i][v]);
                        res[i][v] = vf_fma(vf_cvt(acc[i][v]), vf_mul(scale[v], ev), base);
                    }
                }
            }
        }
#undef HALFS
#undef BYTES
    }
}

/* One pass of a tile: the products, the bias, and the store of `cols` (<= NV * VW) columns of
 * its first `live` rows (the others: padding, see kvserve_blocks_gemm). */
ALWAYS void tile_pass(const int format, const int MR_, const uint8_t *panel, int64_t records,
                      int64_t lane, const tile_rows *rows, const float *bias, float *out,
                      int64_t ldc, int64_t cols, int64_t live) {
    const int NV = NV_FOR(MR_);
    vf res[MR][2];
    for (int i = 0; i < MR_; i++)
        for (int v = 0; v < NV; v++) res[i][v] = vf_zero();
    /* 8 rows of the K-quants, always in their 8-bit form (panel_tiles gives the finer form tiles
     * of K_FINE_ROWS, so no finer-form code is built for these): the results wait in memory
     * between super-blocks (one load and store a row per 256 inputs), leaving the registers to
     * the sums */
    const int hold = MR_ == 8 && FORMATS[format_slot(format)].values == 256;
    float held[MR * 2 * VW] __attribute__((aligned(64)));
    if (hold) {
        tile_products(format, MR_, NV, 0, panel, records, lane, rows, res, held);
        for (int i = 0; i < MR_; i++)
            for (int v = 0; v < NV; v++) res[i][v] = vf_load(held + (2 * i + v) * VW);
    } else if (rows->r) /* each form its own code */
        tile_products(format, MR_, NV, 1, panel, records, lane, rows, res, NULL);
    else
        tile_products(format, MR_, NV, 0, panel, records, lane, rows, res, NULL);
    float tail[VW];
    for (int v = 0; v < NV && v * VW < cols; v++) {
        const int64_t width = cols - v * VW < VW ? cols - v * VW : VW;
        vf b = vf_zero();
        if (bias) {
            memset(tail, 0, sizeof tail);
            memcpy(tail, bias + v * VW, (size_t)width * sizeof(float));
            b = vf_load(tail);
        }
        for (int i = 0; i < MR_ && i < live; i++) {
            const vf value = bias ? vf_add(res[i][v], b) : res[i][v];
            float *o = out + i * ldc + v * VW;
            if (width == VW) {
                vf_store(o, value);
            } else {
                vf_store(tail, value);
                memcpy(o, tail, (size_t)width * sizeof(float));
            }
        }
    }
}

typedef void (*tile_fn)(const uint8_t *, int64_t, int64_t, const tile_rows *, const float *,
                        float *, int64_t, int64_t, int64_t);

#define DEFINE_TILE(NAME, FORMAT, ROWS)                                                            \
    static void tile_##NAME##_##ROWS(const uint8_t *panel, int64_t records, int64_t lane,         \
                                     const tile_rows *rows, const float *bias, float *out,        \
                                     int64_t ldc, int64_t cols, int64_t live) {                   \
        tile_pass(FORMAT, ROWS, panel, records, lane, rows, bias, out, ldc, cols, live);          \
    }

/* Tiles of 1, 2, 4 (and 8) rows; other counts go as sums of these (7 = 4 + 2 + 1): a row's
 * result is the same in any tile, and half the instances compile in half the time.
 * The K-quants' tiles of 8 rows keep their results in memory between super-blocks (`held` in
 * tile_pass): their sub-block scales and offsets take registers that 8 rows' sums and results
 * would need at once, and with the results in registers the spills cost more than the shared
 * unpacking saved (8 rows had been 11% faster in two tiles of 4). Held, 8 rows went from 78.7
 * to 70.2 ms (the products of a decode step of the 1.5B, Sapphire Rapids, 2 threads, the
 * burst prefetch; 62.4 ms with the spread one above). In the finer form (a second sum a row)
 * they stop at 4 rows (K_FINE_ROWS). */
#define DEFINE_TILES_4(NAME, FORMAT)                                                               \
    DEFINE_TILE(NAME, FORMAT, 1)                                                                   \
    DEFINE_TILE(NAME, FORMAT, 2)                                                                   \
    DEFINE_TILE(NAME, FORMAT, 4)                                                                   \
    static const tile_fn tiles_##NAME[MR + 1] = {NULL, tile_##NAME##_1, tile_##NAME##_2, NULL,     \
                                                 tile_##NAME##_4};
#if MR == 8
#define DEFINE_TILES(NAME, FORMAT)                                                                 \
    DEFINE_TILE(NAME, FORMAT, 1)                                                                   \
    DEFINE_TILE(NAME, FORMAT, 2)                                                                   \
    DEFINE_TILE(NAME, FORMAT, 4)                                                                   \
    DEFINE_TILE(NAME, FORMAT, 8)                                                                   \
    static const tile_fn tiles_##NAME[MR + 1] = {NULL, tile_##NAME##_1, tile_##NAME##_2, NULL,     \
                                                 tile_##NAME##_4, NULL, NULL, NULL,               \
                                                 tile_##NAME##_8};
#else
#define DEFINE_TILES(NAME, FORMAT) DEFINE_TILES_4(NAME, FORMAT)
#endif
#define K_FINE_ROWS (MR < 4 ? MR : 4)

DEFINE_TILES(q4_0, KVSERVE_BLOCKS_Q4_0)
DEFINE_TILES(q4_1, KVSERVE_BLOCKS_Q4_1)
DEFINE_TILES(q5_0, KVSERVE_BLOCKS_Q5_0)
DEFINE_TILES(q5_1, KVSERVE_BLOCKS_Q5_1)
DEFINE_TILES(q8_0, KVSERVE_BLOCKS_Q8_0)
DEFINE_TILES(q4_k, KVSERVE_BLOCKS_Q4_K)
DEFINE_TILES(q5_k, KVSERVE_BLOCKS_Q5_K)
DEFINE_TILES(q6_k, KVSERVE_BLOCKS_Q6_K)

static const tile_fn *tiles_of(int64_t format) {
    switch (format) {
    case KVSERVE_BLOCKS_Q4_0: return tiles_q4_0;
    case KVSERVE_BLOCKS_Q4_1: return tiles_q4_1;
    case KVSERVE_BLOCKS_Q5_0: return tiles_q5_0;
    case KVSERVE_BLOCKS_Q5_1: return tiles_q5_1;
    case KVSERVE_BLOCKS_Q8_0: return tiles_q8_0;
    case KVSERVE_BLOCKS_Q4_K: return tiles_q4_k;
    case KVSERVE_BLOCKS_Q5_K: return tiles_q5_k;
    case KVSERVE_BLOCKS_Q6_K: return tiles_q6_k;
    default: return NULL;
    }
}

/* ---- many rows: AMX-INT8 -------------------------------------------------------------------- */

/*
 * From AMX_MIN_ROWS rows on, the K-quants' 8-bit form (one scale per 256) goes through
 * Sapphire Rapids' tile unit (AMX-INT8, with AVX512-VBMI's byte permutes) where the build and
 * the CPU have them, the kernel grants the tile state (arch_prctl, asked once per process), and
 * KVSERVE_AMX is not "0" in the environment (read once: kvserve_blocks_amx). Everything else,
 * and every call when any of these is missing, takes the tiles above.
 *
 * Per panel of 16 columns and super-block of 256 inputs, the weights are expanded once for all
 * the rows of the call to the int16 w_j = u_j * sc_g (Q4_K <= 15 * 63, Q5_K <= 31 * 63; Q6_K
 * (u_j - 32) * sc_g, in -4064..4096): vpmullw of the even and of the odd bytes u by the
 * scales, then vpermt2b takes each product's lo byte (unsigned) and hi byte (signed) to its
 * place in the tile unit's layout of B ([64 inputs / 4][16 columns][4]). Then per row, exactly
 * in int32 (signed activations times the unsigned lo bytes, vpdpbsud, and the signed hi bytes,
 * vpdpbssd),
 *
 *   A = sum_j w_j p_j = C_lo + 256 C_hi
 *
 * the same A = sum_g sc_g S_g (Q6_K: less 32 sum_g sc_g P_g) as the tiles above compute, and
 * for Q4_K, Q5_K the offsets' B = sum_g m_g P_g by vpdpwssd from the activation sums as there.
 * The float update per row, column and super-block is the tiles' one (res = fma(cvt(A),
 * D * e, res'), in the order of the super-blocks, the bias added last), so both paths give the
 * same float32 results, bit for bit, and a row's result still depends on nothing but the row.
 *
 * Work: a unit is up to AMX_PANELS panels of one part with all the rows; the threads split
 * the units (the tiles above take the other parts' panels as units of their own). Super-block
 * by super-block, a thread multiplies each group of 32 rows (two A tiles, their 8 KB of
 * activations shared by the unit's panels) with each panel's B tiles (8 KB, in L1 across the
 * row groups). While the tile unit runs one product, the core does the previous product's
 * float work and, after the last row group, expands that panel's next super-block into the
 * other half of a two-super-block buffer (2 * AMX_PANELS * 8.4 KB a thread), prefetching the
 * record after it (or the next unit's first) to L2 a line at a time as it goes: the weights
 * stream from memory one record ahead of their expansion. The activations are first copied,
 * by all threads, into the tiles' order ([super-block][32 rows][4][64]; rows past the call's
 * are zeros) with their sums' pairs. Buffers are per thread and grow only (kept for the
 * thread's life): a decode step's products allocate nothing after the first.
 *
 * Measured on the Sapphire Rapids machine (kvserve/bench/blocks_bench.py: a decode step's
 * products of the 1.5B, 28 layers, 2 threads; KVSERVE_AMX=0 and unset in turn, 2 rounds each):
 * 32 rows 196-197 -> 109-115 ms, 64 rows 327-337 -> 156-172 ms, 128 rows 669-705 ->
 * 270-274 ms, 512 rows 1320-1328 ms (int8_gemm on the same shapes: 152-161, 217-242, 353-368,
 * 1542-1606 ms); 1 and 8 rows unchanged (the tiles above). With AMX_MIN_ROWS at 8, the tile
 * unit took 8 rows in 85 ms (the tiles above 89), 12 in 85 (106), 16 in 91-93 (111-117) and
 * 24 in 105 (141-160). After the tiles took 8 rows of the K-quants at once (2026-12-07, the
 * same bench, 8 alternated rounds, min): tile unit / tiles 9 rows 88.4 / 76.8 ms, 10 89.4 /
 * 80.2, 12 90.3 / 86.3, 14 91.4 / 105.3, 16 86.7 / 100.4: it takes 13 rows and more.
 */
#if BLOCKS_ISA == 3 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__)
#define BLOCKS_AMX 1
#include <pthread.h>

#include "amx.h"

#define AMX_MIN_ROWS 13 /* rows of a call from which on the tile unit takes its K-quants */
#define AMX_PANELS 4    /* panels of a unit: they share each pass over the activations */
#define AMX_STREAM_BYTES (8 << 20) /* outputs from which on the results bypass the caches */

static int amx_on;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_setup(void) { amx_on = amx_permitted(); }

int kvserve_blocks_amx(void) {
    pthread_once(&amx_once, amx_setup);
    return amx_on ? AMX_MIN_ROWS : 0;
}

/* The tiles of AMX_CONFIG (amx.h): 0-3: the sums C (lo and hi of rows 0-15, then of rows 16-31), 4, 5: A (rows 0-15,
 * 16-31), 6, 7: B (lo, hi) */

/* One panel's super-block, expanded for the tile unit. */
typedef struct __attribute__((aligned(64))) {
    uint8_t lo[4][16][64], hi[4][16][64]; /* B tiles per 64 inputs: [input / 4][column][4] */
    float d[16], dmin[16];                /* Q6_K: d only */
    int16_t pairs[4][32]; /* B's multipliers (Q4_K, Q5_K): (m_2t, m_2t+1) per column, t < 4 */
} amx_block;

/* bytes a[c], b[c] of 16 columns as int16 pairs, stored */
ALWAYS void amx_store_pairs(int16_t *to, const uint8_t *a, int sign) {
    _mm512_store_si512((void *)to, vi_pairs(a, a + 16, sign));
}

/* vpermt2b's picks of the lo and hi bytes from the even and the odd products (below) */
static const uint8_t AMX_TAKE[2][64] __attribute__((aligned(64))) = {
#define AMX_PICK(b, hi) ((b) % 2 ? 64 + (b) - 1 + (hi) : (b) + (hi))
#define AMX_PICK8(b, hi)                                                                           \
    AMX_PICK(b, hi), AMX_PICK(b + 1, hi), AMX_PICK(b + 2, hi), AMX_PICK(b + 3, hi),                \
        AMX_PICK(b + 4, hi), AMX_PICK(b + 5, hi), AMX_PICK(b + 6, hi), AMX_PICK(b + 7, hi)
#define AMX_PICK64(hi)                                                                             \
    AMX_PICK8(0, hi), AMX_PICK8(8, hi), AMX_PICK8(16, hi), AMX_PICK8(24, hi), AMX_PICK8(32, hi),   \
        AMX_PICK8(40, hi), AMX_PICK8(48, hi), AMX_PICK8(56, hi)
    {AMX_PICK64(0)},
    {AMX_PICK64(1)},
#undef AMX_PICK64
#undef AMX_PICK8
#undef AMX_PICK
};

/* The int16 products w = u * sc + offset of a 64-byte vector of unsigned bytes u (vpmullw of
 * the even and of the odd bytes by the scales sc, both int16 halves of each lane), each as its
 * lo byte (w & 255, unsigned) and hi byte (w >> 8, signed) at its column and input
 * (vpermt2b). */
ALWAYS void amx_split(vi u, vi sc, vi offset, vi take_lo, vi take_hi, uint8_t *lo,
                      uint8_t *hi) {
    const vi even = _mm512_add_epi16(
        _mm512_mullo_epi16(vi_and(u, _mm512_set1_epi16(0x00FF)), sc), offset);
    const vi odd = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_srli_epi16(u, 8), sc), offset);
    _mm512_store_si512((void *)lo, _mm512_permutex2var_epi8(even, take_lo, odd));
    _mm512_store_si512((void *)hi, _mm512_permutex2var_epi8(even, take_hi, odd));
}

/* The scales of 16 columns in both int16 halves of each lane (sign: Q6_K's int8 scales). */
ALWAYS vi amx_scale16(const uint8_t *p, int sign) {
    const vi x = vi_scales(p, sign);
    return vi_or(vi_and(x, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(x, 16));
}

/* Prefetches (to L2) of the record `ahead` (NULL: none), spread over an expansion: with each
 * line of nibbles read (at), the same line of `ahead`, and with sub-block j's first, 3 of its
 * lines past the nibbles (high bits, floats, scales). */
ALWAYS void amx_ahead(const format_info *f, const uint8_t *ahead, int j, int64_t at) {
    if (!ahead) return;
    _mm_prefetch((const char *)ahead + at, _MM_HINT_T1);
    if (at % 256 == 0)
        for (int64_t line = 2048 + 192 * j; line < 2048 + 192 * j + 192; line += 64)
            if (line < f->record) _mm_prefetch((const char *)ahead + line, _MM_HINT_T1);
}

/* Q4_K, Q5_K: sub-block j's 32 inputs are rows (j % 2) * 8 + step of B tile j / 2;
 * w = u sc_j (<= 31 * 63). */
static void amx_expand_q45(const format_info *f, const uint8_t *rec, const uint8_t *ahead,
                           amx_block *o) {
    const vi low4 = vi_bytes(0x0F), bit4 = vi_bytes(0x10), zero = vi_zero();
    const vi take_lo = _mm512_load_si512((const void *)AMX_TAKE[0]);
    const vi take_hi = _mm512_load_si512((const void *)AMX_TAKE[1]);
    for (int j = 0; j < 8; j++) {
        const vi sc = amx_scale16(rec + f->sc + 16 * j, 0);
        const vi high = f->high >= 0 ? vi_load(rec + f->high + 64 * j) : zero;
        for (int h = 0; h < 4; h++) {
            amx_ahead(f, ahead, j, 256 * j + 64 * h);
            const vi w = vi_load(rec + 256 * j + 64 * h);
            for (int half = 0; half < 2; half++) {
                vi u = vi_and(half ? vi_srl16(w, 4) : w, low4);
                if (f->high >= 0) u = vi_or(u, vi_and(to_bit4(high, 2 * h + half), bit4));
                const int row = (j % 2) * 8 + 2 * h + half;
                amx_split(u, sc, zero, take_lo, take_hi, o->lo[j / 2][row],
                          o->hi[j / 2][row]);
            }
        }
    }
    _mm512_store_ps(o->d, vf_half(rec + f->d));
    _mm512_store_ps(o->dmin, vf_half(rec + f->dmin));
    for (int t = 0; t < 4; t++) amx_store_pairs(o->pairs[t], rec + f->mn + 32 * t, 0);
}

/* Q6_K: sub-blocks of 16 (scales sc_2j, sc_2j+1 over the halves of the 32),
 * w = (u - 32) sc = u sc - 32 sc, in -4064..4096. */
static void amx_expand_q6(const format_info *f, const uint8_t *rec, const uint8_t *ahead,
                          amx_block *o) {
    const vi low4 = vi_bytes(0x0F), bits45 = vi_bytes(0x30);
    const vi take_lo = _mm512_load_si512((const void *)AMX_TAKE[0]);
    const vi take_hi = _mm512_load_si512((const void *)AMX_TAKE[1]);
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < 2; v++) {
            const uint8_t *at = rec + f->sc + 16 * (2 * j + v);
            const vi sc = amx_scale16(at, 1);
            const vi offset = _mm512_mullo_epi16(sc, _mm512_set1_epi16(-32)); /* -32 sc */
            const vi high = vi_load(rec + f->high + 128 * j + 64 * v);
            for (int h = 2 * v; h < 2 * v + 2; h++) {
                amx_ahead(f, ahead, j, 256 * j + 64 * h);
                const vi w = vi_load(rec + 256 * j + 64 * h);
                for (int half = 0; half < 2; half++) {
                    const int step = 2 * h + half; /* pair step % 4 of the high byte */
                    vi u = vi_and(half ? vi_srl16(w, 4) : w, low4);
                    u = vi_or(u, vi_and(to_bit4(high, 2 * (step % 4)), bits45));
                    const int row = (j % 2) * 8 + step;
                    amx_split(u, sc, offset, take_lo, take_hi, o->lo[j / 2][row],
                              o->hi[j / 2][row]);
                }
            }
        }
    _mm512_store_ps(o->d, vf_half(rec + f->d));
}

/* record rec expanded into o, the record `ahead` (NULL: none) prefetched meanwhile */
ALWAYS void amx_expand(const int six, const format_info *f, const uint8_t *rec,
                       const uint8_t *ahead, amx_block *o) {
    if (six)
        amx_expand_q6(f, rec, ahead, o);
    else
        amx_expand_q45(f, rec, ahead, o);
}

/* The activations as the tile unit reads them, and per row and super-block the pairs of sums
 * Q4_K's and Q5_K's offsets take: (P_2t, P_2t+1) over 32s, t < 4. */
typedef struct {
    const int8_t *tiles;   /* [k / 256][groups of 32 rows][4][32][64] */
    const int32_t *pairs4; /* [rows][k / 256][4], NULL where no part needs them */
    const float *e;
    int64_t rows, k, groups;
} amx_rows;

static void amx_copy_tiles(const int8_t *q, int64_t rows, int64_t k, int64_t groups,
                           int8_t *tiles, int64_t task) {
    const int64_t b = task / groups, g = task % groups;
    for (int st = 0; st < 4; st++)
        for (int i = 0; i < 32; i++) {
            int8_t *to = tiles + ((b * groups + g) * 4 + st) * 2048 + 64 * i;
            if (32 * g + i < rows)
                memcpy(to, q + (32 * g + i) * k + 256 * b + 64 * st, 64);
            else
                memset(to, 0, 64);
        }
}

/* The float update of rows r..r+count-1 (res with a row stride of `stride` floats) for
 * super-block b of a panel, from the C tiles as stored: c[lo0, hi0, lo1, hi1][16][16]. */
ALWAYS void amx_update(const int six, const amx_rows *x, const amx_block *o, int64_t b,
                       int64_t r, int64_t count, int32_t (*c)[16][16], float *res,
                       int64_t stride) {
    const int64_t blocks = x->k / 256;
    const vf d = _mm512_load_ps(o->d), dmin = six ? vf_zero() : _mm512_load_ps(o->dmin);
    vi m[4];
    for (int t = 0; t < 4; t++)
        m[t] = six ? vi_zero() : _mm512_load_si512((const void *)o->pairs[t]);
    for (int64_t i = 0; i < count; i++) {
        const int tile = (int)(i >> 4) * 2, at = (int)(i & 15);
        const vi a = vi_add32(_mm512_load_si512((const void *)c[tile][at]),
                              vi_sll32(_mm512_load_si512((const void *)c[tile + 1][at]), 8));
        const vf ev = vf_set(x->e[(r + i) * (x->k / 32) + 8 * b]);
        float *out = res + i * stride;
        /* Q6_K: A has its offsets already (w = (u - 32) sc), B = 0 */
        vi off = vi_zero();
        if (!six) {
            const int32_t *p = x->pairs4 + ((r + i) * blocks + b) * 4;
            for (int t = 0; t < 4; t++) off = vi_add_pairs(off, m[t], vi_set32(p[t]));
        }
        _mm512_store_ps(out, kquant_update(six, a, off, d, dmin, ev, _mm512_load_ps(out)));
    }
}

/*
 * Panels [first, first + count) of part w (a K-quant) for all the rows: out at the part's
 * first column. 0, or -1 when this thread has no memory for its buffers (the caller then
 * takes the tiles above).
 */
ALWAYS int amx_unit_format(const int six, const kvserve_blocks_weight *w, int64_t first,
                           int count, const amx_rows *x, float *out, int64_t ldc) {
    const format_info *f = find_format(w->format);
    const int64_t blocks = x->k / 256, rows = x->rows, panels = (w->n + PANEL - 1) / PANEL;
    /* two super-blocks' expanded panels: this one's and the next one's */
    amx_block *prep = thread_scratch(0, sizeof(amx_block) * 2 * AMX_PANELS);
    float *res = thread_scratch(1, sizeof(float) * rows * AMX_PANELS * 16);
    if (!prep || !res) return -1;
    for (int pp = 0; pp < count; pp++) {
        const uint8_t *rec = w->packed + (first + pp) * blocks * f->record;
        amx_expand(six, f, rec, blocks > 1 ? rec + f->record : NULL, &prep[pp]);
    }
    memset(res, 0, sizeof(float) * rows * AMX_PANELS * 16);
    int32_t c[2][4][16][16] __attribute__((aligned(64))); /* stored C tiles, two in turn */
    int have = 0, slot = 0;
    const amx_block *last_o = prep;
    int64_t last_b = 0, last_r = 0, last_count = 0;
    float *last_res = res;
    for (int64_t b = 0; b < blocks; b++) {
        amx_block *now = prep + (b & 1) * AMX_PANELS, *next = prep + ((b + 1) & 1) * AMX_PANELS;
        for (int64_t r = 0; r < rows; r += 32) {
            const int64_t live = rows - r < 32 ? rows - r : 32; /* rows past the call: zeros */
            const int two = live > 16, expand = r + 32 >= rows && b + 1 < blocks;
            const int8_t *a = x->tiles + (b * x->groups + r / 32) * 8192;
            for (int pp = 0; pp < count; pp++) {
                const amx_block *o = &now[pp];
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int st = 0; st < 4; st++) {
                    _tile_loadd(4, a + 2048 * st, 64);
                    _tile_loadd(6, o->lo[st], 64);
                    _tile_dpbsud(0, 4, 6);
                    _tile_loadd(7, o->hi[st], 64);
                    _tile_dpbssd(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a + 2048 * st + 1024, 64);
                        _tile_dpbsud(2, 5, 6);
                        _tile_dpbssd(3, 5, 7);
                    }
                }
                /* while the tile unit runs this product: the previous one's float work, and
                 * after the last row group the next super-block's expansion of this panel */
                if (have)
                    amx_update(six, x, last_o, last_b, last_r, last_count, c[slot ^ 1],
                               last_res, AMX_PANELS * 16);
                if (expand) {
                    const uint8_t *rec = w->packed + ((first + pp) * blocks + b + 1) * f->record;
                    /* ahead: the panel's next record, else the first of the next unit's */
                    const int64_t after = first + count + pp;
                    const uint8_t *ahead = b + 2 < blocks ? rec + f->record
                                           : after < panels ? w->packed + after * blocks * f->record
                                                            : NULL;
                    amx_expand(six, f, rec, ahead, &next[pp]);
                }
                _tile_stored(0, c[slot][0], 64);
                _tile_stored(1, c[slot][1], 64);
                if (two) {
                    _tile_stored(2, c[slot][2], 64);
                    _tile_stored(3, c[slot][3], 64);
                }
                have = 1;
                last_o = o, last_b = b, last_r = r, last_count = live;
                last_res = res + (r * AMX_PANELS + pp) * 16;
                slot ^= 1;
            }
        }
    }
    amx_update(six, x, last_o, last_b, last_r, last_count, c[slot ^ 1], last_res,
               AMX_PANELS * 16);
    /* The results, row by row (the unit's columns of a row are adjacent). Where the call's
     * output is larger than the caches it could stay in (AMX_STREAM_BYTES) and the unit's
     * columns are whole aligned lines, they go around the caches (vmovntps): each line is
     * written without first being read. Measured (Sapphire Rapids, 2 threads, a prefill of
     * 8 x 104 prompt tokens of the 1.5B, whose gate|up output is 60 MB a layer; 2 alternated
     * rounds): 3.08-3.44 s, 2.88-3.02 s row by row, 2.82-2.90 s streamed. */
    __mmask16 keep[AMX_PANELS];
    vf bias[AMX_PANELS];
    float *const at = out + first * PANEL;
    int stream = rows * ldc * (int64_t)sizeof(float) >= AMX_STREAM_BYTES &&
                 (uintptr_t)at % 64 == 0 && ldc % 16 == 0;
    for (int pp = 0; pp < count; pp++) {
        const int64_t column = (first + pp) * PANEL;
        const int64_t cols = w->n - column < PANEL ? w->n - column : PANEL;
        keep[pp] = (__mmask16)((1u << cols) - 1);
        stream &= cols == PANEL;
        bias[pp] = w->bias ? _mm512_maskz_loadu_ps(keep[pp], w->bias + column) : vf_zero();
    }
    for (int64_t i = 0; i < rows; i++) {
        float *o = at + i * ldc;
        for (int pp = 0; pp < count; pp++) {
            vf value = _mm512_load_ps(res + (i * AMX_PANELS + pp) * 16);
            if (w->bias) value = vf_add(value, bias[pp]);
            if (stream)
                _mm512_stream_ps(o + 16 * pp, value);
            else
                _mm512_mask_storeu_ps(o + 16 * pp, keep[pp], value);
        }
    }
    if (stream) _mm_sfence(); /* the streamed lines visible before the call returns */
    return 0;
}

static int amx_unit(const kvserve_blocks_weight *w, int64_t first, int count, const amx_rows *x,
                    float *out, int64_t ldc) {
    return w->format == KVSERVE_BLOCKS_Q6_K ? amx_unit_format(1, w, first, count, x, out, ldc)
                                            : amx_unit_format(0, w, first, count, x, out, ldc);
}

#else
#define BLOCKS_AMX 0
int kvserve_blocks_amx(void) { return 0; }
#endif

/* Panel `local` of part w for rows [start, stop) of the call's rows x in the tiles above, out
 * at the part's first column. `padded`: NULL, or the call's last rows from `padded_at` on,
 * copied with zero rows after them to a whole tile of `padded_rows` (see kvserve_blocks_gemm). */
static void panel_tiles(const kvserve_blocks_weight *w, int64_t local, const tile_rows *x,
                        int64_t start, int64_t stop, float *out, int64_t ldc,
                        const tile_rows *padded, int64_t padded_at, int64_t padded_rows) {
    const int64_t k = x->k;
    const format_info *f = find_format(w->format);
    const tile_fn *tiles = tiles_of(w->format);
    const int64_t records = k / f->values;
    const uint8_t *data = w->packed + local * records * f->record;
    const int64_t column = local * PANEL, cols = w->n - column < PANEL ? w->n - column : PANEL;
    const int64_t most = f->values == 256 && x->r ? K_FINE_ROWS : MR;
    for (int64_t r = start, count; r < stop; r += count) {
        count = most; /* the largest tile that fits the rows left */
        while (count > stop - r) count /= 2;
        tile_rows tile = {x->q + r * k,
                          x->r ? x->r + r * k : NULL,
                          x->e + r * (k / 32),
                          x->s + r * (k / 16),
                          k,
                          x->p4 ? x->p4 + r * (k / 256) * 4 : NULL,
                          x->p8 ? x->p8 + r * (k / 256) * 8 : NULL};
        int64_t live = count;
        if (padded && r == padded_at && padded_rows <= most) { /* the rows left, one tile */
            tile = *padded;
            live = stop - r;
            count = padded_rows;
        }
        const int64_t span = NV_FOR(count) * VW; /* columns of one pass */
        for (int64_t at = 0; at < cols; at += span) {
            const int64_t width = cols - at < span ? cols - at : span;
            tiles[count](data, records, 4 * at, &tile, w->bias ? w->bias + column + at : NULL,
                         out + r * ldc + column + at, ldc, width, live);
        }
    }
}

#if BLOCKS_WIDE
/*
 * ---- many rows on AVX2 and AVX512: records expanded once, tiles of rows x 16 columns ---------
 *
 * From WIDE_MIN_ROWS rows on (prefill chunks, many streams), the K-quants' 8-bit form goes
 * record by record with all the rows of the call: each record (a super-block of 16 columns) is
 * expanded once into its bytes u ([64 steps of 4 inputs][16 columns][4], 4 KB, in L1) and its
 * sub-block multipliers, then every tile of rows takes the panel's 16 columns in one pass, so
 * that each broadcast of 4 row bytes feeds both 8-column vectors. The tiles above broadcast
 * once per vpmaddubsw in their tiles of 4 rows (two passes of 8 columns: their sums fill the
 * 16 registers), and on Zen 3 the broadcasts, not the multiplies, bound them. Measured in
 * isolation (AMD EPYC Zen 3, one core, an expanded super-block and its rows in L1, MAC a
 * cycle): 4 rows x 8 columns 18-31, 4 rows x 16 columns with the int32 sums in L1 between
 * sub-blocks 37-39, against 37.6 for vpmaddubsw + vpaddw alone. Tiles of 4 rows keep their
 * int32 sums in L1 (Q4_K, Q5_K: one update a sub-block); Q6_K, whose 6-bit sums widen every
 * 2 steps, takes tiles of 2 rows with the sums in registers (WIDE_ROWS).
 *
 * The integer sums are the tiles' exact ones (the same int16 groups, the same multipliers),
 * and a super-block ends in kquant_update as there: the same floats, bit for bit.
 * Measured on that machine (the 1.5B's products of a step, 28 layers, 2 threads, alternated,
 * min): 64 rows 660-674 -> 521-524 ms, 32 rows 310-335 -> 296-306, 16 rows 156-163 against
 * 159-164 (equal), 8 rows 95-100 against 85-90 (worse: the expansion is shared by too few
 * rows); one product at 512 rows (2 layers' shapes, 6 alternated rounds, one panel a task,
 * below): q|k|v 11.3 ->
 * 9.2 ms, o 7.6 -> 6.1, gate|up 103 -> 91, down (Q6_K) 64 -> 50. A prefill of 8 x 128
 * tokens: 11.1-13.0 -> 9.3-9.5 s.
 * A task is a unit of WIDE_PANELS panels of one part, each record's rows multiplied with the
 * unit's 8 expanded records in turn, so the activations of a tile come from L2 or L3 once a
 * unit (1,024 rows of 8,960 inputs are 9 MB) instead of once a panel: 2 layers' products of
 * 1,024 rows, 2 threads, alternated in one process, min / median of 12: one panel a unit
 * 762 / 849 ms, 8 panels 680 / 756 (another run, of 6: 1 panel 854 / 1001, 4 panels 771 /
 * 799, 8 panels 698 / 788); 4 layers of 512 rows 684 -> 651 ms (min of 6), 28 layers of 64
 * rows 578 -> 558 (4 panels).
 */
/*
 * AVX512 (without the tile unit, or with it turned off) goes the same way from 96 rows, in
 * tiles of 8 rows x 16 columns (one vector; the step's 4 row bytes broadcast inside vpdpbusd),
 * all formats, the sums in registers. Its tiles above unpack in registers for 8 rows at a time
 * and keep up to about 64 rows; beyond, their activations come from L2 or L3 once a panel.
 * The offsets' pairs of every row and super-block are made once a call (offset_pairs) and
 * broadcast inside vpdpwssd (AVX2: vpmaddwd): made per row, record and panel they had taken
 * 18% of the time at 128 rows. Measured on the AMD EPYC Zen 4 machine (8 of the 1.5B's layers'
 * products, 2 threads, alternated in one process, min of 3-5): 16 rows 28.8 against 29.1 ms,
 * 32 rows 54.7 against 60.5, 64 rows 89.4 against 92.9, 96 rows 135.9 -> 131.6, 128 rows
 * 179.0 -> 163.7, 256 rows 342.5 -> 324.9, 512 rows 843.7 -> 675.8; the pairs made once, in
 * the AVX2 build on that machine: 64 rows 120.7 -> 117.3, 256 rows 436.3 -> 410.0.
 */
#if BLOCKS_ISA == 3
#define WIDE_MIN_ROWS 96
#define WIDE_ROWS(six) 8
#else
#define WIDE_MIN_ROWS 32
#define WIDE_ROWS(six) ((six) ? 2 : 4)
#endif
#define WIDE_PANELS 8 /* panels of a unit: they share each pass over the rows */
#define WIDE_FOLDED (BLOCKS_ISA == 3) /* Q6_K's offsets folded into the int32 sums */
#define WV (PANEL / VW) /* vectors of a panel's 16 columns: AVX2 2, AVX512 1 */

/* A panel's record, expanded: the bytes u per step, and per vector of columns the sub-block
 * scales (as vi_add_scaled multiplies them), the offsets' multiplier pairs, d and dmin. */
typedef struct __attribute__((aligned(64))) {
    uint8_t u[64][64];
    vi scale[16][WV], pairs[8][WV];
    vf d[WV], dmin[WV];
} wide_record;

ALWAYS vi vi_load_aligned(const uint8_t *p) {
#if BLOCKS_ISA == 3
    return _mm512_load_si512((const void *)p);
#else
    return _mm256_load_si256((const __m256i *)p);
#endif
}
ALWAYS void vi_store_aligned(uint8_t *p, vi v) {
#if BLOCKS_ISA == 3
    _mm512_store_si512((void *)p, v);
#else
    _mm256_store_si256((__m256i *)p, v);
#endif
}

/* Record `rec` of a K-quant expanded into o (the bytes as block_sums unpacks them), a line of
 * the record `ahead` (NULL: none) prefetched with each of its 64 vectors of nibbles: a whole
 * record asked at once fills the line-fill buffers (see PREFETCH_AHEAD). */
ALWAYS void wide_expand(const int six, const format_info *f, const uint8_t *rec,
                        const uint8_t *ahead, wide_record *o) {
    const vi low4 = vi_bytes(0x0F), mask = vi_bytes(six ? 0x30 : 0x10);
    const int subs = six ? 16 : 8, chunks = six ? 2 : 4; /* 16 or 32 inputs a sub-block */
    for (int j = 0; j < subs; j++)
        for (int v = 0; v < WV; v++) {
            const uint8_t *nib = six ? rec + 256 * (j / 2) + 128 * (j % 2) : rec + 256 * j;
            const vi high =
                f->high >= 0 ? vi_load(rec + f->high + 64 * j + LANES * v) : vi_zero();
            for (int h = 0; h < chunks; h++) {
                const int64_t line = 64 * ((WV * j + v) * chunks + h);
                if (ahead && line < f->record)
                    __builtin_prefetch(ahead + line, 0, PREFETCH_LOCALITY);
                const vi w = vi_load(nib + 64 * h + LANES * v);
                vi u0 = vi_and(w, low4), u1 = vi_and(vi_srl16(w, 4), low4);
                if (six) {
                    u0 = vi_or(u0, vi_and(to_bit4(high, 2 * (2 * h)), mask));
                    u1 = vi_or(u1, vi_and(to_bit4(high, 2 * (2 * h + 1)), mask));
                } else if (f->high >= 0) {
                    u0 = vi_or(u0, vi_and(to_bit4(high, 2 * h), mask));
                    u1 = vi_or(u1, vi_and(to_bit4(high, 2 * h + 1), mask));
                }
                const int step = 2 * chunks * j + 2 * h;
                vi_store_aligned(o->u[step] + LANES * v, u0);
                vi_store_aligned(o->u[step + 1] + LANES * v, u1);
            }
            o->scale[j][v] = vi_scales(rec + f->sc + 16 * j + VW * v, six);
        }
    const int64_t at = six ? f->sc : f->mn;
    for (int t = 0; t < subs / 2; t++)
        for (int v = 0; v < WV; v++)
            o->pairs[t][v] =
                vi_pairs(rec + at + 32 * t + VW * v, rec + at + 32 * t + 16 + VW * v, six);
    for (int v = 0; v < WV; v++) {
        o->d[v] = vf_half(rec + f->d + 2 * VW * v);
        o->dmin[v] = six ? vf_zero() : vf_half(rec + f->dmin + 2 * VW * v);
    }
}

/*
 * Super-block r of a record for R rows (row i's values at q + i * k) and its 16 columns: the
 * sums A, int32 per row and vector of columns (AVX2: 8 columns, for 4 rows in L1 between
 * sub-blocks, for 2 in registers; AVX512: 16 columns, in registers), then B from the rows'
 * offset pairs (row i's at pairs + i * (k / 256) * (subs / 2); Q6_K with VNNI: none, pairs
 * holds the folds of offset_folds, row i's at pairs + i * (k / 16)) and kquant_update into res
 * (row i's 16 floats at res + stride * i). group: 4-input steps whose sums are added before
 * they are scaled (AVX2: the int16 bounds of the header comment; VNNI: a sub-block).
 */
ALWAYS void wide_rows(const int six, const int group, const int R, const wide_record *o,
                      const int8_t *q, const float *e, const int32_t *pairs, int64_t k, int64_t r,
                      float *res, int64_t stride) {
    const int subs = six ? 16 : 8, steps = six ? 4 : 8;
    /* AVX2: the sums of 4 rows in L1 between sub-blocks (the registers hold 2 rows' only) */
    const int in_memory = VW == 8 && R > 2;
    vi acc[8][WV] __attribute__((aligned(64)));
    for (int i = 0; i < R; i++)
        for (int v = 0; v < WV; v++) acc[i][v] = vi_zero();
    /* Q6_K with VNNI: each sub-block's sums start from the row's -32 P_g (pairs: the call's
     * folded offsets, see offset_folds), so that acc is A - 32 B itself */
    const int folded = six && WIDE_FOLDED;
    _Pragma("GCC unroll 1") for (int j = 0; j < subs; j++) {
        vsum sums[8][WV];
        for (int i = 0; i < R; i++)
            for (int v = 0; v < WV; v++)
                sums[i][v] = folded ? vi_set32(pairs[(i * (k / 256) + r) * 16 + j]) : vsum_zero();
        _Pragma("GCC unroll 8") for (int st = 0; st < steps; st++) {
            const int step = steps * j + st;
            vi u[WV];
            for (int v = 0; v < WV; v++) u[v] = vi_load_aligned(o->u[step] + LANES * v);
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                const int8_t *p = q + i * k + 256 * r + 4 * step;
#if BLOCKS_ISA == 3
                sums[i][0] = keep(vsum_step_at(sums[i][0], u[0], p));
#else
                const vi x = vi_bcast4(p);
                for (int v = 0; v < WV; v++) sums[i][v] = keep(vsum_step(sums[i][v], u[v], x));
#endif
            }
            if ((st + 1) % group == 0)
                _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                    for (int v = 0; v < WV; v++) {
                        vi *a = &acc[i][v];
                        if (in_memory) __asm__ volatile("" : : "r"(a) : "memory");
                        *a = vi_add_scaled(*a, sums[i][v], o->scale[j][v]);
                        sums[i][v] = vsum_zero();
                    }
                }
        }
    }
    for (int i = 0; i < R; i++) {
        const vf ev = vf_set(e[i * (k / 32) + 8 * r]);
        vi off[WV];
        for (int v = 0; v < WV; v++) off[v] = vi_zero();
        const int32_t *p = pairs + (i * (k / 256) + r) * (subs / 2);
        for (int t = 0; t < subs / 2 && !folded; t++)
            for (int v = 0; v < WV; v++) off[v] = vi_add_pairs_at(off[v], o->pairs[t][v], p + t);
        for (int v = 0; v < WV; v++) {
            float *at = res + stride * i + VW * v;
            const vf before = r ? vf_load(at) : vf_zero(); /* the first super-block starts them */
            vf_store(at, kquant_update(six, acc[i][v], off[v], o->d[v], o->dmin[v], ev, before));
        }
    }
}

/* Panels [first, first + count) of part w (a K-quant) for all the rows, out at the part's first
 * column: 0, or -1 when this thread has no memory for its buffers (the caller then takes the
 * tiles). The panels share each pass over the rows: a tile's activations, read for the first
 * panel, are in L1 for the others. pairs: the rows' offset pairs (offset_pairs). */
ALWAYS int wide_unit_format(const int six, const int group, const kvserve_blocks_weight *w,
                            int64_t first, int count, const int8_t *q, const float *scales,
                            const int32_t *pairs, int64_t rows, int64_t k, float *out,
                            int64_t ldc) {
    const format_info *f = find_format(w->format);
    const int64_t records = k / 256, stride = 16 * count; /* res: [rows][count][16] */
    float *res = thread_scratch(4, sizeof(float) * (size_t)(rows * stride));
    wide_record *o = thread_scratch(5, sizeof(wide_record) * (size_t)count);
    if (!res || !o) return -1;
    for (int64_t r = 0; r < records; r++) {
        for (int pp = 0; pp < count; pp++) {
            const uint8_t *rec = w->packed + ((first + pp) * records + r) * f->record;
            if (r == 0 && records > 1) /* then each expansion asks for the record after next */
                for (int64_t at = 0; at < f->record; at += 64)
                    __builtin_prefetch(rec + f->record + at, 0, PREFETCH_LOCALITY);
            wide_expand(six, f, rec, r + 2 < records ? rec + 2 * f->record : NULL, &o[pp]);
        }
        int64_t i = 0;
#define WIDE_TILES(R)                                                                              \
    for (int pp = 0; pp < count; pp++)                                                             \
        wide_rows(six, group, R, &o[pp], q + i * k, scales + i * (k / 32),                         \
                  pairs + i * records * (six ? (WIDE_FOLDED ? 16 : 8) : 4), k, r,                  \
                  res + i * stride + 16 * pp, stride);
        if (WIDE_ROWS(six) == 8)
            for (; i + 8 <= rows; i += 8) WIDE_TILES(8)
        if (WIDE_ROWS(six) >= 4)
            for (; i + 4 <= rows; i += 4) WIDE_TILES(4)
        for (; i + 2 <= rows; i += 2) WIDE_TILES(2)
        for (; i < rows; i++) WIDE_TILES(1)
#undef WIDE_TILES
    }
    /* (streamed around the caches, vmovntps, a 36 MB output of 512 rows took longer) */
    for (int pp = 0; pp < count; pp++) {
        const int64_t column = (first + pp) * PANEL;
        const int64_t cols = w->n - column < PANEL ? w->n - column : PANEL;
        const float *bias = w->bias ? w->bias + column : NULL;
        const float *from = res + 16 * pp;
        float *at = out + column;
        if (cols < PANEL) {
            for (int64_t i = 0; i < rows; i++)
                for (int64_t c = 0; c < cols; c++)
                    at[i * ldc + c] = bias ? from[i * stride + c] + bias[c] : from[i * stride + c];
            continue;
        }
        for (int64_t i = 0; i < rows; i++)
            for (int v = 0; v < WV; v++) {
                vf value = vf_load(from + i * stride + VW * v);
                if (bias) value = vf_add(value, vf_load(bias + VW * v));
                vf_store(at + i * ldc + VW * v, value);
            }
    }
    return 0;
}

static int wide_unit(const kvserve_blocks_weight *w, int64_t first, int count, const int8_t *q,
                     const float *scales, const int32_t *pairs4, const int32_t *pairs8,
                     int64_t rows, int64_t k, float *out, int64_t ldc) {
    /* AVX2's int16 pair sums widen in groups of steps (the tiles' bounds); VNNI's int32 sums
     * once a sub-block (8 steps, Q6_K's 4) */
    const int vnni = BLOCKS_ISA == 3;
    switch (w->format) {
    case KVSERVE_BLOCKS_Q4_K:
        return wide_unit_format(0, 8, w, first, count, q, scales, pairs4, rows, k, out, ldc);
    case KVSERVE_BLOCKS_Q5_K:
        return wide_unit_format(0, vnni ? 8 : 4, w, first, count, q, scales, pairs4, rows, k,
                                out, ldc);
    case KVSERVE_BLOCKS_Q6_K:
        return wide_unit_format(1, vnni ? 4 : 2, w, first, count, q, scales, pairs8, rows, k,
                                out, ldc);
    default: return -1;
    }
}

/* The product of the 8-bit form with K-quant parts, many rows (x: the call's rows, their
 * offset pairs made, but with VNNI not Q6_K's: p8 holds their folds, offset_folds; else p8 is
 * x->p8): a task a unit of up to WIDE_PANELS panels of one part (the other parts' panels in
 * the tiles above, all rows a task). */
static void wide_gemm(const tile_rows *x, const int32_t *p8, int64_t rows,
                      const kvserve_blocks_weight *parts, int64_t num_parts,
                      const int64_t *first_column, float *out, int64_t ldc, int num_threads) {
    const int64_t k = x->k;
    int64_t first_unit[num_parts + 1];
    const int64_t units = unit_table(parts, num_parts, WIDE_PANELS, first_unit);
    const int parallel = units > 1 && rows * first_column[num_parts] * k >= (1 << 17);
    task_share share;
    const int teams = task_share_init(&share, units, parallel ? num_threads : 1);
    _Pragma("omp parallel if (teams > 1) num_threads(teams)") {
        task_cursor c = task_cursor_of(&share);
        for (int64_t unit; (unit = next_task(&c)) >= 0;) {
            const unit_panels u = unit_at(parts, first_unit, WIDE_PANELS, unit);
            const kvserve_blocks_weight *w = &parts[u.part];
            float *o = out + first_column[u.part];
            if (u.count == 0)
                panel_tiles(w, u.first, x, 0, rows, o, ldc, NULL, 0, 0);
            else if (wide_unit(w, u.first, u.count, x->q, x->e, x->p4, p8, rows, k, o, ldc))
                for (int pp = 0; pp < u.count; pp++) /* no memory: the tiles */
                    panel_tiles(w, u.first + pp, x, 0, rows, o, ldc, NULL, 0, 0);
        }
    }
}
#endif

#if BLOCKS_AMX
/* The product of the 8-bit form with K-quant parts on the tile unit (the other parts' panels
 * in the tiles above, all rows a task): 0, or -1 without memory for the call's buffers. */
/* all: the call's rows, their offset pairs made (the Q4_K and Q5_K parts take p4). */
static int amx_gemm(const tile_rows *all, int64_t rows, const kvserve_blocks_weight *parts,
                    int64_t num_parts, const int64_t *first_column, float *out, int64_t ldc,
                    int num_threads) {
    const int64_t k = all->k, blocks = k / 256, groups = (rows + 31) / 32;
    int64_t first_unit[num_parts + 1];
    const int64_t units = unit_table(parts, num_parts, AMX_PANELS, first_unit);
    int8_t *tiles = thread_scratch(2, (size_t)(blocks * groups * 8192));
    if (!tiles) return -1;
    const amx_rows x = {tiles, all->p4, all->e, rows, k, groups};
    const int parallel = units > 1 && rows * first_column[num_parts] * k >= (1 << 17);
    _Pragma("omp parallel if (parallel) num_threads(num_threads)") {
        _Pragma("omp for schedule(static)")
        for (int64_t task = 0; task < blocks * groups; task++)
            amx_copy_tiles(all->q, rows, k, groups, tiles, task);
        _tile_loadconfig(&AMX_CONFIG);
        _Pragma("omp for schedule(static)")
        for (int64_t unit = 0; unit < units; unit++) {
            const unit_panels u = unit_at(parts, first_unit, AMX_PANELS, unit);
            const kvserve_blocks_weight *w = &parts[u.part];
            float *o = out + first_column[u.part];
            if (u.count == 0)
                panel_tiles(w, u.first, all, 0, rows, o, ldc, NULL, 0, 0);
            else if (amx_unit(w, u.first, u.count, &x, o, ldc) != 0) /* no memory: the tiles */
                for (int pp = 0; pp < u.count; pp++)
                    panel_tiles(w, u.first + pp, all, 0, rows, o, ldc, NULL, 0, 0);
        }
        _tile_release();
    }
    return 0;
}
#endif

int kvserve_blocks_gemm(const int8_t *q, const int8_t *rest, const float *scales,
                        const int32_t *sums, int64_t rows, int64_t k,
                        const kvserve_blocks_weight *parts, int64_t num_parts, float *out,
                        int64_t ldc, int num_threads) {
    if (num_parts <= 0 || k <= 0 || k % 32) return -1;
    int64_t first_panel[num_parts + 1], first_column[num_parts + 1];
    first_panel[0] = first_column[0] = 0;
    for (int64_t p = 0; p < num_parts; p++) {
        const format_info *f = find_format(parts[p].format);
        if (!f || k % f->values || parts[p].n <= 0) return -1;
        first_panel[p + 1] = first_panel[p] + (parts[p].n + PANEL - 1) / PANEL;
        first_column[p + 1] = first_column[p] + parts[p].n;
    }
    if (rows <= 0) return 0;
    /* the K-quants' 8-bit form takes one scale per 256 values (kvserve_blocks_quantize_*) */
    int wide = 0;
    for (int64_t p = 0; p < num_parts; p++)
        wide |= kvserve_blocks_block_values(parts[p].format) == 256;
    if (wide && !rest)
        for (int64_t i = 0; i < rows * (k / 32); i++)
            if (scales[i] != scales[i - i % 8]) return -3;
    /* the K-quants' offsets, once for all the columns: paired for every path (offset_pairs),
     * but Q6_K's folded where the record-by-record path with VNNI is to take the call
     * (offset_folds); without memory for them, the many-row paths are not taken and each tile
     * makes its own pairs */
    int q45 = 0, q6 = 0;
    for (int64_t p = 0; p < num_parts && !rest; p++) {
        q45 |= parts[p].format == KVSERVE_BLOCKS_Q4_K || parts[p].format == KVSERVE_BLOCKS_Q5_K;
        q6 |= parts[p].format == KVSERVE_BLOCKS_Q6_K;
    }
#if BLOCKS_AMX
    const int amx = wide && !rest && rows >= AMX_MIN_ROWS && kvserve_blocks_amx();
#else
    const int amx = 0;
#endif
    const size_t per_row = sizeof(int32_t) * (size_t)(k / 256);
    int32_t *pairs4 = q45 ? thread_scratch(3, 4 * per_row * (size_t)rows) : NULL, *folds = NULL;
#if BLOCKS_WIDE
    if (q6 && WIDE_FOLDED && wide && rows >= WIDE_MIN_ROWS && !amx)
        folds = thread_scratch(7, 16 * per_row * (size_t)rows);
#endif
    int32_t *pairs8 = q6 && !folds ? thread_scratch(6, 8 * per_row * (size_t)rows) : NULL;
    if (pairs4) offset_pairs(0, sums, k, rows, pairs4);
    if (pairs8) offset_pairs(1, sums, k, rows, pairs8);
    if (folds) offset_folds(sums, k, rows, folds);
    const tile_rows all = {q, rest, scales, sums, k, pairs4, pairs8};
#if BLOCKS_AMX
    if (amx && (pairs4 || !q45) &&
        amx_gemm(&all, rows, parts, num_parts, first_column, out, ldc, num_threads) == 0)
        return 0;
#endif
#if BLOCKS_WIDE
    if (wide && !rest && rows >= WIDE_MIN_ROWS && (pairs4 || !q45) &&
        (!q6 || (WIDE_FOLDED ? folds : pairs8))) {
        wide_gemm(&all, WIDE_FOLDED ? folds : pairs8, rows, parts, num_parts, first_column, out,
                  ldc, num_threads);
        return 0;
    }
#endif
    const int64_t panels = first_panel[num_parts];
    /* Tasks are (panel, row chunk): with few panels for the threads the rows are cut as well
     * (in whole tiles), so that every thread gets work. */
    const int64_t chunk = panels < 4 * num_threads && rows >= 2 * MR
                              ? ((rows + 1) / 2 + MR - 1) / MR * MR
                              : rows;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    /* The rows left after the whole tiles, when not a power of two, go as one tile of the next
     * power of two, the rows after them zeros (their results not stored), instead of a tile of
     * each power of two in them (7 = 4 + 2 + 1 reads each record thrice): once the weights'
     * stream bounds it, a tile of 8 rows takes about the time of one of 4. Measured on the
     * Sapphire Rapids machine (a decode step's products of the 1.5B, 28 layers, 2 threads, 8
     * alternated rounds, min): 3 rows 69.3 -> 60.0 ms, 5 rows 71.6 -> 65.6, 6 72.4 -> 62.7,
     * 7 82.8 -> 62.6 (8 rows 62.9); the AVX2 build on the same machine: 3 rows 82.8 -> 84.8 (4 rows
     * 85.3), within the noise. A row's results are the same either way: its float sequence
     * does not depend on its tile. */
    const int64_t padded_at = rows - rows % MR, left = rows - padded_at;
    int64_t padded_rows = 1;
    while (padded_rows < left) padded_rows *= 2;
    tile_rows padded = {0};
    void *copy = NULL;
    if (padded_rows != left) {
        const size_t q_bytes = (size_t)(padded_rows * k);
        const size_t e_bytes = sizeof(float) * (size_t)(padded_rows * (k / 32));
        const size_t s_bytes = sizeof(int32_t) * (size_t)(padded_rows * (k / 16));
        const size_t p_bytes = 12 * per_row * (size_t)padded_rows; /* pairs, 4 and 8 a block */
        copy = calloc(1, (rest ? 2 : 1) * q_bytes + e_bytes + s_bytes + p_bytes);
        if (copy) {
            int8_t *pq = copy;
            float *pe = (float *)(pq + q_bytes);
            int32_t *ps = (int32_t *)((uint8_t *)pe + e_bytes);
            int32_t *p4 = (int32_t *)((uint8_t *)ps + s_bytes);
            int32_t *p8 = p4 + 4 * padded_rows * (k / 256);
            int8_t *pr = rest ? (int8_t *)((uint8_t *)p4 + p_bytes) : NULL;
            memcpy(pq, q + padded_at * k, (size_t)(left * k));
            if (pr) memcpy(pr, rest + padded_at * k, (size_t)(left * k));
            memcpy(pe, scales + padded_at * (k / 32), sizeof(float) * (size_t)(left * (k / 32)));
            memcpy(ps, sums + padded_at * (k / 16), sizeof(int32_t) * (size_t)(left * (k / 16)));
            if (pairs4) offset_pairs(0, ps, k, padded_rows, p4);
            if (pairs8) offset_pairs(1, ps, k, padded_rows, p8);
            padded = (tile_rows){pq, pr, pe, ps, k, pairs4 ? p4 : NULL, pairs8 ? p8 : NULL};
        }
    }
    const tile_rows *pad = copy ? &padded : NULL;
    const int64_t tasks = panels * chunks;
    const int parallel = tasks > 1 && rows * first_column[num_parts] * k >= (1 << 17);
    task_share share;
    const int teams = task_share_init(&share, tasks, parallel ? num_threads : 1);
    _Pragma("omp parallel if (teams > 1) num_threads(teams)") {
        task_cursor c = task_cursor_of(&share);
        for (int64_t task; (task = next_task(&c)) >= 0;) {
            const int64_t panel = task / chunks, start = (task % chunks) * chunk;
            const int64_t stop = start + chunk < rows ? start + chunk : rows;
            int64_t p = 0;
            while (first_panel[p + 1] <= panel) p++;
            panel_tiles(&parts[p], panel - first_panel[p], &all, start, stop, out + first_column[p],
                        ldc, pad, padded_at, padded_rows);
        }
    }
    free(copy);
    return 0;
}

#else

int kvserve_blocks_amx(void) { return 0; }

int kvserve_blocks_gemm(const int8_t *q, const int8_t *rest, const float *scales,
                        const int32_t *sums, int64_t rows, int64_t k,
                        const kvserve_blocks_weight *parts, int64_t num_parts, float *out,
                        int64_t ldc, int num_threads) {
    (void)q, (void)rest, (void)scales, (void)sums, (void)rows, (void)k, (void)parts,
        (void)num_parts, (void)out, (void)ldc, (void)num_threads;
    return -2;
}

#endif

#if BLOCKS_WIDE /* the tile unit, where it runs, takes those rows first */
int kvserve_blocks_many_rows(void) { return kvserve_blocks_amx() ? 0 : WIDE_MIN_ROWS; }
#else
int kvserve_blocks_many_rows(void) { return 0; }
#endif
