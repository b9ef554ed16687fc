/* Sums of a LoRA product as torch sums it on CPU, for stagerd/engine/torch_sum.py: along the rank in order,
 * in float32, from 0.0f.
 *
 *   block(left, right, out, m, r, n, fused): out[i, j] = sum over k of left[i, k] * right[k, j], the whole
 *       m x r @ r x n product; loops i, k, j, so a row of out is a run the rank steps stream over.
 *   rows(x, y, out, m, r, fused): out[i] = sum over k of x[i, k] * y[i, k], gathered rank vectors.
 *
 * All buffers are C-contiguous float32; their sizes are checked against the dims. Each step is
 * acc = fmaf(a, b, acc), one rounding (torch's BLAS), or with `fused` false acc = acc + (a * b rounded to
 * float32), two (its own loop for a small bmm): FP contraction is off (setup.py passes -ffp-contract=off)
 * so the compiler fuses nothing itself. fmaf is C99's, correctly rounded; on x86-64 the loops are built
 * twice, for the baseline (fmaf from libm) and for AVX2 + FMA (vfmadd, 8 lanes), and the second is picked
 * at import where the CPU has both: the bits are the same either way. No -march flag: the build runs on
 * any x86-64 or aarch64 (whose baseline has FMA). The GIL is released around the loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <string.h>

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#define BLOCK_BODY                                                                                       \
    for (Py_ssize_t i = 0; i < m; i++) {                                                                 \
        float *restrict acc = out + i * n;                                                               \
        memset(acc, 0, (size_t)n * sizeof(float));                                                      \
        for (Py_ssize_t k = 0; k < r; k++) {                                                             \
            const float a = left[i * r + k];                                                             \
            const float *restrict b = right + k * n;                                                     \
            if (fused) {                                                                                 \
                for (Py_ssize_t j = 0; j < n; j++) {                                                     \
                    acc[j] = fmaf(a, b[j], acc[j]);                                                      \
                }                                                                                        \
            } else {                                                                                     \
                for (Py_ssize_t j = 0; j < n; j++) {                                                     \
                    const float p = a * b[j];                                                            \
                    acc[j] = acc[j] + p;                                                                 \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

#define ROWS_BODY                                                                                        \
    for (Py_ssize_t i = 0; i < m; i++) {                                                                 \
        const float *restrict a = x + i * r, *restrict b = y + i * r;                                    \
        float acc = 0.0f;                                                                                \
        if (fused) {                                                                                     \
            for (Py_ssize_t k = 0; k < r; k++) {                                                         \
                acc = fmaf(a[k], b[k], acc);                                                             \
            }                                                                                            \
        } else {                                                                                         \
            for (Py_ssize_t k = 0; k < r; k++) {                                                         \
                const float p = a[k] * b[k];                                                             \
                acc = acc + p;                                                                           \
            }                                                                                            \
        }                                                                                                \
        out[i] = acc;                                                                                    \
    }

typedef void (*block_fn)(const float *restrict left, const float *restrict right, float *restrict out,
                         Py_ssize_t m, Py_ssize_t r, Py_ssize_t n, int fused);
typedef void (*rows_fn)(const float *restrict x, const float *restrict y, float *restrict out, Py_ssize_t m,
                        Py_ssize_t r, int fused);

static void block_base(const float *restrict left, const float *restrict right, float *restrict out, Py_ssize_t m,
                       Py_ssize_t r, Py_ssize_t n, int fused) {
    BLOCK_BODY
}

static void rows_base(const float *restrict x, const float *restrict y, float *restrict out, Py_ssize_t m,
                      Py_ssize_t r, int fused) {
    ROWS_BODY
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DISPATCH 1
__attribute__((target("avx2,fma"))) static void block_fma(const float *restrict left, const float *restrict right,
                                                          float *restrict out, Py_ssize_t m, Py_ssize_t r,
                                                          Py_ssize_t n, int fused) {
    BLOCK_BODY
}

__attribute__((target("avx2,fma"))) static void rows_fma(const float *restrict x, const float *restrict y,
                                                         float *restrict out, Py_ssize_t m, Py_ssize_t r,
                                                         int fused) {
    ROWS_BODY
}
#endif

static block_fn block_impl = block_base;
static rows_fn rows_impl = rows_base;

/* Whether a buffer holds exactly rows * cols float32 values, computed without overflow. */
static int holds(const Py_buffer *buf, Py_ssize_t rows, Py_ssize_t cols) {
    if (rows < 0 || cols < 0) {
        return 0;
    }
    if (rows > 0 && cols > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(float) / rows) {
        return 0;
    }
    return buf->len == rows * cols * (Py_ssize_t)sizeof(float);
}

static PyObject *py_block(PyObject *self, PyObject *args) {
    Py_buffer left, right, out;
    Py_ssize_t m, r, n;
    int fused;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnp", &left, &right, &out, &m, &r, &n, &fused)) {
        return NULL;
    }
    if (!holds(&left, m, r) || !holds(&right, r, n) || !holds(&out, m, n)) {
        PyErr_SetString(PyExc_ValueError, "block: the buffers do not hold m x r, r x n and m x n float32");
        PyBuffer_Release(&left);
        PyBuffer_Release(&right);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    block_impl(left.buf, right.buf, out.buf, m, r, n, fused);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&left);
    PyBuffer_Release(&right);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *py_rows(PyObject *self, PyObject *args) {
    Py_buffer x, y, out;
    Py_ssize_t m, r;
    int fused;
    if (!PyArg_ParseTuple(args, "y*y*w*nnp", &x, &y, &out, &m, &r, &fused)) {
        return NULL;
    }
    if (!holds(&x, m, r) || !holds(&y, m, r) || !holds(&out, m, 1)) {
        PyErr_SetString(PyExc_ValueError, "rows: the buffers do not hold m x r, m x r and m float32");
        PyBuffer_Release(&x);
        PyBuffer_Release(&y);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    rows_impl(x.buf, y.buf, out.buf, m, r, fused);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"block", py_block, METH_VARARGS,
     "block(left, right, out, m, r, n, fused): out = left @ right summed along r in order, float32"},
    {"rows", py_rows, METH_VARARGS, "rows(x, y, out, m, r, fused): out[i] = sum of x[i] * y[i] in order, float32"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_torchsum", NULL, -1, methods};

PyMODINIT_FUNC PyInit__torchsum(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) {
        return NULL;
    }
    int vector = 0;
#ifdef DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        block_impl = block_fma;
        rows_impl = rows_fma;
        vector = 1;
    }
#endif
    /* VECTOR: whether the AVX2 + FMA loops run (x86-64); the same bits either way. */
    if (PyModule_AddObjectRef(mod, "VECTOR", vector ? Py_True : Py_False) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
