// Attention forward and backward of the ViT training step on AVX-512 BF16 CPUs: bf16 operands, fp32 sums
// (vdpbf16ps), one OpenMP work item per (image, head), its operands packed into per-thread buffers that stay
// in L1/L2. With S = scale q k^T, P = softmax(S), O = P v and dO given:
//   vk_attn_fwd: O, written in the token layout (B, T, h d), and P kept in bf16 for the backward pass;
//   vk_attn_bwd: dv = P^T dO, dP = dO v^T, dS = P * (dP - D) with D = rowsum(P * dP),
//                dq = scale dS k, dk = scale dS^T q, written straight into the qkv gradient (B, T, 3, h, d).
// q, k, v are read from the fused projection (B, T, 3, h, d). vdpbf16ps multiplies bf16 pairs, so every
// operand is laid out in pairs along its contraction axis:
//   pairs along d  (t in lanes):  kd[j][t] = (k[t][2j], k[t][2j+1])   for S = q k^T and dP = dO v^T;
//   pairs along t  (c in lanes):  xt[i][c] = (x[2i][c], x[2i+1][c])    for O = P v, dq = dS k, dk, dv;
//   P and dS are kept as pairs of rows, pp[i][t] = (P[2i][t], P[2i+1][t]): a word of it is what dv = P^T dO
//   and dk = dS^T q broadcast, and its two halves are P's rows for dS = P * (dP - D).
// Sizes: Tp = T rounded up to even (pairs), Tw = T rounded up to 16 (lanes), dw = d rounded up to 16; padding
// is zero. The saved P is (B h, Tp / 2, Tw) words.
// Compiled with vitkit/simd.h in front (vitkit.native.kernel_source): AI, widen, narrow, lanes, load16, exp_neg.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MR 6  // rows per tile: MR x 4 accumulators of 16 fp32 lanes stay in registers (MR even: pairs of rows)
#define ATTN_T_MAX 4096
#define ATTN_D_MAX 256

AI __m512 even_row(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
AI __m512 odd_row(__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u))); }
// words (bf16(a), bf16(b)): a in the low half
AI __m512i pair(__m512 a, __m512 b) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(narrow(a)), _mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow(b)), 16));
}

// c[r][16 v + lane] = sum_{k < nk} A(r, k) . b[k][16 v + lane] (fp32 sums of bf16 pair products) for r < MR,
// v < NV, where A(r, k) = a[r][k ks] is one word (a bf16 pair) and rows of b are ldb words apart.
#define TILE(NV)                                                                                               \
    static void tile_##NV(const uint32_t *const *a, long ks, const uint32_t *b, long ldb, int nk, float *c,  \
                          long ldc) {                                                                         \
        __m512 acc[MR][NV];                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();             \
        const uint32_t *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];                \
        for (int k = 0; k < nk; k++) {                                                                        \
            __m512bh bv[NV];                                                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) bv[v] =                                      \
                (__m512bh)_mm512_loadu_si512(b + 16 * v);                                                     \
            const uint32_t w[MR] = {*a0, *a1, *a2, *a3, *a4, *a5};                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {                                            \
                __m512bh ab = (__m512bh)_mm512_set1_epi32((int)w[r]);                                        \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] =                              \
                    _mm512_dpbf16_ps(acc[r][v], ab, bv[v]);                                                   \
            }                                                                                                 \
            a0 += ks, a1 += ks, a2 += ks, a3 += ks, a4 += ks, a5 += ks, b += ldb;                             \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                              \
                _mm512_storeu_ps(c + (size_t)r * ldc + 16 * v, acc[r][v]);                                   \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)

// c[r][0 .. 16 nv) as above, nv vectors of 16 columns in tiles of at most 4
static void gemm_rows(const uint32_t *const *a, long ks, const uint32_t *b, long ldb, int nk, float *c, long ldc,
                      int nv) {
    for (int v0 = 0; v0 < nv;) {
        int w = nv - v0 >= 8 || nv - v0 == 4 ? 4 : nv - v0 >= 5 ? 3 : nv - v0;  // no lone last vector if avoidable
        switch (w) {
            case 4: tile_4(a, ks, b + 16 * v0, ldb, nk, c + 16 * v0, ldc); break;
            case 3: tile_3(a, ks, b + 16 * v0, ldb, nk, c + 16 * v0, ldc); break;
            case 2: tile_2(a, ks, b + 16 * v0, ldb, nk, c + 16 * v0, ldc); break;
            default: tile_1(a, ks, b + 16 * v0, ldb, nk, c + 16 * v0, ldc); break;
        }
        v0 += w;
    }
}

