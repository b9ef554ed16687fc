/* Tile-wise strided copies, for stagerd/engine/strided.py: the transposing placements of a gather.
 *
 * copy2d(src, src_offset, src_row, src_col, dst, dst_offset, dst_row, dst_col, rows, cols, itemsize)
 * sets element (i, j) of the destination, at byte dst_offset + i*dst_row + j*dst_col of dst, to the
 * source element at src_offset + i*src_row + j*src_col of src, for i < rows and j < cols. Strides are in
 * bytes and must not be negative; every byte touched is checked to lie inside its buffer before any is
 * copied. A transpose runs in TILE x TILE tiles, reading and writing whole runs (numpy's own strided copy
 * walks one side a cache line per element: 0.15 GB/s against several GB/s here). The GIL is released, so
 * the export threads copy in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#define RUN_BYTES 1024 /* a tile's runs on either side: long enough to amortise a TLB walk */

/* The transpose: the source runs along i (src_row == itemsize), the destination along j
 * (dst_col == itemsize). Each tile of RUN_BYTES / itemsize elements square is read run by run into a
 * contiguous buffer, then written to the destination rows eight at a time: both big strides are walked
 * whole runs at a time (runs of 64 bytes ran at 0.24-0.7 GB/s on power-of-two strides, 1 KiB ones at 2-5 GB/s),
 * and the strided reads stay inside the buffer. */
