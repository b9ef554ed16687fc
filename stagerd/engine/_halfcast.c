/* F16 casts with the F16C instructions, for stagerd/engine/cast.py.
 *
 * numpy's float16 loops are scalar (0.6-1.4 GB/s here); these run at memory speed. Each function takes a
 * source and a destination buffer, checks they hold the same number of elements, and converts with the
 * GIL released, so the export threads cast in parallel. The rounding and NaN patterns are torch's:
 *   F32 -> F16 and BF16 -> F16: VCVTPS2PH, round to nearest even, NaN -> sign | 0x7e00 | payload >> 13;
 *   F16 -> F32: VCVTPH2PS, exact, a NaN gets its quiet bit;
 *   F16 -> BF16: through F32, then round to nearest even on the bits, any NaN -> 0x7fc0.
 * The caller uses this module only when `F16C` is true; there is no scalar path, the tails go through the
 * same vector code by way of a zero-padded block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

typedef void (*block_fn)(const void *src, void *dst, Py_ssize_t n);

__attribute__((target("avx2,f16c"))) static void f32_to_f16(const void *src, void *dst, Py_ssize_t n) {
    const float *s = src;
    uint16_t *d = dst;
    for (Py_ssize_t i = 0; i < n; i += LANES) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
}

__attribute__((target("avx2,f16c"))) static void f16_to_f32(const void *src, void *dst, Py_ssize_t n) {
    const uint16_t *s = src;
    float *d = dst;
    for (Py_ssize_t i = 0; i < n; i += LANES) {
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    }
}

__attribute__((target("avx2,f16c"))) static void bf16_to_f16(const void *src, void *dst, Py_ssize_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    for (Py_ssize_t i = 0; i < n; i += LANES) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)); /* BF16 is F32's top half */
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
}

/* F32 bits -> BF16 in the low half of each lane: round to nearest even, NaN -> 0x7fc0. */
__attribute__((target("avx2,f16c"))) static inline __m256i f32_bits_to_bf16(__m256 f) {
    __m256i bits = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

__attribute__((target("avx2,f16c"))) static void f16_to_bf16(const void *src, void *dst, Py_ssize_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    for (Py_ssize_t i = 0; i < n; i += LANES) {
        __m256i b = f32_bits_to_bf16(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
        /* packus works per 128-bit lane: 4 results from each half, then join the halves */
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)(d + i), packed);
    }
}

static PyObject *run(PyObject *args, block_fn fn, Py_ssize_t src_size, Py_ssize_t dst_size) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) {
        return NULL;
    }
    Py_ssize_t n = src.len / src_size;
    if (src.len % src_size || dst.len != n * dst_size) {
        PyErr_Format(PyExc_ValueError, "cast of %zd source bytes into %zd destination bytes", src.len, dst.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_ssize_t body = n - n % LANES;
    Py_BEGIN_ALLOW_THREADS;
    fn(src.buf, dst.buf, body);
    if (body < n) {
        unsigned char s_tail[LANES * 4] = {0}, d_tail[LANES * 4];
        memcpy(s_tail, (const char *)src.buf + body * src_size, (n - body) * src_size);
        fn(s_tail, d_tail, LANES);
        memcpy((char *)dst.buf + body * dst_size, d_tail, (n - body) * dst_size);
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyObject *py_f32_to_f16(PyObject *self, PyObject *args) { return run(args, f32_to_f16, 4, 2); }
static PyObject *py_f16_to_f32(PyObject *self, PyObject *args) { return run(args, f16_to_f32, 2, 4); }
static PyObject *py_bf16_to_f16(PyObject *self, PyObject *args) { return run(args, bf16_to_f16, 2, 2); }
static PyObject *py_f16_to_bf16(PyObject *self, PyObject *args) { return run(args, f16_to_bf16, 2, 2); }

static PyMethodDef methods[] = {
    {"f32_to_f16", py_f32_to_f16, METH_VARARGS, "f32_to_f16(src, dst): F32 -> F16, torch's bits."},
    {"f16_to_f32", py_f16_to_f32, METH_VARARGS, "f16_to_f32(src, dst): F16 -> F32, torch's bits."},
    {"bf16_to_f16", py_bf16_to_f16, METH_VARARGS, "bf16_to_f16(src, dst): BF16 -> F16, torch's bits."},
    {"f16_to_bf16", py_f16_to_bf16, METH_VARARGS, "f16_to_bf16(src, dst): F16 -> BF16, torch's bits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_halfcast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__halfcast(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    __builtin_cpu_init();
    int usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (PyModule_AddObjectRef(m, "F16C", usable ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
