// Fused bf16 attention for ViT inference on AVX-512 BF16 CPUs: softmax(scale q k^T) v per (image, head),
// read straight from the fused qkv GEMM output and written straight into the token layout.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>

#define MR 6  // query rows per block: MR x 4 accumulators of 16 fp32 lanes stay in registers
#define AI static inline __attribute__((always_inline))

// exp(x) for x <= 0 in fp32: 2^n p(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-4
// Taylor polynomial: relative error < 5e-5, far below the bf16 rounding (4e-3) the result then gets
AI __m512 exp_neg(__m512 x) {
    // keeps r finite; exp(-87) ~ 1.6e-38 is 0 at bf16 scale. x second: vmaxps returns its second operand
    // when either is NaN, so a NaN score (NaN/inf in q or k) stays NaN and poisons its row as in PyTorch
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// s[r][t0 + 16 v + lane] = sum_j q_r[pair j] . kp[j][t0 + 16 v + lane] (bf16 pairs, fp32 sums), for MR rows
#define QK_TILE(NV)                                                                                            \
    static void qk_tile_##NV(const uint32_t *kp, int tpad, const uint32_t *const *q, int dh, float *s,       \
                             int lds, int t0) {                                                               \
        __m512 acc[MR][NV];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();             \
        for (int j = 0; j < dh; j++) {                                                                        \
            const uint32_t *kr = kp + (size_t)j * tpad + t0;                                                  \
            __m512bh kv[NV];                                                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) kv[v] =                                      \
                (__m512bh)_mm512_loadu_si512(kr + 16 * v);                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r][j]);                                     \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] =                              \
                    _mm512_dpbf16_ps(acc[r][v], qb, kv[v]);                                                   \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                              \
                _mm512_storeu_ps(s + (size_t)r * lds + t0 + 16 * v, acc[r][v]);                               \
    }
QK_TILE(1)
QK_TILE(2)
QK_TILE(3)
QK_TILE(4)

// out_r[c0 + 16 v + lane] = inv_r * sum_tp p_r[pair tp] . vp[tp][c0 + 16 v + lane], rows r < nrows, cols < d
#define PV_TILE(NV)                                                                                            \
    static void pv_tile_##NV(const uint32_t *vp, int dpad, const uint32_t *p, int ldp, int tph,             \
                             uint16_t *const *out, const float *inv, int nrows, int d, int c0) {              \
        __m512 acc[MR][NV];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();             \
        for (int tp = 0; tp < tph; tp++) {                                                                    \
            const uint32_t *vr = vp + (size_t)tp * dpad + c0;                                                 \
            __m512bh vv[NV];                                                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vv[v] =                                      \
                (__m512bh)_mm512_loadu_si512(vr + 16 * v);                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p[(size_t)r * ldp + tp]);                     \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] =                              \
                    _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);                                                   \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < nrows; r++) {                                                                     \
            __m512 sc = _mm512_set1_ps(inv[r]);                                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                            \
                int c = c0 + 16 * v;                                                                          \
                __m256i o = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][v], sc));                        \
                if (c + 16 <= d)                                                                              \
                    _mm256_storeu_si256((__m256i *)(out[r] + c), o);                                          \
                else if (c < d)                                                                               \
                    _mm256_mask_storeu_epi16(out[r] + c, (__mmask16)((1u << (d - c)) - 1), o);                \
            }                                                                                                 \
        }                                                                                                     \
    }
PV_TILE(1)
PV_TILE(2)
PV_TILE(3)
PV_TILE(4)

// kp[j][t] = pair j of key row t (zero for t >= T); rows of k are `stride` elements apart
static void pack_k(const uint16_t *k, long stride, int T, int dh, int tpad, uint32_t *kp) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32((int)(stride / 2));
    for (int t0 = 0; t0 < tpad; t0 += 16) {
        int left = T - t0;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        __m512i idx = _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(t0)), step);
        for (int j = 0; j < dh; j++) {
            __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                    (const int *)k + j, 4);
            _mm512_storeu_si512(kp + (size_t)j * tpad + t0, g);
        }
    }
}

