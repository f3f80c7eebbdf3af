// Fused int8 attention for ViT inference on AVX-512 VNNI CPUs: softmax(scale q k^T) v per (image, head), read
// straight from the fused qkv GEMM's bf16 output, both products by vpdpbusd (u8 x s8 -> s32), written as bf16
// into the token layout. Quantisation, per (image, head), while packing:
//   k: u8 per channel c over the tokens, k_tc ~ lo_c + sk_c kq_tc (lo_c = min_t k_tc, sk_c = range / 255);
//   q: the channel scales folded in (q'_c = q_c sk_c), then s8 per query row (scale max_c |q'_c| / 127).
//      q.k_t ~ q'.kq_t + sum_c q_c lo_c: the offsets add a constant to every score of a row, which the
//      softmax ignores, so no correction is needed;
//   P: the softmax numerators exp(s - max) in [0, 1] as u8 round(255 p) (the row maximum is 255 exactly),
//      normalised by the sum of the rounded values;
//   v: s8 per channel c (scale sv_c = max_t |v_tc| / 127), applied to the output column.
// Both products sum in int32; probabilities x values in runs of 65,536 keys, added up in fp32 (PV_QUADS).
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): AI, widen, lanes, load16, exp_neg.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#define MR 6  // query rows per block: MR x 4 accumulators of 16 lanes stay in registers
#define NI __attribute__((noinline))  // kept out of the OpenMP body: inlined there, GCC 12 allocates registers worse

// 255 * 2^x for x <= 0: 255 p(r) 2^floor(x), r = x - floor(x) in [0, 1) (vreduceps), p a degree-3 fit of 2^r
// (relative error 7.7e-5, far below the 1/255 step of the u8 it is rounded to; 255 p(0) = 254.98 rounds to
// 255). x is finite here: the scores are integers times a finite factor.
AI __m512 exp2_255(__m512 x) {
    __m512 r = _mm512_reduce_ps(x, 0x09);  // round down, no precision exception
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(255.0f * 0.07790722f), r, _mm512_set1_ps(255.0f * 0.22623353f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(255.0f * 0.69577674f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(255.0f * 0.99992789f));
    return _mm512_scalef_ps(p, x);  // p 2^floor(x)
}

// acc + (4 u8 of a) . (4 s8 of b) per 32-bit lane. In asm: GCC 12 keeps the accumulators of the intrinsic
// _mm512_dpbusd_epi32 in a loop in memory as well (a store and a register copy after every vpdpbusd)
AI __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

// s[r][t0 + 16 v + lane] = sum_j kp[j][t0 + 16 v + lane] (4 u8) . q_r[quad j] (4 s8), for MR rows
#define QK_TILE(NV)                                                                                            \
    NI static void qk_tile_##NV(const uint32_t *kp, int tpad, const uint32_t *q, int ldq, int dq, int32_t *s,  \
                             int lds, int t0) {                                                               \
        __m512i acc[MR][NV];                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_si512();          \
        for (int j = 0; j < dq; j++) {                                                                        \
            const uint32_t *kr = kp + (size_t)j * tpad + t0;                                                  \
            __m512i kv[NV];                                                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) kv[v] = _mm512_loadu_si512(kr + 16 * v);     \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m512i qb = _mm512_set1_epi32((int)q[r * ldq + j]);                                          \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] =                              \
                    dpbusd(acc[r][v], kv[v], qb);                                                \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                              \
                _mm512_storeu_si512(s + (size_t)r * lds + t0 + 16 * v, acc[r][v]);                            \
    }
QK_TILE(1)
QK_TILE(2)
QK_TILE(3)
QK_TILE(4)

// Keys per int32 run of the probabilities x values products: a quad of keys adds at most 4 * 255 * 127 to a
// lane, so 16384 quads (65,536 keys) stay below 2^31 (2,122,383,360); longer rows (from 66,312 keys, which
// wrapped around) carry each run's sums in fp32 and start the next run from zero
#define PV_QUADS 16384

