/* Reading .safetensors files: validated tensor directory over a mapped file.
 *
 * Layout: 8-byte little-endian header length N, N bytes of JSON
 * {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
 * then the data section; offsets are relative to its start.
 *
 * cv_st_parse checks everything that can be checked without a model config:
 * header length within the file, the header is a JSON object, every entry is
 * well formed, offsets lie inside the data section, shape product times the
 * element size equals end - begin (checked arithmetic; for dtypes whose size
 * is unknown this one check is skipped) and no two tensors overlap. */
#ifndef CV_MODEL_SAFETENSORS_H
#define CV_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "json.h"

#define CV_ST_MAX_DIMS 8
#define CV_ST_MAX_HEADER ((uint64_t)CV_JSON_MAX_BYTES) /* the cap of every model-file JSON */

typedef struct cv_st_tensor {
    const char *name;       /* NUL-terminated, lives in the header tree [name_len] */
    size_t name_len;
    const char *dtype_name; /* as written in the file: "F32", "BF16", "I8", ... */
    cv_dtype dtype;         /* CV_F32/F16/BF16/F64/I32/I64, else CV_DTYPE_INVALID */
    size_t elem_size;       /* bytes per element; 0 when the dtype is unknown */
    int ndim;
    int64_t shape[CV_ST_MAX_DIMS];
    uint64_t begin, end;    /* offsets into the data section */
    const void *data;       /* start of the tensor's bytes [end - begin] */
} cv_st_tensor;

typedef struct cv_st_file {
    const char *label;      /* names the file in messages (not owned) */
    void *map;              /* owned mapping when opened with cv_st_open [map_len] */
    size_t map_len;
    const unsigned char *data; /* data section [data_len] */
    size_t data_len;
    cv_json_doc header;
    cv_st_tensor *tensors;  /* sorted by name [n_tensors] */
    size_t n_tensors;
} cv_st_file;

/* Validates a safetensors image in memory (buf stays owned by the caller and
 * must outlive f). label names it in errors. */
int cv_st_parse(cv_st_file *f, const void *buf, size_t len, const char *label, cv_err *err);
/* Maps path read-only and parses it; f owns the mapping. label must outlive f. */
int cv_st_open(cv_st_file *f, const char *path, const char *label, cv_err *err);
/* The tensor named name, or NULL. */
const cv_st_tensor *cv_st_find(const cv_st_file *f, const char *name);
/* Hands the mapping to the caller (who must cv_unmap_file it); f keeps
 * pointing into it until closed. */
void cv_st_release_map(cv_st_file *f, void **map, size_t *map_len);
/* Frees the header and unmaps an owned mapping; safe on a zeroed f. */
void cv_st_close(cv_st_file *f);

/* The safetensors dtype string's element size and cv_dtype; returns 0 for an
 * unknown string. */
size_t cv_st_dtype_size(const char *name, cv_dtype *dtype);
/* Writes "[a, b, ...]" into buf[n] (truncated to fit). */
void cv_st_shape_str(char *buf, size_t n, const int64_t *shape, int ndim);

#endif
