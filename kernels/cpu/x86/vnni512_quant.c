/* The AVX512-VNNI quantized GEMM on panel-packed weights (the P16 layout and
 * its per-lane contract: quant_ukr.h). Output lanes are weight rows: a 64-byte
 * vector holds 4 consecutive weights of 16 rows, so one vpdpbusd with the 4
 * activation bytes of one token broadcast adds 64 products into the 16 rows'
 * exact int32 block dots. A tile is P panels (16 P rows) x T tokens: per
 * group of 4 columns it loads (and, for 4 bits, unpacks) each panel's vector
 * once for the T tokens and broadcasts each token's 4 bytes once for the P
 * panels; per block of 32 it turns each int32 dot into the float accumulator
 * with one conversion, one multiply (the two scales) and one FMA (plus one
 * FMA for a min). P x T independent dot chains cover vpdpbusd's latency: 4 x
 * 1 and 4 x 2 for decode (the weights stream from memory, four streams),
 * 2 x 3 and 2 x 4 for batched steps: 2 weight loads and 4 broadcasts per 8
 * dots, measured best on Zen 4 among 1 x 6..8, 2 x 5..6, 3 x 3..4 and 4 x 3
 * (tools/qp16_bench.c: about 0.8 of the vpdpbusd peak for Q8_0
 * with the weights in L1; the conversion, the scale product and the FMA of
 * each block take the rest). The layout's packing and
 * unpacking are plain C and built everywhere. */
#include "../quant_ukr.h"

#include <limits.h>
#include <string.h>

/* ---- the layout ------------------------------------------------------------ */

int cv_qp16_packs(cv_dtype t) {
    return t == CV_Q8_0 || t == CV_Q4_0 || t == CV_Q4_1 || t == CV_Q4_F || t == CV_Q4_K || t == CV_Q5_K || t == CV_Q5_0 ||
           t == CV_Q6_K;
}

static size_t qp_sbytes(cv_dtype t) { return t == CV_Q4_F ? 64 : 32; }
/* Every type's panel is one stream read front to back: a block's scales sit
 * next to its weights, in whole cache lines. Q4: 256 bytes of weights, then
 * 2 x 32 (Q4_0: the m slot unused) or 2 x 64 bytes of scales a block. Q8_0
 * and Q5_0: blocks in pairs, the two blocks' weights (Q8_0 512 bytes each,
 * Q5_0 256 of nibbles and 64 of fifth bits) and then their 2 x 32 of scales
 * (17 or 11 lines; one block and its scales would split vectors across
 * lines). A one-token tile streams its panel at about the rate of a plain
 * read; scales in a region of their own cost a second stream that starts at
 * each panel. */
/* A Q4 type's bytes a block (Q8_0 and Q5_0 go by pairs: qp_pair). */
static size_t qp_bbytes(cv_dtype t) { return t == CV_Q4_F ? 384 : 320; }
static int qp_paired(cv_dtype t) { return t == CV_Q8_0 || t == CV_Q5_0; }
/* A paired type's weights a block, and the pair's bytes. */
static size_t qp_pw(cv_dtype t) { return t == CV_Q8_0 ? 512 : 320; }
static size_t qp_pair(cv_dtype t) { return 2 * qp_pw(t) + 2 * 32; }

/* Offsets in a panel of block i's weights, scales and mins (Q5_0's fifth
 * bits: 256 bytes after its weights). */
static size_t qp_qoff(cv_dtype t, int64_t i) {
    return qp_paired(t) ? (size_t)(i / 2) * qp_pair(t) + (size_t)(i % 2) * qp_pw(t) : (size_t)i * qp_bbytes(t);
}
static size_t qp_doff(cv_dtype t, int64_t i) {
    return qp_paired(t) ? (size_t)(i / 2) * qp_pair(t) + 2 * qp_pw(t) + (size_t)(i % 2) * 32
                        : (size_t)i * qp_bbytes(t) + 256;
}
static size_t qp_moff(cv_dtype t, int64_t i) { return qp_doff(t, i) + qp_sbytes(t); }

/* Q4_K / Q5_K panels: per super-block (8 blocks of 32) qk_bytes(t) bytes,
 * 16 x the file's 144 / 176; its scales first, so that a panel is read
 * front to back. */
#define QK_D 0                     /* d[16], then dmin[16] (float16) */
#define QK_SC (QK_D + 64)          /* the 12 scale bytes, byte k of the 16 rows at QK_SC + 16 k */
#define QK_QH (QK_SC + 12 * 16)    /* Q5_K: its qh as 8 vectors (vector g: qh[4g..4g+3] of each row) */
#define QK_PAIR_BYTES 512          /* the weights, one pair of sub-blocks: 8 vectors of 64 */
static size_t qk_q(cv_dtype t) { return t == CV_Q5_K ? QK_QH + 512 : QK_QH; } /* the 4 pairs */
static size_t qk_bytes(cv_dtype t) { return qk_q(t) + 4 * QK_PAIR_BYTES; }
_Static_assert(QK_QH + 4 * QK_PAIR_BYTES == 16 * sizeof(cv_block_q4_k) &&
               QK_QH + 512 + 4 * QK_PAIR_BYTES == 16 * sizeof(cv_block_q5_k), "K panels hold the file's bytes");

/* Q6_K panels: per super-block (8 blocks of 32) the file's 16 x 210 bytes
 * and 32 of padding, in whole lines read front to back: d[16] (float16),
 * the 16 sub-blocks' int8 scales (sub-block j of the 16 rows at Q6_SC + 16 j),
 * then per half h (elements 128h..) its ql as 2 runs of 8 vectors (run c,
 * vector g: ql[64h + 32c + 4g .. + 3] of each row: low nibbles block 4h + c,
 * high nibbles block 4h + c + 2) and its qh as 8 vectors (vector g:
 * qh[32h + 4g .. + 3] of each row: bits 2k, 2k + 1 block 4h + k). */
#define Q6_D 0
#define Q6_SC 32
#define Q6_HALVES 320           /* after d and the scales, padded to a line */
#define Q6_HALF_BYTES (3 * 512) /* two ql runs, then qh */
#define Q6_BYTES (Q6_HALVES + 2 * Q6_HALF_BYTES)
static size_t q6_ql(int h, int c) { return Q6_HALVES + (size_t)h * Q6_HALF_BYTES + (size_t)c * 512; }
static size_t q6_qh(int h) { return Q6_HALVES + (size_t)h * Q6_HALF_BYTES + 1024; }
_Static_assert(Q6_BYTES == 16 * sizeof(cv_block_q6_k) + 32 && Q6_BYTES % 64 == 0, "Q6_K panels: the file's bytes, whole lines");

size_t cv_qp16_stride(cv_dtype t, int64_t nb) {
    if (t == CV_Q4_K || t == CV_Q5_K) return (size_t)(nb / 8) * qk_bytes(t);
    if (t == CV_Q6_K) return (size_t)(nb / 8) * Q6_BYTES;
    if (qp_paired(t)) return (size_t)((nb + 1) / 2) * qp_pair(t);
    return ((size_t)nb * qp_bbytes(t) + 63) & ~(size_t)63;
}