// out_r[c0 + 16 v + lane] = inv_r sv[c] sum_tq p_r[quad tq] (4 u8) . vp[tq][c] (4 s8), rows r < nrows, c < d;
// int32 sums over runs of PV_QUADS quads, added up in fp32 (``part``, MR x NV x 16 floats) when there are several
#define PV_TILE(NV)                                                                                            \
    NI static void pv_tile_##NV(const uint32_t *vp, int dpad, const uint32_t *p, int ldp, int tqn,             \
                             uint16_t *const *out, const float *inv, const float *sv, int nrows, int d,      \
                             int c0, float *part) {                                                           \
        __m512i acc[MR][NV];                                                                                  \
        for (int tq0 = 0;; tq0 += PV_QUADS) {                                                                 \
            int tq1 = tqn - tq0 > PV_QUADS ? tq0 + PV_QUADS : tqn;                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                               \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_si512();      \
            for (int tq = tq0; tq < tq1; tq++) {                                                              \
                const uint32_t *vr = vp + (size_t)tq * dpad + c0;                                             \
                __m512i vv[NV];                                                                               \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vv[v] = _mm512_loadu_si512(vr + 16 * v); \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                        \
                    __m512i pb = _mm512_set1_epi32((int)p[(size_t)r * ldp + tq]);                             \
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] =                          \
                        dpbusd(acc[r][v], pb, vv[v]);                                                        \
                }                                                                                             \
            }                                                                                                 \
            if (tq1 == tqn) break;                                                                            \
            for (int r = 0; r < nrows; r++)                                                                   \
                for (int v = 0; v < NV; v++) {                                                                \
                    float *f = part + (size_t)(r * NV + v) * 16;                                              \
                    __m512 x = _mm512_cvtepi32_ps(acc[r][v]);                                                 \
                    _mm512_storeu_ps(f, tq0 ? _mm512_add_ps(_mm512_loadu_ps(f), x) : x);                      \
                }                                                                                             \
        }                                                                                                     \
        for (int r = 0; r < nrows; r++) {                                                                     \
            __m512 sc = _mm512_set1_ps(inv[r]);                                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                            \
                int c = c0 + 16 * v;                                                                          \
                __m512 sum = _mm512_cvtepi32_ps(acc[r][v]);                                                   \
                if (tqn > PV_QUADS) sum = _mm512_add_ps(sum, _mm512_loadu_ps(part + (size_t)(r * NV + v) * 16)); \
                __m512 y = _mm512_mul_ps(sum, _mm512_mul_ps(sc, _mm512_loadu_ps(sv + c)));                   \
                __m256i o = narrow(y);                                                                        \
                if (c + 16 <= d)                                                                              \
                    _mm256_storeu_si256((__m256i *)(out[r] + c), o);                                          \
                else if (c < d)                                                                               \
                    _mm256_mask_storeu_epi16(out[r] + c, lanes(d - c), o);                                    \
            }                                                                                                 \
        }                                                                                                     \
    }
PV_TILE(1)
PV_TILE(2)
PV_TILE(3)
PV_TILE(4)

// per-channel scales of T rows of d bf16 (`stride` apart): sc[c] = max_t |x_tc| / 127, isc[c] = 1 / sc[c]
// (0 for an all-zero channel; both zero beyond d). Returns 1 when a value is NaN or infinite.
NI static int channel_scales(const uint16_t *x, long stride, int T, int d, int dpad, float *sc, float *isc) {
    int bad = 0;
    const __m512i abs = _mm512_set1_epi16(0x7FFF);  // |x| as bf16 bits are ordered like the values
    for (int c0 = 0; c0 < dpad; c0 += 32) {
        int left = d - c0;
        __mmask32 m = left >= 32 ? (__mmask32)0xFFFFFFFFu : left > 0 ? (__mmask32)((1u << left) - 1) : 0;
        __m512i mx = _mm512_setzero_si512();
        for (int t = 0; t < T; t++)
            mx = _mm512_max_epu16(mx, _mm512_and_si512(abs, _mm512_maskz_loadu_epi16(m, x + (size_t)t * stride + c0)));
        if (_mm512_cmpge_epu16_mask(mx, _mm512_set1_epi16(0x7F80))) bad = 1;
        for (int half = 0; half < 2 && c0 + 16 * half < dpad; half++) {
            __m512 a = widen(half ? _mm512_extracti64x4_epi64(mx, 1) : _mm512_castsi512_si256(mx));
            __mmask16 nz = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
            _mm512_storeu_ps(sc + c0 + 16 * half, _mm512_mul_ps(a, _mm512_set1_ps(1.0f / 127)));
            _mm512_storeu_ps(isc + c0 + 16 * half, _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.0f), a));
        }
    }
    return bad;
}

