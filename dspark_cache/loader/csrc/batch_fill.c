/*
 * Fills one batch of the loader in a single call without the GIL: zero the stale pad slots,
 * read every sample's payload straight into its batch row, copy the final-state columns out of
 * each chunk while it is still in the CPU cache, widen token ids and masks to int64, and fill
 * the pads of the per-token fields, and hash each byte as it is read where the sample's checksum
 * is to be checked (the first time a process reads it, or every time with verify="always":
 * dspark_cache/loader/verify.py decides). The hash is our own xxh3-64 (format/csrc/xxh3.h): one pass over
 * each chunk while it is still in the CPU cache, instead of a second read of the file.
 *
 * The work comes as a small "program" built in Python (dspark_cache/loader/program.py; loader/fill.py also
 * runs the same program in pure Python when this library is not built):
 *
 *   ops  op_t[n_ops]       {kind, target, offset, count, value, seg_first, seg_count, check}
 *                          ZERO 1: count bytes at offset of buffer target
 *                          FILL_I64 2: value into count int64 slots at offset of buffer target
 *                          SAMPLE 3: the count-byte payload at file offset of fd target,
 *                          through segments seg_first .. seg_first + seg_count; with check 1
 *                          its xxh3-64 must be value, else RC_CHECKSUM
 *                          SAMPLE_MEM 4: as SAMPLE, the payload being the count bytes at offset of
 *                          buffer target (a compressed sample decoded by the reader thread)
 *   segs segment_t[n]      {kind, src_off, len, buf, off, row_bytes, col_off, col_bytes, col_buf, col_dst,
 *                           scale_buf, scale_off, group, out_size, fp8_kind, limit, pick_first, pick_count}
 *                          kinds: COPY 1, COPY_COLS 2 (COPY + columns of each row to col_buf),
 *                          WIDEN_I32 3 and WIDEN_U8 4 (to int64 at buf+off, each value then in
 *                          [0, limit) unless limit is 0, else RC_BAD_TOKEN), DEQUANT 5 (float8
 *                          rows of row_bytes, one float32 scale per group bytes at
 *                          scale_buf+scale_off, to bf16 (out_size 2) or float32 (4) at buf+off;
 *                          col_* as COPY_COLS, in output bytes), PICK 6 (rows of row_bytes through
 *                          scratch, then picks)
 *   picks pick_t[n]        {src, len, to_col, dst, stride}: with pick_count > 0 (PICK, DEQUANT),
 *                          only these ranges of each stored row are handed out: len bytes (DEQUANT:
 *                          codes, whole groups) at src of the row, to dst of row r at buf+off
 *                          (to_col 0) or col_buf+col_dst (to_col 1) + r * stride: a layer subset
 *
 * All are arrays of uint64 fields; dspark_cache/loader/records.py names the same fields in the
 * same order (numpy structured dtypes OP, SEGMENT and PICK), so the two sides share one layout.
 *
 * Segments of a sample are in file order; payload bytes outside every segment (the JSON header,
 * alignment fill) are read into the scratch buffer and dropped (so a truncated payload is still
 * a short read). Every write is checked against its buffer's size, so a wrong program fails with
 * an error instead of corrupting memory.
 *
 * Why C: in Python each 1 MiB chunk cost several GIL hand-overs (read, copy), and a
 * training loop's main thread holding the GIL stalled every reader thread at each of them.
 *
 * FP8 (DEQUANT): a chunk of whole float8 rows is read into scratch and converted while it is in
 * the CPU cache, block by block, into the batch row (and the final-state columns): no second
 * pass over memory. A code's float32 value is built from its bits exactly (no arithmetic on
 * subnormals, so a flush-to-zero mode cannot change it), multiplied by its scale (one IEEE
 * rounding) and, for bf16, rounded to nearest even: bit for bit what loader/fill.py's numpy
 * and format/sample.py's dequantize_rows compute. The FP8 rule (format/sample.py's fp8_bad_scales
 * and fp8_bad_codes): a scale is positive with scale * the format's largest value below 0x1.ffp127
 * (the least float32 that rounds to inf as bf16), else RC_BAD_SCALE; no code is a NaN/inf code,
 * else RC_BAD_CODE; the row in *detail either way, a scale checked before the codes it scales.
 *
 * Tokens (WIDEN): the token rule (format/validate.py's token_problem: ids in [0, vocab_size), loss
 * mask values 0 or 1) as limits set by loader/segments.py. An id outside the target's vocabulary
 * would become a device-side assert in training's embedding lookup, naming no file; here it is
 * RC_BAD_TOKEN with the token in *detail, after every value was written, so the reader can name
 * the sample by the Python rule from the batch buffer.
 *
 * A checked sample that breaks one of these rules is read (and hashed) to its end first: if its
 * checksum fails too, the bytes are damaged and RC_CHECKSUM says so.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include <Python.h>

#include "../../format/csrc/xxh3.h"

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#include <immintrin.h>
#define DSPARK_STREAM 1
#endif

enum { OP_ZERO = 1, OP_FILL_I64 = 2, OP_SAMPLE = 3, OP_SAMPLE_MEM = 4 };
enum { SEG_COPY = 1, SEG_COPY_COLS = 2, SEG_WIDEN_I32 = 3, SEG_WIDEN_U8 = 4, SEG_DEQUANT = 5, SEG_PICK = 6 };
enum { RC_OK = 0, RC_SHORT_READ = 1, RC_CHECKSUM = 2, RC_INVALID = 3, RC_READ_ERROR = 4, RC_BAD_SCALE = 5,
       RC_BAD_CODE = 6, RC_BAD_TOKEN = 7 };
enum { FP8_E4M3 = 1, FP8_E5M2 = 2 };

/* records.py's OP: one op of the program. */
typedef struct {
    uint64_t kind, target, offset, count, value, seg_first, seg_count, check;
} op_t;

