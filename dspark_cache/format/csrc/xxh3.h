/* xxh3.h: our implementation of XXH3-64 (seed 0, default secret) as specified in
 * xxHash's doc/xxhash_spec.md, bit-identical to the `xxhash` package's xxh3_64.
 *
 * Why our own: the loader hashes each sample as it reads it, inside the GIL-free batch filler, and
 * the shard writer hashes every byte it writes (format/tar/csrc/append.c), without the GIL,
 * so the checksum has to be C callable without the interpreter; the project ships only its own
 * code. Everything is static inline (unused parts cost nothing); each including file detects
 * the CPU once for itself.
 *
 *   dspark_xxh3 s; dspark_xxh3_reset(&s); dspark_xxh3_update(&s, p, n)...; dspark_xxh3_digest(&s)
 *   dspark_xxh3_64(p, n)                                  one shot, same value
 *
 * Long inputs (> 240 bytes) run 64-byte stripes through 8 accumulators, 16 stripes to a
 * 1024-byte block, a scramble after each block. That loop is the only hot one; it has a scalar,
 * an SSE2, an AVX2 and an AVX-512 version, chosen once at run time (x86: the widest the CPU has;
 * elsewhere scalar), each compiled through target attributes, so no -m flags are needed. Built
 * with -DDSPARK_XXH3_TESTING, dspark_xxh3_set_path() pins one.
 */
#ifndef DSPARK_XXH3_H
#define DSPARK_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define DSPARK_XXH3_X86 1
#include <immintrin.h>
#else
#define DSPARK_XXH3_X86 0
#endif

#define DSPARK_XXH3_STRIPE 64
#define DSPARK_XXH3_BLOCK_STRIPES 16 /* (secret size 192 - 64) / 8 */
#define DSPARK_XXH3_BUF 256           /* >= 240 (short inputs stay whole), a whole number of stripes */

typedef struct {
    uint64_t acc[8];
    /* [0, 64): the 64 input bytes just before the unconsumed ones, because the final stripe is
     * the input's last 64 bytes and may reach back into consumed data; [64, 64 + buf_len): input
     * not yet accumulated. Invariant: a stripe is accumulated only once a later byte exists,
     * since the final stripe and the block it ends are treated differently. */
    uint8_t mem[DSPARK_XXH3_STRIPE + DSPARK_XXH3_BUF];
    uint64_t total;    /* bytes seen */
    uint32_t buf_len;  /* unconsumed bytes, at mem + 64 */
    uint32_t nstripes; /* stripes accumulated in the current block */
} dspark_xxh3;

#define DSPARK_XXH3_P32_1 0x9E3779B1U
#define DSPARK_XXH3_P32_2 0x85EBCA77U
#define DSPARK_XXH3_P32_3 0xC2B2AE3DU
#define DSPARK_XXH3_P64_1 0x9E3779B185EBCA87ULL
#define DSPARK_XXH3_P64_2 0xC2B2AE3D27D4EB4FULL
#define DSPARK_XXH3_P64_3 0x165667B19E3779F9ULL
#define DSPARK_XXH3_P64_4 0x85EBCA77C2B2AE63ULL
#define DSPARK_XXH3_P64_5 0x27D4EB2F165667C5ULL
#define DSPARK_XXH3_PMX_1 0x165667919E3779F9ULL
#define DSPARK_XXH3_PMX_2 0x9FB21C651E98DF25ULL

/* The spec's default secret (data of the algorithm). */
static const uint8_t dspark_xxh3_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---- scalar building blocks (all reads little-endian, any alignment) ---- */

static inline uint32_t dspark_xxh3__rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t dspark_xxh3__rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Low xor high half of the 128-bit product. */
static inline uint64_t dspark_xxh3__mulfold(uint64_t a, uint64_t b)
{
#ifdef __SIZEOF_INT128__
    __extension__ typedef unsigned __int128 u128; /* __extension__: fine under -Wpedantic */
    u128 m = (u128)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
#else /* 32-bit targets: schoolbook from 32x32 products */
    uint64_t al = (uint32_t)a, ah = a >> 32, bl = (uint32_t)b, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t mid = (ll >> 32) + (uint32_t)lh + (uint32_t)hl;
    uint64_t lo = (mid << 32) | (uint32_t)ll;
    uint64_t hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    return lo ^ hi;
#endif
}

