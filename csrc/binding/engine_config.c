/* Reads an EngineArgs (any object with its attribute names) into a
 * cv_engine_config, as request_params.c reads a SamplingParams. Only type
 * conversion happens here: every range is cv_engine_config_check's. */
#include "engine_config.h"

#include <stdarg.h>
#include <string.h>

/* Raises exc_type (TypeError or ValueError) with .field set. */
static int field_error(PyObject *exc_type, const char *field, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static int field_error(PyObject *exc_type, const char *field, const char *fmt, ...) {
    cv_err err = {0};
    err.code = exc_type == PyExc_TypeError ? CV_ERR_TYPE : CV_ERR_INVALID;
    snprintf(err.field, sizeof err.field, "%s", field);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err.msg, sizeof err.msg, fmt, ap);
    va_end(ap);
    cv_py_raise(&err);
    return -1;
}

/* Where the fields come from: a dict (keyword overrides, or a speculative
 * config given as a dict) before an object's attributes. */
typedef struct source {
    PyObject *dict;     /* or NULL */
    PyObject *obj;      /* or NULL */
    Py_ssize_t n_used;  /* dict keys read so far */
} source;

/* *out: a new reference to field `name`, or NULL when neither the dict nor
 * the object has it (its default applies). Returns 0, or -1 with an exception. */
static int source_get(source *s, const char *name, PyObject **out) {
    *out = NULL;
    if (s->dict) {
        PyObject *key = PyUnicode_FromString(name);
        if (!key) return -1;
        PyObject *v = PyDict_GetItemWithError(s->dict, key);
        Py_DECREF(key);
        if (v) {
            s->n_used++;
            *out = Py_NewRef(v);
            return 0;
        }
        if (PyErr_Occurred()) return -1;
    }
    if (!s->obj) return 0;
    PyObject *v = PyObject_GetAttrString(s->obj, name);
    if (!v) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 0;
}

/* The dict's first key that no read asked for, as UTF-8 (or "?"). */
static const char *unread_key(const source *s, const char *const *names, size_t n_names) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(s->dict, &pos, &key, &value)) {
        const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        if (!k) { PyErr_Clear(); return "?"; }
        size_t i = 0;
        while (i < n_names && strcmp(names[i], k) != 0) i++;
        if (i == n_names) return k;
    }
    return "?";
}

/* An int field. None gives CV_CONFIG_AUTO where the field is optional; an int
 * that does not fit in int64 (or is AUTO itself) is refused. */
static int read_int(source *s, const char *name, int optional, int64_t *out) {
    PyObject *v;
    if (source_get(s, name, &v) < 0) return -1;
    if (!v) return 0;
    if (v == Py_None && optional) {
        Py_DECREF(v);
        *out = CV_CONFIG_AUTO;
        return 0;
    }
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        field_error(PyExc_TypeError, name, "%s must be an int%s, got %s", name, optional ? " or None" : "",
                    Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x == CV_CONFIG_AUTO)
        return field_error(PyExc_ValueError, name, "%s is out of range: it does not fit in 64 bits", name);
    *out = x;
    return 0;
}

/* The seed: an int in [0, 2**64). */
static int read_seed(source *s, uint64_t *out) {
    PyObject *v;
    if (source_get(s, "seed", &v) < 0) return -1;
    if (!v) return 0;
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        field_error(PyExc_TypeError, "seed", "seed must be an int, got %s", Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return field_error(PyExc_ValueError, "seed", "seed must be in [0, 2**64)");
    }
    *out = u;
    return 0;
}

