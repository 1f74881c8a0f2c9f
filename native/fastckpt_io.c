/*
 * fastckpt._native_ext -- the hot I/O path of fastckpt.
 *
 * Writes a host buffer to a file (or reads a file region into a host buffer)
 * with several pwrite()/pread() requests in flight on worker pthreads, while
 * the calling thread computes XXH3-64 (seed 0) checksums of the same bytes in
 * the same pass.  O_DIRECT is used when the buffer allows it and the file
 * system accepts it; otherwise buffered I/O is used transparently.
 *
 * Plain C + CPython API, no torch linkage.  xxhash is compiled in from the
 * header (XXH_INLINE_ALL), so there is no runtime library dependency.
 *
 * The GIL is released for all I/O and hashing.  Worker threads are created
 * per call (no global pool), so the module is fork-safe.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* xxhash, compiled in.  On x86-64 the AVX2 kernels are compiled too (function-level target
 * attribute, the module itself stays baseline x86-64) and picked at run time, like the xxhash
 * package's own x86 dispatch; the results are the same on every path. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FCK_NO_AVX2)
#define FCK_AVX2 1
#define XXH_X86DISPATCH
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <immintrin.h>
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

#ifdef FCK_AVX2
#if XXH_VERSION_NUMBER >= 802
#define FCK_ACC_AVX2 XXH3_accumulate_avx2
#else
#define FCK_ACC_AVX2 XXH3_accumulate_512_avx2
#endif
static int fck_use_avx2;

__attribute__((__target__("avx2"), noinline)) static XXH64_hash_t h64_avx2(const void *p, size_t n) {
    if (n <= XXH3_MIDSIZE_MAX) return XXH3_64bits(p, n);
    return XXH3_hashLong_64b_internal(p, n, XXH3_kSecret, sizeof(XXH3_kSecret), FCK_ACC_AVX2,
                                      XXH3_scrambleAcc_avx2);
}

__attribute__((__target__("avx2"), noinline)) static void update_avx2(XXH3_state_t *st, const void *p, size_t n) {
    XXH3_update(st, (const xxh_u8 *)p, n, FCK_ACC_AVX2, XXH3_scrambleAcc_avx2);
}
#endif

static inline uint64_t fck_h64(const void *p, size_t n) {
#ifdef FCK_AVX2
    if (fck_use_avx2) return h64_avx2(p, n);
#endif
    return XXH3_64bits(p, n);
}

static inline void fck_update(XXH3_state_t *st, const void *p, size_t n) {
#ifdef FCK_AVX2
    if (fck_use_avx2) {
        update_avx2(st, p, n);
        return;
    }
#endif
    XXH3_64bits_update(st, p, n);
}

#define FCK_ALIGN ((Py_ssize_t)4096)
#define FCK_DEFAULT_BLOCK ((Py_ssize_t)16 << 20)
#define FCK_MAX_BLOCK ((Py_ssize_t)1 << 30) /* request counts and rounding stay far from overflow */
#define FCK_MAX_OFFSET ((long long)(INT64_MAX / 2)) /* a file offset or length past any file */
#define FCK_DEFAULT_DEPTH 4
#define FCK_MAX_DEPTH 64
#define FCK_HASH_CHUNK ((Py_ssize_t)1 << 20)
#define FCK_NOGIL_HASH_MIN ((Py_ssize_t)16 << 10)

static inline Py_ssize_t round_up(Py_ssize_t n, Py_ssize_t a) { return (n + a - 1) / a * a; }

/* ------------------------------------------------------------------------ */
/* Shared job state                                                          */
/* ------------------------------------------------------------------------ */

typedef struct {
    int fd;
    int writing;           /* 1 = write job, 0 = read job */
    char *base;            /* buffer start */
    Py_ssize_t nbytes;     /* logical bytes */
    Py_ssize_t io_len;     /* bytes actually transferred (padded for O_DIRECT) */
    long long file_offset; /* file position of base[0] */
    Py_ssize_t block;
    Py_ssize_t nblocks;
    int direct;            /* O_DIRECT currently set on fd */

    Py_ssize_t next;       /* next block to claim (atomic) */
    int stop;              /* set on error (atomic) */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned char *done;   /* reads: per-block completion flags (under mu) */
    int err;               /* first error: errno (under mu) */
    long long err_off;     /* file offset of the first error */
    const char *err_what;  /* "writing", "reading" */
    int eof;               /* read hit EOF before nbytes arrived */
    const struct req *reqs; /* write_segments: the requests (nblocks of them), else NULL */
} job_t;

/* One write request of write_segments: len bytes at address p to file offset off. */
typedef struct req {
    long long off;
    const char *p;
    Py_ssize_t len;
} req_t;