/* Row r's scale (and min) of block i, as stored: 2 or 4 bytes each. */
static void qp_scales_of(const void *blk, cv_dtype t, void *d, void *m) {
    switch (t) {
    case CV_Q8_0: memcpy(d, &((const cv_block_q8_0 *)blk)->d, 2); break;
    case CV_Q4_0: memcpy(d, &((const cv_block_q4_0 *)blk)->d, 2); break;
    case CV_Q5_0: memcpy(d, &((const cv_block_q5_0 *)blk)->d, 2); break;
    case CV_Q4_1:
        memcpy(d, &((const cv_block_q4_1 *)blk)->d, 2);
        memcpy(m, &((const cv_block_q4_1 *)blk)->m, 2);
        break;
    default:
        memcpy(d, &((const cv_block_q4_f *)blk)->d, 4);
        memcpy(m, &((const cv_block_q4_f *)blk)->m, 4);
        break;
    }
}

static const uint8_t *qp_qs_of(const void *blk, cv_dtype t) {
    switch (t) {
    case CV_Q8_0: return (const uint8_t *)((const cv_block_q8_0 *)blk)->qs;
    case CV_Q4_0: return ((const cv_block_q4_0 *)blk)->qs;
    case CV_Q5_0: return ((const cv_block_q5_0 *)blk)->qs;
    case CV_Q4_1: return ((const cv_block_q4_1 *)blk)->qs;
    default: return ((const cv_block_q4_f *)blk)->qs;
    }
}

/* Q4_K / Q5_K rows (nb / 8 super-blocks each) into panels; padding rows stay zero. */
static void qk_pack(uint8_t *dst, const void *src, cv_dtype t, int64_t rows, int64_t nb) {
    const int64_t nsb = nb / 8, panels = (rows + CV_QP16_ROWS - 1) / CV_QP16_ROWS;
    const size_t sbytes = qk_bytes(t), fbytes = cv_quant_block_bytes(t), wq = qk_q(t);
    memset(dst, 0, (size_t)panels * (size_t)nsb * sbytes);
    for (int64_t row = 0; row < rows; row++) {
        const int r = (int)(row % CV_QP16_ROWS);
        for (int64_t sb = 0; sb < nsb; sb++) {
            const char *blk = (const char *)src + (size_t)(row * nsb + sb) * fbytes;
            const uint8_t *scales, *qs, *qh = NULL;
            if (t == CV_Q5_K) {
                const cv_block_q5_k *b = (const cv_block_q5_k *)(const void *)blk;
                scales = b->scales;
                qs = b->qs;
                qh = b->qh;
            } else {
                const cv_block_q4_k *b = (const cv_block_q4_k *)(const void *)blk;
                scales = b->scales;
                qs = b->qs;
            }
            uint8_t *q = dst + (size_t)((row / CV_QP16_ROWS) * nsb + sb) * sbytes;
            for (int c = 0; c < 4; c++)
                for (int g = 0; g < 8; g++) memcpy(q + wq + c * QK_PAIR_BYTES + 64 * g + 4 * r, qs + 32 * c + 4 * g, 4);
            if (qh)
                for (int g = 0; g < 8; g++) memcpy(q + QK_QH + 64 * g + 4 * r, qh + 4 * g, 4);
            memcpy(q + QK_D + 2 * r, blk, 2);           /* d, then dmin: the first 4 bytes of both formats */
            memcpy(q + QK_D + 32 + 2 * r, blk + 2, 2);
            for (int k = 0; k < 12; k++) q[QK_SC + 16 * k + r] = scales[k];
        }
    }
}

/* Q5_0's fifth bits (qh, bit e for element e) as the panel holds them for
 * one row: byte k (of the row's 4 at 4r) has, in bit g, element 4g + k's
 * and, in bit 4 + g, element 16 + 4g + k's, the elements whose nibbles sit
 * in byte k of weight vector g (low and high), so one byte test a vector
 * finds them. */
static void q5_pack_bits(uint8_t *dst, const uint8_t qh[4]) {
    const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    for (int k = 0; k < 4; k++) {
        unsigned v = 0;
        for (int g = 0; g < 4; g++) v |= ((h >> (4 * g + k)) & 1u) << g | ((h >> (16 + 4 * g + k)) & 1u) << (4 + g);
        dst[k] = (uint8_t)v;
    }
}

/* Q6_K rows (nb / 8 super-blocks each) into panels; padding rows stay zero. */
static void q6_pack(uint8_t *dst, const void *src, int64_t rows, int64_t nb) {
    const int64_t nsb = nb / 8, panels = (rows + CV_QP16_ROWS - 1) / CV_QP16_ROWS;
    memset(dst, 0, (size_t)panels * (size_t)nsb * Q6_BYTES);
    for (int64_t row = 0; row < rows; row++) {
        const int r = (int)(row % CV_QP16_ROWS);
        for (int64_t sb = 0; sb < nsb; sb++) {
            const cv_block_q6_k *b = (const cv_block_q6_k *)src + row * nsb + sb;
            uint8_t *q = dst + (size_t)((row / CV_QP16_ROWS) * nsb + sb) * Q6_BYTES;
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 8; g++) {
                    for (int c = 0; c < 2; c++) memcpy(q + q6_ql(h, c) + 64 * g + 4 * r, b->ql + 64 * h + 32 * c + 4 * g, 4);
                    memcpy(q + q6_qh(h) + 64 * g + 4 * r, b->qh + 32 * h + 4 * g, 4);
                }
            memcpy(q + Q6_D + 2 * r, &b->d, 2);
            for (int j = 0; j < 16; j++) q[Q6_SC + 16 * j + r] = (uint8_t)b->scales[j];
        }
    }
}

/* Rows of one Q6_K panel back as Q8_F blocks, cv_quant_repack's: d * sc of
 * each half block (exact), no min, q - 32. */
static void q6_unpack(void *dst, size_t row_bytes, const uint8_t *panel, int n, int64_t nb) {
    for (int r = 0; r < n; r++)
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *q = panel + (size_t)(i / 8) * Q6_BYTES;
            const int s = (int)(i % 8), h = s / 4, k = s % 4;
            uint16_t dh;
            memcpy(&dh, q + Q6_D + 2 * r, 2);
            const float sd = cv_qh_to_f32(dh);
            cv_block_q8_f *b = (cv_block_q8_f *)(void *)((char *)dst + (size_t)r * row_bytes) + i;
            b->d[0] = sd * (float)(int8_t)q[Q6_SC + 16 * (8 * h + 2 * k) + r];
            b->d[1] = sd * (float)(int8_t)q[Q6_SC + 16 * (8 * h + 2 * k + 1) + r];
            b->m = 0.0f;
            for (int l = 0; l < CV_QK; l++) {
                const size_t at = 64 * (size_t)(l / 4) + 4 * (size_t)r + (size_t)(l % 4);
                const int ql = q[q6_ql(h, k & 1) + at], lo = k < 2 ? ql & 0xf : ql >> 4;
                b->qs[l] = (int8_t)((lo | ((q[q6_qh(h) + at] >> (2 * k)) & 3) << 4) - 32);
            }
        }
}

