#include "speculative.h"

#include <string.h>

int cv_spec_config_check(const cv_spec_config *c, cv_err *err) {
    if (!c) return cv_set_err(err, CV_ERR_INVALID, "speculative_config: NULL");
    if (c->method == CV_SPEC_NONE) return CV_OK;
    if (c->method != CV_SPEC_NGRAM && c->method != CV_SPEC_DRAFT)
        return cv_set_field_err(err, CV_ERR_INVALID, "method", "speculative_config: unknown method %d",
                                (int)c->method);
    if (c->num_tokens < 1 || c->num_tokens > CV_SPEC_MAX_TOKENS)
        return cv_set_field_err(err, CV_ERR_INVALID, "num_speculative_tokens",
                                "speculative_config: num_speculative_tokens must be in [1, %d], got %lld",
                                CV_SPEC_MAX_TOKENS, (long long)c->num_tokens);
    if (c->disable_by_batch_size < 0)
        return cv_set_field_err(err, CV_ERR_INVALID, "disable_by_batch_size",
                                "speculative_config: disable_by_batch_size must be >= 0 (0: never), got %lld",
                                (long long)c->disable_by_batch_size);
    if (c->method == CV_SPEC_DRAFT) {
        if (!c->draft_model || !c->draft_model[0])
            return cv_set_field_err(err, CV_ERR_INVALID, "model", "speculative_config: model must name a checkpoint");
        return CV_OK;
    }
    if (c->lookup_min < 1 || c->lookup_min > CV_SPEC_MAX_NGRAM)
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt_lookup_min",
                                "speculative_config: prompt_lookup_min must be in [1, %d], got %lld",
                                CV_SPEC_MAX_NGRAM, (long long)c->lookup_min);
    if (c->lookup_max < 1 || c->lookup_max > CV_SPEC_MAX_NGRAM)
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt_lookup_max",
                                "speculative_config: prompt_lookup_max must be in [1, %d], got %lld",
                                CV_SPEC_MAX_NGRAM, (long long)c->lookup_max);
    if (c->lookup_min > c->lookup_max)
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt_lookup_min",
                                "speculative_config: prompt_lookup_min (%lld) must be <= prompt_lookup_max (%lld)",
                                (long long)c->lookup_min, (long long)c->lookup_max);
    return CV_OK;
}

/* The proposal is chosen as by the plain scan: for the longest len in
 * [lookup_min, lookup_max] with an earlier occurrence of the last len tokens,
 * the latest occurrence with k tokens after it, else the one with the most
 * (the earliest). With p = the number of tokens after an occurrence (1 <= p <=
 * n - len), an occurrence of length len at p exists iff the sequence's suffix
 * and the prefix tokens[0, n - p) share a common suffix of at least len tokens.
 * Those lengths, capped at lookup_max, come from one Z-function pass over the
 * reversed sequence, so a step costs O(n + lookup_max) whatever the tokens
 * (a scan per length was O(n x lookup_max) on repetitive text). The capped
 * Z-function only ever looks back at values below lookup_max, so it keeps
 * those alone. */
int64_t cv_spec_ngram_propose(int32_t *out, const int32_t *tokens, int64_t n, int64_t lookup_min,
                              int64_t lookup_max, int64_t k) {
    if (k <= 0 || n < 2 || lookup_min < 1) return 0;
    if (lookup_max > n - 1) lookup_max = n - 1;
    if (lookup_max > CV_SPEC_MAX_NGRAM) lookup_max = CV_SPEC_MAX_NGRAM;
    if (lookup_min > lookup_max) return 0;
    const int64_t M = lookup_max;
    /* r(x) = tokens[n - 1 - x]: the sequence read backwards */
#define REV(x) tokens[n - 1 - (x)]
    int64_t z_small[CV_SPEC_MAX_NGRAM + 1]; /* capped Z values at positions < M */
    int64_t near_len[CV_SPEC_MAX_TOKENS];   /* p < k: the match length at p */
    int64_t first_p[CV_SPEC_MAX_NGRAM + 1]; /* len -> the smallest p >= k matching it; 0: none */
    int64_t covered = 0;                    /* first_p[1..covered] are set */
    int64_t kk = k < CV_SPEC_MAX_TOKENS ? k : CV_SPEC_MAX_TOKENS;
    int64_t l = 0, r = 0;
    for (int64_t p = 1; p < n && covered < M; p++) {
        int64_t z = 0;
        if (p < r) {
            z = z_small[p - l];
            if (z > r - p) z = r - p;
        }
        while (z < M && p + z < n && REV(z) == REV(p + z)) z++;
        if (p + z > r) {
            l = p;
            r = p + z;
        }
        if (p < M) z_small[p] = z;
        int64_t len = z < n - p ? z : n - p; /* the occurrence must start at index >= 0 */
        if (p < kk) {
            near_len[p] = len;
        } else if (p >= k && len > covered) {
            for (int64_t j = covered + 1; j <= len; j++) first_p[j] = p;
            covered = len;
        }
    }
#undef REV
    for (int64_t len = lookup_max; len >= lookup_min; len--) {
        int64_t p = len <= covered ? first_p[len] : 0;
        for (int64_t q = (k < kk ? k : kk) - 1; p == 0 && q >= 1; q--)
            if (q < n && near_len[q] >= len) p = q;
        if (p == 0) continue;
        int64_t m = p < k ? p : k;
        memcpy(out, tokens + n - p, (size_t)m * sizeof *out);
        return m;
    }
    return 0;
}
