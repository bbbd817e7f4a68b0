/* A GGUF vocabulary given as Python lists, read into C arrays: shared by the
 * SentencePiece encoder of conveyor._core (py_tokenizer.c) and the merge-list
 * hook of conveyor._testing (csrc/testing/py_score_merges.c). */
#ifndef CV_BINDING_VOCAB_LISTS_H
#define CV_BINDING_VOCAB_LISTS_H

#include "binding.h"

#include "../model/vocab_table.h"

/* The C views of tokens (list of str), scores (list of numbers) and types (list
 * of ints or None), valid while the lists live; free with cv_vocab_lists_free. */
typedef struct cv_vocab_lists {
    cv_token_text *text; /* [n] */
    double *score;       /* [n] */
    int32_t *type;       /* [n], NULL for all normal */
    Py_ssize_t n;
} cv_vocab_lists;

/* Fills v from the lists (0), or sets an exception naming the argument or item
 * at fault (-1): TypeError when an argument is not a list, ModelFormatError for
 * a length that differs from the tokens' or an item of the wrong type. A type
 * that is not an int32 is kept as -1 (neither split nor cut out). v holds
 * nothing to free after an error. */
int cv_vocab_lists_read(cv_vocab_lists *v, PyObject *tokens, PyObject *scores, PyObject *types);
void cv_vocab_lists_free(cv_vocab_lists *v);

#endif
