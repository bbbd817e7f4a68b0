/* Development microbenchmark of the AVX512-VNNI panel kernels (kernels/cpu/
 * x86/vnni512_quant.c, the P16 layout of quant_ukr.h), one core, no threads or
 * Python: for each tile shape (P panels x T tokens), TSC cycles per 64-MAC
 * dot (one vpdpbusd's worth: 16 rows x 4 columns x 1 token) with the weights
 * in L1/L2 (the same panels called again and again: batched steps), beside
 * the same figure for a loop of 12 independent vpdpbusd (the peak). Their
 * ratio is the kernel's fraction of the int8-dot peak. Best of many short
 * runs, so a loaded machine shows its quiet moments. Needs AVX512-VNNI.
 *
 *   gcc -O3 -std=c11 -D_GNU_SOURCE -Ikernels tools/qp16_bench.c kernels/cpu/x86/vnni512_quant.c -o /tmp/qp16_bench
 *   /tmp/qp16_bench [blocks]        # default 18 blocks (576 columns)
 *
 * q4_k and q5_k are their panels (CV_QLAYOUT_P16_Q4K/Q5K, whole super-blocks: the blocks
 * rounded down to a multiple of 8, at least 8), its scales expanded once
 * for the repeated calls (as the driver does once per chunk of panels for
 * all its token tiles) and by the kernel in the decode stream; q4_f the
 * same shapes in Q4_F panels (Q4_K's form before its own panels); q6_k its
 * panels (CV_QLAYOUT_P16_Q6K), whole super-blocks too; q5_0 its panels
 * (CV_QLAYOUT_P16_Q50), as the one-token tiles run them (batched steps run
 * them expanded to Q8_0 panels, q8_0's figures).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "cpu/quant.h"

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double peak_cycles(void) {
    __m512i a[12], w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x01010101);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
    double best = 1e30;
    for (int run = 0; run < 50; run++) {
        const unsigned long long c0 = __rdtsc();
        for (int k = 0; k < 20000; k++) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
            __asm__ volatile("" : "+v"(w), "+v"(x));
        }
        const double c = (double)(__rdtsc() - c0) / (20000.0 * 12);
        best = c < best ? c : best;
    }
    volatile int sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(a[i]);
    (void)sink;
    return best;
}

int main(int argc, char **argv) {
    const int nb = argc > 1 ? atoi(argv[1]) : 18;
    if (nb <= 0 || !cv_qp16_kernel(CV_Q8_0, 1, 1)) {
        fprintf(stderr, "usage: qp16_bench [blocks > 0] (needs a compiler with AVX512-VNNI)\n");
        return 1;
    }
    const cv_dtype types[] = {CV_Q8_0, CV_Q4_0, CV_Q4_1, CV_Q4_F, CV_Q4_K, CV_Q5_K, CV_Q5_0, CV_Q6_K};
    const char *names[] = {"q8_0", "q4_0", "q4_1", "q4_f", "q4_k", "q5_k", "q5_0", "q6_k"};
    const int ntypes = (int)(sizeof types / sizeof types[0]);
    const int nbk = nb >= 16 ? nb / 8 * 8 : 8; /* the K-quant comparison's blocks */
    const int shapes[][2] = {{1, 1}, {4, 1}, {4, 2}, {2, 3}, {2, 4}, {1, 4}};
    const int nx = nb > nbk ? nb : nbk;
    cv_xq_block *x = aligned_alloc(64, sizeof(cv_xq_block) * (size_t)nx * CV_QP16_MAX_TOKENS);
    float *out = malloc(sizeof(float) * 4 * CV_QP16_ROWS * CV_QP16_MAX_TOKENS);
    float *sc = malloc(sizeof(float) * 4 * 32 * (size_t)nbk); /* Q4_K's expanded scales, 4 panels */
    if (!x || !out || !sc) return 1;
    srand(1);
    for (int i = 0; i < nx * CV_QP16_MAX_TOKENS; i++) {
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += x[i].q[j] = (int8_t)(rand() % 255 - 127);
        x[i].d = 0.01f;
        x[i].sum = sum;
        x[i].s = 0.01f * (float)sum;
    }
    const double peak = peak_cycles();
    printf("peak: %.3f TSC cycles per vpdpbusd zmm\n", peak);
    for (int ti = 0; ti < ntypes; ti++) {
        const int kp = types[ti] == CV_Q4_K || types[ti] == CV_Q5_K; /* K-quant panels */
        const int kq = kp || types[ti] == CV_Q4_F || types[ti] == CV_Q6_K; /* whole super-blocks */
        const int nbt = kq ? nbk : nb; /* this type's blocks */
        const size_t stride = cv_qp16_stride(types[ti], nbt);
        unsigned char *w = aligned_alloc(64, stride * 4);
        if (!w) return 1;
        for (size_t i = 0; i < stride * 4; i++) w[i] = (unsigned char)rand();
        if (kq) /* normal scales (random bytes make subnormal floats, which run at a fraction of the rate) */
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < nbt; i++) {
                    unsigned char *pp = w + (size_t)p * stride;
                    if (types[ti] == CV_Q4_F)
                        for (int r = 0; r < 32; r++) memcpy(pp + (size_t)i * 384 + 256 + 4 * r, &(float){0.01f}, 4);
                    else if (types[ti] == CV_Q6_K) {
                        if (i % 8 == 0)
                            for (int r = 0; r < 16; r++) memcpy(pp + (size_t)(i / 8) * cv_qp16_stride(CV_Q6_K, 8) + 2 * r, &(uint16_t){0x2000}, 2);
                    } else if (i % 8 == 0)
                        for (int r = 0; r < 32; r++) memcpy(pp + (size_t)(i / 8) * cv_qp16_stride(types[ti], 8) + 2 * r, &(uint16_t){0x2000}, 2);
                }
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int P = shapes[s][0], T = shapes[s][1];
            const cv_qp16_fn f = cv_qp16_kernel(types[ti], P, T);
            const cv_qp16k_fn fk = cv_qp16k_kernel(types[ti], P, T);
            if (kp) cv_qp16k_scales(sc, w, stride, types[ti], P, nbt);
            double best = 1e30;
            for (int run = 0; run < 200; run++) {
                const unsigned long long c0 = __rdtsc();
                for (int k = 0; k < 50; k++)
                    if (kp)
                        fk(w, stride, nbt, x, nbt, out, 4 * CV_QP16_ROWS, P * CV_QP16_ROWS, NULL, 0, NULL, 0, sc);
                    else
                        f(w, stride, nbt, x, nbt, out, 4 * CV_QP16_ROWS, P * CV_QP16_ROWS, NULL, 0, NULL, 0);
                const double c = (double)(__rdtsc() - c0) / (50.0 * nbt * P * T * 8);
                best = c < best ? c : best;
            }
            printf("%s %d panels x %d tokens: %.3f cycles per 64-MAC dot, %.2f of the peak\n", names[ti], P, T, best,
                   peak / best);
        }
        free(w);
        /* decode: T tokens over a matrix larger than the caches, one core, 4 panels a call
         * (four streams) and 1 (one stream: what the driver runs for a GEMM of one token
         * tile, 1 to 4 tokens) */
        const int64_t panels = (int64_t)(96u << 20) / (int64_t)stride / 4 * 4;
        unsigned char *big = aligned_alloc(64, (size_t)panels * stride);
        if (!big) return 1;
        memset(big, 0x11, (size_t)panels * stride);
        const int decode_shapes[][2] = {{4, 1}, {1, 1}, {1, 2}, {1, 4}};
        for (size_t di = 0; di < sizeof decode_shapes / sizeof decode_shapes[0]; di++) {
            const int P = decode_shapes[di][0], T = decode_shapes[di][1];
            const cv_qp16_fn f = cv_qp16_kernel(types[ti], P, T);
            const cv_qp16k_fn fk = cv_qp16k_kernel(types[ti], P, T);
            double best = 1e30;
            for (int run = 0; run < 5; run++) {
                const unsigned long long c0 = __rdtsc();
                for (int64_t p = 0; p < panels; p += P)
                    if (kp) {
                        fk(big + (size_t)p * stride, stride, nbt, x, nbt, out, 4 * CV_QP16_ROWS, P * CV_QP16_ROWS, NULL,
                           0, NULL, 0, NULL);
                    } else {
                        f(big + (size_t)p * stride, stride, nbt, x, nbt, out, 4 * CV_QP16_ROWS, P * CV_QP16_ROWS, NULL,
                          0, NULL, 0);
                    }
                const double c = (double)(__rdtsc() - c0);
                best = c < best ? c : best;
            }
            printf("%s decode, %d panel%s a call, %d token%s, %.0f MB streamed: %.2f bytes per TSC cycle, %.2f weights "
                   "per TSC cycle\n",
                   names[ti], P, P > 1 ? "s" : "", T, T > 1 ? "s" : "", (double)panels * (double)stride / 1e6,
                   (double)panels * (double)stride / best, (double)panels * CV_QP16_ROWS * nbt * CV_QK / best);
        }
        free(big);
    }
    free(x);
    free(out);
    free(sc);
    return 0;
}
