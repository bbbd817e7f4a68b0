/* libFuzzer target: llama2.c checkpoint header and size checks
 * (cv_llama2c_parse).
 *
 * Build (clang):
 *   clang -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -Icsrc -Ikernels \
 *     csrc/fuzz/fuzz_llama2c.c csrc/model/safetensors.c csrc/model/json.c \
 *     csrc/model/checkpoint.c csrc/model/mapped_file.c csrc/model/checkpoint_hf.c csrc/model/checkpoint_llama2c.c base/common.c -lm
 * The first and last byte of every view are read, so ASan catches a view
 * that reaches past the input. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../model/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static unsigned char touch(const cv_tensor_view *v) {
    if (!v->data) return 0;
    const unsigned char *p = v->data; /* [numel * 4] */
    size_t bytes = (size_t)cv_tensor_numel(v) * cv_dtype_size(v->dtype);
    return bytes ? (unsigned char)(p[0] ^ p[bytes - 1]) : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* an exact-size aligned copy, as a mapping would be */
    unsigned char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    cv_checkpoint ck;
    cv_err err;
    if (cv_llama2c_parse(&ck, buf, size, "fuzz.bin", &err) == 0) {
        volatile unsigned char sink = touch(&ck.embed) ^ touch(&ck.final_norm) ^ touch(&ck.lm_head);
        for (int64_t i = 0; i < ck.cfg.n_layers; i++) {
            const cv_layer_views *l = &ck.layers[i];
            sink ^= touch(&l->attn_norm) ^ touch(&l->wq) ^ touch(&l->wk) ^ touch(&l->wv) ^ touch(&l->wo) ^
                    touch(&l->ffn_norm) ^ touch(&l->w_gate) ^ touch(&l->w_up) ^ touch(&l->w_down);
        }
        (void)sink;
    }
    cv_checkpoint_close(&ck);
    free(buf);
    return 0;
}
