// LayerNorm of bf16 rows for the bf16 inference fast path (AVX-512 BF16): y = (x - mean) * rstd * gamma + beta,
// mean and variance in fp32 (two passes over the row, which stays in L1), y rounded to bf16 once (nearest even).
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): row_stats, affine16, lanes, narrow.
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
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *yr = y + r * ldy;
        float mean, rstd;
        row_stats(xr, D, eps, &mean, &rstd);
        const __m512 mu = _mm512_set1_ps(mean), rs = _mm512_set1_ps(rstd);
        for (int64_t c = 0; c < D; c += 16) {
            __mmask16 m = lanes(D - c);
            _mm256_mask_storeu_epi16(yr + c, m, narrow(affine16(xr + c, m, mu, rs, gamma + c, beta + c)));
        }
    }
    return 0;
}
