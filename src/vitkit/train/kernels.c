// Elementwise kernels of the ViT training step on AVX-512 CPUs: bf16 in and out, fp32 arithmetic.
//   vk_gelu_fwd:        y = h Phi(h)                          (exact, erf-based GELU)
//   vk_gelu_bwd_bias:   dh = dy (Phi(h) + h phi(h)), db = sum over rows of dh (fp32), in one pass
//   vk_softmax_fwd:     softmax of every row, in place
// Rows are split over threads by OpenMP (libgomp, PyTorch's own runtime once torch is loaded).
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): AI, widen, narrow, lanes, load16, exp_neg.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

AI __m512 ld(const uint16_t *p) { return widen(_mm256_loadu_si256((const __m256i *)p)); }
AI void st(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, narrow(x)); }
AI void st_m(uint16_t *p, __mmask16 m, __m512 x) { _mm256_mask_storeu_epi16(p, m, narrow(x)); }

// Phi(h) = P(N(0,1) <= h) = (1 + erf(h / sqrt 2)) / 2, erf by Abramowitz & Stegun 7.1.26 as PyTorch's
// own vectorised erf (absolute error < 1.5e-7): erf(z) = 1 - t P(t) exp(-z^2), t = 1 / (1 + 0.3275911 z), z >= 0,
// odd in z. e2 = exp(-z^2) = exp(-h^2 / 2) is given: the backward pass needs it again for phi(h).
AI __m512 cdf(__m512 h, __m512 e2) {
    __m512 z = _mm512_mul_ps(_mm512_abs_ps(h), _mm512_set1_ps(0.70710678118654752f));
    __m512 d = _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.0f));
    __m512 t = _mm512_rcp14_ps(d);
    t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));  // one Newton step: ~28 bits
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    __m512 half_erfc = _mm512_mul_ps(_mm512_mul_ps(p, t), _mm512_mul_ps(e2, _mm512_set1_ps(0.5f)));  // (1-erf)/2
    __mmask16 neg = _mm512_cmp_ps_mask(h, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(1.0f), half_erfc), half_erfc);
}

AI __m512 exp_half_sq(__m512 h) { return exp_neg(_mm512_mul_ps(_mm512_mul_ps(h, h), _mm512_set1_ps(-0.5f))); }

AI __m512 gelu(__m512 h) { return _mm512_mul_ps(h, cdf(h, exp_half_sq(h))); }

// d gelu / dh = Phi(h) + h phi(h), phi(h) = exp(-h^2 / 2) / sqrt(2 pi)
AI __m512 gelu_grad(__m512 h) {
    __m512 e2 = exp_half_sq(h);
    return _mm512_fmadd_ps(_mm512_mul_ps(h, _mm512_set1_ps(0.39894228040143268f)), e2, cdf(h, e2));
}

AI int nthreads(int threads) { return threads > 0 ? threads : 1; }

// y[i] = gelu(h[i]) for i < n (contiguous)
void vk_gelu_fwd(const uint16_t *h, uint16_t *y, long n, int threads) {
    long nv = n / 16;
#pragma omp parallel for schedule(static) num_threads(nthreads(threads))
    for (long v = 0; v < nv; v++) st(y + 16 * v, gelu(ld(h + 16 * v)));
    if (n % 16) {
        __mmask16 m = lanes((int)(n % 16));
        st_m(y + 16 * nv, m, gelu(load16(h + 16 * nv, m)));
    }
}

// dh = dy * gelu'(h) for (rows, cols) contiguous matrices; db[c] = sum_r dh[r][c] in fp32 (before dh is
// rounded to bf16). Each thread sums its block of rows into its own buffer; the buffers are added at the
// end. Returns 0, or -1 when memory ran out (nothing then is meaningful).
int vk_gelu_bwd_bias(const uint16_t *dy, const uint16_t *h, uint16_t *dh, float *db, long rows, int cols,
                     int threads) {
    int nt = nthreads(threads), nv = cols / 16, rem = cols % 16;
    long padded = (cols + 15) / 16 * 16;
    float *part = aligned_alloc(64, (size_t)nt * padded * sizeof(float));
    if (!part) return -1;
    memset(part, 0, (size_t)nt * padded * sizeof(float));
    __mmask16 m = lanes(rem);
#pragma omp parallel num_threads(nt)
    {
        float *acc = part + (size_t)omp_get_thread_num() * padded;
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            const uint16_t *dyr = dy + r * cols, *hr = h + r * cols;
            uint16_t *out = dh + r * cols;
            for (int v = 0; v < nv; v++) {
                __m512 g = _mm512_mul_ps(ld(dyr + 16 * v), gelu_grad(ld(hr + 16 * v)));
                _mm512_store_ps(acc + 16 * v, _mm512_add_ps(_mm512_load_ps(acc + 16 * v), g));
                st(out + 16 * v, g);
            }
            if (rem) {
                __m512 g = _mm512_mul_ps(load16(dyr + 16 * nv, m), gelu_grad(load16(hr + 16 * nv, m)));
                _mm512_store_ps(acc + 16 * nv, _mm512_add_ps(_mm512_load_ps(acc + 16 * nv), g));
                st_m(out + 16 * nv, m, g);
            }
        }
    }
    for (int c = 0; c < cols; c++) {
        float s = 0.0f;
        for (int t = 0; t < nt; t++) s += part[(size_t)t * padded + c];
        db[c] = s;
    }
    free(part);
    return 0;
}

#define SOFTMAX_MAX 4096  // longest row vk_softmax_fwd takes (its fp32 scratch row lives on the stack)

// x[r][0..n) = softmax(x[r][0..n)) in place for every row r < rows (row stride `stride` elements); n <= SOFTMAX_MAX.
// Returns 0, or -2 for a longer row.
int vk_softmax_fwd(uint16_t *x, long rows, int n, long stride, int threads) {
    if (n > SOFTMAX_MAX || n < 0) return -2;
    int nv = n / 16, rem = n % 16;
    __mmask16 m = lanes(rem);
#pragma omp parallel num_threads(nthreads(threads))
    {
        float e[SOFTMAX_MAX] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            uint16_t *row = x + r * stride;
            __m512 mx = _mm512_set1_ps(-__builtin_inff());
            for (int v = 0; v < nv; v++) mx = _mm512_max_ps(mx, ld(row + 16 * v));
            if (rem) mx = _mm512_mask_max_ps(mx, m, mx, load16(row + 16 * nv, m));
            __m512 big = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            for (int v = 0; v < nv; v++) {
                __m512 p = exp_neg(_mm512_sub_ps(ld(row + 16 * v), big));
                _mm512_store_ps(e + 16 * v, p);
                sum = _mm512_add_ps(sum, p);
            }
            if (rem) {
                __m512 p = exp_neg(_mm512_sub_ps(load16(row + 16 * nv, m), big));
                _mm512_store_ps(e + 16 * nv, p);
                sum = _mm512_mask_add_ps(sum, m, sum, p);
            }
            __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(_mm512_reduce_add_ps(sum)));
            for (int v = 0; v < nv; v++) st(row + 16 * v, _mm512_mul_ps(_mm512_load_ps(e + 16 * v), inv));
            if (rem) st_m(row + 16 * nv, m, _mm512_mul_ps(_mm512_load_ps(e + 16 * nv), inv));
        }
    }
    return 0;
}