void cv_qp16_pack(void *dst, const void *src, cv_dtype t, int64_t rows, int64_t nb) {
    if (t == CV_Q4_K || t == CV_Q5_K) {
        qk_pack(dst, src, t, rows, nb);
        return;
    }
    if (t == CV_Q6_K) {
        q6_pack(dst, src, rows, nb);
        return;
    }
    const size_t stride = cv_qp16_stride(t, nb), ss = qp_sbytes(t) / 16;
    const size_t bb = cv_quant_block_bytes(t), row_bytes = (size_t)nb * bb;
    const int64_t panels = (rows + CV_QP16_ROWS - 1) / CV_QP16_ROWS;
    memset(dst, 0, (size_t)panels * stride);
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *qs = (uint8_t *)dst + (size_t)p * stride;
        for (int r = 0; r < CV_QP16_ROWS; r++) {
            const int64_t row = p * CV_QP16_ROWS + r;
            for (int64_t i = 0; i < nb; i++) {
                uint8_t *q = qs + qp_qoff(t, i) + 4 * (size_t)r;
                if (row >= rows) { /* padding: zero weights (Q8_0: 128), zero scales */
                    if (t == CV_Q8_0)
                        for (int g = 0; g < 8; g++) memset(q + 64 * g, 128, 4);
                    continue;
                }
                const void *blk = (const char *)src + (size_t)row * row_bytes + (size_t)i * bb;
                const uint8_t *w = qp_qs_of(blk, t);
                if (t == CV_Q8_0)
                    for (int g = 0; g < 8; g++)
                        for (int b = 0; b < 4; b++) q[64 * g + b] = (uint8_t)((int8_t)w[4 * g + b] + 128);
                else
                    for (int g = 0; g < 4; g++) memcpy(q + 64 * g, w + 4 * g, 4);
                if (t == CV_Q5_0) q5_pack_bits(q + 256, ((const cv_block_q5_0 *)blk)->qh);
                qp_scales_of(blk, t, qs + qp_doff(t, i) + (size_t)r * ss, qs + qp_moff(t, i) + (size_t)r * ss);
            }
        }
    }
}

/* Rows of one Q4_K (Q5_K) panel back as Q4_F (Q8_F) blocks, cv_quant_repack's:
 * d = d * sc, m = -(dmin * mn), both exact; Q4_F in Q4_0's nibble order. */
static void qk_unpack(void *dst, size_t row_bytes, const uint8_t *panel, cv_dtype t, int n, int64_t nb) {
    for (int r = 0; r < n; r++)
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *q = panel + (size_t)(i / 8) * qk_bytes(t);
            const int s = (int)(i % 8), c = s / 2, shift = 4 * (s & 1);
            uint8_t scales[12];
            uint16_t dh, dminh;
            for (int k = 0; k < 12; k++) scales[k] = q[QK_SC + 16 * k + r];
            memcpy(&dh, q + QK_D + 2 * r, 2);
            memcpy(&dminh, q + QK_D + 32 + 2 * r, 2);
            int sc, mn;
            cv_kq_scale_min(scales, s, &sc, &mn);
            const float d = cv_qh_to_f32(dh) * (float)sc, m = -(cv_qh_to_f32(dminh) * (float)mn);
            uint8_t v[CV_QK];
            for (int l = 0; l < CV_QK; l++) {
                const size_t at = 64 * (size_t)(l / 4) + 4 * (size_t)r + (size_t)(l % 4);
                v[l] = (uint8_t)((q[qk_q(t) + (size_t)c * QK_PAIR_BYTES + at] >> shift) & 0xf);
                if (t == CV_Q5_K) v[l] = (uint8_t)(v[l] | ((q[QK_QH + at] >> s) & 1) << 4);
            }
            char *row = (char *)dst + (size_t)r * row_bytes;
            if (t == CV_Q5_K) {
                cv_block_q8_f *b = (cv_block_q8_f *)(void *)row + i;
                b->d[0] = b->d[1] = d;
                b->m = m;
                for (int l = 0; l < CV_QK; l++) b->qs[l] = (int8_t)v[l];
            } else {
                cv_block_q4_f *b = (cv_block_q4_f *)(void *)row + i;
                b->d = d;
                b->m = m;
                for (int l = 0; l < CV_QK / 2; l++) b->qs[l] = (uint8_t)(v[l] | v[l + CV_QK / 2] << 4);
            }
        }
}

void cv_qp16_unpack(void *dst, size_t row_bytes, const void *panel, cv_dtype t, int n, int64_t nb) {
    if (t == CV_Q4_K || t == CV_Q5_K) {
        qk_unpack(dst, row_bytes, panel, t, n, nb);
        return;
    }
    if (t == CV_Q6_K) {
        q6_unpack(dst, row_bytes, panel, n, nb);
        return;
    }
    const size_t ss = qp_sbytes(t) / 16, bb = cv_quant_block_bytes(t == CV_Q5_0 ? CV_Q8_0 : t);
    const uint8_t *qs = panel;
    for (int r = 0; r < n; r++)
        for (int64_t i = 0; i < nb; i++) {
            char *blk = (char *)dst + (size_t)r * row_bytes + (size_t)i * bb;
            const uint8_t *q = qs + qp_qoff(t, i) + 4 * (size_t)r;
            const uint8_t *dr = qs + qp_doff(t, i) + (size_t)r * ss, *mr = qs + qp_moff(t, i) + (size_t)r * ss;
            switch (t) {
            case CV_Q8_0: {
                cv_block_q8_0 *b = (cv_block_q8_0 *)(void *)blk;
                memcpy(&b->d, dr, 2);
                for (int g = 0; g < 8; g++)
                    for (int k = 0; k < 4; k++) b->qs[4 * g + k] = (int8_t)(q[64 * g + k] - 128);
                break;
            }
            case CV_Q5_0: { /* as cv_quant_repack's Q8_0: the same scale, q - 16 */
                cv_block_q8_0 *b = (cv_block_q8_0 *)(void *)blk;
                memcpy(&b->d, dr, 2);
                for (int e = 0; e < CV_QK; e++) {
                    const int hi = e >= 16, g = (e % 16) / 4, k = e % 4;
                    const int nib = (q[64 * g + k] >> (4 * hi)) & 0xf, bit = (q[256 + k] >> (4 * hi + g)) & 1;
                    b->qs[e] = (int8_t)((nib | bit << 4) - 16);
                }
                break;
            }
            case CV_Q4_0: {
                cv_block_q4_0 *b = (cv_block_q4_0 *)(void *)blk;
                memcpy(&b->d, dr, 2);
                for (int g = 0; g < 4; g++) memcpy(b->qs + 4 * g, q + 64 * g, 4);
                break;
            }
            case CV_Q4_1: {
                cv_block_q4_1 *b = (cv_block_q4_1 *)(void *)blk;
                memcpy(&b->d, dr, 2);
                memcpy(&b->m, mr, 2);
                for (int g = 0; g < 4; g++) memcpy(b->qs + 4 * g, q + 64 * g, 4);
                break;
            }
            default: {
                cv_block_q4_f *b = (cv_block_q4_f *)(void *)blk;
                memcpy(&b->d, dr, 4);
                memcpy(&b->m, mr, 4);
                for (int g = 0; g < 4; g++) memcpy(b->qs + 4 * g, q + 64 * g, 4);
                break;
            }
            }
        }
}