// kd[j][t] = (x[t][2j], x[t][2j+1]) for j < d/2, t < Tw (zero for t >= T); rows of x are ld elements apart
static void pack_d(const uint16_t *x, long ld, int T, int d, int Tw, uint32_t *kd) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)(ld / 2)));
    for (int t0 = 0; t0 < Tw; t0 += 16) {
        __mmask16 m = lanes(T - t0);
        const int *rows = (const int *)(x + (size_t)t0 * ld);
        for (int j = 0; j < d / 2; j++)
            _mm512_storeu_si512(kd + (size_t)j * Tw + t0,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, rows + j, 4));
    }
}

// xt[i][c] = (x[2i][c], x[2i+1][c]) for i < Tp/2, c < dw (zero for rows >= T, columns >= d)
static void pack_t(const uint16_t *x, long ld, int T, int d, int dw, uint32_t *xt) {
    for (int i = 0; 2 * i < T; i++) {
        const uint16_t *r0 = x + (size_t)(2 * i) * ld, *r1 = r0 + ld;
        for (int c = 0; c < dw; c += 16) {
            __mmask16 m = lanes(d - c);
            __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + c));
            __m512i b = 2 * i + 1 < T ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r1 + c)) : _mm512_setzero_si512();
            _mm512_storeu_si512(xt + (size_t)i * dw + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

// dst[r][c] = bf16(alpha c[r][c]) for r < nrows, c < d; rows of dst are ld elements apart
static void store_rows(const float *c, int ldc, float alpha, int nrows, int d, uint16_t *dst, long ld) {
    __m512 al = _mm512_set1_ps(alpha);
    for (int r = 0; r < nrows; r++)
        for (int j = 0; j < d; j += 16)
            _mm256_mask_storeu_epi16(dst + (size_t)r * ld + j, lanes(d - j),
                                     narrow(_mm512_mul_ps(al, _mm512_loadu_ps(c + (size_t)r * ldc + j))));
}

// rows r < nrows of s (fp32, Tw wide) become softmax(scale s[r][0..T)) in place, zero from T to Tw
static void softmax_rows(float *s, int Tw, int T, float scale, int nrows) {
    int nv = Tw / 16;
    __mmask16 last = lanes(T - 16 * (nv - 1));
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < nrows; r++) {
        float *row = s + (size_t)r * Tw;
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        for (int v = 0; v < nv; v++) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * v), sc);
            _mm512_storeu_ps(row + 16 * v, x);
            mx = v < nv - 1 ? _mm512_max_ps(mx, x) : _mm512_mask_max_ps(mx, last, mx, x);
        }
        __m512 big = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
        for (int v = 0; v < nv; v++) {
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * v), big));
            if (v == nv - 1) e = _mm512_maskz_mov_ps(last, e);
            _mm512_storeu_ps(row + 16 * v, e);
            sum = _mm512_add_ps(sum, e);
        }
        __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(_mm512_reduce_add_ps(sum)));
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(row + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(row + 16 * v), inv));
    }
}

// the lines of rows [r0, r0 + MR) of x (d elements each, ld apart) into L1: the next (image, head)'s operands
// are fetched a tile at a time while this one computes, so that its packing reads from cache
AI void prefetch_rows(const uint16_t *x, long ld, int r0, int T, int d) {
    for (int r = r0; r < r0 + MR && r < T; r++)
        for (int c = 0; c < d; c += 32) _mm_prefetch((const char *)(x + (size_t)r * ld + c), _MM_HINT_T0);
}

AI int check(int B, int T, int H, int d) {
    return B > 0 && T > 0 && T <= ATTN_T_MAX && H > 0 && d > 0 && d <= ATTN_D_MAX && d % 2 == 0;
}

