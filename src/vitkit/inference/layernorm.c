// LayerNorm of bf16 rows for the bf16 inference fast path (AVX-512 BF16): y = (x - mean) * rstd * gamma + beta,
// mean and variance in fp32 (two passes over the row, which stays in L1), y rounded to bf16 once (nearest even).
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): AI, lanes, load16, narrow.
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>

// x: `rows` rows of D bf16, row stride ldx; y: rows of D bf16, row stride ldy; gamma, beta: D fp32.
// A row holding NaN or inf comes out all NaN, as from torch.nn.functional.layer_norm. Returns 0, or 1 for
// arguments it refuses.
int vk_layernorm_bf16(const uint16_t *x, int64_t rows, int64_t D, int64_t ldx, const float *gamma,
                      const float *beta, float eps, uint16_t *y, int64_t ldy, int threads) {
    if (rows < 0 || D <= 0 || ldx < D || ldy < D) return 1;
    const float inv_d = 1.0f / (float)D;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *yr = y + r * ldy;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 32 <= D; c += 32) {  // two chains: the adds' latency
            s0 = _mm512_add_ps(s0, load16(xr + c, 0xFFFF));
            s1 = _mm512_add_ps(s1, load16(xr + c + 16, 0xFFFF));
        }
        for (; c < D; c += 16) s0 = _mm512_add_ps(s0, load16(xr + c, lanes(D - c)));  // zeros past D
        const float mean = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * inv_d;
        const __m512 mu = _mm512_set1_ps(mean);
        __m512 q0 = _mm512_setzero_ps(), q1 = _mm512_setzero_ps();
        for (c = 0; c + 32 <= D; c += 32) {
            __m512 a = _mm512_sub_ps(load16(xr + c, 0xFFFF), mu), b = _mm512_sub_ps(load16(xr + c + 16, 0xFFFF), mu);
            q0 = _mm512_fmadd_ps(a, a, q0);
            q1 = _mm512_fmadd_ps(b, b, q1);
        }
        for (; c < D; c += 16) {
            __mmask16 m = lanes(D - c);
            __m512 a = _mm512_maskz_sub_ps(m, load16(xr + c, m), mu);  // lanes past D add nothing
            q0 = _mm512_fmadd_ps(a, a, q0);
        }
        const float var = _mm512_reduce_add_ps(_mm512_add_ps(q0, q1)) * inv_d;
        const __m512 rs = _mm512_set1_ps(1.0f / sqrtf(var + eps));
        for (c = 0; c < D; c += 16) {
            __mmask16 m = lanes(D - c);
            __m512 g = _mm512_mul_ps(rs, _mm512_maskz_loadu_ps(m, gamma + c));
            __m512 v = _mm512_fmadd_ps(_mm512_sub_ps(load16(xr + c, m), mu), g, _mm512_maskz_loadu_ps(m, beta + c));
            _mm256_mask_storeu_epi16(yr + c, m, narrow(v));
        }
    }
    return 0;
}