// vp[tp][c] = (v[2 tp][c], v[2 tp + 1][c]) as a bf16 pair (zero beyond T rows and d columns)
static void pack_v(const uint16_t *v, long stride, int T, int d, int tph, int dpad, uint32_t *vp) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int tp = 0; tp < tph; tp++) {
        int t = 2 * tp;
        for (int c = 0; c < dpad; c += 16) {
            __mmask16 m = c + 16 <= d ? (__mmask16)0xFFFF : c < d ? (__mmask16)((1u << (d - c)) - 1) : 0;
            __m256i a = t < T ? _mm256_maskz_loadu_epi16(m, v + (size_t)t * stride + c) : _mm256_setzero_si256();
            __m256i b = t + 1 < T ? _mm256_maskz_loadu_epi16(m, v + (size_t)(t + 1) * stride + c)
                                  : _mm256_setzero_si256();
            __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512(vp + (size_t)tp * dpad + c, _mm512_permutexvar_epi16(idx, ab));
        }
    }
}

// softmax numerators of `rows` score rows into bf16 (p, row stride ldp elements; zeros from T to tpad), 1/sums
// into inv
static void softmax_rows(const float *s, int lds, int T, int tpad, float scale, uint16_t *p, int ldp,
                         float *inv, int rows) {
    int nv = tpad / 16;
    __mmask16 last = (T % 16) ? (__mmask16)((1u << (T % 16)) - 1) : (__mmask16)0xFFFF;
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        const float *row = s + (size_t)r * lds;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int v = 0; v < nv - 1; v++) m = _mm512_max_ps(m, _mm512_loadu_ps(row + 16 * v));
        m = _mm512_mask_max_ps(m, last, m, _mm512_loadu_ps(row + 16 * (nv - 1)));
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m) * scale);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < nv; v++) {
            __m512 e = exp_neg(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v), sc, mx));
            if (v == nv - 1) e = _mm512_maskz_mov_ps(last, e);
            __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(p + (size_t)r * ldp + 16 * v), b);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

// packs image b's head h (pair = b H + h) of qkv into kp (keys, tpad wide) and vp (values, tph x dpad) and
// returns the image's first qkv row
static const uint16_t *pack_head(const uint16_t *qkv, long pair, int T, int H, int d, long qkv_stride, int tpad,
                                 int tph, int dpad, uint32_t *kp, uint32_t *vp) {
    int b = (int)(pair / H), h = (int)(pair % H);
    const uint16_t *base = qkv + (size_t)b * T * qkv_stride;
    pack_k(base + (size_t)H * d + (size_t)h * d, qkv_stride, T, d / 2, tpad, kp);
    pack_v(base + 2 * (size_t)H * d + (size_t)h * d, qkv_stride, T, d, tph, dpad, vp);
    return base;
}

static void qk_block(const uint32_t *kp, int tpad, const uint32_t *const *q, int dh, float *s, int lds) {
    // tiles of 4 vectors of 16 keys, the rest as 3 + 2 rather than a lone 1 (6 accumulators: latency-bound)
    for (int t0 = 0, left = tpad / 16; left > 0;) {
        int w = left >= 8 || left == 4 ? 4 : left >= 5 ? 3 : left;
        switch (w) {
            case 4: qk_tile_4(kp, tpad, q, dh, s, lds, t0); break;
            case 3: qk_tile_3(kp, tpad, q, dh, s, lds, t0); break;
            case 2: qk_tile_2(kp, tpad, q, dh, s, lds, t0); break;
            default: qk_tile_1(kp, tpad, q, dh, s, lds, t0); break;
        }
        t0 += 16 * w;
        left -= w;
    }
}

