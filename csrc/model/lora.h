/* LoRA adapter slots over one model: a fixed number of slots, each holding
 * one adapter's low-rank pairs (A, B^T per layer and projection, f32, on the
 * model's backend) with its rank and scale; and the forward's hook that adds
 * scale * (x A^T) B^T to a projection for the rows of each adapter. */
#ifndef CV_LORA_H
#define CV_LORA_H

#include <pthread.h>
#include <stdint.h>
#include "../../base/common.h"
#include "../../kernels/backend.h"

/* The projections an adapter may target, in the engine's order: the fused
 * projections' outputs lie side by side in this order (q, k, v; gate, up). */
typedef enum cv_lora_module {
    CV_LORA_Q = 0, CV_LORA_K, CV_LORA_V, CV_LORA_O, CV_LORA_GATE, CV_LORA_UP, CV_LORA_DOWN, CV_LORA_N_MODULES
} cv_lora_module;

#define CV_LORA_MAX_SLOTS 1024
#define CV_LORA_MAX_RANK 1024
/* Projections that read the same rows go in one backend call: at most three (q, k, v). */
#define CV_LORA_MAX_FUSED 3

typedef struct cv_lora_slot {
    int loaded;
    int64_t rank;
    float scale;
    void *block; /* one device allocation holding all of them, in the order the forward reads them */
    void **a;    /* [n_layers * CV_LORA_N_MODULES] A [rank][in] (in block, pool dtype), NULL where untargeted */
    void **bt;   /* same: B^T in panels (kernels/backend.h: CV_LORA_BT_AT) */
} cv_lora_slot;

typedef struct cv_lora_pool {
    int64_t n_slots, max_rank, n_layers, max_tokens;
    cv_dtype dtype;      /* of the adapter weights: CV_F32 or CV_BF16 (rounded to nearest even) */
    cv_lora_slot *slots; /* [n_slots] */
    float *tmp;          /* [max_tokens][max_rank] shrink output (device) */
    cv_lora_segment *segs; /* [max_segs] a step's segments of the projections of one call (host) */
    int64_t max_segs;
    /* Held by the stepping thread over a step's device work and by a slot's load or
     * unload, so that a slot is written between steps whichever thread asks. */
    pthread_mutex_t lock;
    int lock_ready;
} cv_lora_pool;

struct cv_model;

/* n_slots slots of adapters up to max_rank, for steps of up to max_tokens rows
 * over max_seqs sequences. */
int cv_lora_pool_init(cv_lora_pool *p, const struct cv_model *m, int64_t n_slots, int64_t max_rank,
                      int64_t max_tokens, int64_t max_seqs, cv_dtype dtype, cv_err *err);
void cv_lora_pool_free(cv_lora_pool *p, cv_backend *b);

/* The pool's lock (nothing when LoRA is off). */
void cv_lora_pool_lock(cv_lora_pool *p);
void cv_lora_pool_unlock(cv_lora_pool *p);

/* Loads an adapter into slot (replacing what it held): n_pairs pairs, pair i for
 * layers[i] and modules[i] (a cv_lora_module), a[i]: A [rank][in], b[i]: B
 * [out][rank] (host f32, copied in the pool's dtype). Shapes follow from the model; every index
 * and the rank are checked, naming what was wrong. */
int cv_lora_pool_load(cv_lora_pool *p, const struct cv_model *m, int64_t slot, int64_t rank, float scale,
                      int64_t n_pairs, const int32_t *layers, const int32_t *modules, const float *const *a,
                      const float *const *b, cv_err *err);
void cv_lora_pool_unload(cv_lora_pool *p, cv_backend *b, int64_t slot);

/* The adapter weights' dtype for "auto": bf16 over a bf16, f16 or quantized base
 * (the delta then rounds no coarser than the base it adds to, and a step reads
 * half the bytes), float32 over a float32 base. */
cv_dtype cv_lora_auto_dtype(const struct cv_model *m);

/* (out, in) of a module of model m. */
void cv_lora_module_shape(const struct cv_model *m, int module, int64_t *out, int64_t *in);

#endif