/* ---- the kernels ------------------------------------------------------------ */

#if CV_HAVE_AVX512 && (defined(CV_EMULATE_AVX512) || (defined(__GNUC__) && (__GNUC__ >= 11 || \
    (defined(__clang_major__) && __clang_major__ >= 12))))

CV_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

static CV_ALWAYS_INLINE __m512i qp_bcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm512_set1_epi32(v);
}

/* v plus 16 in the bytes where bits has a bit of mask: a fifth bit put on an unpacked nibble. */
static CV_ALWAYS_INLINE __m512i qp_fifth(__m512i v, __m512i bits, __m512i mask) {
    return _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(bits, mask), v, _mm512_set1_epi8(16));
}

/* Weight vector g of a Q5_0 block (v its nibbles, fifth its fifth bits,
 * q5_pack_bits) as u8 operands 0..31: elements 4g.. (lo), 16 + 4g.. (hi). */
static CV_ALWAYS_INLINE void q5_weights(__m512i v, __m512i fifth, int g, __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    *lo = qp_fifth(_mm512_and_si512(v, low4), fifth, _mm512_set1_epi8((char)(1 << g)));
    *hi = qp_fifth(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), fifth, _mm512_set1_epi8((char)(16 << g)));
}

/* A tile's P x T accumulators, zero. */
static CV_ALWAYS_INLINE void qp_zero(const int P, const int T, __m512 acc[4][CV_QP16_MAX_TOKENS]) {
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) acc[p][t] = _mm512_setzero_ps();
}

/* The tile's outputs: the first nvalid rows of each token, plus bias, plus out when accumulating. */
static CV_ALWAYS_INLINE void qp_store(const int P, const int T, __m512 acc[4][CV_QP16_MAX_TOKENS], float *out,
                                      int64_t ldo, int nvalid, const float *bias, int accumulate) {
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        const int v = nvalid - p * CV_QP16_ROWS;
        const __mmask16 m = (__mmask16)(v >= CV_QP16_ROWS ? 0xffffu : v <= 0 ? 0u : (1u << v) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + p * CV_QP16_ROWS) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            float *o = out + t * ldo + p * CV_QP16_ROWS;
            __m512 y = bias ? _mm512_add_ps(acc[p][t], b) : acc[p][t];
            if (accumulate) y = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), y);
            _mm512_mask_storeu_ps(o, m, y);
        }
    }
}

/* P panels x T tokens of type `type` (P, T and type constants at each call). */
static CV_ALWAYS_INLINE void qp_tile(const cv_dtype type, const int P, const int T, const void *w, size_t stride,
                                     int64_t nb, const cv_xq_block *x, int64_t xs, float *out, int64_t ldo,
                                     int nvalid, const float *bias, int accumulate, const char *pf,
                                     int64_t pf_lines) {
    const int has_min = type == CV_Q4_1 || type == CV_Q4_F;
    const uint8_t *base = w;
    __m512 acc[4][CV_QP16_MAX_TOKENS];
    _Static_assert(CV_QP16_MAX_TOKENS == 4, "the kernels below are instantiated for 1..4 tokens");
    qp_zero(P, T, acc);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, nb);
    for (int64_t i = 0; i < nb; i++) {
        cv_prefetch_step(&ps);
        __m512 dw[4], mw[4];
        const uint8_t *qs[4];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            const uint8_t *pp = base + (size_t)p * stride;
            qs[p] = pp + qp_qoff(type, i);
            const uint8_t *sc = pp + qp_doff(type, i), *mc = pp + qp_moff(type, i);
            if (type == CV_Q4_F) {
                dw[p] = _mm512_loadu_ps((const void *)sc);
                mw[p] = _mm512_loadu_ps((const void *)mc);
            } else {
                dw[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)sc));
                if (has_min)
                    mw[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)mc));
                else
                    mw[p] = _mm512_setzero_ps();
            }
        }
        __m512i dot[4][CV_QP16_MAX_TOKENS];
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) { /* the exact integer start: Q8_0's +128, Q4_0's -8, Q5_0's -16 taken out */
            const int32_t s = x[t * xs + i].sum;
            const __m512i b = _mm512_set1_epi32(type == CV_Q8_0 ? -128 * s : type == CV_Q4_0 ? -8 * s
                                                : type == CV_Q5_0 ? -16 * s : 0);
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) dot[p][t] = b;
        }
        if (type == CV_Q8_0) {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m512i wv[4];
#pragma GCC unroll 4
                for (int p = 0; p < P; p++) wv[p] = _mm512_loadu_si512((const void *)(qs[p] + 64 * g));
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const __m512i xb = qp_bcast4(x[t * xs + i].q + 4 * g);
#pragma GCC unroll 4
                    for (int p = 0; p < P; p++) dot[p][t] = _mm512_dpbusd_epi32(dot[p][t], wv[p], xb);
                }
            }
        } else {
            __m512i fifth[4]; /* Q5_0: its fifth bits (q5_pack_bits) */
            if (type == CV_Q5_0)
#pragma GCC unroll 4
                for (int p = 0; p < P; p++) fifth[p] = _mm512_loadu_si512((const void *)(qs[p] + 256));
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                __m512i lo[4], hi[4];
#pragma GCC unroll 4
                for (int p = 0; p < P; p++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(qs[p] + 64 * g));
                    if (type == CV_Q5_0) {
                        q5_weights(v, fifth[p], g, &lo[p], &hi[p]);
                    } else {
                        lo[p] = _mm512_and_si512(v, low4);
                        hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    }
                }
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const __m512i xl = qp_bcast4(x[t * xs + i].q + 4 * g);
                    const __m512i xh = qp_bcast4(x[t * xs + i].q + 16 + 4 * g);
#pragma GCC unroll 4
                    for (int p = 0; p < P; p++) {
                        dot[p][t] = _mm512_dpbusd_epi32(dot[p][t], lo[p], xl);
                        dot[p][t] = _mm512_dpbusd_epi32(dot[p][t], hi[p], xh);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            const __m512 dx = _mm512_set1_ps(x[t * xs + i].d);
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) {
                acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][t]), _mm512_mul_ps(dw[p], dx), acc[p][t]);
                if (has_min) acc[p][t] = _mm512_fmadd_ps(mw[p], _mm512_set1_ps(x[t * xs + i].s), acc[p][t]);
            }
        }
    }
    qp_store(P, T, acc, out, ldo, nvalid, bias, accumulate);
}

/* The 16 rows' scales of sub-blocks 0..7 of one Q4_K super-block (at q), as
 * the Q4_F blocks hold them: dw[j] = d * sc_j, mw[j] = -(dmin * mn_j), both
 * exact (11-bit by 6-bit products), so the tile runs Q4_F's operations on
 * the same values. The 6-bit fields (cv_kq_scale_min) are split for all
 * 16 rows and 8 sub-blocks at once, 16 bytes (one sub-block) a 128-bit lane. */