// per-channel ranges of T rows of d bf16 keys (`stride` apart): lo[c] = min_t k_tc, sc[c] = (max - min) / 255,
// isc[c] = 1 / sc[c] (0 for a constant channel; all zero beyond d). Returns 1 when a value is NaN or infinite.
NI static int channel_ranges(const uint16_t *x, long stride, int T, int d, int dpad, float *lo, float *sc,
                             float *isc) {
    __m512i bits = _mm512_setzero_si512();
    for (int c0 = 0; c0 < dpad; c0 += 16) {
        __mmask16 m = lanes(d - c0);
        __m512 mx = _mm512_setzero_ps(), mn = _mm512_setzero_ps();  // (zero lanes beyond d)
        for (int t = 0; t < T; t++) {
            __m512 v = load16(x + (size_t)t * stride + c0, m);
            mx = t ? _mm512_max_ps(mx, v) : v;
            mn = t ? _mm512_min_ps(mn, v) : v;
            // |v| as integers: NaN above inf, and kept (vmaxps would drop a NaN)
            bits = _mm512_max_epu32(bits, _mm512_castps_si512(_mm512_abs_ps(v)));
        }
        __m512 w = _mm512_sub_ps(mx, mn);
        __mmask16 nz = _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
        _mm512_storeu_ps(lo + c0, mn);
        _mm512_storeu_ps(sc + c0, _mm512_mul_ps(w, _mm512_set1_ps(1.0f / 255)));
        _mm512_storeu_ps(isc + c0, _mm512_maskz_div_ps(nz, _mm512_set1_ps(255.0f), w));
    }
    return _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(0x7F800000)) != 0;
}

// kq[t][c] = u8 round((k_tc - lo_c) isk_c) for t < T, c < d (rows kst bytes apart; the rest untouched), then
// kp[j][t] = quad j of kq row t (zero for t >= T), the operand layout of vpdpbusd along d
NI static void pack_k(const uint16_t *k, long stride, int T, int d, int dq, int tpad, int kst, const float *lo,
                      const float *isk, uint8_t *kq, uint32_t *kp) {
    for (int t = 0; t < T; t++)
        for (int c0 = 0; c0 < d; c0 += 16) {
            __mmask16 m = lanes(d - c0);
            __m512 x = load16(k + (size_t)t * stride + c0, m);
            __m512 y = _mm512_mul_ps(_mm512_sub_ps(x, _mm512_loadu_ps(lo + c0)), _mm512_loadu_ps(isk + c0));
            _mm_mask_storeu_epi8(kq + (size_t)t * kst + c0, m, _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(y)));
        }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int t0 = 0; t0 < tpad; t0 += 16) {
        __mmask16 m = lanes(T - t0);
        __m512i idx = _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(t0)), _mm512_set1_epi32(kst));
        for (int j = 0; j < dq; j++)
            _mm512_storeu_si512(kp + (size_t)j * tpad + t0,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, kq + 4 * j, 1));
    }
}

// s8 codes round(v_tc isv_c) of 16 columns of row t (zero for t >= T)
AI __m128i v_codes(const uint16_t *v, long stride, int T, int t, int c0, __mmask16 m, __m512 isv) {
    if (t >= T) return _mm_setzero_si128();
    __m512 x = load16(v + (size_t)t * stride + c0, m);
    return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x, isv)));
}

