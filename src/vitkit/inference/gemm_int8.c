// Int8 GEMM of the int8 inference fast path (AVX-512 VNNI, vpdpbusd): y = epilogue(a_scale * w_scale[n] *
// (sum_k a[m][k] w[n][k] - zp * colsum[n]) + bias[n]) with uint8 activations a (M, K) quantised per tensor
// (scale, zero point zp), int8 weights w (N, K) quantised symmetrically per output channel, int32
// accumulation, fp32 epilogue (none / exact GELU / tanh GELU / residual add of a bf16 `other`), bf16 output.
//
// Weights are packed once (by Int8Gemm.pack_weights in gemm_int8.py): panels of P = NR * 16 columns, in each
// panel the K/4 groups of 4 consecutive k, each group P columns x 4 bytes -- one zmm per 16 columns, the
// operand layout of vpdpbusd. K is padded to a multiple of 4 and N to a multiple of P with zero weights.
// The micro-kernel keeps an MR x NR block of 16-column int32 accumulators in registers over all of K,
// broadcasting 4 bytes of each activation row (vpbroadcastd) against NR weight vectors per k group.
// Rows are split over threads (OpenMP on libgomp, PyTorch's own runtime once torch is loaded); each thread
// walks chunks of mc rows (kept in L2), and in each chunk the panels (kept in L1/L2) one after the other.
// The epilogue's residual and output lines are prefetched before each block's K loop (their cache misses
// stalled the residual-add GEMMs by 25% without). Compiled at -O2: GCC 12 at -O3 keeps the accumulator
// array in memory (stores in the K loop, half the speed); the unrolled loops below keep it in registers.
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): AI, widen, narrow, lanes, load16, exp_neg.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define MR 8  // rows per micro-kernel block (8 x 3 and 6 x 4 measured alike)
#define NR 3  // 16-column vectors per micro-kernel block: panels of 48 columns
#define P (NR * 16)

enum { EPI_NONE = 0, EPI_GELU = 1, EPI_GELU_TANH = 2, EPI_ADD = 3 };


// exact GELU 0.5 h (1 + erf(h / sqrt 2)); erf(z) = z P(z^2) / Q(z^2) on z clamped to [-4, 4] (beyond it erf is
// +-1 in fp32), the rational approximation of Eigen's and XLA's float erf (a few ulp): 16 vector operations and
// a division, about half of the exp-based form (train/kernels.c), which matters here since it runs on every GEMM
// output; vdivps runs beside the FMA pipes that vpdpbusd needs (2-3% faster on fc1 than rcp14 + a Newton step)
AI __m512 gelu_erf(__m512 h) {
    __m512 z = _mm512_mul_ps(h, _mm512_set1_ps(0.70710678118654752f));
    z = _mm512_max_ps(_mm512_min_ps(z, _mm512_set1_ps(4.0f)), _mm512_set1_ps(-4.0f));
    const __m512 z2 = _mm512_mul_ps(z, z);
    __m512 p = _mm512_fmadd_ps(z2, _mm512_set1_ps(-2.72614225801306e-10f), _mm512_set1_ps(2.77068142495902e-08f));
    p = _mm512_fmadd_ps(z2, p, _mm512_set1_ps(-2.10102402082508e-06f));
    p = _mm512_fmadd_ps(z2, p, _mm512_set1_ps(-5.69250639462346e-05f));
    p = _mm512_fmadd_ps(z2, p, _mm512_set1_ps(-7.34990630326855e-04f));
    p = _mm512_fmadd_ps(z2, p, _mm512_set1_ps(-2.95459980854025e-03f));
    p = _mm512_fmadd_ps(z2, p, _mm512_set1_ps(-1.60960333262415e-02f));
    p = _mm512_mul_ps(z, p);
    __m512 q = _mm512_fmadd_ps(z2, _mm512_set1_ps(-1.45660718464996e-05f), _mm512_set1_ps(-2.13374055278905e-04f));
    q = _mm512_fmadd_ps(z2, q, _mm512_set1_ps(-1.68282697438203e-03f));
    q = _mm512_fmadd_ps(z2, q, _mm512_set1_ps(-7.37332916720468e-03f));
    q = _mm512_fmadd_ps(z2, q, _mm512_set1_ps(-1.42647390514189e-02f));
    const __m512 half_h = _mm512_mul_ps(h, _mm512_set1_ps(0.5f));
    return _mm512_fmadd_ps(half_h, _mm512_div_ps(p, q), half_h);
}

