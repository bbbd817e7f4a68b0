/* libFuzzer target: HF config.json parsing (cv_hf_config_parse, and through
 * it the JSON parser).
 *
 * Build (clang):
 *   clang -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -Icsrc -Ikernels \
 *     csrc/fuzz/fuzz_config.c csrc/model/safetensors.c csrc/model/json.c \
 *     csrc/model/checkpoint.c csrc/model/mapped_file.c csrc/model/checkpoint_hf.c csrc/model/checkpoint_llama2c.c base/common.c -lm */
#include <stddef.h>
#include <stdint.h>

#include "../model/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cv_model_config cfg;
    cv_err err;
    if (cv_hf_config_parse(&cfg, (const char *)data, size, "config.json", &err) == 0) {
        /* what an accepted config promises to the model code */
        if (cfg.dim <= 0 || cfg.hidden_dim <= 0 || cfg.n_layers <= 0 || cfg.n_heads <= 0 || cfg.n_kv_heads <= 0 ||
            cfg.head_dim <= 0 || cfg.vocab_size <= 0 || cfg.max_pos <= 0 || cfg.n_heads % cfg.n_kv_heads != 0 ||
            cfg.head_dim % 2 != 0 || !(cfg.rms_eps > 0) || !(cfg.rope_theta > 0) || cfg.n_eos < 0 ||
            cfg.n_eos > CV_MAX_EOS)
            __builtin_trap();
    }
    return 0;
}
