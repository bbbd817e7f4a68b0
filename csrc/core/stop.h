/* Stop strings matched on the detokenized bytes, across token boundaries. */
#ifndef CV_STOP_H
#define CV_STOP_H

#include <stddef.h>
#include <stdint.h>

typedef struct cv_stop_set {
    int n;             /* number of stop strings */
    char **s;          /* [n] byte strings (owned) */
    size_t *len;       /* [n] lengths (> 0) */
    size_t max_len;    /* longest */
} cv_stop_set;

/* Copies the n strings; returns 0 or CV_ERR_NOMEM / CV_ERR_INVALID (empty string). */
int cv_stop_set_init(cv_stop_set *set, const char *const *strs, const size_t *lens, int n);
void cv_stop_set_free(cv_stop_set *set);

/* Looks for the earliest stop string in text[0..n) that ends after byte
 * `new_from` (the bytes added since the last call begin there; earlier
 * text was already searched). Returns the stop string's index, or -1;
 * *match_start receives where the match begins. */
int cv_stop_find(const cv_stop_set *set, const char *text, size_t n, size_t new_from,
                 size_t *match_start);

/* How many trailing bytes of text[0..n) must be held back from a stream
 * because they could be the start of a stop string. */
size_t cv_stop_holdback(const cv_stop_set *set, const char *text, size_t n);

#endif