// vp[tq][c] = the s8 codes of v[4 tq .. 4 tq + 3][c] as one quad (zero beyond T rows and d columns)
NI static void pack_v(const uint16_t *v, long stride, int T, int d, int tqn, int dpad, const float *isv,
                   uint32_t *vp) {
    for (int tq = 0; tq < tqn; tq++) {
        int t = 4 * tq;
        for (int c0 = 0; c0 < dpad; c0 += 16) {
            __mmask16 m = lanes(d - c0);
            __m512 is = _mm512_loadu_ps(isv + c0);
            __m128i a0 = v_codes(v, stride, T, t, c0, m, is), a1 = v_codes(v, stride, T, t + 1, c0, m, is);
            __m128i a2 = v_codes(v, stride, T, t + 2, c0, m, is), a3 = v_codes(v, stride, T, t + 3, c0, m, is);
            __m128i l01 = _mm_unpacklo_epi8(a0, a1), h01 = _mm_unpackhi_epi8(a0, a1);  // columns 0-7, 8-15
            __m128i l23 = _mm_unpacklo_epi8(a2, a3), h23 = _mm_unpackhi_epi8(a2, a3);
            __m512i z = _mm512_castsi128_si512(_mm_unpacklo_epi16(l01, l23));  // columns 0-3
            z = _mm512_inserti32x4(z, _mm_unpackhi_epi16(l01, l23), 1);
            z = _mm512_inserti32x4(z, _mm_unpacklo_epi16(h01, h23), 2);
            z = _mm512_inserti32x4(z, _mm_unpackhi_epi16(h01, h23), 3);
            _mm512_storeu_si512(vp + (size_t)tq * dpad + c0, z);
        }
    }
}

// s8 codes of MR query rows with the key channel scales folded in (row r at qq + r * dpad bytes, zero beyond
// d), and per row the factor from the integer scores to log2-scaled logits (NaN for a row with NaN/inf)
NI static void quantize_q(const uint16_t *const *q, int d, int dpad, const float *sk, float scale, float *qf,
                       int8_t *qq, float *factor) {
    for (int r = 0; r < MR; r++) {
        __m512 amax = _mm512_setzero_ps();
        for (int c0 = 0; c0 < dpad; c0 += 16) {
            __m512 x = _mm512_mul_ps(load16(q[r] + c0, lanes(d - c0)), _mm512_loadu_ps(sk + c0));
            _mm512_storeu_ps(qf + c0, x);
            // as integers: |x| bit patterns order like the values and NaN above inf (vmaxps would drop NaN)
            amax = _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(amax),
                                                        _mm512_castps_si512(_mm512_abs_ps(x))));
        }
        uint32_t bits = (uint32_t)_mm512_reduce_max_epu32(_mm512_castps_si512(amax));
        float a;
        memcpy(&a, &bits, 4);
        __m512 inv = _mm512_set1_ps(a > 0 ? 127.0f / a : 0.0f);
        for (int c0 = 0; c0 < dpad; c0 += 16)
            _mm_storeu_si128((__m128i *)(qq + (size_t)r * dpad + c0),
                             _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qf + c0), inv))));
        factor[r] = bits >= 0x7F800000u ? NAN : scale * (a / 127.0f) * 1.44269504088896341f;
    }
}

