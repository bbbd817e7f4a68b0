/* Shared definitions for the whole C core: status codes, error messages, dtypes.
 *
 * Status codes flow up: 0 ok, negative error, positive soft "retry".
 * The message lives in a cv_err owned by the caller; the binding maps codes
 * to Python exceptions. */
#ifndef CV_COMMON_H
#define CV_COMMON_H

#include <stddef.h>
#include <stdint.h>

enum {
    CV_OK = 0,
    CV_ERR_INVALID = -1,     /* bad argument / user input      -> ValueError        */
    CV_ERR_IO = -2,          /* file missing or unreadable     -> OSError (FileNotFoundError when missing) */
    CV_ERR_FORMAT = -3,      /* malformed model file           -> conveyor.ModelFormatError */
    CV_ERR_NOMEM = -4,       /* allocation failed              -> MemoryError       */
    CV_ERR_UNSUPPORTED = -5, /* valid but not supported        -> conveyor.UnsupportedError */
    CV_ERR_STATE = -6,       /* wrong call order / closed      -> conveyor.EngineClosedError / RuntimeError */
    CV_ERR_NOTFOUND = -7,    /* file does not exist            -> FileNotFoundError */
    CV_ERR_TYPE = -8,        /* wrong type                     -> TypeError */
    CV_ERR_CANCELLED = -9,   /* the caller asked to stop       -> KeyboardInterrupt (the signal's own error) */
    CV_ERR_OVERLOADED = -10, /* the request queue is full      -> conveyor.EngineOverloadedError */
    CV_ERR_BUSY = -11,       /* the engine's background loop runs -> conveyor.EngineBusyError */
    CV_RETRY = 1             /* soft: does not fit now, try later */
};

#define CV_ERR_MSG_LEN 512
#define CV_ERR_FIELD_LEN 48
/* A structured error: the status code, the field at fault ("" when the error
 * is not about one field; request fields use SamplingParams' names, and
 * "prompt" for the prompt; engine config fields EngineArgs' names) and a
 * message that reads on its own. */
typedef struct cv_err {
    int code;
    char msg[CV_ERR_MSG_LEN];
    char field[CV_ERR_FIELD_LEN];
} cv_err;

/* Formats msg into err (if non-NULL) and returns code, so callers can write
 * `return cv_set_err(err, CV_ERR_FORMAT, "tensor %s: ...", name);` */
int cv_set_err(cv_err *err, int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* The same, naming the request field at fault. */
int cv_set_field_err(cv_err *err, int code, const char *field, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

typedef enum cv_dtype {
    CV_F32 = 0,
    CV_F16 = 1,
    CV_BF16 = 2,
    CV_F64 = 3, /* only ever seen in files, converted on load */
    CV_I32 = 4,
    CV_I64 = 5,
    /* block-quantized weights, 32 elements a block (base/quant_format.h);
     * cv_dtype_size is 0 for them: use cv_dtype_bytes */
    CV_Q8_0 = 6,
    CV_Q4_0 = 7,
    CV_Q4_1 = 8,
    /* GGUF's other block formats, as stored in files (Q5_*: 32 elements a
     * block; K-quants: super-blocks of 256) */
    CV_Q5_0 = 9,
    CV_Q5_1 = 10,
    CV_Q4_K = 11,
    CV_Q5_K = 12,
    CV_Q6_K = 13,
    CV_Q3_K = 14,
    /* the CPU kernels' exact repackings of those, 32 elements a block with
     * float32 scales (quant_format.h) */
    CV_Q4_F = 15,
    CV_Q8_F = 16,
    /* GGUF's Q2_K (super-blocks of 256; computed as stored: quant_format.h) */
    CV_Q2_K = 17,
    /* the CPU kernels' form of a stack mixing Q2_K with other formats (quant_format.h) */
    CV_Q8_M = 18,
    /* the KV cache's int8: symmetric, one float32 scale per (token, KV head)
     * in pools of their own (cv_kv_layer) */
    CV_I8 = 19,
    CV_DTYPE_INVALID = -1
} cv_dtype;

/* Bytes per element of a plain dtype; 0 for the block formats (cv_dtype_bytes).
 * Inline, so that base/quant_format.h needs no function of base/common.c. */
static inline size_t cv_dtype_size(cv_dtype t) {
    switch (t) {
    case CV_F32: return 4;
    case CV_F16: return 2;
    case CV_BF16: return 2;
    case CV_F64: return 8;
    case CV_I32: return 4;
    case CV_I64: return 8;
    case CV_I8: return 1;
    default: return 0;
    }
}
/* "float32", "float16", "bfloat16", ...: inline, so that the CUDA library (which
 * does not link base/common.c) names dtypes from the same table. */
static inline const char *cv_dtype_name(cv_dtype t) {
    switch (t) {
    case CV_F32: return "float32";
    case CV_F16: return "float16";
    case CV_BF16: return "bfloat16";
    case CV_F64: return "float64";
    case CV_I32: return "int32";
    case CV_I64: return "int64";
    case CV_Q8_0: return "q8_0";
    case CV_Q4_0: return "q4_0";
    case CV_Q4_1: return "q4_1";
    case CV_Q5_0: return "q5_0";
    case CV_Q5_1: return "q5_1";
    case CV_Q4_K: return "q4_k";
    case CV_Q5_K: return "q5_k";
    case CV_Q6_K: return "q6_k";
    case CV_Q3_K: return "q3_k";
    case CV_Q4_F: return "q4_f32";
    case CV_Q8_F: return "q8_f32";
    case CV_Q2_K: return "q2_k";
    case CV_Q8_M: return "q8_m32";
    case CV_I8: return "int8";
    default: return "invalid";
    }
}

/* Scalar conversions (round to nearest even). */
float cv_bf16_to_f32(uint16_t h);
uint16_t cv_f32_to_bf16(float f);
float cv_f16_to_f32(uint16_t h);
uint16_t cv_f32_to_f16(float f);

/* Monotonic clock in seconds, the same clock as Python's time.monotonic(). */
double cv_now(void);

/* Names the calling thread (Linux; a no-op elsewhere), so that per-thread CPU
 * time tells the engine's threads from the frontend's (bench serve). At most
 * 15 characters. */
void cv_set_thread_name(const char *name);

/* Grows *p (an array of elem-byte items with *cap slots) to hold need items,
 * doubling; returns 0 when out of memory (*p is then unchanged). */
int cv_grow(void **p, size_t *cap, size_t need, size_t elem);

/* Checked size arithmetic: returns 0 on overflow. */
int cv_mul_size(size_t a, size_t b, size_t *out);

/* For whole-array loops in plain C that the compiler vectorizes (e.g. the
 * sampler's passes over the vocabulary): an AVX-512, an AVX2 and a baseline
 * copy of the function, chosen once by the loader (ifunc). No FMA
 * contraction in C11 mode, and explicit lanes in the source, so every copy
 * gives the same bits (checked: seeded sampling with logprobs, avx2 against
 * avx512f copies, identical). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__) && !defined(CV_EMULATE_AVX512) && \
    !defined(CV_NO_VECTOR_CLONES) && \
    defined(__linux__)
#define CV_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CV_VECTOR_CLONES
#endif

#endif
