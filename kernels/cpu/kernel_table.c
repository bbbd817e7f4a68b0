/* The kernel table of each SIMD level (kernel_table.h): the only place that
 * chooses code by level: the plain references first, then each level's
 * versions over them, so a level without its own version of a kernel keeps
 * the one below it. */
#include <string.h>

#include "cpu_internal.h"
#include "gemm_ukr.h"
#include "x86/kernels.h"

void cv_cpu_kernels_fill(cv_simd_level level, cv_cpu_kernels *k) {
    memset(k, 0, sizeof *k);
    k->level = level;
    for (int d = 0; d < 3; d++) k->gemm[d] = cv_gemm_plain_table[d];
    for (int mr = 0; mr <= CV_MR; mr++) k->gemm_np[mr] = 1;
    k->rms_row = cv_rms_row_plain;
    k->kv_quantize_i8 = cv_kv_quantize_i8_plain;
    k->rope_head = cv_rope_head_plain;
    k->att_scores = cv_att_scores_plain;
    k->att_scale = cv_att_scale_plain;
    k->att_softmax = cv_att_softmax_plain;
    k->att_pv = cv_att_pv_plain;
    k->lora_shrink = cv_lora_shrink_plain;
    k->lora_expand = cv_lora_expand_plain;
#if CV_HAVE_AVX2
    if (level >= CV_SIMD_AVX2) {
        for (int d = 0; d < 3; d++) {
            k->gemm[d] = cv_gemm_avx2_table[d];
            k->gemm_pf[d] = cv_gemm_avx2_pf_table[d];
        }
        for (int mr = 1; mr <= CV_MR; mr++) k->gemm_np[mr] = UKR_NP_AVX2(mr);
        k->rms_row = cv_rms_row_avx2;
        k->swiglu_part = cv_swiglu_part_avx2;
        k->geglu_part = cv_geglu_part_avx2;
        k->widen_part = cv_widen_part_avx2;
        k->narrow_part = cv_narrow_part_avx2;
        k->rope_head = cv_rope_head_avx2;
        k->att_scores = cv_att_scores_avx2;
        k->att_scale = cv_att_scale_avx2;
        k->att_softmax = cv_att_softmax_avx2;
        k->att_pv = cv_att_pv_avx2;
        k->lora_shrink = cv_lora_shrink_avx2;
        k->lora_expand = cv_lora_expand_avx2;
    }
#endif
#if CV_HAVE_AVX512
    if (level >= CV_SIMD_AVX512) {
        for (int d = 0; d < 3; d++) {
            k->gemm[d] = cv_gemm_avx512_table[d];
            k->gemm_pf[d] = cv_gemm_avx512_pf_table[d];
        }
        for (int mr = 1; mr <= CV_MR; mr++) k->gemm_np[mr] = UKR_NP_AVX512(mr);
        k->rms_row = cv_rms_row_avx512;
        k->swiglu_part = cv_swiglu_part_avx512;
        k->widen_part = cv_widen_part_avx512;
        k->narrow_part = cv_narrow_part_avx512;
        k->kv_quantize_i8 = cv_kv_quantize_i8_avx512;
        k->rope_head = cv_rope_head_avx512;
        k->att_scores = cv_att_scores_avx512;
        k->att_scale = cv_att_scale_avx512;
        k->att_softmax = cv_att_softmax_avx512;
        k->att_pv = cv_att_pv_avx512;
        k->lora_shrink = cv_lora_shrink_avx512;
        k->lora_expand = cv_lora_expand_avx512;
    }
    if (level >= CV_SIMD_AVX512_BF16) {
        k->gemm_pairs = cv_gemm_bf16dot_table;
        k->gemm_pairs_pf = cv_gemm_bf16dot_pf_table;
        k->att_round_q_bf16 = cv_att_round_q_bf16;
        k->att_scores_bf16 = cv_att_scores_bf16;
        k->att_pv_bf16 = cv_att_pv_bf16;
#if CV_HAVE_ATT_I8DOT
        if (cv_cpu_features_get()->avx512vnni) {
            k->att_quantize_q_i8 = cv_att_quantize_q_i8;
            k->att_scores_i8 = cv_att_scores_i8;
            k->att_pv_i8 = cv_att_pv_i8;
        }
#endif
    }
#endif
}
