/* Guided decoding's part of the engine: the mailbox of token masks the
 * grammar's thread posts (token_mask.h) and the step's scratch for applying
 * them to the logits rows. */
#ifndef CV_GUIDED_H
#define CV_GUIDED_H

#include <stdint.h>
#include "../../base/common.h"
#include "token_mask.h"

typedef struct cv_guided {
    cv_mask_box box;
    int ready;              /* box made */
    uint32_t *scratch;      /* [box.words] the mask being applied */
    uint8_t *failed;        /* [max_rows] this step's guided logits rows left without a mask */
    int wait;               /* synchronous steps wait for masks too */
} cv_guided;

/* Masks of vocab bits, for steps of at most max_rows logits rows. CV_ERR_NOMEM. */
int cv_guided_init(cv_guided *g, int64_t vocab, int64_t max_rows, cv_err *err);
void cv_guided_free(cv_guided *g);

#endif
