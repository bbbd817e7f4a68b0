/* libFuzzer target: safetensors header validation (cv_st_parse).
 *
 * Build (clang):
 *   clang -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -Icsrc -Ikernels \
 *     csrc/fuzz/fuzz_safetensors.c csrc/model/safetensors.c csrc/model/json.c \
 *     csrc/model/checkpoint.c csrc/model/mapped_file.c csrc/model/checkpoint_hf.c csrc/model/checkpoint_llama2c.c base/common.c -lm
 * Every accepted tensor's byte range is read end to end, so ASan catches any
 * range the validator lets through that is outside the input. */
#include <stddef.h>
#include <stdint.h>

#include "../model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cv_st_file f;
    cv_err err;
    if (cv_st_parse(&f, data, size, "fuzz.safetensors", &err) == 0) {
        volatile unsigned char sink = 0;
        for (size_t i = 0; i < f.n_tensors; i++) {
            const cv_st_tensor *t = &f.tensors[i];
            const unsigned char *p = t->data; /* [end - begin] */
            if (t->end > t->begin) sink ^= p[0] ^ p[t->end - t->begin - 1];
            if (cv_st_find(&f, t->name) == NULL && t->name_len == __builtin_strlen(t->name))
                __builtin_trap(); /* every plain name must be found again */
        }
        (void)sink;
    }
    cv_st_close(&f);
    return 0;
}