// softmax numerators of MR integer score rows as u8 round(255 exp(f (s - max))) (p, row stride ldp bytes),
// 1 / (sum of the u8 numerators) into inv (NaN where the factor is NaN). Each step for all rows before the
// next, so that the rows' reductions (latency chains) overlap.
NI static void softmax_rows(const int32_t *s, int lds, int T, int tpad, const float *factor, uint8_t *p, int ldp,
                         float *inv) {
    int nv = tpad / 16;
    __mmask16 last = lanes(T - 16 * (nv - 1));
    float mx[MR];
    for (int r = 0; r < MR; r++) {
        const int32_t *row = s + (size_t)r * lds;
        __m512i m = _mm512_set1_epi32(INT32_MIN);
        for (int v = 0; v < nv - 1; v++) m = _mm512_max_epi32(m, _mm512_loadu_si512(row + 16 * v));
        m = _mm512_mask_max_epi32(m, last, m, _mm512_loadu_si512(row + 16 * (nv - 1)));
        mx[r] = (float)_mm512_reduce_max_epi32(m);
    }
    __m512i sums[MR];
    for (int r = 0; r < MR; r++) {
        const int32_t *row = s + (size_t)r * lds;
        float f = isnan(factor[r]) ? 0.0f : factor[r];
        __m512 F = _mm512_set1_ps(f), M = _mm512_set1_ps(mx[r] * f);
        __m512i sum = _mm512_setzero_si512();
        for (int v = 0; v < nv; v++) {
            __m512 x = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(row + 16 * v)), F, M);
            __m512i e = _mm512_cvtps_epi32(exp2_255(x));
            if (v == nv - 1) e = _mm512_maskz_mov_epi32(last, e);
            sum = _mm512_add_epi32(sum, e);
            _mm_storeu_si128((__m128i *)(p + (size_t)r * ldp + 16 * v), _mm512_cvtusepi32_epi8(e));
        }
        sums[r] = sum;
    }
    for (int r = 0; r < MR; r++)
        inv[r] = isnan(factor[r]) ? NAN : 1.0f / (float)_mm512_reduce_add_epi32(sums[r]);
}

NI static void qk_block(const uint32_t *kp, int tpad, const uint32_t *q, int ldq, int dq, int32_t *s, int lds) {
    // tiles of 4 vectors of 16 keys, the rest as 3 + 2 rather than a lone 1
    for (int t0 = 0, left = tpad / 16; left > 0;) {
        int w = left >= 8 || left == 4 ? 4 : left >= 5 ? 3 : left;
        switch (w) {
            case 4: qk_tile_4(kp, tpad, q, ldq, dq, s, lds, t0); break;
            case 3: qk_tile_3(kp, tpad, q, ldq, dq, s, lds, t0); break;
            case 2: qk_tile_2(kp, tpad, q, ldq, dq, s, lds, t0); break;
            default: qk_tile_1(kp, tpad, q, ldq, dq, s, lds, t0); break;
        }
        t0 += 16 * w;
        left -= w;
    }
}

NI static void pv_block(const uint32_t *vp, int dpad, const uint32_t *p, int ldp, int tqn, uint16_t *const *out,
                     const float *inv, const float *sv, int nrows, int d) {
    float part[MR * 4 * 16] __attribute__((aligned(64)));  // fp32 sums of the int32 runs (rows over PV_QUADS quads)
    int nv = dpad / 16, c0 = 0;
    for (; nv - c0 / 16 >= 4; c0 += 64) pv_tile_4(vp, dpad, p, ldp, tqn, out, inv, sv, nrows, d, c0, part);
    switch (nv - c0 / 16) {
        case 3: pv_tile_3(vp, dpad, p, ldp, tqn, out, inv, sv, nrows, d, c0, part); break;
        case 2: pv_tile_2(vp, dpad, p, ldp, tqn, out, inv, sv, nrows, d, c0, part); break;
        case 1: pv_tile_1(vp, dpad, p, ldp, tqn, out, inv, sv, nrows, d, c0, part); break;
        default: break;
    }
}

