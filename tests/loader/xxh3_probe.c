/* Test-only wrapper around dspark_cache/format/csrc/xxh3.h, built by tests/loader/test_xxh3.py
 * and bench/xxh3.py into a throwaway shared library and called through ctypes (the header is
 * otherwise reachable only from inside the batch filler). */
#include <stdint.h>

#define DSPARK_XXH3_TESTING 1 /* for dspark_xxh3_set_path */
#include "../../dspark_cache/format/csrc/xxh3.h"

/* The stripe-loop path in use: 0 scalar, 1 SSE2, 2 AVX2, 3 AVX-512 (detected on first use). */
int probe_path(void) { return dspark_xxh3_path(); }

/* Pins a path for every later call; -1 detects again. */
void probe_set_path(int path) { dspark_xxh3_set_path(path); }

/* The path of the stripe loop that ran since the last call (-1: none), to check dispatch. */
int probe_ran(void)
{
    int ran = dspark_xxh3__ran;
    dspark_xxh3__ran = -1;
    return ran;
}

uint64_t probe_xxh3_64(const uint8_t *p, uint64_t n) { return dspark_xxh3_64(p, (size_t)n); }

/* bench/xxh3.py: hashes p reps times in one call, so ctypes' call cost stays out of the timing;
 * one shot when chunk is 0, else streamed in chunk-byte updates. Returns the hashes xor'ed. */
uint64_t probe_xxh3_repeat(const uint8_t *p, uint64_t n, uint64_t chunk, uint64_t reps)
{
    uint64_t x = 0;
    for (uint64_t r = 0; r < reps; r++) {
        if (!chunk) {
            x ^= dspark_xxh3_64(p, (size_t)n);
            continue;
        }
        dspark_xxh3 s;
        dspark_xxh3_reset(&s);
        for (uint64_t off = 0; off < n; off += chunk)
            dspark_xxh3_update(&s, p + off, (size_t)(n - off < chunk ? n - off : chunk));
        x ^= dspark_xxh3_digest(&s);
    }
    return x;
}

/* Streams p in pieces of cuts[0], cuts[1], ... (cycling; a 0 cut is an empty update), taking a
 * digest after every piece: digest must not disturb the state, so each is taken twice, and the
 * state goes on growing after it. Returns the final digest, ~0 if two digests disagreed. */
uint64_t probe_xxh3_chunked(const uint8_t *p, uint64_t n, const uint64_t *cuts, uint64_t ncuts)
{
    dspark_xxh3 s;
    dspark_xxh3_reset(&s);
    uint64_t h = dspark_xxh3_digest(&s);
    for (uint64_t off = 0, i = 0; off < n; i++) {
        uint64_t take = cuts[i % ncuts];
        if (take > n - off)
            take = n - off;
        dspark_xxh3_update(&s, p + off, (size_t)take);
        off += take;
        h = dspark_xxh3_digest(&s);
        if (dspark_xxh3_digest(&s) != h)
            return ~(uint64_t)0;
    }
    return h;
}
