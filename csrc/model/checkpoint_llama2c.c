/* llama2.c checkpoints (version 0): 7 int32 header, then float32 arrays.
 *
 * Layout after the header (row-major, [out][in] matrices):
 *   token_embedding[vocab][dim], rms_att[L][dim], wq[L][dim][dim],
 *   wk[L][kv_dim][dim], wv[L][kv_dim][dim], wo[L][dim][dim], rms_ffn[L][dim],
 *   w1[L][hidden][dim], w2[L][dim][hidden], w3[L][hidden][dim], rms_final[dim],
 *   freq_cis_real[seq_len][head_dim/2], freq_cis_imag[seq_len][head_dim/2],
 *   and wcls[vocab][dim] only when the header's vocab_size is negative. */
#include "checkpoint.h"

#include <stdlib.h>
#include <string.h>

#define HEADER_BYTES 28

/* total += a * b * c, checked. */
static int add3(size_t *total, size_t a, size_t b, size_t c) {
    size_t ab, abc;
    if (!cv_mul_size(a, b, &ab) || !cv_mul_size(ab, c, &abc) || abc > SIZE_MAX - *total) return 0;
    *total += abc;
    return 1;
}

static cv_tensor_view view2(const float *p, int64_t rows, int64_t cols) {
    cv_tensor_view v;
    memset(&v, 0, sizeof v);
    v.data = p;
    v.dtype = CV_F32;
    v.ndim = 2;
    v.shape[0] = rows;
    v.shape[1] = cols;
    return v;
}

static cv_tensor_view view1(const float *p, int64_t n) {
    cv_tensor_view v;
    memset(&v, 0, sizeof v);
    v.data = p;
    v.dtype = CV_F32;
    v.ndim = 1;
    v.shape[0] = n;
    return v;
}

