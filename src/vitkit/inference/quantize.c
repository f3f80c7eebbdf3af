// Dynamic per-tensor quantisation of bf16 activations to uint8 for the int8 inference fast path (AVX-512):
// one parallel region, two passes over the tensor (min/max, then quantise), instead of the ~6 of eager PyTorch.
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): AI, lanes, load16, row_stats, affine16.
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#define BLOCK 64  // elements per loop iteration: 4 vectors of 16

// scale and zero point of quantize_dynamic_u8 for the range [lo, hi] (which contains 0)
AI void scale_zero(float lo, float hi, int qmax, float *scale, float *zero) {
    float s = (hi - lo) / (float)qmax;
    *scale = s < 1e-8f ? 1e-8f : s;
    *zero = rintf(-lo / *scale);
}

// Inside the parallel region, called by every thread: its range [tlo, thi] merged into the shared one, then the
// scale and zero point of quantize_dynamic_u8 from it (one thread; the barrier ending `single` lets all see them).
static void agree_range(float tlo, float thi, float *lo, float *hi, float *scale, float *zero, int qmax) {
#pragma omp critical
    {
        *lo = tlo < *lo ? tlo : *lo;
        *hi = thi > *hi ? thi : *hi;
    }
#pragma omp barrier
#pragma omp single
    scale_zero(*lo, *hi, qmax, scale, zero);
}

// codes clamp(round(y * inv) + zp, 0, qmax) of 16 values, stored to the lanes of `m` (vmaxps with 0 first: a NaN y
// gives 0)
AI void store_codes(uint8_t *q, __mmask16 m, __m512 y, __m512 inv, __m512 zp, __m512 top) {
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(y, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, zp), _mm512_setzero_ps()), top);
    _mm512_mask_cvtusepi32_storeu_epi8(q, m, _mm512_cvtps_epi32(v));
}

// q = clamp(round(x / scale) + zero_point, 0, qmax) with scale = max((hi - lo) / qmax, 1e-8), lo = min(min x, 0),
// hi = max(max x, 0), zero_point = round(-lo / scale) (round half to even, as torch.round): the formula of
// vitkit.inference.int8.quantize_dynamic_u8, except that x / scale is x * (1 / scale) here (one rounding step
// apart at exact half-way points). x: n bf16 values; q: n bytes; scale and zero point written to the outputs.
int vk_quantize_u8(const uint16_t *x, int64_t n, uint8_t *q, float *scale_out, int64_t *zero_out, int qmax,
                   int threads) {
    if (n < 0 || qmax < 1 || qmax > 255) return 1;
    float lo = 0.0f, hi = 0.0f;  // the range always contains 0
    float scale = 1.0f, zero = 0.0f;
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        __m512 mn0 = _mm512_setzero_ps(), mn1 = mn0, mx0 = mn0, mx1 = mn0;
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; b++) {
            int64_t i = b * BLOCK;
            if (i + BLOCK <= n) {
                __m512 a = load16(x + i, 0xFFFF), c = load16(x + i + 16, 0xFFFF);
                __m512 d = load16(x + i + 32, 0xFFFF), e = load16(x + i + 48, 0xFFFF);
                // the value first, the running one second: vminps/vmaxps return the second operand when either
                // is NaN, so NaN is left out of the range (and quantises to 0 below)
                mn0 = _mm512_min_ps(c, _mm512_min_ps(a, mn0));
                mn1 = _mm512_min_ps(e, _mm512_min_ps(d, mn1));
                mx0 = _mm512_max_ps(c, _mm512_max_ps(a, mx0));
                mx1 = _mm512_max_ps(e, _mm512_max_ps(d, mx1));
            } else {
                for (int64_t j = i; j < n; j += 16) {  // zero-filled lanes leave a range containing 0 unchanged
                    __m512 a = load16(x + j, lanes(n - j));
                    mn0 = _mm512_min_ps(a, mn0);
                    mx0 = _mm512_max_ps(a, mx0);
                }
            }
        }
        float tlo = _mm512_reduce_min_ps(_mm512_min_ps(mn0, mn1));
        float thi = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1));
        agree_range(tlo, thi, &lo, &hi, &scale, &zero, qmax);
        const __m512 inv = _mm512_set1_ps(1.0f / scale), zp = _mm512_set1_ps(zero), top = _mm512_set1_ps((float)qmax);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            for (int64_t j = b * BLOCK; j < b * BLOCK + BLOCK && j < n; j += 16) {
                __mmask16 m = lanes(n - j);
                store_codes(q + j, m, load16(x + j, m), inv, zp, top);
            }
        }
    }
    *scale_out = scale;
    *zero_out = (int64_t)zero;
    return 0;
}

