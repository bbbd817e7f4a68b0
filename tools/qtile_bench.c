/* Development microbenchmark of the quantized micro-kernels (kernels/cpu/
 * quant_tile.h) at the AVX2 level, one core, no threads or Python: for each
 * tile shape, cycles (TSC) per (row, token, block of 32), i.e. per 32
 * multiply-adds, with the weights in L1 (a row chunk reused by many token
 * panels: batched steps) and streamed from memory (decode). Best of many
 * short runs, so a loaded machine shows its quiet moments; still not a figure
 * to quote from a shared VM. Before it times, it checks that every full tile
 * gives each of its rows the one-row kernel's bits (exit status 1 if not).
 *
 *   gcc -O3 -std=c11 -D_GNU_SOURCE -Ikernels tools/qtile_bench.c kernels/cpu/x86/avx2_quant.c -o /tmp/qtile_bench
 *   /tmp/qtile_bench            # q8_0, q4_0, q4_1
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#include "cpu/quant.h"

enum { NB = 18 }; /* 576 columns: SmolLM-135M's hidden size */

typedef struct shape {
    cv_qtile_fn fn;
    int rows, tokens;
} shape;

/* Best TSC cycles per pair-block of fn over `rows` weight rows, each
 * `chunk` rows met by `panels` token panels of the shape's tokens. */
static double measure(shape s, const unsigned char *w, size_t row_bytes, int64_t rows, int64_t chunk, int panels,
                      const cv_xq_block *x, int runs) {
    float out[CV_QTILE_MAX_ROWS * CV_QTILE_MAX_TOKENS];
    volatile float sink = 0.0f;
    double best = 1e30;
    for (int run = 0; run < runs; run++) {
        const unsigned long long c0 = __rdtsc();
        for (int64_t r0 = 0; r0 + chunk <= rows; r0 += chunk)
            for (int p = 0; p < panels; p++)
                for (int64_t r = r0; r + s.rows <= r0 + chunk; r += s.rows) {
                    s.fn(w + (size_t)r * row_bytes, row_bytes, x + (size_t)p * s.tokens * NB, NB, NB, out);
                    sink += out[0];
                }
        const double pairs = (double)(rows / chunk) * (double)(chunk / s.rows * s.rows) * panels * s.tokens * NB;
        const double c = (double)(__rdtsc() - c0) / pairs;
        best = c < best ? c : best;
    }
    (void)sink;
    return best;
}

int main(void) {
    const cv_dtype types[] = {CV_Q8_0, CV_Q4_0, CV_Q4_1};
    const char *names[] = {"q8_0", "q4_0", "q4_1"};
    const int64_t big_rows = 65536; /* 23-40 MB of weights: more than the caches */
    enum { PANELS = 16 };
    cv_xq_block *x = malloc(sizeof(cv_xq_block) * NB * PANELS * CV_QTILE_MAX_TOKENS);
    if (!x) return 1;
    srand(1);
    for (int i = 0; i < NB * PANELS * CV_QTILE_MAX_TOKENS; i++) {
        for (int j = 0; j < 32; j++) x[i].q[j] = (int8_t)(rand() % 255 - 127);
        x[i].d = 0.01f;
        x[i].s = 0.3f;
    }
    printf("TSC cycles per (row, token, 32-column block); L1: 16-row chunks x %d token panels; memory: %lld rows\n",
           PANELS, (long long)big_rows);
    for (int k = 0; k < 3; k++) {
        cv_qtiles t;
        if (!cv_qtiles_avx2(types[k], &t)) {
            printf("%s: no AVX2 kernels built\n", names[k]);
            continue;
        }
        const size_t block = types[k] == CV_Q8_0   ? sizeof(cv_block_q8_0)
                             : types[k] == CV_Q4_0 ? sizeof(cv_block_q4_0)
                                                   : sizeof(cv_block_q4_1);
        const size_t row_bytes = block * NB;
        unsigned char *w = aligned_alloc(64, (row_bytes * (size_t)big_rows + 63) & ~(size_t)63);
        if (!w) return 1;
        for (size_t i = 0; i < row_bytes * (size_t)big_rows; i++) w[i] = (unsigned char)rand();
        for (int64_t r = 0; r < big_rows; r++) /* scales 1.0 (fp16 0x3c00): no inf/NaN in the sums */
            for (int b = 0; b < NB; b++) {
                const uint16_t one = 0x3c00;
                memcpy(w + (size_t)r * row_bytes + (size_t)b * block, &one, 2);
                if (types[k] == CV_Q4_1) memcpy(w + (size_t)r * row_bytes + (size_t)b * block + 2, &one, 2);
            }
        for (int tokens = 1; tokens <= t.max_tokens; tokens++) { /* the full tile's bits against one row's */
            float a[CV_QTILE_MAX_ROWS * CV_QTILE_MAX_TOKENS], b[CV_QTILE_MAX_TOKENS];
            t.tile[tokens](w, row_bytes, x, NB, NB, a);
            for (int r = 0; r < t.rows[tokens]; r++) {
                t.row[tokens](w + (size_t)r * row_bytes, row_bytes, x, NB, NB, b);
                if (memcmp(a + r * tokens, b, sizeof(float) * (size_t)tokens) != 0) {
                    printf("%s %d token(s): row %d of the %dx%d tile differs from the 1x%d kernel\n", names[k], tokens, r,
                           t.rows[tokens], tokens, tokens);
                    free(w);
                    free(x);
                    return 1;
                }
            }
        }
        for (int tokens = 1; tokens <= t.max_tokens; tokens++) {
            const shape full = {t.tile[tokens], t.rows[tokens], tokens}, one = {t.row[tokens], 1, tokens};
            printf("%s %d token(s): L1 %dx%d %.2f, 1x%d %.2f | memory %dx%d %.2f, 1x%d %.2f\n", names[k], tokens,
                   full.rows, tokens, measure(full, w, row_bytes, 16, 16, PANELS, x, 3000), tokens,
                   measure(one, w, row_bytes, 16, 16, PANELS, x, 3000), full.rows, tokens,
                   measure(full, w, row_bytes, big_rows, 16, 1, x, 10), tokens,
                   measure(one, w, row_bytes, big_rows, 16, 1, x, 10));
        }
        free(w);
    }
    free(x);
    return 0;
}
