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

int64_t cv_spec_ngram_propose(int32_t *out, const int32_t *tokens, int64_t n, int64_t lookup_min,
                              int64_t lookup_max, int64_t k) {
    if (k <= 0 || n < 2) return 0;
    if (lookup_max > n - 1) lookup_max = n - 1;
    for (int64_t len = lookup_max; len >= lookup_min; len--) {
        const int32_t *suffix = tokens + n - len;
        /* the latest earlier occurrence tokens[i..i+len) with k tokens after it,
         * else the one with the most (the earliest) */
        int64_t found = -1;
        for (int64_t i = n - len - 1; i >= 0; i--) {
            if (tokens[i] != suffix[0] || memcmp(tokens + i, suffix, (size_t)len * sizeof *tokens) != 0)
                continue;
            found = i;
            if (n - (i + len) >= k) break;
        }
        if (found < 0) continue;
        int64_t from = found + len, m = n - from < k ? n - from : k;
        memcpy(out, tokens + from, (size_t)m * sizeof *out);
        return m;
    }
    return 0;
}
