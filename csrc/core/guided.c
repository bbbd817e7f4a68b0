/* Guided decoding's part of the engine: see guided.h. */
#include "guided.h"

#include <stdlib.h>
#include <string.h>

int cv_guided_init(cv_guided *g, int64_t vocab, int64_t max_rows, cv_err *err) {
    memset(g, 0, sizeof *g);
    if (cv_mask_box_init(&g->box, vocab)) return cv_set_err(err, CV_ERR_NOMEM, "out of memory for token masks");
    g->ready = 1;
    g->scratch = malloc((size_t)g->box.words * sizeof *g->scratch);
    g->failed = calloc((size_t)max_rows, 1);
    if (!g->scratch || !g->failed) return cv_set_err(err, CV_ERR_NOMEM, "out of memory for token masks");
    return CV_OK;
}

void cv_guided_free(cv_guided *g) {
    if (g->ready) cv_mask_box_free(&g->box);
    g->ready = 0;
    free(g->scratch);
    free(g->failed);
    g->scratch = NULL;
    g->failed = NULL;
}
