/* libFuzzer target for the stop-string matcher (csrc/core/stop.c).
 *
 * Holds cv_stop_find and cv_stop_holdback to brute-force references and traps
 * on any difference; ASan catches reads outside the text.
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc \
 *         csrc/fuzz/fuzz_stop.c csrc/core/stop.c -o fuzz_stop && ./fuzz_stop
 * Without libFuzzer, -DCV_FUZZ_STANDALONE adds a main() that runs random inputs:
 *   gcc -g -fsanitize=address,undefined -DCV_FUZZ_STANDALONE -Icsrc \
 *         csrc/fuzz/fuzz_stop.c csrc/core/stop.c -o fuzz_stop && ./fuzz_stop 200000
 *
 * Input layout: byte 0 = flags (low 2 bits: stop count - 1; bit 2: fold every
 * byte onto a 3-letter alphabet so that matches are common), then for each stop
 * a length byte (1 + b % 8) and that many bytes, then one byte choosing
 * new_from, then the text (the rest). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/stop.h"

#define MAX_STOPS 4

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int ref_find(const cv_stop_set *set, const char *text, size_t n, size_t new_from,
                    size_t *start) {
    for (size_t s = 0; s < n; s++)
        for (int i = 0; i < set->n; i++) {
            size_t len = set->len[i];
            if (len <= n - s && s + len > new_from && memcmp(text + s, set->s[i], len) == 0) {
                *start = s;
                return i;
            }
        }
    return -1;
}

static size_t ref_holdback(const cv_stop_set *set, const char *text, size_t n) {
    for (size_t k = n; k > 0; k--)
        for (int i = 0; i < set->n; i++)
            if (set->len[i] > k && memcmp(text + n - k, set->s[i], k) == 0) return k;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char stops[MAX_STOPS][8];
    const char *strs[MAX_STOPS];
    size_t lens[MAX_STOPS];
    cv_stop_set set;
    if (size < 1) return 0;
    int n = (data[0] & 3) + 1;
    int fold = (data[0] >> 2) & 1;
    size_t pos = 1;
    for (int i = 0; i < n; i++) {
        if (pos >= size) return 0;
        size_t len = 1 + data[pos++] % 8;
        if (len > size - pos) return 0;
        for (size_t j = 0; j < len; j++) {
            uint8_t b = data[pos + j];
            stops[i][j] = (char)(fold ? 'a' + b % 3 : b);
        }
        strs[i] = stops[i];
        lens[i] = len;
        pos += len;
    }
    if (pos >= size) return 0;
    uint8_t pick = data[pos++];
    size_t n_text = size - pos;
    /* an exact-size heap copy, so that ASan sees any read past the end */
    char *text = malloc(n_text ? n_text : 1);
    if (!text) return 0;
    for (size_t j = 0; j < n_text; j++) {
        uint8_t b = data[pos + j];
        text[j] = (char)(fold ? 'a' + b % 3 : b);
    }
    size_t new_from = pick % (n_text + 1);
    if (cv_stop_set_init(&set, strs, lens, n) != 0) {
        free(text);
        return 0;
    }
    size_t got_start = (size_t)-1, want_start = (size_t)-1;
    int got = cv_stop_find(&set, text, n_text, new_from, &got_start);
    int want = ref_find(&set, text, n_text, new_from, &want_start);
    if (got != want || (want >= 0 && got_start != want_start)) __builtin_trap();
    if (cv_stop_holdback(&set, text, n_text) != ref_holdback(&set, text, n_text)) __builtin_trap();
    cv_stop_set_free(&set);
    free(text);
    return 0;
}

#ifdef CV_FUZZ_STANDALONE
#include <stdio.h>

int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 100000;
    uint64_t x = 88172645463325252ull;
    uint8_t buf[64];
    for (long it = 0; it < iters; it++) {
        size_t size = 0;
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        size = (size_t)(x % sizeof buf);
        for (size_t j = 0; j < size; j++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            buf[j] = (uint8_t)x;
        }
        if (size > 0 && it % 4 != 0) buf[0] |= 4; /* mostly the folded alphabet */
        LLVMFuzzerTestOneInput(buf, size);
    }
    printf("fuzz_stop: %ld inputs, no difference\n", iters);
    return 0;
}
#endif
