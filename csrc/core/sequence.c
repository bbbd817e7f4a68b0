#include "sequence.h"

#include <stdlib.h>
#include <string.h>

cv_sequence *cv_sequence_create(int64_t seq_id, const int32_t *prompt, int64_t n_prompt,
                                int64_t max_tokens) {
    cv_sequence *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    int64_t cap = n_prompt + (max_tokens < 64 ? max_tokens : 64) + 1;
    s->tokens = malloc((size_t)cap * sizeof *s->tokens);
    if (!s->tokens) { free(s); return NULL; }
    if (n_prompt > 0) memcpy(s->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
    s->seq_id = seq_id;
    s->n_tokens = n_prompt;
    s->cap_tokens = cap;
    s->n_prompt = n_prompt;
    s->max_total = n_prompt + max_tokens;
    s->status = CV_SEQ_NEW;
    s->sched_index = -1;
    s->heap_index = -1;
    s->lora_slot = -1;
    return s;
}

void cv_sequence_free(cv_sequence *s) {
    if (!s) return;
    free(s->tokens);
    free(s->blocks.table);
    free(s->blocks.gen);
    free(s);
}

int cv_sequence_append(cv_sequence *s, int32_t token) {
    if (s->n_tokens == s->cap_tokens) {
        int64_t cap = s->cap_tokens * 2;
        int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
        if (!t) return CV_ERR_NOMEM;
        s->tokens = t;
        s->cap_tokens = cap;
    }
    s->tokens[s->n_tokens++] = token;
    return CV_OK;
}