static inline uint64_t dspark_xxh3__avalanche(uint64_t x)
{
    x ^= x >> 37;
    x *= DSPARK_XXH3_PMX_1;
    return x ^ (x >> 32);
}

static inline uint64_t dspark_xxh3__avalanche64(uint64_t x) /* XXH64's final mix */
{
    x ^= x >> 33;
    x *= DSPARK_XXH3_P64_2;
    x ^= x >> 29;
    x *= DSPARK_XXH3_P64_3;
    return x ^ (x >> 32);
}

/* 16 input bytes against 16 secret bytes (seed 0, so the secret is used as is). */
static inline uint64_t dspark_xxh3__mix16(const uint8_t *p, const uint8_t *k)
{
    return dspark_xxh3__mulfold(dspark_xxh3__rd64(p) ^ dspark_xxh3__rd64(k),
                                dspark_xxh3__rd64(p + 8) ^ dspark_xxh3__rd64(k + 8));
}

/* ---- 0 to 240 bytes: closed forms, no state ---- */

static inline uint64_t dspark_xxh3__short(const uint8_t *p, size_t n)
{
    const uint8_t *k = dspark_xxh3_secret;
    if (n <= 16) {
        if (n > 8) {
            uint64_t lo = (dspark_xxh3__rd64(k + 24) ^ dspark_xxh3__rd64(k + 32)) ^ dspark_xxh3__rd64(p);
            uint64_t hi = (dspark_xxh3__rd64(k + 40) ^ dspark_xxh3__rd64(k + 48)) ^ dspark_xxh3__rd64(p + n - 8);
            return dspark_xxh3__avalanche(n + __builtin_bswap64(lo) + hi + dspark_xxh3__mulfold(lo, hi));
        }
        if (n >= 4) {
            uint64_t v = (dspark_xxh3__rd64(k + 8) ^ dspark_xxh3__rd64(k + 16))
                         ^ ((uint64_t)dspark_xxh3__rd32(p + n - 4) | ((uint64_t)dspark_xxh3__rd32(p) << 32));
            v ^= ((v << 49) | (v >> 15)) ^ ((v << 24) | (v >> 40));
            v *= DSPARK_XXH3_PMX_2;
            v ^= (v >> 35) + n;
            v *= DSPARK_XXH3_PMX_2;
            return v ^ (v >> 28);
        }
        if (n > 0) {
            uint32_t c = (uint32_t)p[n - 1] | ((uint32_t)n << 8) | ((uint32_t)p[0] << 16)
                         | ((uint32_t)p[n >> 1] << 24);
            return dspark_xxh3__avalanche64((uint64_t)(dspark_xxh3__rd32(k) ^ dspark_xxh3__rd32(k + 4)) ^ c);
        }
        return dspark_xxh3__avalanche64(dspark_xxh3__rd64(k + 56) ^ dspark_xxh3__rd64(k + 64));
    }
    uint64_t acc = (uint64_t)n * DSPARK_XXH3_P64_1;
    if (n <= 128) { /* pairs of 16-byte chunks from both ends, innermost pair first */
        for (int i = (int)((n - 1) >> 5); i >= 0; i--) {
            acc += dspark_xxh3__mix16(p + 16 * i, k + 32 * i);
            acc += dspark_xxh3__mix16(p + n - 16 - 16 * i, k + 32 * i + 16);
        }
        return dspark_xxh3__avalanche(acc);
    }
    for (size_t i = 0; i < 8; i++)
        acc += dspark_xxh3__mix16(p + 16 * i, k + 16 * i);
    acc = dspark_xxh3__avalanche(acc);
    for (size_t i = 8; i < n / 16; i++)
        acc += dspark_xxh3__mix16(p + 16 * i, k + 16 * (i - 8) + 3);
    acc += dspark_xxh3__mix16(p + n - 16, k + 119);
    return dspark_xxh3__avalanche(acc);
}

/* ---- > 240 bytes: the stripe loop ----
 * Each version has the same contract: accumulate `count` stripes from p into acc, continuing a
 * block that already holds *nstripes stripes, scrambling whenever a block fills (right, because
 * callers only pass stripes that later input follows). acc stays in registers for the run. */

