/* libFuzzer target: the GGUF reader (cv_gguf_parse) and the GGUF checkpoint
 * built on it (config from metadata, views of every tensor).
 *
 * Build (clang): see tools/fuzz.sh (model sources plus csrc/model/gguf.c and
 * csrc/model/checkpoint_gguf.c). Every accepted tensor's byte range and every
 * metadata string is read end to end, and the first row of each model tensor
 * is converted to float32 (dequantized), so ASan catches any range the
 * validator lets through that is outside the input. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../base/quant_format.h"
#include "../model/checkpoint.h"
#include "../model/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void touch_view(const cv_tensor_view *v, float *row) {
    if (!v->data) return;
    const int64_t cols = v->ndim == 2 ? v->shape[1] : v->shape[0];
    if (cols > 0 && cols <= 4096) cv_convert_to_f32(row, v->data, v->dtype, (size_t)cols);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cv_gguf_file f;
    cv_err err;
    volatile unsigned char sink = 0;
    if (cv_gguf_parse(&f, data, size, "fuzz.gguf", &err) == 0) {
        for (size_t i = 0; i < f.n_tensors; i++) {
            const cv_gguf_tensor *t = &f.tensors[i];
            const unsigned char *p = t->data; /* [nbytes] */
            sink ^= p[0] ^ p[t->nbytes - 1];
        }
        for (size_t i = 0; i < f.n_kvs; i++) {
            const cv_gguf_kv *kv = &f.kvs[i];
            cv_gguf_str s;
            if (cv_gguf_kv_string(kv, &s) && s.len) sink ^= (unsigned char)s.p[s.len - 1];
            if (kv->type == CV_GGUF_ARRAY && kv->elem_type == CV_GGUF_STRING) {
                const unsigned char *cur = kv->value;
                for (uint64_t k = 0; k < kv->count; k++) {
                    s = cv_gguf_next_string(&cur);
                    if (s.len) sink ^= (unsigned char)s.p[s.len - 1];
                }
            } else if (kv->type == CV_GGUF_ARRAY && kv->count) {
                int64_t v;
                double d;
                if (!cv_gguf_array_int(kv, kv->count - 1, &v)) cv_gguf_array_float(kv, kv->count - 1, &d);
            }
        }
        cv_gguf_close(&f);
    }
    cv_checkpoint ck;
    if (cv_gguf_checkpoint_parse(&ck, data, size, "fuzz.gguf", &err) == 0) {
        float *row = malloc(4096 * sizeof(float));
        if (row) {
            touch_view(&ck.embed, row);
            touch_view(&ck.final_norm, row);
            touch_view(&ck.lm_head, row);
            for (int64_t l = 0; l < ck.cfg.n_layers; l++) {
                const cv_layer_views *L = &ck.layers[l];
                const cv_tensor_view *vs[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq,
                                              &L->bk, &L->bv, &L->ffn_norm, &L->w_gate, &L->w_up, &L->w_down};
                for (size_t k = 0; k < sizeof vs / sizeof vs[0]; k++) touch_view(vs[k], row);
            }
            free(row);
        }
        cv_checkpoint_close(&ck);
    }
    (void)sink;
    return 0;
}
