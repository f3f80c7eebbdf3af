// AVX-512 helpers shared by vitkit's C kernels (train/kernels.c, train/attention.c, inference/gemm_int8.c,
// inference/attention_int8.c, inference/quantize.c, inference/layernorm.c).
// vitkit.native.kernel_source puts this file in front of a kernel's own source before it is compiled, so the
// compiled library (and its cache key, a hash of the text) always carries the version it was built with.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define AI static inline __attribute__((always_inline))

// 16 bf16 -> 16 fp32 (exact: bf16 is the upper half of an fp32)
AI __m512 widen(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }

// the first n of 16 lanes: all of them when n >= 16, none when n <= 0
AI __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1u) : 0; }

// 16 bf16 at p -> fp32; lanes outside m read as +0
AI __m512 load16(const uint16_t *p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }

// LayerNorm statistics of one row of D bf16: the mean, then 1 / sqrt(var + eps) with the variance from a second
// pass over the row (it stays in L1); fp32 sums in two chains (the adds' latency). A row holding NaN or inf gives
// NaN. The LayerNorm kernels (inference/layernorm.c, and quantize.c's LayerNorm fused with the quantiser).
AI void row_stats(const uint16_t *x, int64_t D, float eps, float *mean_out, float *rstd_out) {
    const float inv_d = 1.0f / (float)D;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= D; c += 32) {
        s0 = _mm512_add_ps(s0, load16(x + c, 0xFFFF));
        s1 = _mm512_add_ps(s1, load16(x + c + 16, 0xFFFF));
    }
    for (; c < D; c += 16) s0 = _mm512_add_ps(s0, load16(x + c, lanes(D - c)));  // zeros past D
    const float mean = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * inv_d;
    const __m512 mu = _mm512_set1_ps(mean);
    __m512 q0 = _mm512_setzero_ps(), q1 = _mm512_setzero_ps();
    for (c = 0; c + 32 <= D; c += 32) {
        __m512 a = _mm512_sub_ps(load16(x + c, 0xFFFF), mu), b = _mm512_sub_ps(load16(x + c + 16, 0xFFFF), mu);
        q0 = _mm512_fmadd_ps(a, a, q0);
        q1 = _mm512_fmadd_ps(b, b, q1);
    }
    for (; c < D; c += 16) {
        __mmask16 m = lanes(D - c);
        __m512 a = _mm512_maskz_sub_ps(m, load16(x + c, m), mu);  // lanes past D add nothing
        q0 = _mm512_fmadd_ps(a, a, q0);
    }
    *mean_out = mean;
    *rstd_out = 1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(q0, q1)) * inv_d + eps);
}

// y = (x - mean) * (rstd * gamma) + beta for the 16 columns at x (lanes past m are 0, or NaN when mean is)
AI __m512 affine16(const uint16_t *x, __mmask16 m, __m512 mu, __m512 rs, const float *gamma, const float *beta) {
    __m512 g = _mm512_mul_ps(rs, _mm512_maskz_loadu_ps(m, gamma));
    return _mm512_fmadd_ps(_mm512_sub_ps(load16(x, m), mu), g, _mm512_maskz_loadu_ps(m, beta));
}

#ifdef __AVX512BF16__
// 16 fp32 -> 16 bf16, rounded to nearest even
AI __m256i narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#endif

// exp(x) in fp32 for x <= 0 (every caller's case): 2^n p(r), n = round(x / ln2), r = x - n ln2 (ln2 in two
// parts) in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error ~1e-7). x is clamped to >= -104,
// where 2^n scales to 0; vmaxps returns its second operand when either is NaN, so NaN stays NaN.
AI __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-6f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 720), r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