static void job_fail(job_t *j, int err, long long off, const char *what, int eof) {
    pthread_mutex_lock(&j->mu);
    if (!j->err && !j->eof) {
        j->err = err;
        j->err_off = off;
        j->err_what = what;
        j->eof = eof;
    }
    __atomic_store_n(&j->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* O_DIRECT was refused for this request (EINVAL): switch the open file to
 * buffered I/O for everybody and let the caller retry. */
static int drop_direct(job_t *j) {
    pthread_mutex_lock(&j->mu);
    int ok = 1;
    if (__atomic_load_n(&j->direct, __ATOMIC_ACQUIRE)) {
        int fl = fcntl(j->fd, F_GETFL);
        if (fl < 0 || fcntl(j->fd, F_SETFL, fl & ~O_DIRECT) < 0)
            ok = 0;
        else
            __atomic_store_n(&j->direct, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&j->mu);
    return ok;
}

/* Write p[0:len] at file position foff; returns 0 or sets error. */
static int pwrite_all(job_t *j, const char *p, Py_ssize_t len, long long foff) {
    Py_ssize_t done = 0;
    int retried_direct = 0;
    while (done < len) {
        ssize_t r = pwrite(j->fd, p + done, (size_t)(len - done), (off_t)(foff + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EINVAL && !retried_direct && __atomic_load_n(&j->direct, __ATOMIC_ACQUIRE)) {
                int e = errno;
                retried_direct = 1;
                if (drop_direct(j)) continue;
                errno = e;
            }
            job_fail(j, errno, foff + done, "writing", 0);
            return -1;
        }
        if (r == 0) {
            job_fail(j, EIO, foff + done, "writing", 0);
            return -1;
        }
        done += r;
    }
    return 0;
}

/* Write base[off:off+len] at file position off; returns 0 or sets error. */
static int write_block(job_t *j, Py_ssize_t off, Py_ssize_t len) {
    return pwrite_all(j, j->base + off, len, j->file_offset + off);
}

/* Read into base[off:off+len]; at least `need` bytes must arrive. */
static int read_block(job_t *j, Py_ssize_t off, Py_ssize_t len, Py_ssize_t need) {
    Py_ssize_t done = 0;
    int retried_direct = 0;
    while (done < len) {
        int was_direct = __atomic_load_n(&j->direct, __ATOMIC_ACQUIRE);
        ssize_t r = pread(j->fd, j->base + off + done, (size_t)(len - done),
                          (off_t)(j->file_offset + off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EINVAL && !retried_direct && was_direct) {
                int e = errno;
                retried_direct = 1;
                if (drop_direct(j)) continue;
                errno = e;
            }
            job_fail(j, errno, j->file_offset + off + done, "reading", 0);
            return -1;
        }
        if (r == 0) break; /* EOF */
        done += r;
        if (was_direct && (r % FCK_ALIGN) != 0) break; /* short O_DIRECT read: EOF */
    }
    if (done < need) {
        job_fail(j, 0, j->file_offset + off + done, "reading", 1);
        return -1;
    }
    return 0;
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (;;) {
        if (__atomic_load_n(&j->stop, __ATOMIC_ACQUIRE)) break;
        Py_ssize_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_ACQ_REL);
        if (i >= j->nblocks) break;
        if (j->reqs) {
            if (pwrite_all(j, j->reqs[i].p, j->reqs[i].len, j->reqs[i].off)) break;
            continue;
        }
        Py_ssize_t off = i * j->block;
        Py_ssize_t len = j->io_len - off;
        if (len > j->block) len = j->block;
        if (j->writing) {
            if (write_block(j, off, len)) break;
        } else {
            Py_ssize_t need = j->nbytes - off;
            if (need > j->block) need = j->block;
            if (read_block(j, off, len, need)) break;
            pthread_mutex_lock(&j->mu);
            j->done[i] = 1;
            pthread_cond_broadcast(&j->cv);
            pthread_mutex_unlock(&j->mu);
        }
    }
    return NULL;
}

/* Start up to `want` workers with all signals blocked (signals stay with the
 * Python main thread).  Returns the number started (may be 0). */
static int start_threads(void *(*fn)(void *), void *arg, pthread_t *th, int want) {
    sigset_t all, old;
    pthread_attr_t attr;
    int n = 0;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    for (; n < want; n++)
        if (pthread_create(&th[n], &attr, fn, arg) != 0) break;
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return n;
}

static void join_workers(pthread_t *th, int n) {
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static int job_init(job_t *j) {
    memset(j, 0, sizeof(*j));
    j->fd = -1;
    if (pthread_mutex_init(&j->mu, NULL)) return -1;
    if (pthread_cond_init(&j->cv, NULL)) {
        pthread_mutex_destroy(&j->mu);
        return -1;
    }
    return 0;
}

static void job_destroy(job_t *j) {
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j->done);
}

/* ------------------------------------------------------------------------ */
/* Error helpers (GIL held)                                                  */
/* ------------------------------------------------------------------------ */

static void raise_os(int err, const char *what, const char *path, long long off, int with_off) {
    PyObject *msg = with_off
        ? PyUnicode_FromFormat("%s: %s %s at offset %lld", strerror(err), what, path, off)
        : PyUnicode_FromFormat("%s: %s %s", strerror(err), what, path);
    if (!msg) return;
    PyObject *args = Py_BuildValue("(iN)", err, msg);
    if (!args) return;
    PyErr_SetObject(PyExc_OSError, args);
    Py_DECREF(args);
}

/* ------------------------------------------------------------------------ */
/* Fused hashing                                                             */
/* ------------------------------------------------------------------------ */

typedef struct {
    long long off, len;
} range_t;

typedef struct {
    const char *base;
    const range_t *rg;
    Py_ssize_t nr;
    uint64_t *out;
} ranges_job_t;

/* Hash every range in one shot (runs on its own thread, beside the full-buffer hash). */
static void *hash_ranges(void *arg) {
    ranges_job_t *r = (ranges_job_t *)arg;
    for (Py_ssize_t i = 0; i < r->nr; i++) r->out[i] = fck_h64(r->base + r->rg[i].off, (size_t)r->rg[i].len);
    return NULL;
}

/* Streaming hash of base[0:n] in 1 MiB steps. */
static uint64_t hash_full(XXH3_state_t *st, const char *base, Py_ssize_t n) {
    XXH3_64bits_reset(st);
    for (Py_ssize_t off = 0; off < n; off += FCK_HASH_CHUNK) {
        Py_ssize_t len = n - off < FCK_HASH_CHUNK ? n - off : FCK_HASH_CHUNK;
        fck_update(st, base + off, (size_t)len);
    }
    return XXH3_64bits_digest(st);
}

/* ------------------------------------------------------------------------ */
/* Argument helpers                                                          */
/* ------------------------------------------------------------------------ */

static int check_tuning(Py_ssize_t *block, int *depth) {
    if (*block <= 0) *block = FCK_DEFAULT_BLOCK;
    if (*block % FCK_ALIGN || *block > FCK_MAX_BLOCK) {
        PyErr_SetString(PyExc_ValueError, "block_size must be a multiple of 4096, at most 1 GiB");
        return -1;
    }
    if (*depth <= 0) *depth = FCK_DEFAULT_DEPTH;
    if (*depth > FCK_MAX_DEPTH) *depth = FCK_MAX_DEPTH;
    return 0;
}

static int check_nbytes(Py_buffer *v, Py_ssize_t nbytes) {
    if (nbytes < 0 || nbytes > v->len) {
        PyErr_Format(PyExc_ValueError, "nbytes=%zd outside buffer of %zd bytes", nbytes, v->len);
        return -1;
    }
    return 0;
}

/* Parse ranges into a freshly PyMem_Malloc'd array. */
static int parse_ranges(PyObject *ranges, Py_ssize_t nbytes, range_t **out, Py_ssize_t *nout) {
    PyObject *seq = PySequence_Fast(ranges, "ranges must be a sequence of (offset, length)");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    range_t *rg = n ? (range_t *)PyMem_Malloc((size_t)n * sizeof(range_t)) : NULL;
    if (n && !rg) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
        long long off, len;
        PyObject *pair = PySequence_Fast(it, "each range must be an (offset, length) pair");
        if (!pair) goto fail;
        if (PySequence_Fast_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_ValueError, "each range must be an (offset, length) pair");
            goto fail;
        }
        off = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(pair, 0));
        len = off == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(PySequence_Fast_GET_ITEM(pair, 1));
        Py_DECREF(pair);
        if (PyErr_Occurred()) goto fail;
        if (off < 0 || len < 0 || off > (long long)nbytes || len > (long long)nbytes - off) {
            PyErr_Format(PyExc_ValueError, "range (%lld, %lld) outside [0, %zd)", off, len, nbytes);
            goto fail;
        }
        rg[i].off = off;
        rg[i].len = len;
    }
    Py_DECREF(seq);
    *out = rg;
    *nout = n;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(rg);
    return -1;
}

/* ------------------------------------------------------------------------ */
/* write_file                                                                */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(write_file_doc,
"write_file(path, buf, nbytes, ranges, direct=True, fsync=True, block_size=0, depth=0)\n"
"--\n\n"
"Create/truncate path and write buf[0:nbytes]; return [xxh3_64 per range], hashed on the\n"
"calling thread while the writes are in flight.\n"
"block_size/depth of 0 mean the defaults (16 MiB, 4 requests in flight).");

static PyObject *py_write_file(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "buf", "nbytes", "ranges", "direct", "fsync", "block_size", "depth",
                             NULL};
    PyObject *pathb = NULL, *bufobj, *ranges, *result = NULL, *lst = NULL;
    Py_ssize_t nbytes, block = 0, nr = 0;
    int direct = 1, do_fsync = 1, depth = 0;
    Py_buffer view;
    range_t *rg = NULL;
    uint64_t *rh = NULL;
    job_t job;
    pthread_t th[FCK_MAX_DEPTH];
    int nth = 0;
    /* error reporting (set without the GIL, raised after) */
    int oerr = 0;
    long long ooff = 0;
    const char *owhat = NULL;
    int owith_off = 1;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&OnO|ppni:write_file", kwlist, PyUnicode_FSConverter,
                                     &pathb, &bufobj, &nbytes, &ranges, &direct, &do_fsync, &block, &depth))
        return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(pathb);
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(pathb);
    if (check_tuning(&block, &depth) || check_nbytes(&view, nbytes) ||
        parse_ranges(ranges, nbytes, &rg, &nr))
        goto out_nojob;
    if (nr) {
        rh = (uint64_t *)PyMem_Calloc((size_t)nr, sizeof(uint64_t));
        if (!rh) {
            PyErr_NoMemory();
            goto out_nojob;
        }
    }
    if (job_init(&job)) {
        PyErr_SetString(PyExc_RuntimeError, "pthread init failed");
        goto out_nojob;
    }

    int use_direct = direct && nbytes > 0 && ((uintptr_t)view.buf % FCK_ALIGN) == 0 &&
                     view.len >= round_up(nbytes, FCK_ALIGN);

    Py_BEGIN_ALLOW_THREADS
    int fd = -1;
    if (use_direct) {
        fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
        if (fd < 0 && errno == EINVAL) use_direct = 0;
    }
    if (fd < 0 && !use_direct) fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        oerr = errno; owhat = "opening"; owith_off = 0;
    } else {
        job.fd = fd;
        job.writing = 1;
        job.base = (char *)view.buf;
        job.nbytes = nbytes;
        job.io_len = use_direct ? round_up(nbytes, FCK_ALIGN) : nbytes;
        job.block = block;
        job.nblocks = (job.io_len + block - 1) / block;
        job.direct = use_direct;
        /* preallocate; ENOSPC must surface, "unsupported" is fine */
        if (nbytes > 0 && fallocate(fd, 0, 0, (off_t)nbytes) != 0 && errno != EOPNOTSUPP &&
            errno != ENOSYS && errno != EINVAL) {
            oerr = errno; owhat = "preallocating"; ooff = 0;
        }
        if (!oerr) {
            int want = job.nblocks > 1 ? (int)(job.nblocks < depth ? job.nblocks : depth) : 0;
            nth = want ? start_threads(worker, &job, th, want) : 0;
            if (nth == 0) worker(&job); /* single block (or no threads): write, then hash */
            if (nth > 0 || !job.err) {
                /* fused: the ranges are hashed on this thread while the workers write */
                ranges_job_t rj = {job.base, rg, nr, rh};
                hash_ranges(&rj);
            }
            if (nth > 0) join_workers(th, nth);
            if (job.err) {
                oerr = job.err; owhat = job.err_what; ooff = job.err_off;
            }
        }
        if (!oerr && job.io_len != nbytes && ftruncate(fd, (off_t)nbytes) != 0) {
            oerr = errno; owhat = "truncating"; ooff = nbytes;
        }
        if (!oerr && do_fsync && fsync(fd) != 0) {
            oerr = errno; owhat = "syncing"; ooff = 0; owith_off = 0;
        }
        if (close(fd) != 0 && !oerr) {
            oerr = errno; owhat = "closing"; owith_off = 0;
        }
    }
    Py_END_ALLOW_THREADS

    job_destroy(&job);
    if (oerr) {
        raise_os(oerr, owhat, path, ooff, owith_off);
        goto out_nojob;
    }
    lst = PyList_New(nr);
    if (!lst) goto out_nojob;
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(rh[i]);
        if (!v) goto out_nojob;
        PyList_SET_ITEM(lst, i, v);
    }
    result = lst;
    lst = NULL;