static int read_double(source *s, const char *name, double *out) {
    PyObject *v;
    if (source_get(s, name, &v) < 0) return -1;
    if (!v) return 0;
    if (PyBool_Check(v) || !(PyFloat_Check(v) || PyLong_Check(v))) {
        field_error(PyExc_TypeError, name, "%s must be a number, got %s", name, Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return field_error(PyExc_ValueError, name, "%s is out of range for a float", name);
    }
    *out = d;
    return 0;
}

static int read_bool(source *s, const char *name, int *out) {
    PyObject *v;
    if (source_get(s, name, &v) < 0) return -1;
    if (!v) return 0;
    int ok = PyBool_Check(v);
    if (ok) *out = v == Py_True;
    else field_error(PyExc_TypeError, name, "%s must be a bool, got %s", name, Py_TYPE(v)->tp_name);
    Py_DECREF(v);
    return ok ? 0 : -1;
}

/* One of a few strings (`names`, their C values in `values`); None gives
 * none_value where none_ok. */
static int read_choice(source *s, const char *name, const char *const *names, const int *values, int n,
                       int none_ok, int none_value, int *out) {
    PyObject *v;
    if (source_get(s, name, &v) < 0) return -1;
    if (!v) return 0;
    char allowed[160] = "";
    size_t len = 0;
    for (int i = 0; i < n && len < sizeof allowed; i++)
        len += (size_t)snprintf(allowed + len, sizeof allowed - len, "%s'%s'", i ? ", " : "", names[i]);
    if (v == Py_None && none_ok) {
        Py_DECREF(v);
        *out = none_value;
        return 0;
    }
    if (!PyUnicode_Check(v)) {
        field_error(PyExc_TypeError, name, "%s must be a str%s, got %s", name, none_ok ? " or None" : "",
                    Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    const char *str = PyUnicode_AsUTF8(v);
    if (!str) { Py_DECREF(v); return -1; }
    for (int i = 0; i < n; i++)
        if (strcmp(str, names[i]) == 0) {
            Py_DECREF(v);
            *out = values[i];
            return 0;
        }
    field_error(PyExc_ValueError, name, "%s must be one of (%s%s), got '%.64s'", name, allowed,
                none_ok ? ", None" : "", str);
    Py_DECREF(v);
    return -1;
}

/* A path (str, bytes or os.PathLike) as bytes in *out (a new reference). */
static int path_bytes(PyObject *v, const char *name, const char *what, PyObject **out) {
    if (PyUnicode_FSConverter(v, out)) return 0;
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
    PyErr_Clear();
    return field_error(PyExc_TypeError, name, "%s must be a path (str or os.PathLike), got %s", what,
                       Py_TYPE(v)->tp_name);
}

static const char *const DTYPE_NAMES[] = {"auto", "float32", "bfloat16", "float16"};
static const int DTYPE_VALUES[] = {CV_DTYPE_INVALID, CV_F32, CV_BF16, CV_F16};
static const char *const KV_DTYPE_NAMES[] = {"auto", "float32", "bfloat16", "float16", "int8"};
static const int KV_DTYPE_VALUES[] = {CV_DTYPE_INVALID, CV_F32, CV_BF16, CV_F16, CV_I8};
static const char *const QUANT_NAMES[] = {"q8_0", "q4_0", "q4_1"};
static const int QUANT_VALUES[] = {CV_Q8_0, CV_Q4_0, CV_Q4_1};
static const char *const DEVICE_NAMES[] = {"cpu", "cuda"};
static const int DEVICE_VALUES[] = {0, 1};
static const char *const POLICY_NAMES[] = {"continuous", "static", "priority", "fcfs"};
static const int POLICY_VALUES[] = {CV_SCHED_CONTINUOUS, CV_SCHED_STATIC, CV_SCHED_PRIORITY, CV_SCHED_FCFS};
static const char *const ACTIVATION_NAMES[] = {"auto", "float32"};
static const char *const LORA_DTYPE_NAMES[] = {"auto", "float32", "bfloat16"};
static const int LORA_DTYPE_VALUES[] = {CV_DTYPE_INVALID, CV_F32, CV_BF16};
static const int ACTIVATION_VALUES[] = {0, 1};
static const char *const SPEC_METHOD_NAMES[] = {"ngram", "draft_model"};
static const int SPEC_METHOD_VALUES[] = {CV_SPEC_NGRAM, CV_SPEC_DRAFT};

#define N_OF(a) ((int)(sizeof(a) / sizeof(a[0])))

/* The engine fields an override may name (the model and tokenizer facts aside). */
static const char *const CONFIG_FIELDS[] = {
    "model", "dtype", "device", "num_threads", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "block_size", "kv_cache_memory", "kv_cache_sequences", "gpu_memory_utilization", "kv_cache_dtype", "enable_prefix_caching",
    "enable_chunked_prefill", "scheduling", "seed", "quantization", "activation_dtype",
    "max_prefill_tokens_while_decoding", "max_queued_requests", "admission_reserve", "adaptive_batch_limit",
    "speculative_config",
    "enable_lora", "max_loras", "max_lora_rank", "lora_dtype"};
static const char *const SPEC_FIELDS[] = {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
                                          "prompt_lookup_max", "disable_by_batch_size"};

static int read_choice_dtype(source *s, const char *name, const char *const *names, const int *values, int n,
                             int none_ok, cv_dtype *out) {
    int v = (int)*out;
    if (read_choice(s, name, names, values, n, none_ok, CV_DTYPE_INVALID, &v) < 0) return -1;
    *out = (cv_dtype)v;
    return 0;
}

static int read_speculative(cv_py_engine_config *c, source *outer) {
    PyObject *v;
    if (source_get(outer, "speculative_config", &v) < 0) return -1;
    if (!v || v == Py_None) { Py_XDECREF(v); return 0; }
    if (PyUnicode_Check(v) || PyBytes_Check(v)) {
        field_error(PyExc_TypeError, "speculative_config", "speculative_config must be a dict or None, got %s",
                    Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    source s = {PyDict_Check(v) ? v : NULL, PyDict_Check(v) ? NULL : v, 0};
    cv_spec_config *sp = &c->cfg.spec;
    int method = CV_SPEC_NGRAM, rc = -1;
    PyObject *model = NULL;
    if (source_get(&s, "model", &model) < 0) goto done;
    if (model && model != Py_None) method = CV_SPEC_DRAFT; /* a draft model implies its method */
    if (read_choice(&s, "method", SPEC_METHOD_NAMES, SPEC_METHOD_VALUES, N_OF(SPEC_METHOD_NAMES), 0, 0,
                    &method) < 0)
        goto done;
    sp->method = (cv_spec_method)method;
    if (read_int(&s, "num_speculative_tokens", 0, &sp->num_tokens) < 0 ||
        read_int(&s, "prompt_lookup_min", 0, &sp->lookup_min) < 0 ||
        read_int(&s, "prompt_lookup_max", 0, &sp->lookup_max) < 0 ||
        read_int(&s, "disable_by_batch_size", 0, &sp->disable_by_batch_size) < 0)
        goto done;
    if (model && model != Py_None) {
        if (path_bytes(model, "model", "speculative_config: model", &c->draft_path) < 0) goto done;
        sp->draft_model = PyBytes_AS_STRING(c->draft_path);
    }
    if (s.dict && s.n_used < PyDict_Size(s.dict)) {
        const char *k = unread_key(&s, SPEC_FIELDS, (size_t)N_OF(SPEC_FIELDS));
        field_error(PyExc_ValueError, k, "speculative_config: unknown key '%.64s'", k);
        goto done;
    }
    rc = 0;
done:
    Py_XDECREF(model);
    Py_DECREF(v);
    return rc;
}

int cv_py_engine_config_read(cv_py_engine_config *c, PyObject *config, PyObject *overrides) {
    memset(c, 0, sizeof *c);
    cv_engine_config *cfg = &c->cfg;
    cv_engine_config_defaults(cfg);
    int is_path = PyUnicode_Check(config) || PyBytes_Check(config) || PyObject_HasAttrString(config, "__fspath__");
    source s = {overrides, is_path ? NULL : config, 0};
    if (is_path) {
        if (path_bytes(config, "model", "model", &c->model_path) < 0) return -1;
    } else {
        PyObject *model;
        if (source_get(&s, "model", &model) < 0) return -1;
        if (!model) return field_error(PyExc_TypeError, "model", "the engine config has no model");
        int rc = path_bytes(model, "model", "model", &c->model_path);
        Py_DECREF(model);
        if (rc < 0) return -1;
    }
    cfg->model_path = PyBytes_AS_STRING(c->model_path);
    int device = cfg->use_cuda, policy = (int)cfg->policy;
    if (read_choice_dtype(&s, "dtype", DTYPE_NAMES, DTYPE_VALUES, N_OF(DTYPE_NAMES), 0, &cfg->dtype) < 0 ||
        read_choice_dtype(&s, "kv_cache_dtype", KV_DTYPE_NAMES, KV_DTYPE_VALUES, N_OF(KV_DTYPE_NAMES), 0,
                          &cfg->kv_dtype) < 0 ||
        read_choice_dtype(&s, "quantization", QUANT_NAMES, QUANT_VALUES, N_OF(QUANT_NAMES), 1,
                          &cfg->quantization) < 0 ||
        read_choice(&s, "device", DEVICE_NAMES, DEVICE_VALUES, N_OF(DEVICE_NAMES), 0, 0, &device) < 0 ||
        read_choice(&s, "scheduling", POLICY_NAMES, POLICY_VALUES, N_OF(POLICY_NAMES), 0, 0, &policy) < 0 ||
        read_choice(&s, "activation_dtype", ACTIVATION_NAMES, ACTIVATION_VALUES, N_OF(ACTIVATION_NAMES), 0, 0,
                    &cfg->exact_activations) < 0 ||
        read_int(&s, "num_threads", 1, &cfg->num_threads) < 0 ||
        read_int(&s, "max_model_len", 1, &cfg->max_model_len) < 0 ||
        read_int(&s, "max_num_seqs", 0, &cfg->max_num_seqs) < 0 ||
        read_int(&s, "max_num_batched_tokens", 1, &cfg->max_num_batched_tokens) < 0 ||
        read_int(&s, "block_size", 0, &cfg->block_size) < 0 ||
        read_int(&s, "kv_cache_memory", 1, &cfg->kv_cache_bytes) < 0 ||
        read_int(&s, "kv_cache_sequences", 1, &cfg->kv_cache_sequences) < 0 ||
        read_double(&s, "gpu_memory_utilization", &cfg->gpu_memory_utilization) < 0 ||
        read_bool(&s, "enable_prefix_caching", &cfg->enable_prefix_caching) < 0 ||
        read_bool(&s, "enable_chunked_prefill", &cfg->enable_chunked_prefill) < 0 ||
        read_seed(&s, &cfg->seed) < 0 ||
        read_int(&s, "max_prefill_tokens_while_decoding", 1, &cfg->max_prefill_tokens_while_decoding) < 0 ||
        read_int(&s, "max_queued_requests", 1, &cfg->max_queued_requests) < 0 ||
        read_int(&s, "admission_reserve", 1, &cfg->admission_reserve) < 0 ||
        read_bool(&s, "adaptive_batch_limit", &cfg->adaptive_batch_limit) < 0 ||
        read_bool(&s, "enable_lora", &cfg->enable_lora) < 0 ||
        read_int(&s, "max_loras", 0, &cfg->max_loras) < 0 ||
        read_int(&s, "max_lora_rank", 0, &cfg->max_lora_rank) < 0 ||
        read_choice_dtype(&s, "lora_dtype", LORA_DTYPE_NAMES, LORA_DTYPE_VALUES, N_OF(LORA_DTYPE_NAMES), 0,
                          &cfg->lora_dtype) < 0 ||
        read_speculative(c, &s) < 0)
        return -1;
    cfg->use_cuda = device;
    cfg->policy = (cv_sched_policy)policy;
    if (overrides && s.n_used < PyDict_Size(overrides)) {
        const char *k = unread_key(&s, CONFIG_FIELDS, (size_t)N_OF(CONFIG_FIELDS));
        return field_error(PyExc_TypeError, k, "Engine() got an unexpected keyword argument '%.64s'", k);
    }
    return 0;
}

void cv_py_engine_config_free(cv_py_engine_config *c) {
    Py_CLEAR(c->model_path);
    Py_CLEAR(c->draft_path);
}