/* Prefetch this far ahead of the stripe being read (into L1, ahead of the loads). Against none
 * (bench/xxh3.py --also=-DDSPARK_XXH3_PREFETCH=0, Ice Lake, paired rounds): from DRAM +5% (AVX-512)
 * to +20% (scalar); L2-hot +20-40% AVX2, +5% scalar, AVX-512 and SSE2 within noise (+-5%), never
 * a clear loss. 0 compiles it out. Addresses past the input are harmless: prefetches never fault,
 * and the address is formed as an integer, so there is no out-of-bounds pointer arithmetic. */
#ifndef DSPARK_XXH3_PREFETCH
#define DSPARK_XXH3_PREFETCH 384
#endif
#if DSPARK_XXH3_PREFETCH
#define DSPARK_XXH3__PREFETCH(p) __builtin_prefetch((const void *)((uintptr_t)(p) + DSPARK_XXH3_PREFETCH))
#else
#define DSPARK_XXH3__PREFETCH(p) ((void)0)
#endif

/* Each stripe loop notes its path in test builds, so tests can see that dispatch reached the
 * loop it pinned (every path gives the same hash, so hashes alone cannot tell). */
#ifdef DSPARK_XXH3_TESTING
static int dspark_xxh3__ran = -1;
#define DSPARK_XXH3__RAN(path) (dspark_xxh3__ran = (path))
#else
#define DSPARK_XXH3__RAN(path) ((void)0)
#endif

static inline void dspark_xxh3__stripe_scalar(uint64_t *acc, const uint8_t *p, const uint8_t *k)
{
    for (int i = 0; i < 8; i++) {
        uint64_t d = dspark_xxh3__rd64(p + 8 * i);
        uint64_t v = d ^ dspark_xxh3__rd64(k + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (v & 0xFFFFFFFFu) * (v >> 32);
    }
}

static inline void dspark_xxh3__run_scalar(uint64_t *acc_io, uint32_t *nstripes, const uint8_t *p, size_t count)
{
    DSPARK_XXH3__RAN(0);
    uint64_t acc[8];
    memcpy(acc, acc_io, sizeof acc);
    const uint8_t *ks = dspark_xxh3_secret + 128;
    size_t n = *nstripes;
    while (count) {
        size_t take = DSPARK_XXH3_BLOCK_STRIPES - n < count ? DSPARK_XXH3_BLOCK_STRIPES - n : count;
        for (size_t i = 0; i < take; i++) {
            DSPARK_XXH3__PREFETCH(p + 64 * i);
            dspark_xxh3__stripe_scalar(acc, p + 64 * i, dspark_xxh3_secret + 8 * (n + i));
        }
        p += 64 * take, count -= take, n += take;
        if (n == DSPARK_XXH3_BLOCK_STRIPES) {
            for (int i = 0; i < 8; i++) {
                uint64_t a = acc[i] ^ (acc[i] >> 47) ^ dspark_xxh3__rd64(ks + 8 * i);
                acc[i] = a * DSPARK_XXH3_P32_1;
            }
            n = 0;
        }
    }
    memcpy(acc_io, acc, sizeof acc);
    *nstripes = (uint32_t)n;
}

#if DSPARK_XXH3_X86
/* SSE2: two lanes per register. _mm_mul_epu32 multiplies the low 32-bit halves of each 64-bit
 * lane, so lo*hi is v times v >> 32; the lane-pair swap (i ^ 1) of the raw input is a 64-bit
 * shuffle within the register. The 64x32 scramble multiply is two 32x32 products (the high one
 * shifted up) since SSE2 has no 64-bit multiply. */
__attribute__((target("sse2"))) static inline void dspark_xxh3__run_sse2(uint64_t *acc_io, uint32_t *nstripes,
                                                                  const uint8_t *p, size_t count)
{
    DSPARK_XXH3__RAN(1);
    __m128i a[4];
    for (int j = 0; j < 4; j++)
        a[j] = _mm_loadu_si128((const __m128i *)(acc_io + 2 * j));
    const __m128i prime = _mm_set1_epi32((int)DSPARK_XXH3_P32_1);
    size_t n = *nstripes;
    while (count) {
        size_t take = DSPARK_XXH3_BLOCK_STRIPES - n < count ? DSPARK_XXH3_BLOCK_STRIPES - n : count;
        const uint8_t *k = dspark_xxh3_secret + 8 * n;
        for (const uint8_t *end = k + 8 * take; k != end; p += 64, k += 8) {
            DSPARK_XXH3__PREFETCH(p);
            for (int j = 0; j < 4; j++) {
                __m128i d = _mm_loadu_si128((const __m128i *)(p + 16 * j));
                __m128i v = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(k + 16 * j)));
                __m128i prod = _mm_mul_epu32(v, _mm_srli_epi64(v, 32));
                a[j] = _mm_add_epi64(a[j], _mm_add_epi64(prod, _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
            }
        }
        count -= take, n += take;
        if (n == DSPARK_XXH3_BLOCK_STRIPES) {
            for (int j = 0; j < 4; j++) {
                __m128i x = _mm_xor_si128(a[j], _mm_srli_epi64(a[j], 47));
                x = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)(dspark_xxh3_secret + 128 + 16 * j)));
                __m128i lo = _mm_mul_epu32(x, prime);
                __m128i hi = _mm_mul_epu32(_mm_srli_epi64(x, 32), prime);
                a[j] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
            }
            n = 0;
        }
    }
    for (int j = 0; j < 4; j++)
        _mm_storeu_si128((__m128i *)(acc_io + 2 * j), a[j]);
    *nstripes = (uint32_t)n;
}