int cv_llama2c_parse(cv_checkpoint *ck, const void *buf, size_t len, const char *path, cv_err *err) {
    static const char *names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                   "seq_len"};
    int rc = 0;
    memset(ck, 0, sizeof *ck);
    ck->format = CV_FMT_LLAMA2C;
    if (!buf || len == 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: file is empty (a llama2.c checkpoint starts with a %d-byte header)",
                        path, HEADER_BYTES);
        goto done;
    }
    if (len < HEADER_BYTES) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: file is %zu bytes, shorter than the %d-byte llama2.c header", path,
                        len, HEADER_BYTES);
        goto done;
    }
    if ((uintptr_t)buf % sizeof(float) != 0) {
        rc = cv_set_err(err, CV_ERR_INVALID, "%s: buffer is not 4-byte aligned", path);
        goto done;
    }
    const unsigned char *b = buf;
    int32_t h[7];
    for (int k = 0; k < 7; k++) {
        uint32_t u = (uint32_t)b[4 * k] | (uint32_t)b[4 * k + 1] << 8 | (uint32_t)b[4 * k + 2] << 16 |
                     (uint32_t)b[4 * k + 3] << 24;
        memcpy(&h[k], &u, 4);
    }
    int tied = h[5] > 0;
    for (int k = 0; k < 7; k++) {
        int bad = (k == 5) ? (h[k] == 0 || h[k] == INT32_MIN) : (h[k] <= 0);
        if (bad) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header field %s is %d, must be %s", path, names[k], (int)h[k],
                            k == 5 ? "non-zero (negative means an untied classifier)" : "positive");
            goto done;
        }
    }
    int64_t dim = h[0], hidden = h[1], n_layers = h[2], n_heads = h[3], n_kv = h[4];
    int64_t vocab = tied ? h[5] : -(int64_t)h[5], seq_len = h[6];
    if (n_kv > n_heads || n_heads % n_kv != 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header n_heads=%lld is not a multiple of n_kv_heads=%lld", path,
                        (long long)n_heads, (long long)n_kv);
        goto done;
    }
    if (dim % n_heads != 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header dim=%lld is not a multiple of n_heads=%lld", path,
                        (long long)dim, (long long)n_heads);
        goto done;
    }
    int64_t head_dim = dim / n_heads;
    if (head_dim % 2 != 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: head_dim=%lld (dim/n_heads) must be even for RoPE", path,
                        (long long)head_dim);
        goto done;
    }
    int64_t kv_dim = n_kv * head_dim;
    size_t D = (size_t)dim, H = (size_t)hidden, L = (size_t)n_layers, V = (size_t)vocab, KV = (size_t)kv_dim;
    size_t floats = 0;
    int ok = add3(&floats, V, D, 1)             /* token_embedding */
             && add3(&floats, L, D, 1)          /* rms_att */
             && add3(&floats, L, D, D)          /* wq */
             && add3(&floats, L, KV, D)         /* wk */
             && add3(&floats, L, KV, D)         /* wv */
             && add3(&floats, L, D, D)          /* wo */
             && add3(&floats, L, D, 1)          /* rms_ffn */
             && add3(&floats, L, H, D)          /* w1 */
             && add3(&floats, L, D, H)          /* w2 */
             && add3(&floats, L, H, D)          /* w3 */
             && add3(&floats, D, 1, 1)          /* rms_final */
             && add3(&floats, (size_t)seq_len, (size_t)head_dim, 1) /* two tables of head_dim/2 */
             && (tied || add3(&floats, V, D, 1)); /* wcls */
    size_t need = 0;
    if (!ok || !cv_mul_size(floats, 4, &need) || need > SIZE_MAX - HEADER_BYTES) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header sizes (dim=%lld, hidden_dim=%lld, n_layers=%lld, vocab=%lld) "
                        "overflow the size range", path, (long long)dim, (long long)hidden, (long long)n_layers,
                        (long long)vocab);
        goto done;
    }
    need += HEADER_BYTES;
    if (len < need) {
        rc = cv_set_err(err, CV_ERR_FORMAT,
                        "%s: truncated: the header (dim=%lld, hidden_dim=%lld, n_layers=%lld, n_heads=%lld, "
                        "n_kv_heads=%lld, vocab_size=%d, seq_len=%lld) needs %zu bytes, the file has %zu",
                        path, (long long)dim, (long long)hidden, (long long)n_layers, (long long)n_heads,
                        (long long)n_kv, (int)h[5], (long long)seq_len, need, len);
        goto done;
    }

    cv_model_config *c = &ck->cfg;
    c->arch = CV_ARCH_LLAMA;
    c->dim = dim;
    c->hidden_dim = hidden;
    c->n_layers = n_layers;
    c->n_heads = n_heads;
    c->n_kv_heads = n_kv;
    c->head_dim = head_dim;
    c->vocab_size = vocab;
    c->max_pos = seq_len;
    c->rms_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    c->rope_layout = CV_ROPE_PAIRS;
    c->tie_embeddings = tied;
    c->qkv_bias = 0;
    c->bos_id = 1;
    c->eos_ids[0] = 2;
    c->n_eos = 1;
    c->torch_dtype = CV_F32;

    ck->layers = calloc(L, sizeof *ck->layers);
    if (!ck->layers) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory for %lld layers", path, (long long)n_layers);
        goto done;
    }
    /* the header is 28 bytes, so every array below is 4-byte aligned in a mapping */
    const float *p = (const float *)(b + HEADER_BYTES);
    const float *emb = p;        p += V * D;     /* [vocab][dim] */
    const float *rms_att = p;    p += L * D;     /* [L][dim] */
    const float *wq = p;         p += L * D * D; /* [L][dim][dim] */
    const float *wk = p;         p += L * KV * D;/* [L][kv_dim][dim] */
    const float *wv = p;         p += L * KV * D;/* [L][kv_dim][dim] */
    const float *wo = p;         p += L * D * D; /* [L][dim][dim] */
    const float *rms_ffn = p;    p += L * D;     /* [L][dim] */
    const float *w1 = p;         p += L * H * D; /* [L][hidden][dim] */
    const float *w2 = p;         p += L * D * H; /* [L][dim][hidden] */
    const float *w3 = p;         p += L * H * D; /* [L][hidden][dim] */
    const float *rms_final = p;  p += D;         /* [dim] */
    p += (size_t)seq_len * (size_t)head_dim;     /* skip the two unused RoPE tables */
    const float *wcls = tied ? NULL : p;         /* [vocab][dim] */

    ck->embed = view2(emb, vocab, dim);
    ck->final_norm = view1(rms_final, dim);
    if (wcls) ck->lm_head = view2(wcls, vocab, dim);
    for (size_t l = 0; l < L; l++) {
        cv_layer_views *lv = &ck->layers[l];
        lv->attn_norm = view1(rms_att + l * D, dim);
        lv->wq = view2(wq + l * D * D, dim, dim);
        lv->wk = view2(wk + l * KV * D, kv_dim, dim);
        lv->wv = view2(wv + l * KV * D, kv_dim, dim);
        lv->wo = view2(wo + l * D * D, dim, dim);
        lv->ffn_norm = view1(rms_ffn + l * D, dim);
        lv->w_gate = view2(w1 + l * H * D, hidden, dim);
        lv->w_down = view2(w2 + l * D * H, dim, hidden);
        lv->w_up = view2(w3 + l * H * D, hidden, dim);
    }
    rc = 0;
done:
    if (rc < 0) cv_checkpoint_close(ck);
    return rc;
}

int cv_checkpoint_open_llama2c(cv_checkpoint *ck, const char *path, cv_err *err) {
    void *map = NULL;
    size_t len = 0;
    memset(ck, 0, sizeof *ck);
    int rc = cv_map_file(&map, &len, path, err);
    if (rc < 0) return rc;
    rc = cv_llama2c_parse(ck, map, len, path, err);
    if (rc < 0) {
        cv_unmap_file(map, len);
        return rc;
    }
    ck->maps[0] = map;
    ck->map_lens[0] = len;
    ck->n_maps = 1;
    return 0;
}
