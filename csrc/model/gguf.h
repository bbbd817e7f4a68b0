/* Reading GGUF files (llama.cpp's single-file format): a validated directory
 * of metadata and tensors over a memory-mapped file.
 *
 * Layout (little-endian, versions 2 and 3):
 *   "GGUF", u32 version, u64 tensor count, u64 metadata count,
 *   metadata: key (u64 length + UTF-8 bytes), u32 value type, value
 *     (strings: u64 length + bytes; arrays: u32 element type, u64 count, elements),
 *   tensor infos: name, u32 n_dims, u64 ne[n_dims] (ne[0] contiguous),
 *     u32 ggml type, u64 offset (from the data section, a multiple of the alignment),
 *   padding to general.alignment (default 32), then the data section.
 *
 * cv_gguf_parse checks everything that can be checked without a model: every
 * count, length and offset against the bytes left, value and tensor types,
 * dimensions, block sizes, alignment, and unique keys and tensor names. */
#ifndef CV_MODEL_GGUF_H
#define CV_MODEL_GGUF_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"

#define CV_GGUF_MAX_DIMS 4

typedef enum cv_gguf_type {
    CV_GGUF_U8 = 0, CV_GGUF_I8 = 1, CV_GGUF_U16 = 2, CV_GGUF_I16 = 3, CV_GGUF_U32 = 4,
    CV_GGUF_I32 = 5, CV_GGUF_F32 = 6, CV_GGUF_BOOL = 7, CV_GGUF_STRING = 8, CV_GGUF_ARRAY = 9,
    CV_GGUF_U64 = 10, CV_GGUF_I64 = 11, CV_GGUF_F64 = 12
} cv_gguf_type;

/* A string inside the mapping (not NUL-terminated). */
typedef struct cv_gguf_str {
    const char *p;
    size_t len;
} cv_gguf_str;

typedef struct cv_gguf_kv {
    cv_gguf_str key;
    cv_gguf_type type;      /* value type */
    cv_gguf_type elem_type; /* arrays: the element type */
    uint64_t count;         /* arrays: element count; 1 otherwise */
    size_t index;           /* position in the file (kvs[] is sorted by key) */
    const unsigned char *value; /* scalars: the value; strings: the u64 length;
                                   arrays: the first element */
} cv_gguf_kv;

typedef struct cv_gguf_tensor {
    cv_gguf_str name;
    int n_dims;
    int64_t ne[CV_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension */
    uint32_t ggml_type;
    cv_dtype dtype;         /* F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K */
    uint64_t offset;        /* from the start of the data section */
    size_t nbytes;
    const void *data;
} cv_gguf_tensor;

typedef struct cv_gguf_file {
    const char *label;      /* names the file in messages (not owned) */
    void *map;              /* owned mapping when opened with cv_gguf_open [map_len] */
    size_t map_len;
    uint32_t version;
    uint64_t alignment;
    size_t data_start;      /* offset of the data section in the file */
    cv_gguf_kv *kvs;        /* sorted by key [n_kvs] */
    size_t n_kvs;
    cv_gguf_tensor *tensors;/* sorted by name [n_tensors] */
    size_t n_tensors;
} cv_gguf_file;

/* Validates a GGUF image in memory (buf stays owned by the caller and must
 * outlive f); label names it in errors. */
int cv_gguf_parse(cv_gguf_file *f, const void *buf, size_t len, const char *label, cv_err *err);
/* Maps path read-only and parses it; f owns the mapping. label must outlive f. */
int cv_gguf_open(cv_gguf_file *f, const char *path, const char *label, cv_err *err);
/* Frees the directory and unmaps an owned mapping; safe on a zeroed f. */
void cv_gguf_close(cv_gguf_file *f);
/* Hands the mapping to the caller (who must cv_unmap_file it). */
void cv_gguf_release_map(cv_gguf_file *f, void **map, size_t *map_len);

const cv_gguf_kv *cv_gguf_find_kv(const cv_gguf_file *f, const char *key);
const cv_gguf_tensor *cv_gguf_find_tensor(const cv_gguf_file *f, const char *name);
/* 1 when the file starts with the GGUF magic. */
int cv_gguf_is_gguf(const void *buf, size_t len);

/* Value accessors: a scalar of an integer type (any width, value range
 * checked by the caller), a float type, a bool; 0 when the kv is of another
 * type. */
int cv_gguf_kv_int(const cv_gguf_kv *kv, int64_t *out);
int cv_gguf_kv_float(const cv_gguf_kv *kv, double *out);
int cv_gguf_kv_bool(const cv_gguf_kv *kv, int *out);
/* A string value; 0 when the kv is not a string. */
int cv_gguf_kv_string(const cv_gguf_kv *kv, cv_gguf_str *out);
/* The elements of a string array in order: start *cursor at kv->value and
 * call count times (the array was validated by the parser). */
cv_gguf_str cv_gguf_next_string(const unsigned char **cursor);
/* Element i of a numeric array as int64/double (0 when not that kind). */
int cv_gguf_array_int(const cv_gguf_kv *kv, uint64_t i, int64_t *out);
int cv_gguf_array_float(const cv_gguf_kv *kv, uint64_t i, double *out);
/* Bytes of one scalar of type t (0 for strings and arrays). */
size_t cv_gguf_scalar_size(cv_gguf_type t);
/* "Q4_K" etc. for a ggml tensor type number, NULL when unknown. */
const char *cv_gguf_ggml_type_name(uint32_t t);

#endif