// tanh GELU 0.5 h (1 + tanh(u)), u = sqrt(2/pi) (h + 0.044715 h^3); tanh(|u|) = (1 - e) / (1 + e), e = exp(-2|u|)
AI __m512 gelu_tanh(__m512 h) {
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), h), _mm512_mul_ps(h, h), h));
    __m512 e = exp_neg(_mm512_mul_ps(_mm512_abs_ps(u), _mm512_set1_ps(-2.0f)));
    __m512 th = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th),  // the sign of u
                                             _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(INT32_MIN))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), h), _mm512_add_ps(_mm512_set1_ps(1.0f), th));
}

typedef struct {
    const uint8_t *a;
    int64_t lda;
    int K;
    const int8_t *bp;      // packed weights
    const int32_t *colsum; // sum_k w[n][k]
    const float *w_scale;  // per output channel
    const float *bias;     // bias[n], or NULL
    float a_scale;
    int32_t zp;
    const float *row_scale;  // per-row activation scales (M), or NULL: a_scale for every row
    const int32_t *row_zp;   // per-row zero points (M), with row_scale
    const uint16_t *other; // bf16 (M, N) residual for EPI_ADD
    int64_t ldo;
    uint16_t *c;
    int64_t ldc;
    int N, epi;
} job_t;

// 4 bytes of activations at p (k group g), zero-filled past K
AI __m512i bcast(const uint8_t *p, int g, int K) {
    int32_t v = 0;
    int left = K - 4 * g;
    memcpy(&v, p + 4 * g, left >= 4 ? 4 : (size_t)left);
    return _mm512_set1_epi32(v);
}

// rows [m0, m0 + mr) x panel j (columns [j P, j P + P) clipped to N)
AI void block(const job_t *J, int64_t m0, int mr, int j) {
    __m512i acc[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NR; v++) acc[r][v] = _mm512_setzero_si512();
    const int K4 = J->K / 4, G = (J->K + 3) / 4;
    const __m512i *b = (const __m512i *)(J->bp + (int64_t)j * G * 4 * P);
    const uint8_t *a = J->a + m0 * J->lda;
    const int64_t lda = J->lda;
    // the epilogue's residual and output lines, fetched while the K loop runs (its misses would stall it)
    for (int r = 0; r < mr; r++) {
        const int64_t n = (int64_t)j * P;
        for (int off = 0; off < P * 2; off += 64) {
            if (J->epi == EPI_ADD) _mm_prefetch((const char *)(J->other + (m0 + r) * J->ldo + n) + off, _MM_HINT_T0);
            _mm_prefetch((const char *)(J->c + (m0 + r) * J->ldc + n) + off, _MM_HINT_ET0);
        }
    }
    for (int g = 0; g < K4; g++, b += NR) {
        __m512i bv[NR];
#pragma GCC unroll 4
        for (int v = 0; v < NR; v++) bv[v] = _mm512_load_si512(b + v);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                __m512i av = _mm512_set1_epi32(*(const int32_t *)(a + r * lda + 4 * g));
#pragma GCC unroll 4
                for (int v = 0; v < NR; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], av, bv[v]);
            }
        }
    }
    if (K4 < G) {  // K not a multiple of 4: the last group's missing bytes are zeros (and so are the weights')
        __m512i bv[NR];
#pragma GCC unroll 4
        for (int v = 0; v < NR; v++) bv[v] = _mm512_load_si512(b + v);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                __m512i av = bcast(a + r * lda, K4, J->K);
#pragma GCC unroll 4
                for (int v = 0; v < NR; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], av, bv[v]);
            }
        }
    }
    // epilogue
