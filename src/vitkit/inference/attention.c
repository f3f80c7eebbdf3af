// Fused bf16 attention for ViT inference on AVX-512 BF16 CPUs: softmax(scale q k^T) v per (image, head),
// read straight from the fused qkv GEMM output and written straight into the token layout.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>

#define MR 6  // query rows per block: MR x 4 accumulators of 16 fp32 lanes stay in registers
#define AI static inline __attribute__((always_inline))

// 2^y for y <= 0 in fp32: 2^floor(y) p(f), f = y - floor(y) in [0, 1) (vreduceps), p the degree-3 minimax
// polynomial of 2^f (relative error < 7.5e-5, far below the bf16 rounding, 4e-3, the result then gets);
// vscalefps takes the floor of y itself. No clamp needed: y = -inf (a -inf score) gives f = 0 and 2^-inf = 0,
// a very negative y 0 or a denormal; a NaN y (NaN/inf in q or k) stays NaN and poisons its row as in PyTorch
AI __m512 exp2_neg(__m512 y) {
    __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.07802452f), f, _mm512_set1_ps(0.22606719f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69583350f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992520f));
    return _mm512_scalef_ps(p, y);
}

// s[r][t0 + 16 v + lane] = sum_j q_r[pair j] . kp[j][t0 + 16 v + lane] (bf16 pairs, fp32 sums), for MR rows;
// rmax[r] (lane-wise) takes the maximum of the row's scores of keys < T as well
#define QK_TILE(NV)                                                                                           \
    static void qk_tile_##NV(const uint32_t *kp, int tpad, const uint32_t *const *q, int dh, float *s,        \
                             int lds, int t0, int T, __m512 *rmax) {                                          \
        __m512 acc[MR][NV];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();             \
        for (int j = 0; j < dh; j++) {                                                                        \
            const uint32_t *kr = kp + (size_t)j * tpad + t0;                                                  \
            __m512bh kv[NV];                                                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) kv[v] =                                      \
                (__m512bh)_mm512_loadu_si512(kr + 16 * v);                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r][j]);                                      \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] =                              \
                    _mm512_dpbf16_ps(acc[r][v], qb, kv[v]);                                                   \
            }                                                                                                 \
        }                                                                                                     \
        __mmask16 keep[NV];                                                                                   \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                                \
            int left = T - t0 - 16 * v;                                                                       \
            keep[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;          \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                                \
            __m512 m = rmax[r];                                                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                            \
                _mm512_storeu_ps(s + (size_t)r * lds + t0 + 16 * v, acc[r][v]);                               \
                m = _mm512_mask_max_ps(m, keep[v], m, acc[r][v]);                                             \
            }                                                                                                 \
            rmax[r] = m;                                                                                      \
        }                                                                                                     \
    }
QK_TILE(1)
QK_TILE(2)
QK_TILE(3)
QK_TILE(4)

// out_r[c0 + 16 v + lane] = inv_r * sum_tp p_r[pair tp] . vp[tp][c0 + 16 v + lane], rows r < nrows, cols < d
#define PV_TILE(NV)                                                                                           \
    static void pv_tile_##NV(const uint32_t *vp, int dpad, const uint32_t *p, int ldp, int tph,               \
                             uint16_t *const *out, const float *inv, int nrows, int d, int c0) {              \
        __m512 acc[MR][NV];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();             \
        for (int tp = 0; tp < tph; tp++) {                                                                    \
            const uint32_t *vr = vp + (size_t)tp * dpad + c0;                                                 \
            __m512bh vv[NV];                                                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vv[v] =                                      \
                (__m512bh)_mm512_loadu_si512(vr + 16 * v);                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p[(size_t)r * ldp + tp]);                      \
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

// r[i] lane j -> r[j] lane i, 16 x 16 dwords: pairs, then quads, within 128-bit lanes, then the lanes
AI void transpose16(__m512i *r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // rows i, i+1; columns 0 1 | 4 5 | 8 9 | 12 13
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // columns 2 3 | 6 7 | ...
    }
    for (int i = 0; i < 16; i += 4) {  // b[i + c]: rows i..i+3 of columns c, c + 4, c + 8, c + 12 (one per lane)
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i lo = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), hi = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        __m512i lo2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
        __m512i hi2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(lo, lo2, 0x88);
        r[c + 4] = _mm512_shuffle_i32x4(hi, hi2, 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(lo, lo2, 0xDD);
        r[c + 12] = _mm512_shuffle_i32x4(hi, hi2, 0xDD);
    }
}

