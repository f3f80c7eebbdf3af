// The bf16 attention of attention.c on Intel AMX tiles (Sapphire Rapids and later: amx_tile, amx_bf16): the same
// packing (pack_k, pack_v), softmax (softmax_rows) and output, with both products by tdpbf16ps on 16-row tiles
// instead of vdpbf16ps on 6 rows. Compiled after attention.c (one source: attention.py's AMX_SOURCES).
//   S = q k^T: A = 16 query rows x 32 channels, loaded from the qkv rows themselves; B = 16 pairs of channels x 16
//      keys from the packed keys (kp[j][t], the VNNI layout tdpbf16ps reads); C = 16 x 16 fp32 scores.
//   O = P v: A = 16 rows x 32 keys of the bf16 numerators; B = 16 pairs of keys x 16 channels from the packed
//      values (vp[tp][c]); C = 16 x 16 fp32, scaled by 1 / sum and rounded to bf16 into the token layout.
// Head widths that are multiples of 32 up to 128 (every published ViT but So400m's 72); others take attention.c.
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void amx_configure(void) {
    struct tile_config cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&cfg);
}

// Linux hands a process the AMX tile state only when asked (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA)
int vk_amx_enable(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

// s[r][t] = q_r . k_t for 16 rows (q: rows `ldq` bf16 apart) and keys t < tpad (a multiple of 16)
static void qk_amx(const uint16_t *q, long ldq, const uint32_t *kp, int tpad, int d, float *s) {
    int t0 = 0;
    for (; t0 + 32 <= tpad; t0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < d; c += 32) {
            _tile_loadd(4, q + c, ldq * 2);
            _tile_loadd(2, kp + (size_t)(c / 2) * tpad + t0, tpad * 4);
            _tile_loadd(3, kp + (size_t)(c / 2) * tpad + t0 + 16, tpad * 4);
            _tile_dpbf16ps(0, 4, 2);
            _tile_dpbf16ps(1, 4, 3);
        }
        _tile_stored(0, s + t0, tpad * 4);
        _tile_stored(1, s + t0 + 16, tpad * 4);
    }
    if (t0 < tpad) {
        _tile_zero(0);
        for (int c = 0; c < d; c += 32) {
            _tile_loadd(4, q + c, ldq * 2);
            _tile_loadd(2, kp + (size_t)(c / 2) * tpad + t0, tpad * 4);
            _tile_dpbf16ps(0, 4, 2);
        }
        _tile_stored(0, s + t0, tpad * 4);
    }
}

// o[r][c] = sum_t p[r][t] v[t][c] for 16 rows, c < d, over tpad32 keys (p: rows `ldp` bf16 apart, zero past T)
static void pv_amx(const uint16_t *p, int ldp, const uint32_t *vp, int tpad32, int d, float *o) {
    for (int c0 = 0; c0 < d; c0 += 64) {
        int n = (d - c0) / 16 < 4 ? (d - c0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k0 = 0; k0 < tpad32; k0 += 32) {
            const uint32_t *vb = vp + (size_t)(k0 / 2) * d + c0;
            _tile_loadd(4, p + k0, ldp * 2);
            _tile_loadd(5, vb, d * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vb + 16, d * 4);
            _tile_dpbf16ps(1, 4, 6);
            if (n > 2) {
                _tile_loadd(7, vb + 32, d * 4);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (n > 3) {
                _tile_loadd(5, vb + 48, d * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o + c0, d * 4);
        _tile_stored(1, o + c0 + 16, d * 4);
        if (n > 2) _tile_stored(2, o + c0 + 32, d * 4);
        if (n > 3) _tile_stored(3, o + c0 + 48, d * 4);
    }
}

// vk_attention_bf16's function on AMX; d must be a multiple of 32, at most 128. Returns 0, -1 when memory ran out,
// -2 for arguments it does not take.
int vk_attention_amx(const uint16_t *qkv, uint16_t *out, int B, int T, int H, int d, long qkv_stride,
                     long out_stride, float scale, int threads) {
    if (T <= 0 || d <= 0 || d % 32 || d > 128) return -2;
    int tpad = (T + 15) / 16 * 16, tpad32 = (T + 31) / 32 * 32, dh = d / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
    {
        size_t kp_n = (size_t)dh * tpad, vp_n = (size_t)(tpad32 / 2) * d;
        size_t s_n = (size_t)AMX_ROWS * tpad, p_n = (size_t)AMX_ROWS * tpad32 / 2, o_n = (size_t)AMX_ROWS * d;
        size_t q_n = (size_t)AMX_ROWS * d / 2;
        uint32_t *buf = aligned_alloc(64, ((kp_n + vp_n + s_n + p_n + o_n + q_n) * 4 + 63) / 64 * 64);
        uint32_t *kp = buf, *vp = kp + kp_n;
        float *s = (float *)(vp + vp_n), *o = s + s_n + p_n;
        uint16_t *pp = (uint16_t *)(s + s_n), *qb = (uint16_t *)(o + o_n);
        float inv[AMX_ROWS];
        failed = buf == NULL;
        if (buf) {
            amx_configure();
            for (int r = 0; r < AMX_ROWS; r++)  // the numerators' columns from T's 16-padding to its 32-padding
                for (int t = tpad; t < tpad32; t++) pp[(size_t)r * tpad32 + t] = 0;  // (softmax never writes them)
        }
#pragma omp for schedule(static)
        for (long pair = 0; pair < (long)B * H; pair++) {
            if (!buf) continue;  // every thread must meet the loop; one without memory does nothing
            int b = (int)(pair / H), h = (int)(pair % H);
            const uint16_t *base = pack_head(qkv, pair, T, H, d, qkv_stride, tpad, tpad32 / 2, d, kp, vp);
            for (int i0 = 0; i0 < T; i0 += AMX_ROWS) {
                int rows = T - i0 < AMX_ROWS ? T - i0 : AMX_ROWS;
                const uint16_t *q = base + (size_t)i0 * qkv_stride + (size_t)h * d;
                long ldq = qkv_stride;
                if (rows < AMX_ROWS) {  // the last block: its rows copied, zeros below (no read past the image)
                    memset(qb, 0, (size_t)AMX_ROWS * d * 2);
                    for (int r = 0; r < rows; r++) memcpy(qb + (size_t)r * d, q + (size_t)r * qkv_stride, (size_t)d * 2);
                    q = qb;
                    ldq = d;
                }
                qk_amx(q, ldq, kp, tpad, d, s);
                softmax_rows(s, tpad, T, tpad, scale, pp, tpad32, inv, rows);
                pv_amx(pp, tpad32, vp, tpad32, d, o);
                for (int r = 0; r < rows; r++) {
                    uint16_t *dst = out + ((size_t)b * T + i0 + r) * out_stride + (size_t)h * d;
                    __m512 sc = _mm512_set1_ps(inv[r]);
                    for (int c = 0; c < d; c += 16)
                        _mm256_storeu_si256((__m256i *)(dst + c),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + (size_t)r * d + c), sc)));
                }
            }
        }
        if (buf) _tile_release();
        free(buf);
    }
    return failed ? -1 : 0;
}