static CV_ALWAYS_INLINE void qk_scales(const uint8_t *q, __m512 dw[8], __m512 mw[8]) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(q + QK_D)));
    const __m512 nm = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(q + QK_D + 32)))),
        _mm512_set1_epi32(INT32_MIN)));
    const __m512i a = _mm512_loadu_si512((const void *)(q + QK_SC)), b = _mm512_loadu_si512((const void *)(q + QK_SC + 64)),
                  c = _mm512_loadu_si512((const void *)(q + QK_SC + 128));
    const __m512i m6 = _mm512_set1_epi8(63), m4 = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const __m512i sc_lo = _mm512_and_si512(a, m6), mn_lo = _mm512_and_si512(b, m6);
    const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_and_si512(_mm512_srli_epi16(a, 2), top));
    const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), m4),
                                          _mm512_and_si512(_mm512_srli_epi16(b, 2), top));
#define QK_LANE(v, j) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, j))) /* 0..63: sign = zero extension */
    dw[0] = _mm512_mul_ps(d, QK_LANE(sc_lo, 0));
    dw[1] = _mm512_mul_ps(d, QK_LANE(sc_lo, 1));
    dw[2] = _mm512_mul_ps(d, QK_LANE(sc_lo, 2));
    dw[3] = _mm512_mul_ps(d, QK_LANE(sc_lo, 3));
    dw[4] = _mm512_mul_ps(d, QK_LANE(sc_hi, 0));
    dw[5] = _mm512_mul_ps(d, QK_LANE(sc_hi, 1));
    dw[6] = _mm512_mul_ps(d, QK_LANE(sc_hi, 2));
    dw[7] = _mm512_mul_ps(d, QK_LANE(sc_hi, 3));
    mw[0] = _mm512_mul_ps(nm, QK_LANE(mn_lo, 0));
    mw[1] = _mm512_mul_ps(nm, QK_LANE(mn_lo, 1));
    mw[2] = _mm512_mul_ps(nm, QK_LANE(mn_lo, 2));
    mw[3] = _mm512_mul_ps(nm, QK_LANE(mn_lo, 3));
    mw[4] = _mm512_mul_ps(nm, QK_LANE(mn_hi, 0));
    mw[5] = _mm512_mul_ps(nm, QK_LANE(mn_hi, 1));
    mw[6] = _mm512_mul_ps(nm, QK_LANE(mn_hi, 2));
    mw[7] = _mm512_mul_ps(nm, QK_LANE(mn_hi, 3));
#undef QK_LANE
}

/* One Q5_0 panel (nb blocks) as a Q8_0 panel: the same integers (q - 16,
 * stored + 128) and scales, so Q8_0's kernels compute the Q5_0 kernels' bits. */
static void q5_to_q8_panel(uint8_t *dst, const uint8_t *src, int64_t nb) {
    const __m512i off = _mm512_set1_epi8(112);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *q = src + qp_qoff(CV_Q5_0, i);
        uint8_t *o = dst + qp_qoff(CV_Q8_0, i);
        const __m512i fifth = _mm512_loadu_si512((const void *)(q + 256));
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            __m512i lo, hi;
            q5_weights(_mm512_loadu_si512((const void *)(q + 64 * g)), fifth, g, &lo, &hi);
            _mm512_storeu_si512((void *)(o + 64 * g), _mm512_add_epi8(lo, off));
            _mm512_storeu_si512((void *)(o + 64 * (4 + g)), _mm512_add_epi8(hi, off));
        }
        memcpy(dst + qp_doff(CV_Q8_0, i), src + qp_doff(CV_Q5_0, i), 32);
    }
}

/* The scales of np Q4_K panels (stride bytes apart) for the kernels:
 * dst[(p nb + i) 32 ..] holds block i's d (16 rows), then its m. */
static void qk_expand(float *dst, const void *panels, size_t stride, cv_dtype t, int np, int64_t nb) {
    for (int p = 0; p < np; p++)
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            __m512 dw[8], mw[8];
            qk_scales((const uint8_t *)panels + (size_t)p * stride + (size_t)sb * qk_bytes(t), dw, mw);
            float *o = dst + ((size_t)p * (size_t)nb + 8 * (size_t)sb) * 32;
            for (int j = 0; j < 8; j++) {
                _mm512_storeu_ps(o + 32 * j, dw[j]);
                _mm512_storeu_ps(o + 32 * j + 16, mw[j]);
            }
        }
}

/* P panels x T tokens of Q4_K panels, their scales expanded (sc: qk_expand
 * of these P panels) once for every token tile that meets them, or, sc
 * NULL (one token tile: decode), here once per super-block, which keeps the
 * weights one stream read front to back; the same values either way. Per pair of
 * sub-blocks each 64-byte vector's low nibbles meet the first sub-block's
 * activations and its high nibbles the second's. Every output lane runs
 * Q4_F's operations over the blocks in order (quant_ukr.h), so the results
 * are the bits of the same matrix repacked as Q4_F, alone or in any batch. */
static CV_ALWAYS_INLINE void qk_tile(const cv_dtype type, const int P, const int T, const void *w, size_t stride,
                                     int64_t nb,
                                     const cv_xq_block *x, int64_t xs, float *out, int64_t ldo, int nvalid,
                                     const float *bias, int accumulate, const char *pf, int64_t pf_lines,
                                     const float *sc) {
    const uint8_t *base = w;
    __m512 acc[4][CV_QP16_MAX_TOKENS];
    qp_zero(P, T, acc);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, nb);
    __m512 kdw[4][8], kmw[4][8]; /* sc NULL: the super-block's scales */
    const size_t sbytes = qk_bytes(type), wq = qk_q(type);
    for (int64_t i = 0; i < nb; i += 2) { /* a pair of sub-blocks: blocks i, i + 1 */
        const int64_t sb = i / 8, c = (i % 8) / 2;
        /* Q5_K: the fifth bits of sub-blocks 2c and 2c + 1 */
        const __m512i bit0 = _mm512_set1_epi8((char)(1 << (2 * c))), bit1 = _mm512_set1_epi8((char)(2 << (2 * c)));
        if (!sc && c == 0)
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) qk_scales(base + (size_t)p * stride + (size_t)sb * sbytes, kdw[p], kmw[p]);
        cv_prefetch_step(&ps);
        cv_prefetch_step(&ps);
        __m512i dot[2][4][CV_QP16_MAX_TOKENS];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++)
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) dot[0][p][t] = dot[1][p][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m512i lo[4], hi[4];
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) {
                const uint8_t *sbp = base + (size_t)p * stride + (size_t)sb * sbytes;
                const __m512i v = _mm512_loadu_si512((const void *)(sbp + wq + (size_t)c * QK_PAIR_BYTES + 64 * g));
                lo[p] = _mm512_and_si512(v, low4);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if (type == CV_Q5_K) { /* plus 16 where the fifth bit is set */
                    const __m512i h = _mm512_loadu_si512((const void *)(sbp + QK_QH + 64 * g));
                    lo[p] = qp_fifth(lo[p], h, bit0);
                    hi[p] = qp_fifth(hi[p], h, bit1);
                }
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const __m512i xl = qp_bcast4(x[t * xs + i].q + 4 * g);
                const __m512i xh = qp_bcast4(x[t * xs + i + 1].q + 4 * g);
#pragma GCC unroll 4
                for (int p = 0; p < P; p++) {
                    dot[0][p][t] = _mm512_dpbusd_epi32(dot[0][p][t], lo[p], xl);
                    dot[1][p][t] = _mm512_dpbusd_epi32(dot[1][p][t], hi[p], xh);
                }
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512 dw[4], mw[4];
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) {
                if (sc) {
                    const float *s = sc + ((size_t)p * (size_t)nb + (size_t)(i + h)) * 32;
                    dw[p] = _mm512_loadu_ps(s);
                    mw[p] = _mm512_loadu_ps(s + 16);
                } else {
                    dw[p] = kdw[p][2 * c + h];
                    mw[p] = kmw[p][2 * c + h];
                }
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const __m512 dx = _mm512_set1_ps(x[t * xs + i + h].d), sx = _mm512_set1_ps(x[t * xs + i + h].s);
#pragma GCC unroll 4
                for (int p = 0; p < P; p++) {
                    acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h][p][t]), _mm512_mul_ps(dw[p], dx), acc[p][t]);
                    acc[p][t] = _mm512_fmadd_ps(mw[p], sx, acc[p][t]);
                }
            }
        }
    }
    qp_store(P, T, acc, out, ldo, nvalid, bias, accumulate);
}