#define TRANSPOSE_TILES(T)                                                                               \
    {                                                                                                    \
        const Py_ssize_t tile = RUN_BYTES / sizeof(T);                                                   \
        T *tmp = tmp_buf;                                                                                \
        for (Py_ssize_t i0 = 0; i0 < rows; i0 += tile) {                                                 \
            Py_ssize_t ni = rows - i0 < tile ? rows - i0 : tile;                                         \
            for (Py_ssize_t j0 = 0; j0 < cols; j0 += tile) {                                             \
                Py_ssize_t nj = cols - j0 < tile ? cols - j0 : tile;                                     \
                for (Py_ssize_t j = 0; j < nj; j++) {                                                    \
                    memcpy(tmp + j * tile, src + i0 * src_row + (j0 + j) * src_col, ni * sizeof(T));     \
                }                                                                                        \
                for (Py_ssize_t i = 0; i < ni; i += 8) {                                                 \
                    Py_ssize_t m = ni - i < 8 ? ni - i : 8;                                              \
                    T *d[8];                                                                             \
                    for (Py_ssize_t k = 0; k < m; k++) {                                                 \
                        d[k] = (T *)(dst + (i0 + i + k) * dst_row + j0 * dst_col);                       \
                    }                                                                                    \
                    for (Py_ssize_t j = 0; j < nj; j++) {                                                \
                        const T *t = tmp + j * tile + i;                                                 \
                        for (Py_ssize_t k = 0; k < m; k++) {                                             \
                            d[k][j] = t[k];                                                              \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

static void copy_tiles(const char *src, Py_ssize_t src_row, Py_ssize_t src_col, char *dst, Py_ssize_t dst_row,
                       Py_ssize_t dst_col, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t itemsize, void *tmp_buf) {
    if (src_col == itemsize && dst_col == itemsize) { /* rows of runs on both sides */
        for (Py_ssize_t i = 0; i < rows; i++) {
            memcpy(dst + i * dst_row, src + i * src_row, cols * itemsize);
        }
        return;
    }
    if (src_row == itemsize && dst_col == itemsize && tmp_buf != NULL) {
        switch (itemsize) {
        case 1:
            TRANSPOSE_TILES(uint8_t);
            return;
        case 2:
            TRANSPOSE_TILES(uint16_t);
            return;
        case 4:
            TRANSPOSE_TILES(uint32_t);
            return;
        case 8:
            TRANSPOSE_TILES(uint64_t);
            return;
        }
    }
    for (Py_ssize_t i = 0; i < rows; i++) { /* any other strides: element by element, still in C */
        for (Py_ssize_t j = 0; j < cols; j++) {
            memcpy(dst + i * dst_row + j * dst_col, src + i * src_row + j * src_col, itemsize);
        }
    }
}

/* Whether rows x cols elements at offset with these strides lie inside a buffer of len bytes. */
static int inside(Py_ssize_t len, Py_ssize_t offset, Py_ssize_t row, Py_ssize_t col, Py_ssize_t rows,
                  Py_ssize_t cols, Py_ssize_t itemsize) {
    if (offset < 0 || offset > len || row < 0 || col < 0) {
        return 0;
    }
    if (rows == 0 || cols == 0) {
        return offset <= len;
    }
    /* the last element's end, computed without overflow: each term is checked against len first */
    Py_ssize_t end = offset;
    if ((rows - 1) > 0 && row > (len - end) / (rows - 1)) {
        return 0;
    }
    end += (rows - 1) * row;
    if ((cols - 1) > 0 && col > (len - end) / (cols - 1)) {
        return 0;
    }
    end += (cols - 1) * col;
    return itemsize <= len - end;
}

static PyObject *py_copy2d(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t so, sr, sc, d_o, dr, dc, rows, cols, itemsize;
    if (!PyArg_ParseTuple(args, "y*nnnw*nnnnnn", &src, &so, &sr, &sc, &dst, &d_o, &dr, &dc, &rows, &cols,
                          &itemsize)) {
        return NULL;
    }
    if (rows < 0 || cols < 0 || itemsize <= 0 || !inside(src.len, so, sr, sc, rows, cols, itemsize) ||
        !inside(dst.len, d_o, dr, dc, rows, cols, itemsize)) {
        PyErr_SetString(PyExc_ValueError, "copy2d: the strided block does not lie inside its buffer");
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    void *tmp = malloc((size_t)RUN_BYTES * RUN_BYTES / (size_t)itemsize); /* one tile */
    copy_tiles((const char *)src.buf + so, sr, sc, (char *)dst.buf + d_o, dr, dc, rows, cols, itemsize, tmp);
    free(tmp);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

/* read_runs(fd, dst, starts, run): run k of `run` bytes at file offset starts[k] (an int64 buffer) into
 * dst[k * run : (k + 1) * run], by pread, GIL released: the thin strips one slab of a big transpose needs
 * are thousands of runs of a KiB, and a Python call per run cost more than its read. Returns how many
 * runs were read whole; fewer than len(starts) means the file ended early. A failed pread raises OSError. */
static PyObject *py_read_runs(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer dst, starts;
    Py_ssize_t run;
    if (!PyArg_ParseTuple(args, "iw*y*n", &fd, &dst, &starts, &run)) {
        return NULL;
    }
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    if (run <= 0 || starts.len % sizeof(int64_t) || n > dst.len / run) {
        PyErr_SetString(PyExc_ValueError, "read_runs: the runs do not fit the buffer");
        PyBuffer_Release(&dst);
        PyBuffer_Release(&starts);
        return NULL;
    }
    const int64_t *at = starts.buf;
    Py_ssize_t k = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (; k < n; k++) {
        Py_ssize_t done = 0;
        while (done < run) {
            ssize_t got = pread(fd, (char *)dst.buf + k * run + done, run - done, at[k] + done);
            if (got < 0 && errno == EINTR) {
                continue;
            }
            if (got < 0) {
                err = errno;
                break;
            }
            if (got == 0) {
                break;
            }
            done += got;
        }
        if (err || done < run) {
            break;
        }
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&dst);
    PyBuffer_Release(&starts);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(k);
}

static PyMethodDef methods[] = {
    {"copy2d", py_copy2d, METH_VARARGS,
     "copy2d(src, src_offset, src_row, src_col, dst, dst_offset, dst_row, dst_col, rows, cols, itemsize)"},
    {"read_runs", py_read_runs, METH_VARARGS, "read_runs(fd, dst, starts, run) -> runs read whole"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tiles", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tiles(void) { return PyModule_Create(&module); }