out_nojob:
    Py_XDECREF(lst);
    PyMem_Free(rh);
    PyMem_Free(rg);
    PyBuffer_Release(&view);
    Py_DECREF(pathb);
    return result;
}

/* ------------------------------------------------------------------------ */
/* write_segments: a shard written straight from the tensors' memory         */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(write_segments_doc,
"write_segments(path, nbytes, segments, hash_ranges, direct=True, fsync=True, block_size=0, depth=0)\n"
"--\n\n"
"Create/truncate path, 'nbytes' long, from segments: (file_offset, address, length) triples,\n"
"sorted and non-overlapping, that together cover the file (the last one may run past nbytes\n"
"to the next 4096 boundary: the file is truncated after).  O_DIRECT is used when every\n"
"offset, address and length is a multiple of 4096.  hash_ranges: (address, length) pairs\n"
"hashed (xxh3_64) on this thread while the workers write; returns their hashes.  The caller\n"
"guarantees that every address stays valid and unchanged during the call.");

static int parse_triples(PyObject *o, long long (**out)[3], Py_ssize_t *nout, int width, const char *what) {
    PyObject *seq = PySequence_Fast(o, what);
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long (*a)[3] = n ? PyMem_Calloc((size_t)n, sizeof(*a)) : NULL;
    if (n && !a) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i), what);
        if (!t) goto fail;
        if (PySequence_Fast_GET_SIZE(t) != width) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_ValueError, what);
            goto fail;
        }
        for (int k = 0; k < width; k++) {
            PyObject *v = PySequence_Fast_GET_ITEM(t, k);
            a[i][k] = PyLong_AsLongLong(v); /* (checked by the caller: negative or too large) */
            if (PyErr_Occurred()) {
                Py_DECREF(t);
                if (PyErr_ExceptionMatches(PyExc_OverflowError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_ValueError, "%s (item %zd: a number out of range)", what, i);
                }
                goto fail;
            }
        }
        Py_DECREF(t);
    }
    Py_DECREF(seq);
    *out = a;
    *nout = n;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(a);
    return -1;
}

static PyObject *py_write_segments(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "nbytes", "segments", "hash_ranges", "direct", "fsync", "block_size",
                             "depth", NULL};
    PyObject *pathb = NULL, *segs_o, *hr_o, *result = NULL, *lst = NULL;
    Py_ssize_t nbytes, block = 0, nseg = 0, nhr = 0, nreq = 0;
    int direct = 1, do_fsync = 1, depth = 0, nth = 0;
    long long (*segs)[3] = NULL, (*hr)[3] = NULL;
    req_t *reqs = NULL;
    uint64_t *hashes = NULL;
    pthread_t th[FCK_MAX_DEPTH];
    job_t job;
    int oerr = 0, owith_off = 1, have_job = 0;
    long long ooff = 0, end = 0;
    const char *owhat = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&nOO|ppni:write_segments", kwlist, PyUnicode_FSConverter,
                                     &pathb, &nbytes, &segs_o, &hr_o, &direct, &do_fsync, &block, &depth))
        return NULL;
    const char *path = PyBytes_AS_STRING(pathb);
    if (check_tuning(&block, &depth) ||
        parse_triples(segs_o, &segs, &nseg, 3, "segments must be (file_offset, address, length) triples") ||
        parse_triples(hr_o, &hr, &nhr, 2, "hash_ranges must be (address, length) pairs"))
        goto out;
    if (nbytes < 0 || nbytes > FCK_MAX_OFFSET) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0 and below 2**62");
        goto out;
    }
    int aligned = 1;
    long long cap = (long long)round_up(nbytes, FCK_ALIGN);
    for (Py_ssize_t i = 0; i < nseg; i++) {
        long long off = segs[i][0], addr = segs[i][1], len = segs[i][2];
        /* off == end <= cap here, so cap - off cannot overflow, nor off + len below */
        if (off != end || len < 0 || len > cap - off || addr < 0 || (len && !addr)) {
            PyErr_Format(PyExc_ValueError, "segment %zd (offset %lld, length %lld) does not continue the "
                         "previous one at %lld within the file's %zd bytes", i, off, len, end, nbytes);
            goto out;
        }
        end = off + len;
        if (off % FCK_ALIGN || addr % FCK_ALIGN || len % FCK_ALIGN) aligned = 0;
        nreq += (Py_ssize_t)((len + block - 1) / block);
    }
    if (end < nbytes || end > round_up(nbytes, FCK_ALIGN)) {
        PyErr_Format(PyExc_ValueError, "segments cover %lld bytes, the file has %zd", end, nbytes);
        goto out;
    }
    for (Py_ssize_t i = 0; i < nhr; i++)
        if (hr[i][1] < 0 || hr[i][0] < 0 || (hr[i][1] && !hr[i][0])) {
            PyErr_SetString(PyExc_ValueError, "hash range with a null address or negative length");
            goto out;
        }
    reqs = nreq ? PyMem_Calloc((size_t)nreq, sizeof(req_t)) : NULL;
    hashes = nhr ? PyMem_Calloc((size_t)nhr, sizeof(uint64_t)) : NULL;
    if ((nreq && !reqs) || (nhr && !hashes)) {
        PyErr_NoMemory();
        goto out;
    }
    nreq = 0;
    for (Py_ssize_t i = 0; i < nseg; i++)
        for (long long k = 0; k < segs[i][2]; k += block) {
            long long len = segs[i][2] - k < block ? segs[i][2] - k : block;
            reqs[nreq].off = segs[i][0] + k;
            reqs[nreq].p = (const char *)(uintptr_t)(segs[i][1] + k);
            reqs[nreq].len = (Py_ssize_t)len;
            nreq++;
        }
    if (job_init(&job)) {
        PyErr_SetString(PyExc_RuntimeError, "pthread init failed");
        goto out;
    }
    have_job = 1;
    int use_direct = direct && aligned && nbytes > 0;

    Py_BEGIN_ALLOW_THREADS
    int fd = -1;
    if (use_direct) {
        fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
        if (fd < 0 && errno == EINVAL) use_direct = 0;
    }
    if (fd < 0 && !use_direct) fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        oerr = errno; owhat = "opening"; owith_off = 0;
    } else {
        job.fd = fd;
        job.writing = 1;
        job.reqs = reqs;
        job.nblocks = nreq;
        job.direct = use_direct;
        if (nbytes > 0 && fallocate(fd, 0, 0, (off_t)nbytes) != 0 && errno != EOPNOTSUPP &&
            errno != ENOSYS && errno != EINVAL) {
            oerr = errno; owhat = "preallocating"; ooff = 0;
        }
        if (!oerr) {
            int want = nreq > 1 ? (int)(nreq < depth ? nreq : depth) : 0;
            nth = want ? start_threads(worker, &job, th, want) : 0;
            if (nth == 0) worker(&job);
            for (Py_ssize_t i = 0; i < nhr; i++)  /* the checksums, while the workers write */
                hashes[i] = fck_h64((const void *)(uintptr_t)hr[i][0], (size_t)hr[i][1]);
            if (nth > 0) join_workers(th, nth);
            if (job.err) {
                oerr = job.err; owhat = job.err_what; ooff = job.err_off;
            }
        }
        if (!oerr && end != nbytes && ftruncate(fd, (off_t)nbytes) != 0) {
            oerr = errno; owhat = "truncating"; ooff = nbytes;
        }
        if (!oerr && do_fsync && fsync(fd) != 0) {
            oerr = errno; owhat = "syncing"; ooff = 0; owith_off = 0;
        }
        if (close(fd) != 0 && !oerr) {
            oerr = errno; owhat = "closing"; owith_off = 0;
        }
    }
    Py_END_ALLOW_THREADS

    if (oerr) {
        raise_os(oerr, owhat, path, ooff, owith_off);
        goto out;
    }
    lst = PyList_New(nhr);
    if (!lst) goto out;
    for (Py_ssize_t i = 0; i < nhr; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(hashes[i]);
        if (!v) goto out;
        PyList_SET_ITEM(lst, i, v);
    }
    result = lst;
    lst = NULL;