/* The sum of a block's first 16 int8 activations. */
static CV_ALWAYS_INLINE int32_t q6_half_sum(const int8_t *q) {
    const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)q), _mm_set1_epi8((char)0x80));
    const __m128i s = _mm_sad_epu8(v, _mm_setzero_si128()); /* two sums of 8 (q + 128) */
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

/* The 6-bit weights of block 4h + k (k = 0..3) from its ql vector v (the run
 * k & 1) and the half's qh vector: the low (k < 2) or high nibble, and the
 * bits 2k, 2k + 1 of qh moved to bits 4, 5, put together with one ternary op. */
static CV_ALWAYS_INLINE __m512i q6_weights(const int k, __m512i v, __m512i hq) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i nib = k < 2 ? _mm512_and_si512(v, low4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    const __m512i hb = k == 0 ? _mm512_slli_epi16(hq, 4) : k == 1 ? _mm512_slli_epi16(hq, 2)
                     : k == 2 ? hq : _mm512_srli_epi16(hq, 2);
    return _mm512_ternarylogic_epi32(nib, hb, top2, 0xF8); /* nib | (hb & 0x30) */
}

/* d x sc of sub-block j (16 elements) of the 16 rows of super-block sp (d its
 * 16 d, widened): the scale each half-block's integer dot is multiplied by. */
static CV_ALWAYS_INLINE __m512 q6_dw(__m512 d, const uint8_t *sp, int j) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(const void *)(sp + Q6_SC + 16 * j));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}

/* Lines [first, first + n) of the super-block after sp, those that exist: a
 * one-panel tile's stream asked for one super-block ahead (from memory the
 * hardware prefetchers alone kept it at a third of the other types' rate). */
static CV_ALWAYS_INLINE void q6_ahead(const uint8_t *sp, int first, int n) {
#pragma GCC unroll 7
    for (int j = 0; j < n; j++)
        if (first + j < Q6_BYTES / 64) __builtin_prefetch(sp + Q6_BYTES + (size_t)(first + j) * 64, 0, 2);
}

/* One panel, one token (decode): each half's two ql runs and its qh read
 * once, front to back, for its four blocks together (the general tile reads
 * a run for each of its two blocks and qh for each of four, jumping back
 * within the half), and the next super-block asked for ahead (q6_ahead).
 * The integer dots are exact, and the four
 * blocks' float steps then run in the general tile's order, so the results
 * are its bits. */
static CV_ALWAYS_INLINE void q6_tile_1x1(const void *w, int64_t nb, const cv_xq_block *x, float *out, int nvalid,
                                         const float *bias, int accumulate, const char *pf, int64_t pf_lines) {
    __m512 acc[4][CV_QP16_MAX_TOKENS];
    qp_zero(1, 1, acc);
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, nb);
    for (int64_t i0 = 0; i0 < nb; i0 += 8) {
        const uint8_t *sp = (const uint8_t *)w + (size_t)(i0 / 8) * Q6_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(sp + Q6_D)));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const cv_xq_block *xb = x + i0 + 4 * h;
            __m512i dot[4][2];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                cv_prefetch_step(&ps);
                const int32_t h0 = q6_half_sum(xb[k].q);
                dot[k][0] = _mm512_set1_epi32(-32 * h0);
                dot[k][1] = _mm512_set1_epi32(-32 * (xb[k].sum - h0));
            }
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m512i v0 = _mm512_loadu_si512((const void *)(sp + q6_ql(h, 0) + 64 * g));
                const __m512i v1 = _mm512_loadu_si512((const void *)(sp + q6_ql(h, 1) + 64 * g));
                const __m512i hq = _mm512_loadu_si512((const void *)(sp + q6_qh(h) + 64 * g));
                q6_ahead(sp, (h * 8 + g) * 4, 4); /* its 53 lines, 4 a vector step */
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    dot[k][g / 4] = _mm512_dpbusd_epi32(dot[k][g / 4], q6_weights(k, k & 1 ? v1 : v0, hq),
                                                        qp_bcast4(xb[k].q + 4 * g));
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512 dx = _mm512_set1_ps(xb[k].d);
#pragma GCC unroll 2
                for (int half = 0; half < 2; half++)
                    acc[0][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[k][half]),
                                                _mm512_mul_ps(q6_dw(d, sp, 8 * h + 2 * k + half), dx), acc[0][0]);
            }
        }
    }
    qp_store(1, 1, acc, out, 0, nvalid, bias, accumulate);
}

/* P panels x T tokens of Q6_K panels. A block's two halves (16 elements)
 * have their own scales, so each lane runs, per block, two of the panel
 * contract's steps: acc = fma(float(idot_h), (d * sc_h) * dx, acc), idot_h
 * the exact integer dot of q - 32 (the -32 taken out in the start value with
 * the half's activation sum), the same operations whatever the tile. The
 * 6-bit weights: 4 bits from the ql vector (low or high nibble), 2 from the
 * qh vector shifted into bits 4 and 5, put together with one ternary op. */
