/* SentencePiece-style encoding of a GGUF "llama" vocabulary (tokens, scores,
 * types), straight from its tables: no merge list is built, as llama.cpp
 * does it, and the ids are those of the equivalent BPE that HF `tokenizers`
 * runs with the merges of score_merges.h.
 *
 * encode(text):
 *   1. control, unknown and user-defined tokens are cut out of the raw text,
 *      leftmost-longest (a byte trie);
 *   2. each piece between them gets "▁" in front (when add_space_prefix) and
 *      "▁" for every space;
 *   3. each character becomes its token, else its <0xNN> byte tokens (when
 *      all exist), else the unknown token (runs of them fused into one);
 *   4. adjacent symbols (a, b) whose joined text is a token t (of type normal
 *      or user-defined, 2..max_token_chars characters) are merged, the best
 *      first: t's score, then the ids of t, a, b, then the leftmost.
 * A text held by several ids is known by its first id; the merge of a text
 * held by several ids ranks by its worst-scoring such id (the last in the
 * merge list). Time O(n log n) in the text's bytes, plus at most
 * CV_SPM_MAX_CUT_BYTES trie steps per byte for step 1; memory O(n). */
#ifndef CV_MODEL_SPM_TOKENIZER_H
#define CV_MODEL_SPM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "vocab_table.h"

/* The longest control, unknown or user-defined token accepted (bytes): real
 * vocabularies stay far below (Gemma 3: 31, SmolLM2: 16). */
#define CV_SPM_MAX_CUT_BYTES 256

typedef struct cv_spm_tokenizer cv_spm_tokenizer;

/* Builds the tables from tokens [n] (copied), scores [n], types [n] (NULL:
 * all normal); unk_id < 0: none. A NaN score, or a token to cut out longer
 * than CV_SPM_MAX_CUT_BYTES, is CV_ERR_FORMAT. */
int cv_spm_create(cv_spm_tokenizer **out, const cv_token_text *tokens, const double *scores, const int32_t *types,
                  int64_t n, int max_token_chars, int32_t unk_id, int add_space_prefix, uint64_t seed, cv_err *err);
/* The ids of text[len] (valid UTF-8) in *ids (malloc'd, the caller frees), *n_ids of them. */
int cv_spm_encode(const cv_spm_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n_ids, cv_err *err);
void cv_spm_free(cv_spm_tokenizer *t);

#endif