out:
    if (have_job) job_destroy(&job);
    Py_XDECREF(lst);
    PyMem_Free(reqs);
    PyMem_Free(hashes);
    PyMem_Free(segs);
    PyMem_Free(hr);
    Py_DECREF(pathb);
    return result;
}

/* ------------------------------------------------------------------------ */
/* read_into                                                                 */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(read_into_doc,
"read_into(path, file_offset, buf, nbytes, direct=True, block_size=0, depth=0, hash=True)\n"
"--\n\n"
"Read exactly nbytes at file_offset into buf[0:nbytes]; return their xxh3_64 (None with\n"
"hash=False, for callers that check smaller ranges themselves).");

/* How a read ended: an OS error (err, what, at off when with_off), or a file too short (eof,
 * its size fsize). */
typedef struct {
    int err, eof, with_off;
    long long off, fsize;
    const char *what;
} rstatus_t;

/* Open a shard for reading (no GIL needed): O_NOFOLLOW, never through a link; O_NONBLOCK, a
 * FIFO in place of a shard does not block the open (no effect on regular files); O_DIRECT when
 * *direct (cleared where the file system refuses it). Only a regular file of at least `end`
 * bytes is read. Returns the fd, or -1 with rs set (and the fd closed). */
static int open_shard(const char *path, int *direct, long long end, rstatus_t *rs) {
    int fd = -1;
    struct stat st;
    if (*direct) {
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_DIRECT);
        if (fd < 0 && errno == EINVAL) *direct = 0;
    }
    if (fd < 0 && !*direct) fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        rs->err = errno; rs->what = "opening"; rs->with_off = 0;
        return -1;
    }
    if (fstat(fd, &st) != 0) {
        rs->err = errno; rs->what = "stat of"; rs->with_off = 0;
    } else if (!S_ISREG(st.st_mode)) {
        rs->err = EINVAL; rs->what = "opening (not a regular file)"; rs->with_off = 0;
    } else if ((long long)st.st_size < end) {
        rs->eof = 1;
        rs->fsize = (long long)st.st_size;
    } else {
        return fd;
    }
    close(fd);
    return -1;
}

/* The Python result of a read (with the GIL): the hash, None, or the exception. */
static PyObject *read_result(const rstatus_t *rs, const char *path, Py_ssize_t nbytes,
                             long long file_offset, int want_hash, uint64_t h) {
    if (rs->eof) {
        PyErr_Format(PyExc_EOFError, "%s: expected %zd bytes at offset %lld, file ended at %lld", path, nbytes,
                     file_offset, rs->fsize);
        return NULL;
    }
    if (rs->err) {
        raise_os(rs->err, rs->what, path, rs->off, rs->with_off);
        return NULL;
    }
    return want_hash ? PyLong_FromUnsignedLongLong(h) : Py_NewRef(Py_None);
}

static PyObject *py_read_into(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "file_offset", "buf", "nbytes", "direct", "block_size", "depth", "hash",
                             NULL};
    PyObject *pathb = NULL, *bufobj, *result = NULL;
    long long file_offset;
    Py_ssize_t nbytes, block = 0;
    int direct = 1, depth = 0, want_hash = 1;
    Py_buffer view;
    job_t job;
    pthread_t th[FCK_MAX_DEPTH];
    int nth = 0;
    uint64_t h = 0;
    XXH3_state_t hs;
    rstatus_t rs = {0, 0, 1, 0, 0, NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&LOn|pnip:read_into", kwlist, PyUnicode_FSConverter, &pathb,
                                     &file_offset, &bufobj, &nbytes, &direct, &block, &depth,
                                     &want_hash))
        return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(pathb);
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(pathb);
    if (file_offset > FCK_MAX_OFFSET) { /* past any file: as any offset past the end */
        PyErr_Format(PyExc_EOFError, "%s: expected %zd bytes at offset %lld, past the end of the file", path,
                     nbytes, file_offset);
        goto out;
    }
    if (file_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "file_offset out of range");
        goto out;
    }
    if (check_tuning(&block, &depth) || check_nbytes(&view, nbytes)) goto out;
    if (job_init(&job)) {
        PyErr_SetString(PyExc_RuntimeError, "pthread init failed");
        goto out;
    }

    int use_direct = direct && nbytes > 0 && ((uintptr_t)view.buf % FCK_ALIGN) == 0 &&
                     file_offset % FCK_ALIGN == 0 && view.len >= round_up(nbytes, FCK_ALIGN);

    Py_BEGIN_ALLOW_THREADS
    struct stat st;
    int fd = open_shard(path, &use_direct, file_offset + (long long)nbytes, &rs);
    if (fd < 0) {
        /* rs says why */
    } else if (nbytes > 0) {
        job.fd = fd;
        job.writing = 0;
        job.base = (char *)view.buf;
        job.nbytes = nbytes;
        job.io_len = use_direct ? round_up(nbytes, FCK_ALIGN) : nbytes;
        job.file_offset = file_offset;
        job.block = block;
        job.nblocks = (job.io_len + block - 1) / block;
        job.direct = use_direct;
        job.done = (unsigned char *)calloc((size_t)job.nblocks, 1);
        if (!job.done) {
            rs.err = ENOMEM; rs.what = "reading"; rs.with_off = 0;
        } else {
            int want = job.nblocks > 1 ? (int)(job.nblocks < depth ? job.nblocks : depth) : 0;
            nth = want ? start_threads(worker, &job, th, want) : 0;
            XXH3_64bits_reset(&hs);
            if (nth == 0) {
                worker(&job);
                if (!job.err && !job.eof && want_hash) h = hash_full(&hs, job.base, nbytes);
            } else if (!want_hash) {
                join_workers(th, nth);
            } else {
                /* fused: hash blocks in order as they land */
                for (Py_ssize_t i = 0; i < job.nblocks; i++) {
                    pthread_mutex_lock(&job.mu);
                    while (!job.done[i] && !job.err && !job.eof) pthread_cond_wait(&job.cv, &job.mu);
                    int bad = job.err || job.eof;
                    pthread_mutex_unlock(&job.mu);
                    if (bad) break;
                    Py_ssize_t off = i * block;
                    Py_ssize_t len = nbytes - off;
                    if (len > block) len = block;
                    for (Py_ssize_t k = 0; k < len; k += FCK_HASH_CHUNK)
                        fck_update(&hs, job.base + off + k, (size_t)(len - k < FCK_HASH_CHUNK ? len - k : FCK_HASH_CHUNK));
                }
                join_workers(th, nth);
                h = XXH3_64bits_digest(&hs);
            }
            if (job.eof) {
                rs.eof = 1;
                rs.fsize = fstat(fd, &st) == 0 ? (long long)st.st_size : job.err_off;
            } else if (job.err) {
                rs.err = job.err; rs.what = job.err_what; rs.off = job.err_off;
            }
        }
    } else {
        h = XXH3_64bits(view.buf, 0);
    }
    if (fd >= 0) close(fd);
    Py_END_ALLOW_THREADS

    job_destroy(&job);
    result = read_result(&rs, path, nbytes, file_offset, want_hash, h);