/* records.py's SEGMENT: where a byte range of a sample's payload goes. */
typedef struct {
    uint64_t kind, src_off, len, buf, off, row_bytes, col_off, col_bytes, col_buf, col_dst, scale_buf, scale_off, group, out_size, fp8_kind, limit, pick_first, pick_count;
} segment_t;

/* records.py's PICK: a range of every stored row that is handed out. */
typedef struct {
    uint64_t src, len, to_col, dst, stride;
} pick_t;

_Static_assert(sizeof(op_t) == 64 && sizeof(segment_t) == 144 && sizeof(pick_t) == 40,
               "records.py's OP, SEGMENT and PICK layouts");

typedef struct {
    const uint64_t *bases, *sizes;
    uint64_t n_bufs;
    const pick_t *picks;
    uint64_t n_picks;
    uint8_t *scratch;
    uint64_t scratch_size, chunk;
} context;

/* One payload being read, in file order: pos bytes of it so far, each hashed when hash is set;
 * from mem (its bounds checked once) instead of the file when mem is set. */
typedef struct {
    const context *cx;
    int fd;
    uint64_t base, pos;
    dspark_xxh3 *hash;
    const uint8_t *mem;
} reading;

/* Batch memory is written once and read later by training (or a DMA engine): stores that
 * bypass the cache skip reading each destination line from DRAM first. */
