/* llama2.c's encoder over a tokenizer.bin vocabulary (pieces and scores):
 *   1. each character of the text (a valid UTF-8 sequence, else a single byte)
 *      becomes the first id whose piece is its bytes, else one byte token per
 *      byte (id = byte + 3);
 *   2. the adjacent pair whose joined pieces are a piece (its first id) of the
 *      best score is merged, the leftmost on ties, until no pair joins into a
 *      piece of score > -1e10.
 * The caller's leading ids (BOS, the dummy-prefix space) take part in the
 * merges as llama2.c's do. Time O(n log n) in the text's bytes, memory O(n). */
#ifndef CV_MODEL_LLAMA2C_BPE_H
#define CV_MODEL_LLAMA2C_BPE_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "vocab_table.h"

typedef struct cv_llama2c_bpe cv_llama2c_bpe;

/* Builds the tables from pieces [n] (copied) and scores [n]; n >= 259 (<unk>,
 * <s>, </s> and the 256 byte tokens), else CV_ERR_FORMAT. */
int cv_llama2c_bpe_create(cv_llama2c_bpe **out, const cv_token_text *pieces, const double *scores, int64_t n,
                          uint64_t seed, cv_err *err);
/* The ids of lead [n_lead] (each in the vocabulary) followed by the text
 * data[len], in *ids (malloc'd, the caller frees), *n_ids of them. */
int cv_llama2c_bpe_encode(const cv_llama2c_bpe *t, const int32_t *lead, size_t n_lead, const unsigned char *data,
                          size_t len, int32_t **ids, size_t *n_ids, cv_err *err);
void cv_llama2c_bpe_free(cv_llama2c_bpe *t);

#endif