out:
    PyBuffer_Release(&view);
    Py_DECREF(pathb);
    return result;
}

/* ------------------------------------------------------------------------ */
/* read_to: a file region straight into its destination                     */
/* ------------------------------------------------------------------------ */

/* One read of read_to: its iovecs (the head bounce page, a run of the destination, the tail
 * bounce page: only the ones it has), the file offset of the first, the bytes that must arrive. */
typedef struct {
    struct iovec iov[3];
    int niov;
    long long foff;
    Py_ssize_t len, need;
} rreq_t;

typedef struct {
    job_t j;               /* fd, direct, next, stop, mu/cv, done[], errors */
    rreq_t *rq;
    char *dst;             /* the destination: dst[0:nbytes] holds file bytes [off, off+nbytes) */
    long long off;
    Py_ssize_t nbytes;
    char *head, *tail;     /* bounce pages for the partial first and last pages (or NULL) */
    Py_ssize_t head_skip, head_len, tail_len; /* head: head[head_skip:+head_len] -> dst[0:]; tail: -> dst[nbytes-tail_len:] */
} rjob_t;

/* preadv of one request, on to the end (a short O_DIRECT read is the end of the file). */
static int rreq_read(rjob_t *r, rreq_t *q) {
    job_t *j = &r->j;
    struct iovec iov[3];
    int niov = q->niov, first = 0, retried_direct = 0;
    memcpy(iov, q->iov, sizeof(iov));
    Py_ssize_t done = 0;
    while (done < q->len) {
        int was_direct = __atomic_load_n(&j->direct, __ATOMIC_ACQUIRE);
        ssize_t n = preadv(j->fd, iov + first, niov - first, (off_t)(q->foff + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EINVAL && !retried_direct && was_direct) {
                int e = errno;
                retried_direct = 1;
                if (drop_direct(j)) continue;
                errno = e;
            }
            job_fail(j, errno, q->foff + done, "reading", 0);
            return -1;
        }
        if (n == 0) break;
        done += n;
        for (Py_ssize_t k = n; k > 0 && first < niov;) {  /* advance past the bytes read */
            if ((Py_ssize_t)iov[first].iov_len <= k) {
                k -= (Py_ssize_t)iov[first].iov_len;
                first++;
            } else {
                iov[first].iov_base = (char *)iov[first].iov_base + k;
                iov[first].iov_len -= (size_t)k;
                k = 0;
            }
        }
        if (was_direct && (n % FCK_ALIGN) != 0) break;
    }
    if (done < q->need) {
        job_fail(j, 0, q->foff + done, "reading", 1);
        return -1;
    }
    return 0;
}

static void *rjob_worker(void *arg) {
    rjob_t *r = (rjob_t *)arg;
    job_t *j = &r->j;
    for (;;) {
        if (__atomic_load_n(&j->stop, __ATOMIC_ACQUIRE)) break;
        Py_ssize_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_ACQ_REL);
        if (i >= j->nblocks) break;
        if (rreq_read(r, &r->rq[i])) break;
        /* the partial pages into place before the block counts as landed (the hash reads them) */
        if (i == 0 && r->head) memcpy(r->dst, r->head + r->head_skip, (size_t)r->head_len);
        if (i == j->nblocks - 1 && r->tail) memcpy(r->dst + r->nbytes - r->tail_len, r->tail, (size_t)r->tail_len);
        pthread_mutex_lock(&j->mu);
        j->done[i] = 1;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
    return NULL;
}

PyDoc_STRVAR(read_to_doc,
"read_to(path, file_offset, address, nbytes, direct=True, block_size=0, depth=0, hash=True)\n"
"--\n\n"
"Read exactly nbytes at file_offset into the raw memory [address, address+nbytes) (which the\n"
"caller keeps alive) and return their xxh3_64, each block hashed in order as it lands (None\n"
"with hash=False). With direct and address % 4096 == file_offset % 4096, every byte is read\n"
"with O_DIRECT: the whole pages straight into the destination, the partial first and last\n"
"pages into bounce pages in the same requests (preadv), then copied; no byte outside\n"
"[address, address+nbytes) is written. Otherwise buffered reads straight into it.");