static void store_stream(uint8_t *dst, const uint8_t *src, size_t n) {
#ifdef DSPARK_STREAM
    if (n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15, i = 0;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void zero_stream(uint8_t *dst, size_t n) {
#ifdef DSPARK_STREAM
    if (n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15, i = 0;
        const __m128i z = _mm_setzero_si128();
        memset(dst, 0, head);
        dst += head, n -= head;
        for (; i + 64 <= n; i += 64) {
            _mm_stream_si128((__m128i *)(dst + i), z);
            _mm_stream_si128((__m128i *)(dst + i + 16), z);
            _mm_stream_si128((__m128i *)(dst + i + 32), z);
            _mm_stream_si128((__m128i *)(dst + i + 48), z);
        }
        memset(dst + i, 0, n - i);
        return;
    }
#endif
    memset(dst, 0, n);
}

/* The address of bytes [off, off + n) of buffer buf, or NULL when they are not all inside it. */
static uint8_t *span(const context *cx, uint64_t buf, uint64_t off, uint64_t n) {
    if (buf >= cx->n_bufs || off > cx->sizes[buf] || n > cx->sizes[buf] - off) return NULL;
    return (uint8_t *)(uintptr_t)cx->bases[buf] + off;
}

/* span() of count items of size bytes; NULL also when count * size does not fit 64 bits. */
static uint8_t *span_of(const context *cx, uint64_t buf, uint64_t off, uint64_t count, uint64_t size) {
    uint64_t n;
    return __builtin_mul_overflow(count, size, &n) ? NULL : span(cx, buf, off, n);
}

/* Reads the next n bytes of the payload into dst (and the hash, while they are in the cache);
 * RC_SHORT_READ at end of file, RC_READ_ERROR with errno in *detail. */
static int read_exact(reading *rd, uint8_t *dst, uint64_t n, uint64_t *detail) {
    uint64_t done = 0;
    int rc = RC_OK;
    if (rd->mem) memcpy(dst, rd->mem + rd->pos, (size_t)n), done = n;
    while (done < n) {
        ssize_t r = pread(rd->fd, dst + done, (size_t)(n - done), (off_t)(rd->base + rd->pos + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            *detail = (uint64_t)errno;
            rc = RC_READ_ERROR;
            break;
        }
        if (r == 0) {
            rc = RC_SHORT_READ;
            break;
        }
        done += (uint64_t)r;
    }
    if (rd->hash) dspark_xxh3_update(rd->hash, dst, (size_t)done);
    rd->pos += done;
    return rc;
}

/* Bytes no tensor wants (header, alignment fill): read into scratch (and hashed) and dropped. */
static int read_gap(reading *rd, uint64_t end, uint64_t *detail) {
    const context *cx = rd->cx;
    if (rd->mem && !rd->hash && rd->pos < end) rd->pos = end; /* in memory: nothing to read through */
    while (rd->pos < end) {
        uint64_t n = end - rd->pos < cx->chunk ? end - rd->pos : cx->chunk;
        int rc = read_exact(rd, cx->scratch, n, detail);
        if (rc) return rc;
    }
    return RC_OK;
}

/* Where row 0 of pick p of segment g goes (checked by segment_picks). */
static uint8_t *pick_dst(const context *cx, const segment_t *g, const pick_t *p) {
    uint64_t buf = p->to_col ? g->col_buf : g->buf, off = p->to_col ? g->col_dst : g->off;
    return (uint8_t *)(uintptr_t)cx->bases[buf] + off + p->dst;
}

/* The segment's picks, each checked to lie inside its stored row and, for all rows, inside its
 * destination buffer (out: output bytes per stored unit of a pick); NULL when one does not. */
static const pick_t *segment_picks(const context *cx, const segment_t *g, uint64_t rows, uint64_t out) {
    if (g->pick_first > cx->n_picks || g->pick_count > cx->n_picks - g->pick_first) return NULL;
    const pick_t *picks = cx->picks + g->pick_first;
    for (uint64_t i = 0; i < g->pick_count; i++) {
        const pick_t *p = picks + i;
        if (p->to_col > 1 || p->src > g->row_bytes || p->len > g->row_bytes - p->src || !p->stride ||
            p->len > UINT64_MAX / out || p->dst > p->stride || p->len * out > p->stride - p->dst ||
            (rows && p->stride > UINT64_MAX / rows))
            return NULL;
        if (!(p->to_col ? span(cx, g->col_buf, g->col_dst, rows * p->stride) : span(cx, g->buf, g->off, rows * p->stride)))
            return NULL;
    }
    return picks;
}

/* Rows through scratch, a chunk of whole rows at a time; each pick's columns to its place. */
static int read_picked(reading *rd, const segment_t *g, uint64_t *detail) {
    const context *cx = rd->cx;
    uint64_t row_bytes = g->row_bytes;
    if (!row_bytes || g->len % row_bytes || row_bytes > cx->scratch_size) return RC_INVALID;
    uint64_t rows = g->len / row_bytes;
    const pick_t *picks = segment_picks(cx, g, rows, 1);
    if (!picks) return RC_INVALID;
    uint64_t step = cx->chunk / row_bytes ? cx->chunk / row_bytes : 1;
    if (step * row_bytes > cx->scratch_size) step = cx->scratch_size / row_bytes;
    for (uint64_t first = 0; first < rows; first += step) {
        uint64_t n = rows - first < step ? rows - first : step;
        int rc = read_exact(rd, cx->scratch, n * row_bytes, detail);
        if (rc) return rc;
        for (uint64_t r = 0; r < n; r++) {
            const uint8_t *src = cx->scratch + r * row_bytes;
            for (uint64_t i = 0; i < g->pick_count; i++)
                store_stream(pick_dst(cx, g, picks + i) + (first + r) * picks[i].stride, src + picks[i].src,
                             (size_t)picks[i].len);
        }
    }
    return RC_OK;
}

static int read_rows(reading *rd, const segment_t *g, uint64_t *detail) {
    const context *cx = rd->cx;
    uint64_t len = g->len, row_bytes = g->row_bytes, col_off = g->col_off, col_bytes = g->col_bytes;
    uint8_t *dst = span(cx, g->buf, g->off, len);
    uint8_t *cols = NULL;
    if (!dst) return RC_INVALID;
    uint64_t step = cx->chunk;
    if (g->kind == SEG_COPY_COLS) {
        if (!row_bytes || len % row_bytes || col_off > row_bytes || col_bytes > row_bytes - col_off) return RC_INVALID;
        cols = span(cx, g->col_buf, g->col_dst, len / row_bytes * col_bytes);
        if (!cols) return RC_INVALID;
        step = cx->chunk / row_bytes * row_bytes; /* whole rows per chunk */
        if (!step) step = row_bytes;
    }
    for (uint64_t done = 0; done < len; done += step) {
        uint64_t n = len - done < step ? len - done : step;
        int rc = read_exact(rd, dst + done, n, detail);
        if (rc) return rc;
        if (cols) { /* still in cache from the read */
            for (uint64_t r = done / row_bytes, end = (done + n) / row_bytes; r < end; r++)
                store_stream(cols + r * col_bytes, dst + r * row_bytes + col_off, (size_t)col_bytes);
        }
    }
    return RC_OK;
}

static int read_widened(reading *rd, const segment_t *g, uint64_t *detail) {
    const context *cx = rd->cx;
    uint64_t len = g->len, width = g->kind == SEG_WIDEN_I32 ? 4 : 1, count = len / width;
    int64_t *dst = (int64_t *)span_of(cx, g->buf, g->off, count, 8);
    if (!dst || len % width || len > cx->scratch_size || ((uintptr_t)dst & 7)) return RC_INVALID;
    int rc = read_exact(rd, cx->scratch, len, detail);
    if (rc) return rc;
    if (width == 4) {
        for (uint64_t i = 0; i < count; i++) {
            int32_t v;
            memcpy(&v, cx->scratch + 4 * i, 4);
            dst[i] = v;
        }
    } else {
        for (uint64_t i = 0; i < count; i++) dst[i] = cx->scratch[i];
    }
    if (g->limit) { /* as unsigned, a negative id is past the limit too: one comparison a token */
        for (uint64_t i = 0; i < count; i++) {
            if ((uint64_t)dst[i] >= g->limit) {
                *detail = i;
                return RC_BAD_TOKEN;
            }
        }
    }
    return RC_OK;
}

/* ---- FP8 ----------------------------------------------------------------------------------- */

enum { DQ_BLOCK = 1024 }; /* elements converted into a stack block, then streamed out */

typedef struct {
    int mbits, bias; /* mantissa bits and exponent bias: e4m3fn 3/7, e5m2 2/15 */
    float max;       /* the largest finite value: 448, 57344 */
    uint8_t special; /* NaN/inf codes are those with (c & special) == special: 0x7F, 0x7C */
} fp8_format;

#define FP8_SCALE_LIMIT 0x1.ffp127f /* format/sample.py's FP8_SCALE_LIMIT */

static int fp8_format_of(uint64_t kind, fp8_format *f) {
    if (kind == FP8_E4M3) f->mbits = 3, f->bias = 7, f->max = 448.0f, f->special = 0x7F;
    else if (kind == FP8_E5M2) f->mbits = 2, f->bias = 15, f->max = 57344.0f, f->special = 0x7C;
    else return 0;
    return 1;
}

/* The float32 value of code c, exactly: a normal code's exponent and mantissa are moved into
 * place; a subnormal one is its mantissa (a small integer) times a power of two. */
static float fp8_value(uint8_t c, fp8_format f) {
    uint32_t e = (uint32_t)(c & 0x7F) >> f.mbits, m = c & ((1u << f.mbits) - 1), bits;
    float v;
    if (e) {
        bits = ((e + 127 - (uint32_t)f.bias) << 23) | (m << (23 - f.mbits));
        memcpy(&v, &bits, 4);
    } else {
        v = (float)m * (f.mbits == 3 ? 0x1p-9f : 0x1p-16f); /* 2^(1 - bias - mbits) */
    }
    return (c & 0x80) ? -v : v;
}

static inline uint16_t bf16_bits(float v) { /* round to nearest even, as torch */
    uint32_t b;
    memcpy(&b, &v, 4);
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

/* n codes times scale into out (bf16 or float32): the portable path, through a 256-entry table.
 * Returns nonzero when a code is a NaN/inf code. */
static int dequant_block_table(const float *table, const uint8_t *src, size_t n, float scale, int out_size,
                               uint8_t special, uint8_t *out) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad |= (src[i] & special) == special;
    if (out_size == 4) {
        float *o = (float *)out;
        for (size_t i = 0; i < n; i++) o[i] = table[src[i]] * scale;
    } else {
        uint16_t *o = (uint16_t *)out;
        for (size_t i = 0; i < n; i++) o[i] = bf16_bits(table[src[i]] * scale);
    }
    return bad;
}

#ifdef DSPARK_STREAM
/* The same on 8 lanes (AVX2), 16 codes per step; the tail goes through the table. */
__attribute__((target("avx2"))) static int dequant_block_avx2(const float *table, const uint8_t *src, size_t n,
                                                              float scale, int out_size, fp8_format f,
                                                              uint8_t *out) {
    const __m256i low7 = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32(0x80), zero = _mm256_setzero_si256();
    const __m256i mant = _mm256_set1_epi32((1 << f.mbits) - 1), expo = _mm256_set1_epi32(0x7F & ~((1 << f.mbits) - 1));
    const __m256i rebias = _mm256_set1_epi32((127 - f.bias) << 23), half = _mm256_set1_epi32(0x7FFF);
    const __m256i one = _mm256_set1_epi32(1);
    const __m256 sub = _mm256_set1_ps(f.mbits == 3 ? 0x1p-9f : 0x1p-16f), s = _mm256_set1_ps(scale);
    const __m128i special = _mm_set1_epi8((char)f.special);
    __m128i bad = _mm_setzero_si128();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(src + i));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi8(_mm_and_si128(raw, special), special));
        __m256 v[2];
        __m256i r[2];
        for (int h = 0; h < 2; h++) {
            __m256i c = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(raw, 8) : raw);
            __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(c, low7), 23 - f.mbits), rebias);
            __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, mant)), sub);
            __m256i is_tiny = _mm256_cmpeq_epi32(_mm256_and_si256(c, expo), zero);
            __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), tiny, _mm256_castsi256_ps(is_tiny));
            __m256 neg = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, sign), 24));
            v[h] = _mm256_mul_ps(_mm256_xor_ps(mag, neg), s);
            __m256i b = _mm256_castps_si256(v[h]);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one); /* round to nearest even */
            r[h] = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(half, odd)), 16);
        }
        if (out_size == 4) {
            _mm256_storeu_ps((float *)out + i, v[0]);
            _mm256_storeu_ps((float *)out + i + 8, v[1]);
        } else { /* pack the 16 halves in order: packus interleaves 128-bit lanes, the permute undoes it */
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), packed);
        }
    }
    int tail = dequant_block_table(table, src + i, n - i, scale, out_size, f.special, out + i * (size_t)out_size);
    return tail | (_mm_movemask_epi8(bad) != 0);
}
#endif