// out[b][t][h d + c] = O and pp[b H + h] = P (pairs of rows) for every image b < B and head h < H, from
// qkv (B, T, 3, H, d). Returns 0, -1 when memory ran out, -2 for sizes it does not take.
int vk_attn_fwd(const uint16_t *qkv, uint16_t *out, uint32_t *pp, int B, int T, int H, int d, float scale,
                int threads) {
    if (!check(B, T, H, d)) return -2;
    int Tp = T + (T & 1), Tw = (T + 15) / 16 * 16, dw = (d + 15) / 16 * 16, D = H * d;
    long ld = 3L * D;
    size_t kd_n = (size_t)(d / 2) * Tw, vt_n = (size_t)(Tp / 2) * dw, s_n = (size_t)MR * Tw;
    size_t pr_n = (size_t)MR * Tw / 2, o_n = (size_t)MR * dw;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
    {
        uint32_t *buf = aligned_alloc(64, ((kd_n + vt_n + s_n + pr_n + o_n) * 4 + 63) / 64 * 64);
        uint32_t *kd = buf, *vt = kd + kd_n, *pr = vt + vt_n + s_n;
        float *s = (float *)(vt + vt_n), *o = (float *)(pr + pr_n);
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!buf) continue;  // every thread must meet the loop; one without memory does nothing
            long b = bh / H, h = bh % H;
            const uint16_t *q = qkv + (size_t)b * T * ld + h * d, *k = q + D, *v = q + 2 * D;
            uint32_t *P = pp + (size_t)bh * (Tp / 2) * Tw;
            pack_d(k, ld, T, d, Tw, kd);
            pack_t(v, ld, T, d, dw, vt);
            long nx = bh + 1 < (long)B * H ? bh + 1 : bh;  // the next item (a thread's items are consecutive)
            const uint16_t *nq = qkv + (size_t)(nx / H) * T * ld + (nx % H) * d;
            for (int r0 = 0; r0 < T; r0 += MR) {
                int nr = T - r0 < MR ? T - r0 : MR;
                for (int part = 0; part < 3; part++) prefetch_rows(nq + (size_t)part * D, ld, r0, T, d);
                const uint32_t *a[MR];
                for (int r = 0; r < MR; r++) a[r] = (const uint32_t *)(q + (size_t)(r < nr ? r0 + r : r0) * ld);
                gemm_rows(a, 1, kd, Tw, d / 2, s, Tw, Tw / 16);  // q k^T
                softmax_rows(s, Tw, T, scale, nr);
                memset(s + (size_t)nr * Tw, 0, (size_t)(MR - nr) * Tw * 4);  // rows past T: P = 0
                uint16_t *p16 = (uint16_t *)pr;
                for (int r = 0; r < MR; r++)
                    for (int t = 0; t < Tw; t += 16)
                        _mm256_storeu_si256((__m256i *)(p16 + (size_t)r * Tw + t), narrow(_mm512_loadu_ps(s + (size_t)r * Tw + t)));
                for (int i = r0 / 2; i < (r0 + MR) / 2 && i < Tp / 2; i++)
                    for (int t = 0; t < Tw; t += 16)
                        _mm512_storeu_si512(P + (size_t)i * Tw + t, pair(_mm512_loadu_ps(s + (size_t)(2 * i - r0) * Tw + t),
                                                                         _mm512_loadu_ps(s + (size_t)(2 * i + 1 - r0) * Tw + t)));
                for (int r = 0; r < MR; r++) a[r] = pr + (size_t)r * Tw / 2;
                gemm_rows(a, 1, vt, dw, Tp / 2, o, dw, dw / 16);  // P v
                store_rows(o, dw, 1.0f, nr, d, out + ((size_t)b * T + r0) * D + h * d, D);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

// dqkv (B, T, 3, H, d) = the gradient of O with respect to qkv, given dout = dO (B, T, H d) and pp = P from
// vk_attn_fwd. D = rowsum(P * dP) (= rowsum(dO * O)) is taken from the fp32 dP and the bf16 P that dS then
// uses: from dO * O with O rounded to bf16, dS = P (dP - D) lost its accuracy where P is nearly one-hot. Returns 0, -1 when memory ran out, -2 for sizes it does not take.
int vk_attn_bwd(const uint16_t *qkv, const uint16_t *dout, const uint32_t *pp,
                uint16_t *dqkv, int B, int T, int H, int d, float scale, int threads) {
    if (!check(B, T, H, d)) return -2;
    int Tp = T + (T & 1), Tw = (T + 15) / 16 * 16, dw = (d + 15) / 16 * 16, D = H * d;
    long ld = 3L * D;
    size_t vd_n = (size_t)(d / 2) * Tw, xt_n = (size_t)(Tp / 2) * dw, ds_n = (size_t)(Tp / 2) * Tw;
    size_t s_n = (size_t)MR * Tw, dr_n = (size_t)MR * Tw / 2, o_n = (size_t)MR * dw;
    size_t total = vd_n + 3 * xt_n + ds_n + s_n + dr_n + o_n;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
    {
        uint32_t *buf = aligned_alloc(64, (total * 4 + 63) / 64 * 64);
        uint32_t *vd = buf, *kt = vd + vd_n, *qt = kt + xt_n, *ot = qt + xt_n, *dsp = ot + xt_n;
        uint32_t *dsr = dsp + ds_n + s_n;
        float *s = (float *)(dsp + ds_n), *o = (float *)(dsr + dr_n);
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!buf) continue;
            long b = bh / H, h = bh % H;
            const uint16_t *q = qkv + (size_t)b * T * ld + h * d, *k = q + D, *v = q + 2 * D;
            const uint16_t *g = dout + (size_t)b * T * D + h * d;
            uint16_t *dq = dqkv + (size_t)b * T * ld + h * d, *dk = dq + D, *dv = dq + 2 * D;
            const uint32_t *P = pp + (size_t)bh * (Tp / 2) * Tw;
            pack_d(v, ld, T, d, Tw, vd);
            pack_t(k, ld, T, d, dw, kt);
            pack_t(q, ld, T, d, dw, qt);
            pack_t(g, D, T, d, dw, ot);
            long nx = bh + 1 < (long)B * H ? bh + 1 : bh;  // the next item (a thread's items are consecutive)
            const uint16_t *nq = qkv + (size_t)(nx / H) * T * ld + (nx % H) * d;
            const uint16_t *ng = dout + (size_t)(nx / H) * T * D + (nx % H) * d;
            for (int r0 = 0; r0 < T; r0 += MR) {
                int nr = T - r0 < MR ? T - r0 : MR;
                for (int part = 0; part < 3; part++) prefetch_rows(nq + (size_t)part * D, ld, r0, T, d);
                prefetch_rows(ng, D, r0, T, d);
                const uint32_t *a[MR];
                for (int r = 0; r < MR; r++) a[r] = (const uint32_t *)(g + (size_t)(r < nr ? r0 + r : r0) * D);
                gemm_rows(a, 1, vd, Tw, d / 2, s, Tw, Tw / 16);  // dP = dO v^T
                uint16_t *d16 = (uint16_t *)dsr;
                for (int i = r0 / 2; i < (r0 + MR) / 2; i++) {
                    int e = 2 * i - r0;
                    if (i >= Tp / 2) {  // rows past the padding: dS = 0 (their dq is not stored)
                        memset(d16 + (size_t)e * Tw, 0, (size_t)2 * Tw * 2);
                        continue;
                    }
                    __m512 se = _mm512_setzero_ps(), so = _mm512_setzero_ps();  // D of the two rows
                    for (int t = 0; t < Tw; t += 16) {
                        __m512i w = _mm512_loadu_si512(P + (size_t)i * Tw + t);
                        se = _mm512_fmadd_ps(even_row(w), _mm512_loadu_ps(s + (size_t)e * Tw + t), se);
                        so = _mm512_fmadd_ps(odd_row(w), _mm512_loadu_ps(s + (size_t)(e + 1) * Tw + t), so);
                    }
                    __m512 de = _mm512_set1_ps(_mm512_reduce_add_ps(se)), dodd = _mm512_set1_ps(_mm512_reduce_add_ps(so));
                    for (int t = 0; t < Tw; t += 16) {
                        __m512i w = _mm512_loadu_si512(P + (size_t)i * Tw + t);
                        __m512 se = _mm512_mul_ps(even_row(w), _mm512_sub_ps(_mm512_loadu_ps(s + (size_t)e * Tw + t), de));
                        __m512 so = _mm512_mul_ps(odd_row(w), _mm512_sub_ps(_mm512_loadu_ps(s + (size_t)(e + 1) * Tw + t), dodd));
                        _mm512_storeu_si512(dsp + (size_t)i * Tw + t, pair(se, so));
                        _mm256_storeu_si256((__m256i *)(d16 + (size_t)e * Tw + t), narrow(se));
                        _mm256_storeu_si256((__m256i *)(d16 + (size_t)(e + 1) * Tw + t), narrow(so));
                    }
                }
                for (int r = 0; r < MR; r++) a[r] = dsr + (size_t)r * Tw / 2;
                gemm_rows(a, 1, kt, dw, Tp / 2, o, dw, dw / 16);  // dq = scale dS k
                store_rows(o, dw, scale, nr, d, dq + (size_t)r0 * ld, ld);
            }
            for (int t0 = 0; t0 < T; t0 += MR) {  // dk = scale dS^T q, dv = P^T dO: rows are keys
                int nr = T - t0 < MR ? T - t0 : MR;
                const uint32_t *a[MR];
                for (int r = 0; r < MR; r++) a[r] = dsp + (r < nr ? t0 + r : t0);
                gemm_rows(a, Tw, qt, dw, Tp / 2, o, dw, dw / 16);
                store_rows(o, dw, scale, nr, d, dk + (size_t)t0 * ld, ld);
                for (int r = 0; r < MR; r++) a[r] = P + (r < nr ? t0 + r : t0);
                gemm_rows(a, Tw, ot, dw, Tp / 2, o, dw, dw / 16);
                store_rows(o, dw, 1.0f, nr, d, dv + (size_t)t0 * ld, ld);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