static PyObject *py_read_to(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "file_offset", "address", "nbytes", "direct", "block_size", "depth", "hash",
                             NULL};
    PyObject *pathb = NULL, *result = NULL;
    long long file_offset;
    unsigned long long address;
    Py_ssize_t nbytes, block = 0;
    int direct = 1, depth = 0, want_hash = 1, nth = 0, have_job = 0;
    rjob_t r;
    pthread_t th[FCK_MAX_DEPTH];
    uint64_t h = 0;
    XXH3_state_t hs;
    rstatus_t rs = {0, 0, 1, 0, 0, NULL};
    char *bounce = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&LKn|pnip:read_to", kwlist, PyUnicode_FSConverter, &pathb,
                                     &file_offset, &address, &nbytes, &direct, &block, &depth, &want_hash))
        return NULL;
    const char *path = PyBytes_AS_STRING(pathb);
    memset(&r, 0, sizeof(r));
    if (file_offset > FCK_MAX_OFFSET && nbytes >= 0) { /* past any file: as any offset past the end */
        PyErr_Format(PyExc_EOFError, "%s: expected %zd bytes at offset %lld, past the end of the file", path,
                     nbytes, file_offset);
        goto out;
    }
    if (file_offset < 0 || nbytes < 0 || nbytes > (Py_ssize_t)(INT64_MAX / 4) || (nbytes > 0 && !address)) {
        PyErr_SetString(PyExc_ValueError, "file_offset, address or nbytes out of range");
        goto out;
    }
    if (check_tuning(&block, &depth)) goto out;
    if (job_init(&r.j)) {
        PyErr_SetString(PyExc_RuntimeError, "pthread init failed");
        goto out;
    }
    have_job = 1;
    r.dst = (char *)(uintptr_t)address;
    r.off = file_offset;
    r.nbytes = nbytes;
    long long end = file_offset + nbytes;
    long long lo = round_up(file_offset, FCK_ALIGN), hi = end / FCK_ALIGN * FCK_ALIGN;
    int use_direct = direct && nbytes > 0 && (long long)(address % FCK_ALIGN) == file_offset % FCK_ALIGN &&
                     hi > lo;
    if (use_direct && (lo > file_offset || hi < end)) {
        bounce = aligned_alloc((size_t)FCK_ALIGN, (size_t)(2 * FCK_ALIGN));
        if (!bounce) {
            PyErr_NoMemory();
            goto out;
        }
    }
    /* the requests: [lo, hi) in blocks, the head page with the first, the tail page with the last */
    Py_ssize_t body = use_direct ? (Py_ssize_t)(hi - lo) : nbytes;
    Py_ssize_t nreq = body > 0 ? (body + block - 1) / block : 1;
    r.rq = PyMem_Calloc((size_t)nreq, sizeof(rreq_t));
    r.j.done = calloc((size_t)nreq, 1);
    if (!r.rq || !r.j.done) {
        PyErr_NoMemory();
        goto out;
    }
    long long base = use_direct ? lo : file_offset;
    char *mem = r.dst + (base - file_offset);
    for (Py_ssize_t i = 0; i < nreq; i++) {
        rreq_t *q = &r.rq[i];
        Py_ssize_t len = body - i * block < block ? body - i * block : block;
        q->foff = base + (long long)i * block;
        if (i == 0 && use_direct && lo > file_offset) {
            r.head = bounce;
            r.head_skip = (Py_ssize_t)(file_offset % FCK_ALIGN);
            r.head_len = (Py_ssize_t)(lo - file_offset);
            q->iov[q->niov].iov_base = bounce;
            q->iov[q->niov++].iov_len = (size_t)FCK_ALIGN;
            q->foff -= FCK_ALIGN;
            q->len += FCK_ALIGN;
            q->need += FCK_ALIGN;
        }
        if (len > 0) {
            q->iov[q->niov].iov_base = mem + (Py_ssize_t)i * block;
            q->iov[q->niov++].iov_len = (size_t)len;
            q->len += len;
            q->need += len;
        }
        if (i == nreq - 1 && use_direct && hi < end) {
            r.tail = bounce + FCK_ALIGN;
            r.tail_len = (Py_ssize_t)(end - hi);
            q->iov[q->niov].iov_base = r.tail;
            q->iov[q->niov++].iov_len = (size_t)FCK_ALIGN;
            q->len += FCK_ALIGN;
            q->need += r.tail_len;
        }
    }
    r.j.nblocks = nreq;

    Py_BEGIN_ALLOW_THREADS
    struct stat st;
    int fd = open_shard(path, &use_direct, end, &rs);
    if (fd < 0) {
        /* rs says why */
    } else if (nbytes > 0) {
        r.j.fd = fd;
        r.j.direct = use_direct;  /* O_DIRECT refused at open: the same requests, buffered */
        int want = nreq > 1 ? (int)(nreq < depth ? nreq : depth) : 0;
        nth = want ? start_threads(rjob_worker, &r, th, want) : 0;
        XXH3_64bits_reset(&hs);
        if (nth == 0) rjob_worker(&r);
        /* hash the destination in order, each block as soon as it (and its partial page) landed */
        Py_ssize_t hashed = 0;
        for (Py_ssize_t i = 0; i < nreq && want_hash; i++) {
            pthread_mutex_lock(&r.j.mu);
            while (!r.j.done[i] && !r.j.err && !r.j.eof) pthread_cond_wait(&r.j.cv, &r.j.mu);
            int bad = r.j.err || r.j.eof;
            pthread_mutex_unlock(&r.j.mu);
            if (bad) break;
            Py_ssize_t upto = i == nreq - 1 ? nbytes : (Py_ssize_t)(base - file_offset) + (i + 1) * block;
            for (; hashed < upto;) {
                Py_ssize_t k = upto - hashed < FCK_HASH_CHUNK ? upto - hashed : FCK_HASH_CHUNK;
                fck_update(&hs, r.dst + hashed, (size_t)k);
                hashed += k;
            }
        }
        if (nth > 0) join_workers(th, nth);
        h = XXH3_64bits_digest(&hs);
        if (r.j.eof) {
            rs.eof = 1;
            rs.fsize = fstat(fd, &st) == 0 ? (long long)st.st_size : r.j.err_off;
        } else if (r.j.err) {
            rs.err = r.j.err; rs.what = r.j.err_what; rs.off = r.j.err_off;
        }
    } else {
        h = XXH3_64bits(NULL, 0);
    }
    if (fd >= 0) close(fd);
    Py_END_ALLOW_THREADS

    result = read_result(&rs, path, nbytes, file_offset, want_hash, h);
out:
    if (have_job) job_destroy(&r.j);  /* frees done[] */
    PyMem_Free(r.rq);
    free(bounce);
    Py_DECREF(pathb);
    return result;
}

/* ------------------------------------------------------------------------ */
/* hash                                                                      */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(hash_doc, "hash(buf, nbytes)\n--\n\nxxh3_64 (seed 0) of buf[0:nbytes].");

static PyObject *py_hash(PyObject *self, PyObject *args) {
    PyObject *bufobj;
    Py_ssize_t nbytes;
    Py_buffer view;
    uint64_t h;
    if (!PyArg_ParseTuple(args, "On:hash", &bufobj, &nbytes)) return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (check_nbytes(&view, nbytes)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (nbytes >= FCK_NOGIL_HASH_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = fck_h64(view.buf, (size_t)nbytes);
        Py_END_ALLOW_THREADS
    } else {
        h = fck_h64(view.buf, (size_t)nbytes);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* ------------------------------------------------------------------------ */
/* copy_hash: staging copy with the checksum fused into the same pass        */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(copy_hash_doc,
"copy_hash(dst, dst_offset, src_address, nbytes, hash=True)\n--\n\n"
"Copy nbytes from the raw address src_address into dst[dst_offset:dst_offset+nbytes] on one\n"
"thread with the GIL released; with hash=True also return their xxh3_64, computed on each\n"
"256 KiB step right after it is copied (still in cache), else None.  The caller guarantees\n"
"that src_address holds nbytes readable bytes that do not overlap dst.");

#define FCK_COPY_STEP ((Py_ssize_t)256 << 10)

static PyObject *py_copy_hash(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dst", "dst_offset", "src_address", "nbytes", "hash", NULL};
    PyObject *bufobj;
    Py_ssize_t off, nbytes;
    unsigned long long src;
    int want = 1;
    Py_buffer view;
    uint64_t h = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnKn|p:copy_hash", kwlist, &bufobj, &off, &src,
                                     &nbytes, &want))
        return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_WRITABLE) < 0) return NULL;
    if (off < 0 || nbytes < 0 || off > view.len || nbytes > view.len - off || (nbytes && !src)) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes to offset %zd outside buffer of %zd bytes",
                     nbytes, off, view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    char *dst = (char *)view.buf + off;
    const char *s = (const char *)(uintptr_t)src;
    Py_BEGIN_ALLOW_THREADS
    if (want) {
        XXH3_state_t st;
        XXH3_64bits_reset(&st);
        for (Py_ssize_t p = 0; p < nbytes; p += FCK_COPY_STEP) {
            Py_ssize_t n = nbytes - p < FCK_COPY_STEP ? nbytes - p : FCK_COPY_STEP;
            memcpy(dst + p, s + p, (size_t)n);
            fck_update(&st, dst + p, (size_t)n);
        }
        h = XXH3_64bits_digest(&st);
    } else if (nbytes) {
        memcpy(dst, s, (size_t)nbytes);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (!want) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(copy_doc,
"copy(dst_address, src_address, nbytes)\n--\n\n"
"memcpy between raw addresses on one thread with the GIL released (no thread pool to spin\n"
"afterwards).  The caller guarantees both ranges are valid and do not overlap.");

static PyObject *py_copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst, &src, &nbytes)) return NULL;
    if (nbytes < 0 || (nbytes && (!dst || !src))) {
        PyErr_SetString(PyExc_ValueError, "copy: null address or negative length");
        return NULL;
    }
    if (nbytes >= FCK_NOGIL_HASH_MIN) {
        Py_BEGIN_ALLOW_THREADS
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)nbytes);
        Py_END_ALLOW_THREADS
    } else if (nbytes) {
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)nbytes);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* copy_many: a staging copy of many ranges split evenly over threads        */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(copy_many_doc,
"copy_many(copies, threads)\n--\n\n"
"memcpy every (dst_address, src_address, nbytes) of the sequence copies, with the GIL\n"
"released, the total bytes split into `threads` equal shares (a range may be cut between two\n"
"shares), one share on the calling thread and one on each extra worker thread.  One thread\n"
"does not saturate a host's memory bandwidth: on the build VM, 1.5 GiB of 64 MiB tensors took\n"
"0.09 s on two threads, 0.16-0.17 s on one, and torch's copy_ on two threads 0.15 s.\n"
"Returns the number of threads used.  The caller guarantees every range is valid and that\n"
"no destination overlaps a source or another destination.");

/* A large copy: non-temporal stores, four pages interleaved, the source prefetched ahead.
 * glibc 2.36's memcpy switches to such a loop only for a single copy of 16x its non-temporal
 * threshold (~100 MiB here); below that, a staging copy of 64 MiB tensors ran at 0.28 s per
 * 1.5 GiB on one thread against 0.19-0.20 s with this loop (benchmarks: docs/benchmarks.md). */