/* AVX2: the same arithmetic, four lanes per register, a stripe in two registers. */
#define DSPARK_XXH3__AVX2 __attribute__((target("avx2"))) static inline

DSPARK_XXH3__AVX2 __m256i dspark_xxh3__avx2_lanes(__m256i acc, __m256i d, const uint8_t *k)
{
    __m256i v = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)k));
    __m256i prod = _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32));
    return _mm256_add_epi64(acc, _mm256_add_epi64(prod, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
}

DSPARK_XXH3__AVX2 __m256i dspark_xxh3__avx2_scramble(__m256i acc, const uint8_t *k)
{
    const __m256i prime = _mm256_set1_epi32((int)DSPARK_XXH3_P32_1);
    __m256i x = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    x = _mm256_xor_si256(x, _mm256_loadu_si256((const __m256i *)k));
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
    return _mm256_add_epi64(_mm256_mul_epu32(x, prime), _mm256_slli_epi64(hi, 32));
}

DSPARK_XXH3__AVX2 void dspark_xxh3__run_avx2(uint64_t *acc_io, uint32_t *nstripes, const uint8_t *p, size_t count)
{
    DSPARK_XXH3__RAN(2);
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc_io);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc_io + 4));
    size_t n = *nstripes;
    while (count) {
        size_t take = DSPARK_XXH3_BLOCK_STRIPES - n < count ? DSPARK_XXH3_BLOCK_STRIPES - n : count;
        const uint8_t *k = dspark_xxh3_secret + 8 * n;
        for (const uint8_t *end = k + 8 * take; k != end; p += 64, k += 8) {
            DSPARK_XXH3__PREFETCH(p);
            a0 = dspark_xxh3__avx2_lanes(a0, _mm256_loadu_si256((const __m256i *)p), k);
            a1 = dspark_xxh3__avx2_lanes(a1, _mm256_loadu_si256((const __m256i *)(p + 32)), k + 32);
        }
        count -= take, n += take;
        if (n == DSPARK_XXH3_BLOCK_STRIPES) {
            a0 = dspark_xxh3__avx2_scramble(a0, dspark_xxh3_secret + 128);
            a1 = dspark_xxh3__avx2_scramble(a1, dspark_xxh3_secret + 160);
            n = 0;
        }
    }
    _mm256_storeu_si256((__m256i *)acc_io, a0);
    _mm256_storeu_si256((__m256i *)(acc_io + 4), a1);
    *nstripes = (uint32_t)n;
}
#undef DSPARK_XXH3__AVX2

/* AVX-512F: all 8 accumulators in one register, a stripe in one load. The pair swap stays within
 * 128-bit lanes, so the same 32-bit shuffle does it (_MM_PERM_BADC is _MM_SHUFFLE(1, 0, 3, 2)).
 * The scramble multiplies in 32-bit halves as SSE2 does: a 64-bit multiply would need AVX512DQ. */
#define DSPARK_XXH3__AVX512 __attribute__((target("avx512f"))) static inline

