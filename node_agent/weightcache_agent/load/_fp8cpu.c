/* Block-wise FP8 of bf16 rows on the CPU, in C, without the GIL.
 *
 * Same arithmetic and the same bytes as `fp8.quantize_rows`' torch path: per 128x128 block
 * the largest |x| (from the bf16 bits: |x| orders like its bits), a power-of-two scale 2^k
 * with amax <= 448 * 2^k, then x * 2^-k (exact) rounded to nearest-even into e4m3fn. torch
 * converts to float8 one element at a time (~3 GB/s per core) and the loader's workers
 * call it ~12 times per 128 rows; here both passes run over one 128-row group while it is
 * in cache, in a loop the compiler vectorises, with other threads (the readers) free to run.
 *
 * quantize_bf16(src, out, scale, rows, cols) -> -1, or the first row of a block holding a
 * non-finite value (nothing is promised about `out` then). Addresses are raw pointers
 * checked by the Python caller: src bf16 [rows, cols], out uint8 [rows, cols], scale fp32
 * [ceil(rows/128), ceil(cols/128)], all contiguous.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 128

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* float -> e4m3fn, round to nearest even, for |f| <= 448 (the scale guarantees it). */
static inline uint8_t e4m3(float f) {
    uint32_t bits = to_bits(f);
    uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    /* below 2^-6: e4m3 subnormals, a grid of 2^-9; adding 2^14 lets the FPU round onto it */
    uint32_t sub = to_bits(from_bits(bits) + 16384.0f) - (141u << 23);
    /* normal: rebias the exponent (127 -> 7) and round the mantissa from 23 to 3 bits, ties to even */
    uint32_t normal = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
    uint32_t tiny = 0u - (uint32_t)(bits < (121u << 23));  /* all ones below 2^-6: a select without a branch */
    return (uint8_t)(((sub & tiny) | (normal & ~tiny)) | (sign >> 24));
}

/* Smallest k with amax <= 448 * 2^k (448 = 0.875 * 2^9), 0 for an all-zero block, in [-126, 127]. */
static inline int pow2_exponent(float amax) {
    if (amax == 0.0f)
        return 0;
    int e;
    float m = frexpf(amax, &e);
    int k = e - 9 + (m > 0.875f);
    return k < -126 ? -126 : (k > 127 ? 127 : k);
}

/* AVX2 where the CPU has it, chosen at load time; SSE2 (every x86-64) otherwise. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static Py_ssize_t quantize(const uint16_t *restrict src, uint8_t *restrict out, float *restrict scale, Py_ssize_t rows,
                           Py_ssize_t cols) {
    Py_ssize_t cblocks = (cols + BLOCK - 1) / BLOCK;
    uint16_t amax[cblocks];
    float inv[cblocks];
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += BLOCK) {
        Py_ssize_t r1 = r0 + BLOCK < rows ? r0 + BLOCK : rows;
        memset(amax, 0, sizeof amax);
        for (Py_ssize_t r = r0; r < r1; r++) {
            const uint16_t *row = src + r * cols;
            for (Py_ssize_t b = 0; b < cblocks; b++) {
                Py_ssize_t c0 = b * BLOCK, c1 = c0 + BLOCK < cols ? c0 + BLOCK : cols;
                uint16_t m = amax[b];
                for (Py_ssize_t c = c0; c < c1; c++) {
                    uint16_t v = row[c] & 0x7FFFu;
                    m = v > m ? v : m;
                }
                amax[b] = m;
            }
        }
        for (Py_ssize_t b = 0; b < cblocks; b++) {
            if (amax[b] >= 0x7F80u)  /* inf or nan */
                return r0;
            int k = pow2_exponent(from_bits((uint32_t)amax[b] << 16));
            scale[(r0 / BLOCK) * cblocks + b] = ldexpf(1.0f, k);
            inv[b] = ldexpf(1.0f, -k);
        }
        for (Py_ssize_t r = r0; r < r1; r++) {
            const uint16_t *row = src + r * cols;
            uint8_t *dst = out + r * cols;
            for (Py_ssize_t b = 0; b < cblocks; b++) {
                Py_ssize_t c0 = b * BLOCK, c1 = c0 + BLOCK < cols ? c0 + BLOCK : cols;
                float s = inv[b];
                for (Py_ssize_t c = c0; c < c1; c++)
                    dst[c] = e4m3(from_bits((uint32_t)row[c] << 16) * s);  /* exact: s is a power of two */
            }
        }
    }
    return -1;
}

static PyObject *quantize_bf16(PyObject *self, PyObject *args) {
    unsigned long long src, out, scale;
    Py_ssize_t rows, cols;
    if (!PyArg_ParseTuple(args, "KKKnn", &src, &out, &scale, &rows, &cols))
        return NULL;
    if (rows < 0 || cols <= 0 || cols > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "quantize_bf16: bad shape [%zd, %zd]", rows, cols);
        return NULL;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = quantize((const uint16_t *)(uintptr_t)src, (uint8_t *)(uintptr_t)out, (float *)(uintptr_t)scale, rows, cols);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(bad);
}

static PyMethodDef methods[] = {
    {"quantize_bf16", quantize_bf16, METH_VARARGS,
     "quantize_bf16(src_ptr, out_ptr, scale_ptr, rows, cols) -> -1, or the first row of a non-finite block"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_fp8cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fp8cpu(void) { return PyModule_Create(&moduledef); }