#define FCK_NT_MIN ((size_t)1 << 20)
#define FCK_PG 4096
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

static void copy_range(char *d, const char *s, size_t n) {
#if defined(__x86_64__) && defined(__SSE2__)
    if (n >= FCK_NT_MIN) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        const size_t blk = 4 * FCK_PG;
        for (; n >= blk; d += blk, s += blk, n -= blk) {
            for (size_t off = 0; off < FCK_PG; off += 128) {
                __m128i v[32];
                for (int p = 0; p < 4; p++) {
                    _mm_prefetch(s + p * FCK_PG + off + 256, _MM_HINT_T0);
                    _mm_prefetch(s + p * FCK_PG + off + 320, _MM_HINT_T0);
                }
                for (int p = 0; p < 4; p++)
                    for (int k = 0; k < 8; k++)
                        v[p * 8 + k] = _mm_loadu_si128((const __m128i *)(s + p * FCK_PG + off + 16 * k));
                for (int p = 0; p < 4; p++)
                    for (int k = 0; k < 8; k++)
                        _mm_stream_si128((__m128i *)(d + p * FCK_PG + off + 16 * k), v[p * 8 + k]);
            }
        }
        _mm_sfence(); /* the streamed stores are visible before anyone is told the copy ended */
    }
#endif
    memcpy(d, s, n);
}

typedef struct {
    const uint64_t *tab; /* n x (dst, src, len) */
    Py_ssize_t n;
    uint64_t lo, hi;     /* this share: [lo, hi) of the concatenated ranges */
} copy_share_t;

static void *copy_share(void *arg) {
    const copy_share_t *c = (const copy_share_t *)arg;
    uint64_t pos = 0;
    for (Py_ssize_t i = 0; i < c->n && pos < c->hi; i++) {
        uint64_t len = c->tab[3 * i + 2];
        uint64_t a = pos > c->lo ? pos : c->lo, z = pos + len < c->hi ? pos + len : c->hi;
        if (z > a)
            copy_range((char *)(uintptr_t)c->tab[3 * i] + (a - pos),
                       (const char *)(uintptr_t)c->tab[3 * i + 1] + (a - pos), (size_t)(z - a));
        pos += len;
    }
    return NULL;
}

#define FCK_COPY_MAX_THREADS 64
#define FCK_COPY_MIN_SHARE ((uint64_t)4 << 20) /* a thread is not worth starting for less */

static PyObject *py_copy_many(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi:copy_many", &seq, &threads)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "copy_many: copies must be a sequence of (dst, src, nbytes)");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *tab = PyMem_Malloc(sizeof(uint64_t) * 3 * (size_t)(n ? n : 1));
    if (!tab) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long d, s;
        Py_ssize_t len;
        PyObject *item = PySequence_Tuple(PySequence_Fast_GET_ITEM(fast, i)); /* a list too */
        int ok = item && PyArg_ParseTuple(item, "KKn:copy_many", &d, &s, &len);
        Py_XDECREF(item);
        if (!ok) {
            PyMem_Free(tab);
            Py_DECREF(fast);
            return NULL;
        }
        if (len < 0 || (len && (!d || !s))) {
            PyErr_Format(PyExc_ValueError, "copy_many: copy %zd has a null address or a negative length", i);
            PyMem_Free(tab);
            Py_DECREF(fast);
            return NULL;
        }
        tab[3 * i] = d, tab[3 * i + 1] = s, tab[3 * i + 2] = (uint64_t)len;
        total += (uint64_t)len;
    }
    Py_DECREF(fast);
    int want = threads < 1 ? 1 : threads > FCK_COPY_MAX_THREADS ? FCK_COPY_MAX_THREADS : threads;
    if ((uint64_t)want > total / FCK_COPY_MIN_SHARE) want = (int)(total / FCK_COPY_MIN_SHARE);
    if (want < 1) want = 1;
    copy_share_t shares[FCK_COPY_MAX_THREADS];
    pthread_t th[FCK_COPY_MAX_THREADS];
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    /* shares of 64-byte multiples of the concatenated ranges (two threads may still meet
     * inside one destination cache line where a range starts unaligned: correct, rare) */
    uint64_t each = (total / (uint64_t)want + 63) & ~(uint64_t)63;
    for (int k = 0; k < want; k++) {
        uint64_t lo = each * (uint64_t)k, hi = k == want - 1 ? total : lo + each;
        shares[k] = (copy_share_t){tab, n, lo < total ? lo : total, hi < total ? hi : total};
    }
    for (int k = 1; k < want; k++) { /* a thread that fails to start: its share runs here */
        if (start_threads(copy_share, &shares[k], &th[started], 1) == 1)
            started++;
        else
            copy_share(&shares[k]);
    }
    copy_share(&shares[0]);
    join_workers(th, started);
    Py_END_ALLOW_THREADS
    PyMem_Free(tab);
    return PyLong_FromLong(started + 1);
}

/* ------------------------------------------------------------------------ */

/* Testing aid: force the portable (SSE2) kernels, or go back to AVX2 when the CPU has it. */
static PyObject *py_set_hash_impl(PyObject *self, PyObject *arg) {
    int want_avx2 = PyObject_IsTrue(arg);
    if (want_avx2 < 0) return NULL;
#ifdef FCK_AVX2
    int old = fck_use_avx2;
    fck_use_avx2 = want_avx2 && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(old);
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_hash_impl(PyObject *self, PyObject *unused) {
#ifdef FCK_AVX2
    return PyUnicode_FromString(fck_use_avx2 ? "avx2" : "sse2");
#else
    return PyUnicode_FromString("generic");
#endif
}

/* ------------------------------------------------------------------------ */
/* byte grouping for the compression codec (fastckpt.storage.codec)          */
/* ------------------------------------------------------------------------ */

/* group: n elements of W bytes in s -> W planes of n bytes in d (plane k = byte k of every
 * element); ungroup is the inverse.  W is a compile-time constant in each instance so that the
 * compiler turns the inner loop into SSE2 shuffles: 13-15 GB/s on one core for a 4 MiB block,
 * 8-12 GB/s for 16 MiB (AVX2 instances were no faster, so there are none).  Bytes are moved,
 * never interpreted: every kernel gives the same result. */
#define FCK_DEF_REGROUP(W)                                                                        \
    static void fck_group##W(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {          \
        for (size_t i = 0; i < n; i++)                                                            \
            for (size_t k = 0; k < (W); k++) d[k * n + i] = s[i * (W) + k];                       \
    }                                                                                             \
    static void fck_ungroup##W(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {        \
        for (size_t i = 0; i < n; i++)                                                            \
            for (size_t k = 0; k < (W); k++) d[i * (W) + k] = s[k * n + i];                       \
    }

FCK_DEF_REGROUP(2)
FCK_DEF_REGROUP(4)
FCK_DEF_REGROUP(8)

typedef void (*fck_regroup_fn)(const uint8_t *restrict, uint8_t *restrict, size_t);

#if defined(__SSE2__)
#include <emmintrin.h>
/* width 8 (the compiler does not vectorize this direction): 16 elements per step, an 8x16 byte
 * transpose in four rounds of unpacks (even/odd elements, then 2-, 4-, 8-byte groups). */