DSPARK_XXH3__AVX512 __m512i dspark_xxh3__avx512_stripe(__m512i acc, const uint8_t *p, const uint8_t *k)
{
    DSPARK_XXH3__PREFETCH(p);
    __m512i d = _mm512_loadu_si512(p);
    __m512i v = _mm512_xor_si512(d, _mm512_loadu_si512(k));
    __m512i prod = _mm512_mul_epu32(v, _mm512_srli_epi64(v, 32));
    return _mm512_add_epi64(acc, _mm512_add_epi64(prod, _mm512_shuffle_epi32(d, _MM_PERM_BADC)));
}

DSPARK_XXH3__AVX512 void dspark_xxh3__run_avx512(uint64_t *acc_io, uint32_t *nstripes, const uint8_t *p,
                                               size_t count)
{
    DSPARK_XXH3__RAN(3);
    const __m512i prime = _mm512_set1_epi32((int)DSPARK_XXH3_P32_1);
    __m512i a = _mm512_loadu_si512(acc_io);
    size_t n = *nstripes;
    while (count) {
        if (n == 0 && count >= DSPARK_XXH3_BLOCK_STRIPES) {
            /* A whole block, unrolled: at constant offsets the compiler turns the secret reads
             * into aligned constants, where 64-byte reads at 8-byte steps mostly straddle two
             * cache lines; ~1.5x on L2-hot input. (Unrolling the AVX2 loop made it slower.) */
#pragma GCC unroll 16
            for (int i = 0; i < DSPARK_XXH3_BLOCK_STRIPES; i++)
                a = dspark_xxh3__avx512_stripe(a, p + 64 * i, dspark_xxh3_secret + 8 * i);
            p += 64 * DSPARK_XXH3_BLOCK_STRIPES, count -= DSPARK_XXH3_BLOCK_STRIPES;
            n = DSPARK_XXH3_BLOCK_STRIPES;
        } else {
            a = dspark_xxh3__avx512_stripe(a, p, dspark_xxh3_secret + 8 * n);
            p += 64, count--, n++;
        }
        if (n == DSPARK_XXH3_BLOCK_STRIPES) {
            __m512i x = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
            x = _mm512_xor_si512(x, _mm512_loadu_si512(dspark_xxh3_secret + 128));
            __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime);
            a = _mm512_add_epi64(_mm512_mul_epu32(x, prime), _mm512_slli_epi64(hi, 32));
            n = 0;
        }
    }
    _mm512_storeu_si512(acc_io, a);
    *nstripes = (uint32_t)n;
}
#undef DSPARK_XXH3__AVX512
#endif /* DSPARK_XXH3_X86 */

/* 0 scalar, 1 SSE2, 2 AVX2, 3 AVX-512; -1 until detected. Detected once; relaxed atomics because
 * fillers on several threads may race to the first call (they all store the same value).
 * __builtin_cpu_supports also requires the OS to save the wider registers (XCR0). */
static int dspark_xxh3__path_cache = -1;

static inline int dspark_xxh3_path(void)
{
    int path = __atomic_load_n(&dspark_xxh3__path_cache, __ATOMIC_RELAXED);
    if (path < 0) {
#if DSPARK_XXH3_X86
        __builtin_cpu_init();
        path = __builtin_cpu_supports("avx512f") ? 3
             : __builtin_cpu_supports("avx2")    ? 2
             : __builtin_cpu_supports("sse2")    ? 1
                                                 : 0;
#else
        path = 0;
#endif
        __atomic_store_n(&dspark_xxh3__path_cache, path, __ATOMIC_RELAXED);
    }
    return path;
}

#ifdef DSPARK_XXH3_TESTING
/* Tests and benchmarks only: pin a path, -1 to detect again. A path the CPU lacks faults;
 * off x86 every path is the scalar one. */
static inline void dspark_xxh3_set_path(int path)
{
    __atomic_store_n(&dspark_xxh3__path_cache, path, __ATOMIC_RELAXED);
}
#endif

static inline void dspark_xxh3__run(uint64_t *acc, uint32_t *nstripes, const uint8_t *p, size_t count)
{
#if DSPARK_XXH3_X86
    switch (dspark_xxh3_path()) {
    case 3: dspark_xxh3__run_avx512(acc, nstripes, p, count); return;
    case 2: dspark_xxh3__run_avx2(acc, nstripes, p, count); return;
    case 1: dspark_xxh3__run_sse2(acc, nstripes, p, count); return;
    default: break;
    }
#endif
    dspark_xxh3__run_scalar(acc, nstripes, p, count);
}