static CV_ALWAYS_INLINE void q6_tile(const cv_dtype type, const int P, const int T, const void *w, size_t stride,
                                     int64_t nb, const cv_xq_block *x, int64_t xs, float *out, int64_t ldo, int nvalid,
                                     const float *bias, int accumulate, const char *pf, int64_t pf_lines) {
    (void)type; /* CV_Q6_K: qp_tile's call shape */
    if (P == 1 && T == 1) {
        q6_tile_1x1(w, nb, x, out, nvalid, bias, accumulate, pf, pf_lines);
        return;
    }
    const uint8_t *base = w;
    __m512 acc[4][CV_QP16_MAX_TOKENS];
    qp_zero(P, T, acc);
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, nb);
    for (int64_t i0 = 0; i0 < nb; i0 += 8) { /* a super-block: its 8 blocks with constant offsets */
        const uint8_t *sp[4];
        __m512 d[4];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            sp[p] = base + (size_t)p * stride + (size_t)(i0 / 8) * Q6_BYTES;
            d[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(sp[p] + Q6_D)));
        }
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const int64_t i = i0 + s;
            const int h = s / 4, k = s % 4;
            cv_prefetch_step(&ps);
            if (P == 1) q6_ahead(sp[0], s * 7, 7); /* one stream (a GEMM of one token tile): 7 lines a block */
            int32_t hs[CV_QP16_MAX_TOKENS][2];
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                hs[t][0] = q6_half_sum(x[t * xs + i].q);
                hs[t][1] = x[t * xs + i].sum - hs[t][0];
            }
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                __m512 dw[4];
                __m512i dot[4][CV_QP16_MAX_TOKENS];
#pragma GCC unroll 4
                for (int p = 0; p < P; p++) dw[p] = q6_dw(d[p], sp[p], 8 * h + 2 * k + half);
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const __m512i b = _mm512_set1_epi32(-32 * hs[t][half]);
#pragma GCC unroll 4
                    for (int p = 0; p < P; p++) dot[p][t] = b;
                }
#pragma GCC unroll 4
                for (int gg = 0; gg < 4; gg++) {
                    const int g = 4 * half + gg;
                    __m512i wv[4];
#pragma GCC unroll 4
                    for (int p = 0; p < P; p++) {
                        const __m512i v = _mm512_loadu_si512((const void *)(sp[p] + q6_ql(h, k & 1) + 64 * g));
                        const __m512i hq = _mm512_loadu_si512((const void *)(sp[p] + q6_qh(h) + 64 * g));
                        wv[p] = q6_weights(k, v, hq);
                    }
#pragma GCC unroll 8
                    for (int t = 0; t < T; t++) {
                        const __m512i xb = qp_bcast4(x[t * xs + i].q + 4 * g);
#pragma GCC unroll 4
                        for (int p = 0; p < P; p++) dot[p][t] = _mm512_dpbusd_epi32(dot[p][t], wv[p], xb);
                    }
                }
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const __m512 dx = _mm512_set1_ps(x[t * xs + i].d);
#pragma GCC unroll 4
                    for (int p = 0; p < P; p++)
                        acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[p][t]), _mm512_mul_ps(dw[p], dx), acc[p][t]);
                }
            }
        }
    }
    qp_store(P, T, acc, out, ldo, nvalid, bias, accumulate);
}

#define QK_FN(TY, P, T) TY##_##P##x##T
#define QK_ONE(TY, TYPE, P, T)                                                                                \
    static void QK_FN(TY, P, T)(const void *w, size_t stride, int64_t nb, const cv_xq_block *x, int64_t xs,  \
                                float *out, int64_t ldo, int nvalid, const float *bias, int accumulate,      \
                                const char *pf, int64_t pf_lines, const float *sc) {                         \
        qk_tile(TYPE, P, T, w, stride, nb, x, xs, out, ldo, nvalid, bias, accumulate, pf, pf_lines, sc);     \
    }
#define QK_TYPE(TY, TYPE)                                                                                     \
    QK_ONE(TY, TYPE, 4, 1) QK_ONE(TY, TYPE, 4, 2) QK_ONE(TY, TYPE, 2, 3) QK_ONE(TY, TYPE, 2, 4)                 \
    QK_ONE(TY, TYPE, 1, 1) QK_ONE(TY, TYPE, 1, 2) QK_ONE(TY, TYPE, 1, 3) QK_ONE(TY, TYPE, 1, 4)                 \
    static const cv_qp16k_fn TY[CV_QP16_MAX_TOKENS + 1][2] = {                                                \
        {NULL, NULL}, {QK_FN(TY, 1, 1), QK_FN(TY, 4, 1)}, {QK_FN(TY, 1, 2), QK_FN(TY, 4, 2)},                  \
        {QK_FN(TY, 1, 3), QK_FN(TY, 2, 3)}, {QK_FN(TY, 1, 4), QK_FN(TY, 2, 4)},                                \
    };
QK_TYPE(qk4, CV_Q4_K)
QK_TYPE(qk5, CV_Q5_K)

#define QP_FN(TY, P, T) qp_##TY##_##P##x##T
/* TILE(TYPE, P, T, ...): qp_tile, or q6_tile for Q6_K. */
#define QP_ONE(TY, TILE, TYPE, P, T)                                                                         \
    static void QP_FN(TY, P, T)(const void *w, size_t stride, int64_t nb, const cv_xq_block *x, int64_t xs, \
                                float *out, int64_t ldo, int nvalid, const float *bias, int accumulate,    \
                                const char *pf, int64_t pf_lines) {                                        \
        TILE(TYPE, P, T, w, stride, nb, x, xs, out, ldo, nvalid, bias, accumulate, pf, pf_lines);          \
    }
#define QP_TYPE(TY, TILE, TYPE)                                                                              \
    QP_ONE(TY, TILE, TYPE, 4, 1) QP_ONE(TY, TILE, TYPE, 4, 2) QP_ONE(TY, TILE, TYPE, 2, 3)                    \
    QP_ONE(TY, TILE, TYPE, 2, 4) QP_ONE(TY, TILE, TYPE, 1, 1) QP_ONE(TY, TILE, TYPE, 1, 2)                    \
    QP_ONE(TY, TILE, TYPE, 1, 3) QP_ONE(TY, TILE, TYPE, 1, 4)                                                 \
    static const cv_qp16_fn qp_##TY[CV_QP16_MAX_TOKENS + 1][2] = {                                           \
        {NULL, NULL},                                                                                        \
        {QP_FN(TY, 1, 1), QP_FN(TY, 4, 1)}, {QP_FN(TY, 1, 2), QP_FN(TY, 4, 2)},                                \
        {QP_FN(TY, 1, 3), QP_FN(TY, 2, 3)}, {QP_FN(TY, 1, 4), QP_FN(TY, 2, 4)},                                \
    };
QP_TYPE(q8_0, qp_tile, CV_Q8_0)
QP_TYPE(q4_0, qp_tile, CV_Q4_0)
QP_TYPE(q5_0, qp_tile, CV_Q5_0)
QP_TYPE(q4_1, qp_tile, CV_Q4_1)
QP_TYPE(q4_f, qp_tile, CV_Q4_F)
QP_TYPE(q6_k, q6_tile, CV_Q6_K)

/* cv_quantize_x with AVX-512, the same bytes (as avx2_quant.c's): the same
 * float products v * (1/d), rounded half away from zero exactly (floor of
 * |t|, plus one where the exact fraction is >= 0.5, the sign put back).
 * Sixteen blocks at a time: their maxima and sums are reduced together in
 * one transposing tree (qx_reduce16) and their scales divided in one
 * vector, instead of two horizontal reductions and two scalar divisions a
 * block; the maximum and the integer sum do not depend on the order, and
 * the vector divisions round as the scalar ones, so the bytes are the same. */