// kp[j][t] = pair j of key row t (zero for t >= T); rows of k are `stride` elements apart. 16 keys x 16 pairs
// at a time: 16 row loads and a transpose (a 16-lane gather per pair was 2-3x slower)
static void pack_k(const uint16_t *k, long stride, int T, int dh, int tpad, uint32_t *kp) {
    for (int t0 = 0; t0 < tpad; t0 += 16) {
        for (int j0 = 0; j0 < dh; j0 += 16) {
            int nj = dh - j0 < 16 ? dh - j0 : 16;
            __mmask16 m = (__mmask16)((1u << nj) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = t0 + i < T ? _mm512_maskz_loadu_epi32(m, (const uint32_t *)(k + (size_t)(t0 + i) * stride) + j0)
                                  : _mm512_setzero_si512();
            transpose16(r);
            for (int j = 0; j < nj; j++) _mm512_storeu_si512(kp + (size_t)(j0 + j) * tpad + t0, r[j]);
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

// softmax numerators of MR score rows into bf16 (p, row stride ldp elements), 1/sums into inv; rmax: the
// rows' maxima, lane-wise (from qk_block). One pass: exp, sum and the bf16 numerators, two vectors at a time
static void softmax_rows(const float *s, int lds, int T, int tpad, float scale, const __m512 *rmax, uint16_t *p,
                         int ldp, float *inv) {
    int nv = tpad / 16;
    __mmask16 last = (T % 16) ? (__mmask16)((1u << (T % 16)) - 1) : (__mmask16)0xFFFF;
    __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);  // exp(scale x) = 2^(scale log2(e) x)
    for (int r = 0; r < MR; r++) {
        const float *row = s + (size_t)r * lds;
        uint16_t *out = p + (size_t)r * ldp;
        __m512 mx = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(rmax[r])), sc);
        __m512 sum = _mm512_setzero_ps(), sum2 = _mm512_setzero_ps();
        int v = 0;
        for (; v + 2 < nv; v += 2) {  // the last vector (masked) is left to the tail
            __m512 e0 = exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v), sc, mx));
            __m512 e1 = exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v + 16), sc, mx));
            sum = _mm512_add_ps(sum, e0);
            sum2 = _mm512_add_ps(sum2, e1);
            _mm512_storeu_si512(out + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        __m512 e0 = exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v), sc, mx));
        if (v + 1 == nv) {
            e0 = _mm512_maskz_mov_ps(last, e0);
            _mm256_storeu_si256((__m256i *)(out + 16 * v), (__m256i)_mm512_cvtneps_pbh(e0));
        } else {
            __m512 e1 = exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v + 16), sc, mx));
            e1 = _mm512_maskz_mov_ps(last, e1);
            sum2 = _mm512_add_ps(sum2, e1);
            _mm512_storeu_si512(out + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum, e0), sum2));
    }
}

static void qk_block(const uint32_t *kp, int tpad, const uint32_t *const *q, int dh, float *s, int lds, int T,
                     __m512 *rmax) {
    // tiles of 4 vectors of 16 keys, the rest as 3 + 2 rather than a lone 1 (6 accumulators: latency-bound)
    for (int t0 = 0, left = tpad / 16; left > 0;) {
        int w = left >= 8 || left == 4 ? 4 : left >= 5 ? 3 : left;
        switch (w) {
            case 4: qk_tile_4(kp, tpad, q, dh, s, lds, t0, T, rmax); break;
            case 3: qk_tile_3(kp, tpad, q, dh, s, lds, t0, T, rmax); break;
            case 2: qk_tile_2(kp, tpad, q, dh, s, lds, t0, T, rmax); break;
            default: qk_tile_1(kp, tpad, q, dh, s, lds, t0, T, rmax); break;
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
            const uint16_t *base = qkv + (size_t)b * T * qkv_stride;
            pack_k(base + (size_t)H * d + (size_t)h * d, qkv_stride, T, dh, tpad, kp);
            pack_v(base + 2 * (size_t)H * d + (size_t)h * d, qkv_stride, T, d, tph, dpad, vp);
            long next = pair + 1 < (long)B * H ? pair + 1 : pair;
            const uint16_t *nbase = qkv + (size_t)(next / H) * T * qkv_stride + (size_t)(next % H) * d;
            for (int i0 = 0; i0 < T; i0 += MR) {
                // the next pair's q, k, v rows, a block at a time, into L2: its packing then reads from cache (into
                // L1 they were evicted before use: 75 KiB for B/16 next to 53 KiB of packed k and v; 1-4% slower)
                for (int r = i0; r < i0 + MR && r < T; r++)
                    for (int part = 0; part < 3; part++)
                        for (int c = 0; c < d; c += 32)
                            _mm_prefetch((const char *)(nbase + (size_t)r * qkv_stride + (size_t)part * H * d + c),
                                         _MM_HINT_T1);
                const uint32_t *q[MR];
                uint16_t *o[MR];
                for (int r = 0; r < MR; r++) {
                    int i = i0 + r < T ? i0 + r : T - 1;  // rows past T repeat the last (not stored)
                    q[r] = (const uint32_t *)(base + (size_t)i * qkv_stride + (size_t)h * d);
                    o[r] = out + ((size_t)b * T + i) * out_stride + (size_t)h * d;
                }
                __m512 rmax[MR];
                for (int r = 0; r < MR; r++) rmax[r] = _mm512_set1_ps(-INFINITY);
                qk_block(kp, tpad, q, dh, s, tpad, T, rmax);
                softmax_rows(s, tpad, T, tpad, scale, rmax, (uint16_t *)pp, tpad, inv);
                // pairs of keys up to T only: those past it (padding to 16) have zero numerators
                pv_block(vp, dpad, pp, tph, (T + 1) / 2, o, inv, T - i0 < MR ? T - i0 : MR, d);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