static inline void dspark_xxh3__acc_init(uint64_t *acc)
{
    static const uint64_t init[8] = {DSPARK_XXH3_P32_3, DSPARK_XXH3_P64_1, DSPARK_XXH3_P64_2, DSPARK_XXH3_P64_3,
                                     DSPARK_XXH3_P64_4, DSPARK_XXH3_P32_2, DSPARK_XXH3_P64_5, DSPARK_XXH3_P32_1};
    memcpy(acc, init, sizeof init);
}

/* Final stripe (the input's last 64 bytes, at its own secret offset) and the merge. */
static inline uint64_t dspark_xxh3__finish(uint64_t *acc, const uint8_t *last, uint64_t total)
{
    dspark_xxh3__stripe_scalar(acc, last, dspark_xxh3_secret + 192 - 71);
    uint64_t h = total * DSPARK_XXH3_P64_1;
    for (int i = 0; i < 4; i++)
        h += dspark_xxh3__mulfold(acc[2 * i] ^ dspark_xxh3__rd64(dspark_xxh3_secret + 11 + 16 * i),
                                  acc[2 * i + 1] ^ dspark_xxh3__rd64(dspark_xxh3_secret + 19 + 16 * i));
    return dspark_xxh3__avalanche(h);
}

static inline uint64_t dspark_xxh3_64(const uint8_t *p, size_t n)
{
    if (n <= 240)
        return dspark_xxh3__short(p, n);
    uint64_t acc[8];
    uint32_t nstripes = 0;
    dspark_xxh3__acc_init(acc);
    dspark_xxh3__run(acc, &nstripes, p, (n - 1) / 64); /* every stripe but the last */
    return dspark_xxh3__finish(acc, p + n - 64, n);
}

static inline void dspark_xxh3_reset(dspark_xxh3 *s)
{
    dspark_xxh3__acc_init(s->acc);
    s->total = 0;
    s->buf_len = 0;
    s->nstripes = 0;
}

static inline void dspark_xxh3_update(dspark_xxh3 *s, const uint8_t *p, size_t n)
{
    uint8_t *buf = s->mem + DSPARK_XXH3_STRIPE;
    if (n == 0)
        return;
    s->total += n;
    if (n <= DSPARK_XXH3_BUF - s->buf_len) { /* it fits: keep it, a later byte may not come */
        memcpy(buf + s->buf_len, p, n);
        s->buf_len += (uint32_t)n;
        return;
    }
    /* Bytes beyond the buffer exist, so everything buffered, and all of p's whole stripes but
     * the last 1..64 bytes, can be accumulated now. */
    const uint8_t *last = NULL; /* the last stripe accumulated here */
    if (s->buf_len) {
        size_t fill = DSPARK_XXH3_BUF - s->buf_len;
        memcpy(buf + s->buf_len, p, fill);
        p += fill, n -= fill;
        dspark_xxh3__run(s->acc, &s->nstripes, buf, DSPARK_XXH3_BUF / 64);
        last = buf + DSPARK_XXH3_BUF - 64;
    }
    if (n > 64) { /* straight from the caller's memory: no copy */
        size_t k = (n - 1) / 64;
        dspark_xxh3__run(s->acc, &s->nstripes, p, k);
        last = p + 64 * (k - 1);
        p += 64 * k, n -= 64 * k;
    }
    memcpy(s->mem, last, 64); /* history for a final stripe that reaches back */
    memcpy(buf, p, n);
    s->buf_len = (uint32_t)n;
}

static inline uint64_t dspark_xxh3_digest(const dspark_xxh3 *s)
{
    const uint8_t *buf = s->mem + DSPARK_XXH3_STRIPE;
    if (s->total <= 240) /* nothing consumed yet: all of it is in buf */
        return dspark_xxh3__short(buf, (size_t)s->total);
    /* Work on copies so the state can keep growing after a digest. buf_len >= 1 here. */
    uint64_t acc[8];
    uint32_t nstripes = s->nstripes;
    memcpy(acc, s->acc, sizeof acc);
    dspark_xxh3__run(acc, &nstripes, buf, (s->buf_len - 1) / 64);
    return dspark_xxh3__finish(acc, buf + s->buf_len - 64, s->total);
}

#endif /* DSPARK_XXH3_H */
