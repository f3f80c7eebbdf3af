// Dynamic per-tensor quantisation of bf16 activations to uint8 for the int8 inference fast path (AVX-512):
// one parallel region, two passes over the tensor (min/max, then quantise), instead of the ~6 of eager PyTorch.
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>

#define AI static inline __attribute__((always_inline))
#define BLOCK 64  // elements per loop iteration: 4 vectors of 16

// 16 bf16 values -> fp32 (bf16 is the top half of an fp32); lanes past `m` read as +0
AI __m512 load16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

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
                mn0 = _mm512_min_ps(mn0, _mm512_min_ps(a, c));
                mn1 = _mm512_min_ps(mn1, _mm512_min_ps(d, e));
                mx0 = _mm512_max_ps(mx0, _mm512_max_ps(a, c));
                mx1 = _mm512_max_ps(mx1, _mm512_max_ps(d, e));
            } else {
                for (int64_t j = i; j < n; j += 16) {  // zero-filled lanes leave a range containing 0 unchanged
                    __m512 a = load16(x + j, lanes(n - j));
                    mn0 = _mm512_min_ps(mn0, a);
                    mx0 = _mm512_max_ps(mx0, a);
                }
            }
        }
        float tlo = _mm512_reduce_min_ps(_mm512_min_ps(mn0, mn1));
        float thi = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1));
#pragma omp critical
        {
            lo = tlo < lo ? tlo : lo;
            hi = thi > hi ? thi : hi;
        }
#pragma omp barrier
#pragma omp single
        {
            scale = (hi - lo) / (float)qmax;
            scale = scale < 1e-8f ? 1e-8f : scale;
            zero = rintf(-lo / scale);
        }  // implicit barrier: every thread sees scale and zero
        const __m512 inv = _mm512_set1_ps(1.0f / scale), zp = _mm512_set1_ps(zero);
        const __m512 top = _mm512_set1_ps((float)qmax), bottom = _mm512_setzero_ps();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            for (int64_t j = b * BLOCK; j < b * BLOCK + BLOCK && j < n; j += 16) {
                __mmask16 m = lanes(n - j);
                __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + j, m), inv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, zp), bottom), top);
                _mm512_mask_cvtusepi32_storeu_epi8(q + j, m, _mm512_cvtps_epi32(v));
            }
        }
    }
    *scale_out = scale;
    *zero_out = (int64_t)zero;
    return 0;
}
