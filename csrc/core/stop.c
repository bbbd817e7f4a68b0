/* Stop strings matched on detokenized bytes (see stop.h).
 *
 * Rules:
 *  - cv_stop_find reports the match that starts first among those ending
 *    after new_from; when several stop strings match at that same start, the
 *    one listed first wins. Only the window that can hold such a match
 *    (new_from - max_len + 1 .. n) is searched, so a streaming caller pays for
 *    the new bytes, not the whole text.
 *  - cv_stop_holdback returns the longest suffix of the text that is a proper
 *    prefix of some stop string (a full match is cv_stop_find's business).
 * Bytes are compared as bytes: a multibyte UTF-8 stop string matches only its
 * exact encoding, and NUL bytes are ordinary bytes. */
#include "stop.h"

#include <stdlib.h>
#include <string.h>

#include "../../base/common.h"

int cv_stop_set_init(cv_stop_set *set, const char *const *strs, const size_t *lens, int n) {
    if (!set) return CV_ERR_INVALID;
    memset(set, 0, sizeof *set);
    if (n < 0 || (n > 0 && (!strs || !lens))) return CV_ERR_INVALID;
    if (n == 0) return CV_OK;
    for (int i = 0; i < n; i++)
        if (lens[i] == 0 || !strs[i]) return CV_ERR_INVALID;
    int rc = CV_ERR_NOMEM;
    set->s = calloc((size_t)n, sizeof *set->s);
    set->len = calloc((size_t)n, sizeof *set->len);
    if (!set->s || !set->len) goto done;
    set->n = n;
    for (int i = 0; i < n; i++) {
        if (lens[i] == SIZE_MAX) goto done; /* no room for the terminator */
        set->s[i] = malloc(lens[i] + 1);
        if (!set->s[i]) goto done;
        memcpy(set->s[i], strs[i], lens[i]);
        set->s[i][lens[i]] = '\0'; /* for debuggers only; lengths rule */
        set->len[i] = lens[i];
        if (lens[i] > set->max_len) set->max_len = lens[i];
    }
    rc = CV_OK;
done:
    if (rc != CV_OK) cv_stop_set_free(set);
    return rc;
}

void cv_stop_set_free(cv_stop_set *set) {
    if (!set) return;
    if (set->s)
        for (int i = 0; i < set->n; i++) free(set->s[i]);
    free(set->s);
    free(set->len);
    memset(set, 0, sizeof *set);
}

/* First start in [from, last] where pat[0..len) occurs in text; -1 if none.
 * The caller guarantees last + len <= the text's length. */
static int64_t find_first(const char *text, size_t from, size_t last, const char *pat, size_t len) {
    size_t pos = from;
    while (pos <= last) {
        const char *hit = memchr(text + pos, pat[0], last - pos + 1);
        if (!hit) return -1;
        pos = (size_t)(hit - text);
        if (memcmp(hit + 1, pat + 1, len - 1) == 0) return (int64_t)pos;
        pos++;
    }
    return -1;
}

int cv_stop_find(const cv_stop_set *set, const char *text, size_t n, size_t new_from,
                 size_t *match_start) {
    if (!set || set->n <= 0 || !set->s || !set->len || !text) return -1;
    if (new_from >= n) return -1; /* no new bytes, so no match can end after new_from */
    int best = -1;
    size_t best_start = 0;
    for (int i = 0; i < set->n; i++) {
        size_t len = set->len[i];
        if (len == 0 || len > n) continue;
        /* a match must end after new_from: start + len > new_from */
        size_t from = new_from + 1 >= len ? new_from + 1 - len : 0;
        size_t last = n - len;
        if (best >= 0) {
            /* only a strictly earlier start can win; ties keep the earlier listed */
            if (best_start == 0) break;
            if (last > best_start - 1) last = best_start - 1;
        }
        if (from > last) continue;
        int64_t at = find_first(text, from, last, set->s[i], len);
        if (at >= 0) {
            best = i;
            best_start = (size_t)at;
        }
    }
    if (best >= 0 && match_start) *match_start = best_start;
    return best;
}

size_t cv_stop_holdback(const cv_stop_set *set, const char *text, size_t n) {
    if (!set || set->n <= 0 || !set->s || !set->len || !text || n == 0) return 0;
    size_t best = 0;
    for (int i = 0; i < set->n; i++) {
        size_t len = set->len[i];
        if (len < 2) continue; /* a one-byte string has no non-empty proper prefix */
        size_t k = len - 1 < n ? len - 1 : n; /* longest suffix worth trying */
        if (k <= best) continue;
        /* the earliest suffix start that equals a prefix gives the longest */
        const char *s = set->s[i];
        for (size_t pos = n - k; pos < n - best; pos++) {
            const char *hit = memchr(text + pos, s[0], n - best - pos);
            if (!hit) break;
            pos = (size_t)(hit - text);
            if (memcmp(hit, s, n - pos) == 0) {
                best = n - pos;
                break;
            }
        }
    }
    return best;
}