// out[b T + t][h d + c] = softmax_t'(scale q.k) v for every image b < B, head h < H, token t < T, c < d, with
// q, k, P and v quantised as described at the top. qkv: rows of `qkv_stride` bf16 elements holding q (columns
// h d ..), k (H d + h d ..), v (2 H d + h d ..); out: rows of `out_stride` elements. A NaN or infinite k or v
// makes the whole (image, head) NaN, one in q its row. Returns 0, or -1 when memory ran out.
int vk_attention_int8(const uint16_t *qkv, uint16_t *out, int B, int T, int H, int d, long qkv_stride,
                      long out_stride, float scale, int threads) {
    if (T <= 0 || d <= 0) return -2;
    int tpad = (T + 15) / 16 * 16, dq = (d + 3) / 4, dpad = (d + 15) / 16 * 16, kst = dq * 4;
    int tqp = tpad / 4, tqn = (T + 3) / 4;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
    {
        // one buffer, 64-byte aligned parts: kq, kp, vp, s, p, qq (bytes) and sk, isk, sv, isv, qf (floats)
        size_t sizes[12] = {(size_t)tpad * kst, (size_t)dq * tpad * 4, (size_t)tqp * dpad * 4,
                            (size_t)MR * tpad * 4, (size_t)MR * tpad, (size_t)MR * dpad};
        for (int i = 6; i < 12; i++) sizes[i] = (size_t)dpad * 4;
        size_t total = 0, off[12];
        for (int i = 0; i < 12; i++) {
            off[i] = total;
            total += (sizes[i] + 63) / 64 * 64;
        }
        char *buf = aligned_alloc(64, total);
        failed = buf == NULL;
        if (buf) memset(buf, 0, total);
        uint8_t *kq = (uint8_t *)(buf + off[0]);
        uint32_t *kp = (uint32_t *)(buf + off[1]), *vp = (uint32_t *)(buf + off[2]);
        int32_t *s = (int32_t *)(buf + off[3]);
        uint8_t *pp = (uint8_t *)(buf + off[4]);
        int8_t *qq = (int8_t *)(buf + off[5]);
        float *sk = (float *)(buf + off[6]), *isk = (float *)(buf + off[7]), *sv = (float *)(buf + off[8]);
        float *isv = (float *)(buf + off[9]), *qf = (float *)(buf + off[10]), *lo = (float *)(buf + off[11]);
        float inv[MR], factor[MR];
#pragma omp for schedule(static)
        for (long pair = 0; pair < (long)B * H; pair++) {
            if (!buf) continue;  // every thread must meet the loop; one without memory does nothing
            int b = (int)(pair / H), h = (int)(pair % H);
            const uint16_t *base = qkv + (size_t)b * T * qkv_stride;
            const uint16_t *k = base + (size_t)H * d + (size_t)h * d, *v = base + 2 * (size_t)H * d + (size_t)h * d;
            int bad = channel_ranges(k, qkv_stride, T, d, dpad, lo, sk, isk);
            bad |= channel_scales(v, qkv_stride, T, d, dpad, sv, isv);
            pack_k(k, qkv_stride, T, d, dq, tpad, kst, lo, isk, kq, kp);
            pack_v(v, qkv_stride, T, d, tqn, dpad, isv, vp);
            long next = pair + 1 < (long)B * H ? pair + 1 : pair;
            const uint16_t *nbase = qkv + (size_t)(next / H) * T * qkv_stride + (size_t)(next % H) * d;
            for (int i0 = 0; i0 < T; i0 += MR) {
                // the next pair's q, k, v rows, a block at a time: its packing then reads from cache
                for (int r = i0; r < i0 + MR && r < T; r++)
                    for (int part = 0; part < 3; part++)
                        for (int c = 0; c < d; c += 32)
                            _mm_prefetch((const char *)(nbase + (size_t)r * qkv_stride + (size_t)part * H * d + c),
                                         _MM_HINT_T0);
                const uint16_t *q[MR];
                uint16_t *o[MR];
                for (int r = 0; r < MR; r++) {
                    int i = i0 + r < T ? i0 + r : T - 1;  // rows past T repeat the last (not stored)
                    q[r] = base + (size_t)i * qkv_stride + (size_t)h * d;
                    o[r] = out + ((size_t)b * T + i) * out_stride + (size_t)h * d;
                }
                quantize_q(q, d, dpad, sk, scale, qf, qq, factor);
                qk_block(kp, tpad, (const uint32_t *)qq, dpad / 4, dq, s, tpad);
                softmax_rows(s, tpad, T, tpad, factor, pp, tpad, inv);
                if (bad)
                    for (int r = 0; r < MR; r++) inv[r] = NAN;
                pv_block(vp, dpad, (const uint32_t *)pp, tqp, tqn, o, inv, sv, T - i0 < MR ? T - i0 : MR, d);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