// LayerNorm of bf16 rows fused with the quantiser above (the int8 path's norm1 -> qkv and norm2 -> fc1): y =
// (x - mean) * rstd * gamma + beta in fp32 (mean and variance in two passes over the row, in L1), quantised
// per tensor as by vk_quantize_u8 from the min/max of y, which is computed on the fly and not stored: pass 1
// per row mean, rstd and the running min/max of y; pass 2 recomputes y from the kept mean/rstd and writes the
// codes. Against LayerNorm -> bf16 -> quantise, no bf16 output is written and read back twice, and y is not
// rounded to bf16 before it is quantised. x: M rows of D bf16, row stride ldx; gamma, beta: D fp32; q: M x D
// bytes (row stride D). NaN outputs (a row with NaN or inf) are left out of the range and quantise to 0, as in
// vk_quantize_u8 (vminps/vmaxps return their second operand when either is NaN).
int vk_layernorm_u8(const uint16_t *x, int64_t M, int64_t D, int64_t ldx, const float *gamma, const float *beta,
                    float eps, uint8_t *q, float *scale_out, int64_t *zero_out, int qmax, int threads) {
    if (M < 0 || D < 1 || ldx < D || qmax < 1 || qmax > 255) return 1;
    float *stats = (float *)malloc((size_t)(M > 0 ? M : 1) * 2 * sizeof(float));  // mean, rstd per row
    if (!stats) return 2;
    float lo = 0.0f, hi = 0.0f;  // the range always contains 0
    float scale = 1.0f, zero = 0.0f;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        __m512 mn = _mm512_setzero_ps(), mx = mn;
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *row = x + r * ldx;
            float mean, rstd;
            row_stats(row, D, eps, &mean, &rstd);
            stats[2 * r] = mean, stats[2 * r + 1] = rstd;
            const __m512 mu = _mm512_set1_ps(mean), rs = _mm512_set1_ps(rstd);
            for (int64_t j = 0; j < D; j += 16) {
                __mmask16 m = lanes(D - j);
                __m512 y = affine16(row + j, m, mu, rs, gamma + j, beta + j);
                mn = _mm512_mask_min_ps(mn, m, y, mn);  // y first: a NaN y leaves the running value
                mx = _mm512_mask_max_ps(mx, m, y, mx);
            }
        }
        float tlo = _mm512_reduce_min_ps(mn), thi = _mm512_reduce_max_ps(mx);
        agree_range(tlo, thi, &lo, &hi, &scale, &zero, qmax);
        const __m512 inv = _mm512_set1_ps(1.0f / scale), zp = _mm512_set1_ps(zero), top = _mm512_set1_ps((float)qmax);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            const uint16_t *row = x + r * ldx;
            const __m512 mu = _mm512_set1_ps(stats[2 * r]), rs = _mm512_set1_ps(stats[2 * r + 1]);
            for (int64_t j = 0; j < D; j += 16) {
                __mmask16 m = lanes(D - j);
                __m512 y = affine16(row + j, m, mu, rs, gamma + j, beta + j);
                store_codes(q + r * D + j, m, y, inv, zp, top);
            }
        }
    }
    free(stats);
    *scale_out = scale;
    *zero_out = (int64_t)zero;
    return 0;
}

// vk_quantize_u8 per row (for the int8 GEMM's per-row scales and zero points): row r of x (M rows of D bf16, ldx
// apart) quantised from its own range [min(min_r x, 0), max(max_r x, 0)] by the same formula -> codes q (rows D
// apart), scale[r], zero[r]. One pass from memory per row: its min/max, then its codes from L1; no barrier. NaN
// is left out of a row's range and quantises to 0, as in vk_quantize_u8.
int vk_quantize_rows_u8(const uint16_t *x, int64_t M, int64_t D, int64_t ldx, uint8_t *q, float *scale_out,
                        int32_t *zero_out, int qmax, int threads) {
    if (M < 0 || D < 1 || ldx < D || qmax < 1 || qmax > 255) return 1;
    const __m512 top = _mm512_set1_ps((float)qmax);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = x + r * ldx;
        __m512 mn0 = _mm512_setzero_ps(), mn1 = mn0, mx0 = mn0, mx1 = mn0;  // the range contains 0
        int64_t j = 0;
        for (; j + 32 <= D; j += 32) {
            __m512 a = load16(row + j, 0xFFFF), c = load16(row + j + 16, 0xFFFF);
            mn0 = _mm512_min_ps(a, mn0), mx0 = _mm512_max_ps(a, mx0);  // the value first: NaN left out
            mn1 = _mm512_min_ps(c, mn1), mx1 = _mm512_max_ps(c, mx1);
        }
        for (; j < D; j += 16) {
            __m512 a = load16(row + j, lanes(D - j));  // zero-filled lanes: no change to a range containing 0
            mn0 = _mm512_min_ps(a, mn0), mx0 = _mm512_max_ps(a, mx0);
        }
        const float lo = _mm512_reduce_min_ps(_mm512_min_ps(mn0, mn1));
        const float hi = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1));
        float s, zero;
        scale_zero(lo, hi, qmax, &s, &zero);
        scale_out[r] = s, zero_out[r] = (int32_t)zero;
        const __m512 inv = _mm512_set1_ps(1.0f / s), zp = _mm512_set1_ps(zero);
        for (j = 0; j < D; j += 16) {
            __mmask16 m = lanes(D - j);
            store_codes(q + r * D + j, m, load16(row + j, m), inv, zp, top);
        }
    }
    return 0;
}
