/* append.c: a shard writer's hot loop. A batch of samples arrives as a list of pieces (tar member
 * headers, safetensors headers, tensor bytes in the staging ring, zero padding); each byte is
 * read once from memory: a 64 KiB chunk is hashed into the shard's running xxh3-64 and, when it
 * belongs to a sample's payload, into that sample's xxh3-64 while it sits in L2, and is then
 * written with writev from where it lies (no copy into a Python object, no second pass).
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
#define HASH_CHUNK (64u << 10)   /* hashed twice while it is in L2 */
#define WRITE_BATCH (256u << 10) /* one writev once this much is hashed: still cached when copied */
#define MAX_IOV 1024             /* IOV_MAX on Linux */

int dspark_append_abi(void) { return DSPARK_APPEND_ABI; }

size_t dspark_append_state_size(void) { return sizeof(dspark_xxh3); }

void dspark_append_reset(void *state) { dspark_xxh3_reset((dspark_xxh3 *)state); }

uint64_t dspark_append_digest(const void *state) { return dspark_xxh3_digest((const dspark_xxh3 *)state); }

typedef struct {
    int fd;
    struct iovec iov[MAX_IOV];
    int count;
    size_t bytes;
} write_batch;

/* Write everything queued; 0 or -errno. */
static int flush(write_batch *w)
{
    struct iovec *iov = w->iov;
    int count = w->count;
    while (count > 0) {
        ssize_t done = writev(w->fd, iov, count);
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
    w->count = 0;
    w->bytes = 0;
    return 0;
}

static int queue(write_batch *w, const uint8_t *p, size_t n)
{
    if (w->count == MAX_IOV) {
        int rc = flush(w);
        if (rc)
            return rc;
    }
    w->iov[w->count].iov_base = (void *)p;
    w->iov[w->count].iov_len = n;
    w->count++;
    w->bytes += n;
    return w->bytes >= WRITE_BATCH ? flush(w) : 0;
}

int dspark_append(int fd, void *state, const uint64_t *ptrs, const uint64_t *lens, const int64_t *owners, size_t n,
                  uint64_t *sample_hashes, size_t n_samples)
{
    dspark_xxh3 *tar = (dspark_xxh3 *)state;
    dspark_xxh3 sample;
    int64_t current = -1; /* the sample whose payload is being hashed */
    int64_t highest = -1; /* samples come in order, each one's pieces together */
    write_batch w;
    w.fd = fd, w.count = 0, w.bytes = 0;
    for (size_t i = 0; i < n; i++) {
        if (owners[i] != current) {
            if (current >= 0)
                sample_hashes[current] = dspark_xxh3_digest(&sample);
            current = owners[i];
            if (current >= (int64_t)n_samples || (current >= 0 && current <= highest))
                return -EINVAL; /* checked before a byte of the piece is written */
            if (current >= 0) {
                dspark_xxh3_reset(&sample);
                highest = current;
            }
        }
        const uint8_t *p = (const uint8_t *)(uintptr_t)ptrs[i];
        size_t left = (size_t)lens[i];
        while (left) {
            size_t k = left < HASH_CHUNK ? left : HASH_CHUNK;
            if (current >= 0)
                dspark_xxh3_update(&sample, p, k);
            dspark_xxh3_update(tar, p, k);
            int rc = queue(&w, p, k);
            if (rc)
                return rc;
            p += k, left -= k;
        }
    }
    if (current >= 0)
        sample_hashes[current] = dspark_xxh3_digest(&sample);
    return flush(&w);
}

/* Loaded with ctypes (which releases the GIL around each call); the module object only makes the
 * file importable, so that Python finds it where the package is installed. */
static struct PyModuleDef append_module = {PyModuleDef_HEAD_INIT, "_append",
                                           "The shard writer's native hot loop (see append.c).", -1, NULL};

PyMODINIT_FUNC PyInit__append(void) { return PyModule_Create(&append_module); }
