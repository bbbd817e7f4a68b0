/* What every checkpoint format shares: tensor views, binding a layer's
 * tensors by name, lookup by canonical name, and release. Choosing a format's
 * reader is checkpoint_open.c's job, so the readers sit between the two. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "checkpoint.h"
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>


void cv_checkpoint_close(cv_checkpoint *ck) {
    if (!ck) return;
    for (int i = 0; i < ck->n_maps && i < CV_MAX_MAPS; i++) cv_unmap_file(ck->maps[i], ck->map_lens[i]);
    free(ck->layers);
    if (ck->gguf) {
        cv_gguf_close(ck->gguf);
        free(ck->gguf);
    }
    memset(ck, 0, sizeof *ck);
}

int64_t cv_tensor_numel(const cv_tensor_view *v) {
    if (!v || !v->data) return 0;
    return v->ndim == 1 ? v->shape[0] : v->shape[0] * v->shape[1];
}

/* Dimensions a layer tensor's shape is made of. */
enum { D_NONE, D_DIM, D_Q, D_KV, D_HID, D_HEAD };

static int64_t dim_of(const cv_model_config *c, int d) {
    switch (d) {
    case D_DIM: return c->dim;
    case D_Q: return c->n_heads * c->head_dim;
    case D_KV: return c->n_kv_heads * c->head_dim;
    case D_HID: return c->hidden_dim;
    case D_HEAD: return c->head_dim;
    default: return -1;
    }
}

cv_layer_slot cv_layer_slot_at(const cv_model_config *c, cv_layer_views *l, int k) {
    static const struct {
        const char *name;
        size_t off;
        int rows, cols, kind; /* kind: 0 always, 1 qkv_bias, 2 qk_norm, 3 gemma */
    } table[CV_LAYER_TENSORS] = {
        {"attn_norm", offsetof(cv_layer_views, attn_norm), D_DIM, D_NONE, 0},
        {"wq", offsetof(cv_layer_views, wq), D_Q, D_DIM, 0},
        {"wk", offsetof(cv_layer_views, wk), D_KV, D_DIM, 0},
        {"wv", offsetof(cv_layer_views, wv), D_KV, D_DIM, 0},
        {"wo", offsetof(cv_layer_views, wo), D_DIM, D_Q, 0},
        {"bq", offsetof(cv_layer_views, bq), D_Q, D_NONE, 1},
        {"bk", offsetof(cv_layer_views, bk), D_KV, D_NONE, 1},
        {"bv", offsetof(cv_layer_views, bv), D_KV, D_NONE, 1},
        {"ffn_norm", offsetof(cv_layer_views, ffn_norm), D_DIM, D_NONE, 0},
        {"w_gate", offsetof(cv_layer_views, w_gate), D_HID, D_DIM, 0},
        {"w_up", offsetof(cv_layer_views, w_up), D_HID, D_DIM, 0},
        {"w_down", offsetof(cv_layer_views, w_down), D_DIM, D_HID, 0},
        {"q_norm", offsetof(cv_layer_views, q_norm), D_HEAD, D_NONE, 2},
        {"k_norm", offsetof(cv_layer_views, k_norm), D_HEAD, D_NONE, 2},
        {"post_attn_norm", offsetof(cv_layer_views, post_attn_norm), D_DIM, D_NONE, 3},
        {"post_ffn_norm", offsetof(cv_layer_views, post_ffn_norm), D_DIM, D_NONE, 3},
    };
    const int kind = table[k].kind;
    cv_layer_slot s = {
        .view = (cv_tensor_view *)((char *)l + table[k].off), .name = table[k].name,
        .rows = dim_of(c, table[k].rows), .cols = dim_of(c, table[k].cols),
        .present = kind == 0 || (kind == 1 && c->qkv_bias) || (kind == 2 && c->qk_norm) || (kind == 3 && c->gemma),
    };
    return s;
}

int cv_checkpoint_bind_layers(cv_checkpoint *ck, const char *prefix, const char *const names[CV_LAYER_TENSORS],
                              cv_bind_fn bind, void *loader) {
    char name[160];
    int rc;
    for (int64_t i = 0; i < ck->cfg.n_layers; i++)
        for (int k = 0; k < CV_LAYER_TENSORS; k++) {
            cv_layer_slot s = cv_layer_slot_at(&ck->cfg, &ck->layers[i], k);
            if (!s.present || !names[k]) continue;
            snprintf(name, sizeof name, "%s%lld.%s", prefix, (long long)i, names[k]);
            if ((rc = bind(loader, s.view, name, s.rows, s.cols, 1)) < 0) return rc;
        }
    return 0;
}

static const cv_tensor_view *present(const cv_tensor_view *v) { return v->data ? v : NULL; }

const cv_tensor_view *cv_checkpoint_find(const cv_checkpoint *ck, const char *name) {
    if (!ck || !name) return NULL;
    if (strcmp(name, "embed") == 0) return present(&ck->embed);
    if (strcmp(name, "final_norm") == 0) return present(&ck->final_norm);
    if (strcmp(name, "lm_head") == 0) return present(&ck->lm_head);
    if (strncmp(name, "layers.", 7) != 0 || !ck->layers) return NULL;
    const char *s = name + 7;
    /* a decimal index without sign or leading zeros */
    if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] >= '0' && s[1] <= '9')) return NULL;
    int64_t i = 0;
    while (*s >= '0' && *s <= '9') {
        i = i * 10 + (*s - '0');
        if (i >= ck->cfg.n_layers) return NULL;
        s++;
    }
    if (*s != '.') return NULL;
    s++;
    for (int k = 0; k < CV_LAYER_TENSORS; k++) {
        cv_layer_slot slot = cv_layer_slot_at(&ck->cfg, &ck->layers[i], k);
        if (strcmp(s, slot.name) == 0) return present(slot.view);
    }
    return NULL;
}
