/* A SamplingParams object read into the C request parameters (the buffers the
 * parameters point into stay owned here until cv_py_request_free). */
#ifndef CV_BINDING_REQUEST_PARAMS_H
#define CV_BINDING_REQUEST_PARAMS_H

#include "binding.h"
#include "../core/engine.h"

typedef struct cv_py_request {
    cv_request_params p;
    int32_t *stop_ids;
    const char **stop_ptrs;
    size_t *stop_lens;
    PyObject *stop_list, *stop_bytes;
    /* logit controls' arrays */
    int32_t *bias_ids; float *bias_values;
    int32_t *allowed_ids;
    int32_t *bad_start, *bad_tokens;
} cv_py_request;

/* Type conversion only (TypeError/ValueError with .field when a value has the
 * wrong type or does not fit the C type); returns 0 or -1 with an exception. */
int cv_py_request_read(cv_py_request *r, PyObject *sampling_params);
void cv_py_request_free(cv_py_request *r);

#endif