#pragma GCC unroll 4
    for (int v = 0; v < NR; v++) {
        const int n = j * P + v * 16;
        if (n >= J->N) continue;
        const int left = J->N - n;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512i cs = _mm512_maskz_loadu_epi32(m, J->colsum + n);
        const __m512 ws = _mm512_maskz_loadu_ps(m, J->w_scale + n);
        const __m512i comp = _mm512_mullo_epi32(cs, _mm512_set1_epi32(J->zp));
        const __m512 sc = _mm512_mul_ps(ws, _mm512_set1_ps(J->a_scale));
        const __m512 bias = J->bias ? _mm512_maskz_loadu_ps(m, J->bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                __m512i cr = comp;
                __m512 sr = sc;
                if (J->row_scale) {  // the row's own scale and zero point
                    cr = _mm512_mullo_epi32(cs, _mm512_set1_epi32(J->row_zp[m0 + r]));
                    sr = _mm512_mul_ps(ws, _mm512_set1_ps(J->row_scale[m0 + r]));
                }
                __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], cr));
                y = _mm512_fmadd_ps(y, sr, bias);
                if (J->epi == EPI_GELU) y = gelu_erf(y);
                else if (J->epi == EPI_GELU_TANH) y = gelu_tanh(y);
                else if (J->epi == EPI_ADD)
                    y = _mm512_add_ps(y, load16(J->other + (m0 + r) * J->ldo + n, m));
                _mm256_mask_storeu_epi16(J->c + (m0 + r) * J->ldc + n, m, narrow(y));
            }
        }
    }
}

static void run_rows(const job_t *J, int64_t lo, int64_t hi, int64_t mc) {
    const int panels = (J->N + P - 1) / P;
    for (int64_t c0 = lo; c0 < hi; c0 += mc) {
        const int64_t c1 = c0 + mc < hi ? c0 + mc : hi;
        for (int j = 0; j < panels; j++) {
            int64_t m0 = c0;
            for (; m0 + MR <= c1; m0 += MR) block(J, m0, MR, j);
            switch (c1 - m0) {  // the row tail, with a block of as many rows
#define TAIL(R) case R: block(J, m0, R, j); break;
                TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
                default: break;
            }
        }
    }
}

int vk_gemm_int8_mr(void) { return MR; }
int vk_gemm_int8_panel(void) { return P; }

// c (M, N) bf16 = epilogue(...) as above. a: uint8 (M, K), rows lda apart; bp: vk packed weights of N x K;
// colsum, w_scale, bias (nullable): N values; other (EPI_ADD): bf16 rows ldo apart; c: rows ldc apart.
// mc: rows per chunk (<= 0: a default). K <= 65536 keeps |acc| and zp * colsum below 2^31 (255 * 128 * K).
// row_scale, row_zp (nullable, M values each): a scale and zero point per activation row instead of a_scale, zp.
// Returns 0, or 1 for arguments it refuses.
int vk_gemm_u8s8(const uint8_t *a, int64_t lda, int64_t M, int K, int N, const int8_t *bp, const int32_t *colsum,
                 const float *w_scale, const float *bias, float a_scale, int32_t zp, int epi, const uint16_t *other,
                 int64_t ldo, uint16_t *c, int64_t ldc, int64_t mc, int threads, const float *row_scale,
                 const int32_t *row_zp) {
    if (M < 0 || K < 1 || K > 65536 || N < 1 || lda < K || ldc < N || epi < 0 || epi > 3) return 1;
    if (((uintptr_t)bp) & 63) return 1;  // the packed weights' aligned loads
    if (epi == EPI_ADD && (other == NULL || ldo < N)) return 1;
    if ((row_scale == NULL) != (row_zp == NULL)) return 1;
    if (M == 0) return 0;
    job_t J = {a, lda, K, bp, colsum, w_scale, bias, a_scale, zp, row_scale, row_zp, other, ldo, c, ldc, N, epi};
    if (mc <= 0) mc = 256;
    mc = (mc + MR - 1) / MR * MR;
    int T = threads > 0 ? threads : 1;
    int64_t blocks = (M + MR - 1) / MR;
    if (blocks < T) T = (int)blocks;
#pragma omp parallel num_threads(T)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo = blocks * t / nt * MR, hi = blocks * (t + 1) / nt * MR;
        if (hi > M) hi = M;
        if (lo < hi) run_rows(&J, lo, hi, mc);
    }
    return 0;
}