static int have_avx2(void) {
#ifdef DSPARK_STREAM
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

typedef struct {
    float table[256];
    fp8_format format;
    int avx2;
} dequantizer;

/* Nonzero when a code is a NaN/inf code (the block's output is then garbage, and never used). */
static int dequant_block(const dequantizer *d, const uint8_t *src, size_t n, float scale, int out_size,
                         uint8_t *out) {
#ifdef DSPARK_STREAM
    if (d->avx2) return dequant_block_avx2(d->table, src, n, scale, out_size, d->format, out);
#endif
    return dequant_block_table(d->table, src, n, scale, out_size, d->format.special, out);
}

/* Groups [g0, g0 + ng) of one stored row (codes src, their scales) into out, back to back; the
 * output bytes in [col_off, col_off + col_bytes) of out also to cols (NULL: none). */
static int dequant_groups(const dequantizer *d, const uint8_t *src, const uint8_t *scales, uint64_t g0, uint64_t ng,
                          uint64_t group, uint64_t out_size, uint8_t *out, uint8_t *cols, uint64_t col_off,
                          uint64_t col_bytes) {
    _Alignas(64) uint8_t block[DQ_BLOCK * 4];
    for (uint64_t k = g0; k < g0 + ng; k++) {
        float scale;
        memcpy(&scale, scales + 4 * k, 4);
        if (!(scale > 0.0f && scale * d->format.max < FP8_SCALE_LIMIT)) return RC_BAD_SCALE; /* NaN fails both */
        for (uint64_t done = 0; done < group; done += DQ_BLOCK) {
            uint64_t m = group - done < DQ_BLOCK ? group - done : DQ_BLOCK;
            uint64_t at = ((k - g0) * group + done) * out_size, end = at + m * out_size; /* bytes in out */
            if (dequant_block(d, src + k * group + done, (size_t)m, scale, (int)out_size, block)) return RC_BAD_CODE;
            store_stream(out + at, block, (size_t)(m * out_size));
            if (cols && at < col_off + col_bytes && end > col_off) { /* the part inside the columns */
                uint64_t lo = at > col_off ? at : col_off;
                uint64_t hi = end < col_off + col_bytes ? end : col_off + col_bytes;
                store_stream(cols + (lo - col_off), block + (lo - at), (size_t)(hi - lo));
            }
        }
    }
    return RC_OK;
}

/* Float8 rows -> bf16/float32 rows (and the final-state columns), chunk by chunk through scratch;
 * with picks, only the picked groups, each pick into its place. */
static int read_dequant(reading *rd, const segment_t *g, uint64_t *detail) {
    const context *cx = rd->cx;
    uint64_t len = g->len, in_row = g->row_bytes, group = g->group, out_size = g->out_size;
    dequantizer d;
    if (!fp8_format_of(g->fp8_kind, &d.format) || !in_row || !group || in_row % group || len % in_row ||
        (out_size != 2 && out_size != 4))
        return RC_INVALID;
    if (in_row > UINT64_MAX / 8) return RC_INVALID; /* so that in_row * out_size and groups * 4 fit */
    uint64_t rows = len / in_row, groups = in_row / group, out_row = in_row * out_size;
    const uint8_t *scale_bytes = span_of(cx, g->scale_buf, g->scale_off, rows, groups * 4); /* groups <= in_row */
    uint8_t *dst = NULL, *cols = NULL;
    const pick_t *picks = NULL;
    uint64_t col_off = g->col_off, col_bytes = g->col_bytes;
    if (!scale_bytes) return RC_INVALID;
    if (g->pick_count) {
        if (!(picks = segment_picks(cx, g, rows, out_size))) return RC_INVALID;
        for (uint64_t i = 0; i < g->pick_count; i++)
            if (picks[i].src % group || picks[i].len % group) return RC_INVALID;
    } else {
        if (!(dst = span_of(cx, g->buf, g->off, rows, out_row))) return RC_INVALID;
        if (col_bytes) {
            if (col_off > out_row || col_bytes > out_row - col_off) return RC_INVALID;
            if (!(cols = span_of(cx, g->col_buf, g->col_dst, rows, col_bytes))) return RC_INVALID;
        }
    }
    uint64_t step = cx->chunk / in_row ? cx->chunk / in_row : 1; /* whole rows per chunk */
    if (step * in_row > cx->scratch_size) return RC_INVALID;
    for (int c = 0; c < 256; c++) d.table[c] = fp8_value((uint8_t)c, d.format);
    d.avx2 = have_avx2();
    for (uint64_t first = 0; first < rows; first += step) {
        uint64_t n = rows - first < step ? rows - first : step;
        int rc = read_exact(rd, cx->scratch, n * in_row, detail);
        if (rc) return rc;
        for (uint64_t r = first; r < first + n; r++) {
            const uint8_t *src = cx->scratch + (r - first) * in_row, *scales = scale_bytes + 4 * r * groups;
            if (picks) {
                for (uint64_t i = 0; i < g->pick_count && !rc; i++)
                    rc = dequant_groups(&d, src, scales, picks[i].src / group, picks[i].len / group, group, out_size,
                                        pick_dst(cx, g, picks + i) + r * picks[i].stride, NULL, 0, 0);
            } else {
                rc = dequant_groups(&d, src, scales, 0, groups, group, out_size, dst + r * out_row,
                                    cols ? cols + r * col_bytes : NULL, col_off, col_bytes);
            }
            if (rc) {
                *detail = r;
                return rc;
            }
        }
    }
    return RC_OK;
}

static int is_rule(int rc) { return rc == RC_BAD_SCALE || rc == RC_BAD_CODE || rc == RC_BAD_TOKEN; }

static int run_sample(const context *cx, const op_t *op, const segment_t *segs, uint64_t n_segs,
                      uint64_t *detail) {
    dspark_xxh3 hash;
    reading rd = {cx, (int)op->target, op->offset, 0, op->check ? &hash : NULL, NULL};
    uint64_t size = op->count, first = op->seg_first, count = op->seg_count;
    if (op->kind == OP_SAMPLE_MEM) { /* every read lies inside the payload, so inside the buffer */
        if (!(rd.mem = span(cx, op->target, op->offset, size))) return RC_INVALID;
        rd.fd = -1, rd.base = 0;
    } else if (op->target > INT32_MAX || op->offset > (uint64_t)INT64_MAX - size)
        return RC_INVALID;
    if (first > n_segs || count > n_segs - first || op->check > 1) return RC_INVALID;
    if (rd.hash) dspark_xxh3_reset(rd.hash);
    int rc = RC_OK;
    for (uint64_t s = first; s < first + count && !rc; s++) {
        const segment_t *g = segs + s;
        if (g->src_off < rd.pos || g->src_off > size || g->len > size - g->src_off) return RC_INVALID;
        if (g->pick_count && g->kind != SEG_PICK && g->kind != SEG_DEQUANT) return RC_INVALID;
        rc = read_gap(&rd, g->src_off, detail);
        if (rc) break;
        switch (g->kind) {
        case SEG_COPY:
        case SEG_COPY_COLS: rc = read_rows(&rd, g, detail); break;
        case SEG_PICK: rc = read_picked(&rd, g, detail); break;
        case SEG_WIDEN_I32:
        case SEG_WIDEN_U8: rc = read_widened(&rd, g, detail); break;
        case SEG_DEQUANT: rc = read_dequant(&rd, g, detail); break;
        default: return RC_INVALID;
        }
    }
    if (rd.hash && is_rule(rc)) { /* damaged bytes are named as such, not by the rule they happen to break */
        uint64_t rule_detail = *detail;
        int tail = read_gap(&rd, size, detail);
        if (tail == RC_SHORT_READ) *detail = rd.pos;
        if (tail) return tail;
        if (dspark_xxh3_digest(rd.hash) != op->value) return (*detail = 0, RC_CHECKSUM);
        *detail = rule_detail;
        return rc;
    }
    if (!rc) rc = read_gap(&rd, size, detail);
    if (rc == RC_SHORT_READ) *detail = rd.pos;
    if (!rc && rd.hash && dspark_xxh3_digest(rd.hash) != op->value) rc = RC_CHECKSUM, *detail = 0;
    return rc;
}

/* Runs the ops in order; on failure returns its code, the op's index in *fail_op and, for a
 * short read the payload bytes read, for a read error the errno, for a bad scale, code or token
 * its row (token), in *detail. */
int dspark_fill_batch(const op_t *ops, uint64_t n_ops, const segment_t *segs, uint64_t n_segs, const pick_t *picks,
                      uint64_t n_picks, const uint64_t *bases, const uint64_t *sizes, uint64_t n_bufs,
                      uint8_t *scratch, uint64_t scratch_size, uint64_t chunk, uint64_t *fail_op, uint64_t *detail) {
    context cx = {bases, sizes, n_bufs, picks, n_picks, scratch, scratch_size,
                  chunk < scratch_size ? chunk : scratch_size};
    int rc = RC_OK;
    uint64_t i = 0;
    if (!cx.chunk) return RC_INVALID;
    for (; i < n_ops && !rc; i++) {
        const op_t *op = ops + i;
        uint8_t *dst;
        switch (op->kind) {
        case OP_ZERO:
            if (!(dst = span(&cx, op->target, op->offset, op->count))) rc = RC_INVALID;
            else zero_stream(dst, (size_t)op->count);
            break;
        case OP_FILL_I64:
            if (op->count > UINT64_MAX / 8 || !(dst = span(&cx, op->target, op->offset, op->count * 8)) ||
                ((uintptr_t)dst & 7))
                rc = RC_INVALID;
            else for (uint64_t k = 0; k < op->count; k++) ((int64_t *)dst)[k] = (int64_t)op->value;
            break;
        case OP_SAMPLE:
        case OP_SAMPLE_MEM: rc = run_sample(&cx, op, segs, n_segs, detail); break;
        default: rc = RC_INVALID;
        }
    }
#ifdef DSPARK_STREAM
    _mm_sfence(); /* streamed stores are visible before the batch is handed over */
#endif
    *fail_op = rc ? i - 1 : n_ops;
    return rc;
}

/* The layout of the records this library reads: records.py's FILL_ABI, compared before the first
 * call, so that a library left from an older build is never called with records it misreads. */
int dspark_fill_abi(void) { return 3; }

/* An importable (empty) module, so that Python finds the library through the import system. */
static struct PyModuleDef batch_fill_module = {PyModuleDef_HEAD_INIT, "_batch_fill",
                                               "Native batch filler; called through ctypes.", -1, NULL};

PyMODINIT_FUNC PyInit__batch_fill(void) { return PyModule_Create(&batch_fill_module); }
