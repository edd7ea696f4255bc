/* append.c: a shard writer's hot loop. A batch of samples arrives as a list of pieces (tar member
 * headers, safetensors headers, tensor bytes in the staging ring, zero padding); each byte is
 * read once from memory: 256 KiB at a time are written with writev from where they lie (no copy
 * into a Python object), then, while the kernel's copy has left them in L2, hashed into the
 * shard's running xxh3-64 and, for a sample's payload, into that sample's xxh3-64.
 *
 * Why C: the work is all bytes, and ctypes calls it without the GIL, so N writer threads run on
 * N cores. The hash is our own (format/csrc/xxh3.h), bit-identical to the `xxhash` package that
 * the Python fallback (format/tar/append.py) uses, so either path writes the same shard and index.
 *
 *   dspark_append_state_size()                   bytes a running tar hash needs
 *   dspark_append_reset(state)                   start one (a new shard)
 *   dspark_append_digest(state)                  its value so far
 *   dspark_append(fd, state, ptrs, lens, owners, n, sample_hashes, n_samples)
 *       writes pieces [0, n) in order; owners[i] is the index (< n_samples) of the sample whose
 *       payload piece i is, or -1 (tar framing, hashed into the shard only). A sample's pieces are
 *       consecutive. Returns 0, or -errno of the failed write (what was written stays written and
 *       hashed: the caller abandons the shard).
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include <Python.h>

#include "../../csrc/xxh3.h"

#define DSPARK_APPEND_ABI 1
#define HASH_CHUNK (64u << 10)   /* the most one iovec entry holds */
#define WRITE_BATCH (256u << 10) /* one writev, then both checksums over it while it is in L2 */
#define MAX_IOV 1024             /* IOV_MAX on Linux */

int dspark_append_abi(void) { return DSPARK_APPEND_ABI; }

size_t dspark_append_state_size(void) { return sizeof(dspark_xxh3); }

void dspark_append_reset(void *state) { dspark_xxh3_reset((dspark_xxh3 *)state); }

uint64_t dspark_append_digest(const void *state) { return dspark_xxh3_digest((const dspark_xxh3 *)state); }

typedef struct {
    int fd;
    dspark_xxh3 *tar;       /* the shard's running checksum */
    dspark_xxh3 sample;     /* the payload checksum of sample `current` */
    int64_t current;        /* -1: tar framing */
    uint64_t *sample_hashes;
    struct iovec iov[MAX_IOV];
    int64_t owner[MAX_IOV]; /* each entry's sample, or -1 */
    struct iovec todo[MAX_IOV];
    int count;
    size_t bytes;
} appender;

/* Write what is queued, then hash it: the kernel's copy has just brought those bytes into the cache,
 * so both checksums read them from L2 (hashing first would pull them from memory itself). */
static int flush(appender *a)
{
    struct iovec *iov = a->todo;
    int count = a->count;
    memcpy(a->todo, a->iov, (size_t)count * sizeof(struct iovec));
    while (count > 0) {
        ssize_t done = writev(a->fd, iov, count);
        if (done < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        while (count > 0 && (size_t)done >= iov->iov_len) { /* whole entries written */
            done -= (ssize_t)iov->iov_len;
            iov++, count--;
        }
        if (count > 0) { /* a short write: the rest of this entry next */
            iov->iov_base = (uint8_t *)iov->iov_base + done;
            iov->iov_len -= (size_t)done;
        }
    }
    for (int i = 0; i < a->count; i++) {
        const uint8_t *p = (const uint8_t *)a->iov[i].iov_base;
        size_t n = a->iov[i].iov_len;
        if (a->owner[i] != a->current) {
            if (a->current >= 0)
                a->sample_hashes[a->current] = dspark_xxh3_digest(&a->sample);
            a->current = a->owner[i];
            if (a->current >= 0)
                dspark_xxh3_reset(&a->sample);
        }
        if (a->current >= 0)
            dspark_xxh3_update(&a->sample, p, n);
        dspark_xxh3_update(a->tar, p, n);
    }
    a->count = 0;
    a->bytes = 0;
    return 0;
}

static int queue(appender *a, const uint8_t *p, size_t n, int64_t owner)
{
    if (a->count == MAX_IOV) {
        int rc = flush(a);
        if (rc)
            return rc;
    }
    a->iov[a->count].iov_base = (void *)p;
    a->iov[a->count].iov_len = n;
    a->owner[a->count] = owner;
    a->count++;
    a->bytes += n;
    return a->bytes >= WRITE_BATCH ? flush(a) : 0;
}

int dspark_append(int fd, void *state, const uint64_t *ptrs, const uint64_t *lens, const int64_t *owners, size_t n,
                  uint64_t *sample_hashes, size_t n_samples)
{
    /* Checked before a byte is written (append.py checks the same): samples 0..n_samples-1 in order,
     * each with a piece, each one's pieces together. */
    int64_t current = -1, highest = -1;
    for (size_t i = 0; i < n; i++) {
        if (owners[i] != current) {
            current = owners[i];
            if (current >= 0 && current != highest + 1)
                return -EINVAL;
            if (current >= 0)
                highest = current;
        }
    }
    if (highest != (int64_t)n_samples - 1)
        return -EINVAL;
    static __thread appender a; /* 40 KiB of iovecs: per thread, not on its stack */
    a.fd = fd, a.tar = (dspark_xxh3 *)state, a.current = -1, a.sample_hashes = sample_hashes;
    a.count = 0, a.bytes = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)ptrs[i];
        size_t left = (size_t)lens[i];
        while (left) {
            size_t k = left < HASH_CHUNK ? left : HASH_CHUNK;
            int rc = queue(&a, p, k, owners[i]);
            if (rc)
                return rc;
            p += k, left -= k;
        }
        if (lens[i] == 0) { /* queued all the same: a sample of empty pieces still gets its checksum */
            int rc = queue(&a, p, 0, owners[i]);
            if (rc)
                return rc;
        }
    }
    int rc = flush(&a);
    if (!rc && a.current >= 0)
        sample_hashes[a.current] = dspark_xxh3_digest(&a.sample);
    return rc;
}

/* Loaded with ctypes (which releases the GIL around each call); the module object only makes the
 * file importable, so that Python finds it where the package is installed. */
static struct PyModuleDef append_module = {PyModuleDef_HEAD_INIT, "_append",
                                           "The shard writer's native hot loop (see append.c).", -1, NULL};

PyMODINIT_FUNC PyInit__append(void) { return PyModule_Create(&append_module); }