static void fck_group8_sse2(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m128i *p = (const __m128i *)(s + i * 8);
        __m128i a0 = _mm_loadu_si128(p + 0), a1 = _mm_loadu_si128(p + 1);
        __m128i a2 = _mm_loadu_si128(p + 2), a3 = _mm_loadu_si128(p + 3);
        __m128i a4 = _mm_loadu_si128(p + 4), a5 = _mm_loadu_si128(p + 5);
        __m128i a6 = _mm_loadu_si128(p + 6), a7 = _mm_loadu_si128(p + 7);
        __m128i b0 = _mm_unpacklo_epi8(a0, a1), b1 = _mm_unpackhi_epi8(a0, a1);
        __m128i b2 = _mm_unpacklo_epi8(a2, a3), b3 = _mm_unpackhi_epi8(a2, a3);
        __m128i b4 = _mm_unpacklo_epi8(a4, a5), b5 = _mm_unpackhi_epi8(a4, a5);
        __m128i b6 = _mm_unpacklo_epi8(a6, a7), b7 = _mm_unpackhi_epi8(a6, a7);
        __m128i c0 = _mm_unpacklo_epi16(b0, b2), c1 = _mm_unpackhi_epi16(b0, b2);
        __m128i c2 = _mm_unpacklo_epi16(b1, b3), c3 = _mm_unpackhi_epi16(b1, b3);
        __m128i c4 = _mm_unpacklo_epi16(b4, b6), c5 = _mm_unpackhi_epi16(b4, b6);
        __m128i c6 = _mm_unpacklo_epi16(b5, b7), c7 = _mm_unpackhi_epi16(b5, b7);
        __m128i d0 = _mm_unpacklo_epi32(c0, c4), d1 = _mm_unpackhi_epi32(c0, c4);
        __m128i d2 = _mm_unpacklo_epi32(c1, c5), d3 = _mm_unpackhi_epi32(c1, c5);
        __m128i d4 = _mm_unpacklo_epi32(c2, c6), d5 = _mm_unpackhi_epi32(c2, c6);
        __m128i d6 = _mm_unpacklo_epi32(c3, c7), d7 = _mm_unpackhi_epi32(c3, c7);
        _mm_storeu_si128((__m128i *)(d + 0 * n + i), _mm_unpacklo_epi8(d0, d4));
        _mm_storeu_si128((__m128i *)(d + 1 * n + i), _mm_unpackhi_epi8(d0, d4));
        _mm_storeu_si128((__m128i *)(d + 2 * n + i), _mm_unpacklo_epi8(d1, d5));
        _mm_storeu_si128((__m128i *)(d + 3 * n + i), _mm_unpackhi_epi8(d1, d5));
        _mm_storeu_si128((__m128i *)(d + 4 * n + i), _mm_unpacklo_epi8(d2, d6));
        _mm_storeu_si128((__m128i *)(d + 5 * n + i), _mm_unpackhi_epi8(d2, d6));
        _mm_storeu_si128((__m128i *)(d + 6 * n + i), _mm_unpacklo_epi8(d3, d7));
        _mm_storeu_si128((__m128i *)(d + 7 * n + i), _mm_unpackhi_epi8(d3, d7));
    }
    for (; i < n; i++)
        for (size_t k = 0; k < 8; k++) d[k * n + i] = s[i * 8 + k];
}
#endif

static void fck_regroup_any(const uint8_t *restrict s, uint8_t *restrict d, size_t n, size_t w,
                            int inverse) {
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < w; k++) {
            if (inverse) d[i * w + k] = s[k * n + i];
            else d[k * n + i] = s[i * w + k];
        }
}

static fck_regroup_fn fck_regroup_kernel(size_t w, int inverse) {
    switch (w) {
    case 2: return inverse ? fck_ungroup2 : fck_group2;
    case 4: return inverse ? fck_ungroup4 : fck_group4;
#if defined(__SSE2__)
    case 8: return inverse ? fck_ungroup8 : fck_group8_sse2;
#else
    case 8: return inverse ? fck_ungroup8 : fck_group8;
#endif
    }
    return NULL;
}

#define FCK_GROUP_WIDTH_MAX 64

static PyObject *fck_regroup(PyObject *args, int inverse, const char *fmt) {
    PyObject *srcobj, *dstobj;
    Py_ssize_t w;
    Py_buffer sv, dv;
    if (!PyArg_ParseTuple(args, fmt, &srcobj, &dstobj, &w)) return NULL;
    if (w < 1 || w > FCK_GROUP_WIDTH_MAX) {
        PyErr_Format(PyExc_ValueError, "width must be 1..%d, got %zd", FCK_GROUP_WIDTH_MAX, w);
        return NULL;
    }
    if (PyObject_GetBuffer(srcobj, &sv, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(dstobj, &dv, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    const uint8_t *s = (const uint8_t *)sv.buf;
    uint8_t *d = (uint8_t *)dv.buf;
    size_t nbytes = (size_t)sv.len;
    if (dv.len < sv.len) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes is shorter than the source (%zd)",
                     dv.len, sv.len);
        goto fail;
    }
    if (nbytes && s < d + nbytes && d < s + nbytes) {
        PyErr_SetString(PyExc_ValueError, "source and destination overlap");
        goto fail;
    }
    size_t n = nbytes / (size_t)w, body = n * (size_t)w;
    fck_regroup_fn fn = fck_regroup_kernel((size_t)w, inverse);
    Py_BEGIN_ALLOW_THREADS
    if (w == 1) memcpy(d, s, nbytes);
    else if (fn) fn(s, d, n);
    else fck_regroup_any(s, d, n, (size_t)w, inverse);
    if (w > 1 && nbytes > body) memcpy(d + body, s + body, nbytes - body); /* the tail, as is */
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return NULL;
}

PyDoc_STRVAR(byte_group_doc,
"byte_group(src, dst, width)\n--\n\n"
"Byte grouping: the n = len(src) // width elements of width bytes in src become width planes\n"
"of n bytes in dst[0:n*width] (plane k holds byte k of every element, in order); the\n"
"len(src) % width tail bytes follow as they are.  Writes exactly len(src) bytes of dst (which\n"
"must be at least that long and must not overlap src); the GIL is released.");

static PyObject *py_byte_group(PyObject *self, PyObject *args) {
    return fck_regroup(args, 0, "OOn:byte_group");
}

PyDoc_STRVAR(byte_ungroup_doc,
"byte_ungroup(src, dst, width)\n--\n\n"
"The inverse of byte_group: width planes of n = len(src) // width bytes in src become n\n"
"interleaved elements in dst; the tail bytes follow as they are.  Writes exactly len(src)\n"
"bytes of dst; the GIL is released.");

static PyObject *py_byte_ungroup(PyObject *self, PyObject *args) {
    return fck_regroup(args, 1, "OOn:byte_ungroup");
}

static PyMethodDef methods[] = {
    {"_set_hash_avx2", py_set_hash_impl, METH_O, "testing aid: enable/disable the AVX2 hash kernels; returns the old state"},
    {"hash_impl", py_hash_impl, METH_NOARGS, "which xxh3 kernels are in use: avx2, sse2 or generic"},
    {"write_file", (PyCFunction)(void (*)(void))py_write_file, METH_VARARGS | METH_KEYWORDS, write_file_doc},
    {"read_into", (PyCFunction)(void (*)(void))py_read_into, METH_VARARGS | METH_KEYWORDS, read_into_doc},
    {"read_to", (PyCFunction)(void (*)(void))py_read_to, METH_VARARGS | METH_KEYWORDS, read_to_doc},
    {"hash", py_hash, METH_VARARGS, hash_doc},
    {"copy", py_copy, METH_VARARGS, copy_doc},
    {"copy_many", py_copy_many, METH_VARARGS, copy_many_doc},
    {"write_segments", (PyCFunction)(void (*)(void))py_write_segments, METH_VARARGS | METH_KEYWORDS,
     write_segments_doc},
    {"copy_hash", (PyCFunction)(void (*)(void))py_copy_hash, METH_VARARGS | METH_KEYWORDS, copy_hash_doc},
    {"byte_group", py_byte_group, METH_VARARGS, byte_group_doc},
    {"byte_ungroup", py_byte_ungroup, METH_VARARGS, byte_ungroup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "fastckpt._native_ext",
    "Native hot I/O path of fastckpt (fused write/read + xxh3_64). Load via fastckpt._native.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__native_ext(void) {
#ifdef FCK_AVX2
    __builtin_cpu_init();
    fck_use_avx2 = __builtin_cpu_supports("avx2") != 0;
#endif
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "DEFAULT_BLOCK_SIZE", (long)FCK_DEFAULT_BLOCK) ||
        PyModule_AddIntConstant(m, "DEFAULT_DEPTH", FCK_DEFAULT_DEPTH) ||
        PyModule_AddIntConstant(m, "ALIGN", (long)FCK_ALIGN) ||
        PyModule_AddIntConstant(m, "XXH_VERSION", XXH_VERSION_NUMBER)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