static void pv_block(const uint32_t *vp, int dpad, const uint32_t *p, int ldp, int tph, uint16_t *const *out,
                     const float *inv, int nrows, int d) {
    int nv = dpad / 16, c0 = 0;
    for (; nv - c0 / 16 >= 4; c0 += 64) pv_tile_4(vp, dpad, p, ldp, tph, out, inv, nrows, d, c0);
    switch (nv - c0 / 16) {
        case 3: pv_tile_3(vp, dpad, p, ldp, tph, out, inv, nrows, d, c0); break;
        case 2: pv_tile_2(vp, dpad, p, ldp, tph, out, inv, nrows, d, c0); break;
        case 1: pv_tile_1(vp, dpad, p, ldp, tph, out, inv, nrows, d, c0); break;
        default: break;
    }
}

// out[b T + t][h d + c] = softmax_t'(scale q.k) v for every image b < B, head h < H, token t < T, c < d.
// qkv: rows of `qkv_stride` bf16 elements holding q (columns h d ..), k (H d + h d ..), v (2 H d + h d ..);
// out: rows of `out_stride` elements. d must be even. Returns 0, or -1 when memory ran out.
int vk_attention_bf16(const uint16_t *qkv, uint16_t *out, int B, int T, int H, int d, long qkv_stride,
                      long out_stride, float scale, int threads) {
    if (T <= 0 || d <= 0 || d % 2) return -2;
    int tpad = (T + 15) / 16 * 16, tph = tpad / 2, dh = d / 2, dpad = (d + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
    {
        size_t kp_n = (size_t)dh * tpad, vp_n = (size_t)tph * dpad;
        size_t s_n = (size_t)MR * tpad, p_n = (size_t)MR * tpad / 2;
        uint32_t *buf = aligned_alloc(64, ((kp_n + vp_n + s_n + p_n) * 4 + 63) / 64 * 64);
        uint32_t *kp = buf, *vp = kp + kp_n, *pp = vp + vp_n + s_n;
        float *s = (float *)(vp + vp_n);
        float inv[MR];
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (long pair = 0; pair < (long)B * H; pair++) {
            if (!buf) continue;  // every thread must meet the loop; one without memory does nothing
            int b = (int)(pair / H), h = (int)(pair % H);
            const uint16_t *base = pack_head(qkv, pair, T, H, d, qkv_stride, tpad, tph, dpad, kp, vp);
            long next = pair + 1 < (long)B * H ? pair + 1 : pair;
            const uint16_t *nbase = qkv + (size_t)(next / H) * T * qkv_stride + (size_t)(next % H) * d;
            for (int i0 = 0; i0 < T; i0 += MR) {
                // the next pair's q, k, v rows, a block at a time: its packing then reads from cache
                for (int r = i0; r < i0 + MR && r < T; r++)
                    for (int part = 0; part < 3; part++)
                        for (int c = 0; c < d; c += 32)
                            _mm_prefetch((const char *)(nbase + (size_t)r * qkv_stride + (size_t)part * H * d + c),
                                         _MM_HINT_T0);
                const uint32_t *q[MR];
                uint16_t *o[MR];
                for (int r = 0; r < MR; r++) {
                    int i = i0 + r < T ? i0 + r : T - 1;  // rows past T repeat the last (not stored)
                    q[r] = (const uint32_t *)(base + (size_t)i * qkv_stride + (size_t)h * d);
                    o[r] = out + ((size_t)b * T + i) * out_stride + (size_t)h * d;
                }
                qk_block(kp, tpad, q, dh, s, tpad);
                softmax_rows(s, tpad, T, tpad, scale, (uint16_t *)pp, tpad, inv, MR);
                // over the (T + 1) / 2 pairs holding a key: the rest of the 16-padded count is zeros
                pv_block(vp, dpad, pp, tph, (T + 1) / 2, o, inv, T - i0 < MR ? T - i0 : MR, d);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