/* Block i's 32 activations into out (its q bytes), the scale's inverse id
 * given; returns the vector of its 16 pairwise q sums (q[j] + q[16 + j]). */
static CV_ALWAYS_INLINE __m512i qx_round_store(cv_xq_block *out, __m512 a0, __m512 a1, float id) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), vid = _mm512_set1_ps(id);
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);
    __m512i q[2];
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
        const __m512 t = _mm512_mul_ps(k ? a1 : a0, vid), u = _mm512_abs_ps(t);
        /* floor (imm 1: no scaling; without _MM_FROUND_NO_EXC, which SIMDe 0.7 misreads as a
         * scale; the inexact flag it may raise is masked) */
        const __m512 f = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEG_INF);
        const __m512 r = _mm512_mask_add_ps(f, _mm512_cmp_ps_mask(_mm512_sub_ps(u, f), half, _CMP_GE_OQ), f, one);
        const __m512i sr = _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(t), sign));
        q[k] = _mm512_cvtps_epi32(_mm512_castsi512_ps(sr));
    }
    _mm_storeu_si128((__m128i *)(void *)out->q, _mm512_cvtepi32_epi8(q[0]));
    _mm_storeu_si128((__m128i *)(void *)(out->q + 16), _mm512_cvtepi32_epi8(q[1]));
    return _mm512_add_epi32(q[0], q[1]);
}

/* The 16 lanes of a block's amax candidates: max(y, m) returns m where y is
 * NaN, so a NaN lane is skipped, as in C. */
static CV_ALWAYS_INLINE __m512 qx_absmax(__m512 a0, __m512 a1) {
    return _mm512_max_ps(_mm512_abs_ps(a1), _mm512_max_ps(_mm512_abs_ps(a0), _mm512_setzero_ps()));
}

static CV_ALWAYS_INLINE __m512 qx_op(__m512 a, __m512 b, int add) {
    return add ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
               : _mm512_max_ps(a, b);
}

/* Lane b of the result: the maximum (add: the int32 sum) of v[b]'s 16 lanes.
 * Each level halves the vectors: pairs of 256-bit halves, of 128-bit
 * quarters, then of 64- and 32-bit pairs inside the quarters, which leaves
 * v[4j + q] in lane 4q + j; one permutation puts it in lane 4j + q. */
static CV_ALWAYS_INLINE __m512 qx_reduce16(__m512 v[16], int add) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        v[k] = qx_op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                     _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)), add);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        v[k] = qx_op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)), add);
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
        v[k] = qx_op(_mm512_shuffle_ps(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                     _mm512_shuffle_ps(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)), add);
    const __m512 r = qx_op(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)), add);
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, r);
}

static void quantize_x_avx512(cv_xq_block *out, const float *x, int64_t n) {
    const int64_t nb = n / CV_QK;
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16) {
        const float *v = x + i * CV_QK;
        __m512 m[16];
#pragma GCC unroll 16
        for (int b = 0; b < 16; b++)
            m[b] = qx_absmax(_mm512_loadu_ps(v + b * CV_QK), _mm512_loadu_ps(v + b * CV_QK + 16));
        const __m512 amax = qx_reduce16(m, 0), d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
        const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ),
                                              _mm512_set1_ps(1.0f), d);
        float ids[16], ds[16], ss[16];
        int32_t sums[16];
        _mm512_storeu_ps(ids, id);
        __m512 qs[16];
#pragma GCC unroll 16
        for (int b = 0; b < 16; b++)
            qs[b] = _mm512_castsi512_ps(qx_round_store(out + i + b, _mm512_loadu_ps(v + b * CV_QK),
                                                       _mm512_loadu_ps(v + b * CV_QK + 16), ids[b]));
        const __m512i sum = _mm512_castps_si512(qx_reduce16(qs, 1));
        _mm512_storeu_ps(ds, d);
        _mm512_storeu_si512((void *)sums, sum);
        _mm512_storeu_ps(ss, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
        for (int b = 0; b < 16; b++) {
            out[i + b].d = ds[b];
            out[i + b].sum = sums[b];
            out[i + b].s = ss[b];
        }
    }
    for (; i < nb; i++) { /* the last blocks of a row, one at a time */
        const __m512 a0 = _mm512_loadu_ps(x + i * CV_QK), a1 = _mm512_loadu_ps(x + i * CV_QK + 16);
        const float amax = _mm512_reduce_max_ps(qx_absmax(a0, a1)), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        out[i].d = d;
        out[i].sum = _mm512_reduce_add_epi32(qx_round_store(out + i, a0, a1, id));
        out[i].s = d * (float)out[i].sum;
    }
}

CV_TARGET_END

cv_quantize_x_fn cv_quantize_x_avx512(void) { return quantize_x_avx512; }

cv_qp16_fn cv_qp16_kernel(cv_dtype t, int panels, int tokens) {
    if (tokens < 1 || tokens > CV_QP16_MAX_TOKENS) return NULL;
    const int full = panels == cv_qp16_panels_for(tokens);
    if (panels != 1 && !full) return NULL;
    switch (t) {
    case CV_Q8_0: return qp_q8_0[tokens][full];
    case CV_Q4_0: return qp_q4_0[tokens][full];
    case CV_Q5_0: return qp_q5_0[tokens][full];
    case CV_Q6_K: return qp_q6_k[tokens][full];
    case CV_Q4_1: return qp_q4_1[tokens][full];
    case CV_Q4_F: return qp_q4_f[tokens][full];
    default: return NULL;
    }
}

cv_qp16k_fn cv_qp16k_kernel(cv_dtype t, int panels, int tokens) {
    if (tokens < 1 || tokens > CV_QP16_MAX_TOKENS || (t != CV_Q4_K && t != CV_Q5_K)) return NULL;
    const int full = panels == cv_qp16_panels_for(tokens);
    if (panels != 1 && !full) return NULL;
    return t == CV_Q4_K ? qk4[tokens][full] : qk5[tokens][full];
}

void cv_qp16k_scales(float *dst, const void *panels, size_t stride, cv_dtype t, int np, int64_t nb) {
    qk_expand(dst, panels, stride, t, np, nb);
}

void cv_qp16_q5_to_q8(void *dst, const void *panel, int64_t nb) { q5_to_q8_panel(dst, panel, nb); }

#else
cv_quantize_x_fn cv_quantize_x_avx512(void) { return NULL; }

void cv_qp16_q5_to_q8(void *dst, const void *panel, int64_t nb) { /* never called: no Q5_0 panels without the kernels */
    (void)dst;
    (void)panel;
    (void)nb;
}

cv_qp16k_fn cv_qp16k_kernel(cv_dtype t, int panels, int tokens) {
    (void)t;
    (void)panels;
    (void)tokens;
    return NULL;
}

void cv_qp16k_scales(float *dst, const void *panels, size_t stride, cv_dtype t, int np, int64_t nb) {
    (void)dst;
    (void)panels;
    (void)stride;
    (void)t;
    (void)np;
    (void)nb;
}

cv_qp16_fn cv_qp16_kernel(cv_dtype t, int panels, int tokens) {
    (void)t;
    (void)panels;
    (void)tokens;
    return NULL;
}
#endif
