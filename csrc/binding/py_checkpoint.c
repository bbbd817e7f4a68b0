/* conveyor._core.Checkpoint: a checkpoint opened for inspection.
 *
 *   ck = Checkpoint(path)        # HF directory, llama2.c .bin or .gguf
 *   ck.format, ck.config, ck.path, ck.closed
 *   ck.metadata -> dict of every GGUF key (arrays as lists; {} for other formats)
 *   ck.tensors() -> {name: (dtype, shape)}, ck.tensor(name) -> float32 ndarray
 *   ck.close(); also a context manager. */
#include "arrays.h"

#include <stdio.h>
#include <string.h>

#include "../../base/quant_format.h"
#include "../model/checkpoint.h"
#include "../model/gguf.h"

typedef struct {
    PyObject_HEAD
    cv_checkpoint ck;
    int is_open;
    int busy;        /* tensor() calls running without the GIL */
    PyObject *path;  /* exact str, as given (after os.fspath) */
} CheckpointObject;

static int check_open(CheckpointObject *self) {
    if (self->is_open) return 0;
    cv_err e;
    cv_set_err(&e, CV_ERR_STATE, "checkpoint is closed");
    cv_py_raise(&e);
    return -1;
}

static void close_now(CheckpointObject *self) {
    if (self->is_open) cv_checkpoint_close(&self->ck);
    self->is_open = 0;
}

static int Checkpoint_init(CheckpointObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", NULL};
    PyObject *arg = NULL, *str = NULL, *bytes = NULL;
    int ret = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Checkpoint", kwlist, &arg)) return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "checkpoint is in use by another thread");
        return -1;
    }
    bytes = cv_py_fs_path(arg, "checkpoint", &str);
    if (!bytes) goto done;
    const char *cpath = PyBytes_AS_STRING(bytes);
    cv_checkpoint tmp;
    cv_err err;
    memset(&err, 0, sizeof err);
    int rc;
    /* open into a local so that no other thread sees a half-built checkpoint */
    Py_BEGIN_ALLOW_THREADS
    rc = cv_checkpoint_open(&tmp, cpath, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        cv_py_raise(&err);
        goto done;
    }
    close_now(self);
    self->ck = tmp;
    self->is_open = 1;
    Py_XSETREF(self->path, str);
    str = NULL;
    ret = 0;
done:
    Py_XDECREF(str);
    Py_XDECREF(bytes);
    return ret;
}

static void Checkpoint_dealloc(CheckpointObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    close_now(self);
    Py_XDECREF(self->path);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyObject *Checkpoint_close(CheckpointObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "checkpoint is in use by another thread");
        return NULL;
    }
    close_now(self);
    Py_RETURN_NONE;
}

static PyObject *Checkpoint_enter(CheckpointObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Checkpoint_exit(CheckpointObject *self, PyObject *args) {
    (void)args;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "checkpoint is in use by another thread");
        return NULL;
    }
    close_now(self);
    Py_RETURN_FALSE;
}

static PyObject *shape_tuple(const cv_tensor_view *v) {
    return v->ndim == 1 ? Py_BuildValue("(L)", (long long)v->shape[0])
                        : Py_BuildValue("(LL)", (long long)v->shape[0], (long long)v->shape[1]);
}

static PyObject *Checkpoint_get_config(CheckpointObject *self, void *closure) {
    (void)closure;
    if (check_open(self) < 0) return NULL;
    const cv_model_config *c = &self->ck.cfg;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    if (cv_py_put_model_config(d, c) < 0) goto fail;
    if (c->rope_llama3) {
        PyObject *rs = Py_BuildValue("{s:d,s:d,s:d,s:L}", "factor", (double)c->rope_factor, "low_freq_factor",
                                     (double)c->rope_low_freq_factor, "high_freq_factor",
                                     (double)c->rope_high_freq_factor, "original_max_position_embeddings",
                                     (long long)c->rope_original_max_pos);
        if (cv_py_put(d, "rope_scaling", rs) < 0) goto fail;
    } else {
        if (cv_py_put(d, "rope_scaling", Py_NewRef(Py_None)) < 0) goto fail;
    }
    if (cv_py_put(d, "tie_embeddings", PyBool_FromLong(c->tie_embeddings)) < 0 ||
        cv_py_put(d, "qkv_bias", PyBool_FromLong(c->qkv_bias)) < 0 ||
        cv_py_put(d, "qk_norm", PyBool_FromLong(c->qk_norm)) < 0 ||
        cv_py_put(d, "sliding_window", PyLong_FromLongLong(c->sliding_window)) < 0 ||
        cv_py_put(d, "sliding_window_period", PyLong_FromLongLong(c->swa_period)) < 0 ||
        cv_py_put(d, "bos_id", PyLong_FromLong(c->bos_id)) < 0 ||
        cv_py_put(d, "eos_ids", cv_py_int32_list(c->eos_ids, c->n_eos)) < 0 ||
        cv_py_put(d, "dtype", PyUnicode_FromString(cv_dtype_name(c->torch_dtype))) < 0)
        goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static const char *format_name(cv_ckpt_format f) {
    return f == CV_FMT_LLAMA2C ? "llama2c" : f == CV_FMT_GGUF ? "gguf" : "hf";
}

static PyObject *Checkpoint_get_metadata(CheckpointObject *self, void *closure) {
    (void)closure;
    if (check_open(self) < 0) return NULL;
    return self->ck.gguf ? cv_py_gguf_metadata(self->ck.gguf) : PyDict_New();
}

static PyObject *Checkpoint_get_format(CheckpointObject *self, void *closure) {
    (void)closure;
    if (!self->path) return PyErr_Format(PyExc_ValueError, "checkpoint was never opened");
    return PyUnicode_FromString(format_name(self->ck.format));
}

static PyObject *Checkpoint_get_path(CheckpointObject *self, void *closure) {
    (void)closure;
    if (!self->path) Py_RETURN_NONE;
    Py_INCREF(self->path);
    return self->path;
}

static PyObject *Checkpoint_get_closed(CheckpointObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(!self->is_open);
}

/* Adds name -> (dtype, shape) to d when the tensor exists. */
static int add_entry(CheckpointObject *self, PyObject *d, const char *name) {
    const cv_tensor_view *v = cv_checkpoint_find(&self->ck, name);
    if (!v) return 0;
    PyObject *shape = shape_tuple(v);
    if (!shape) return -1;
    PyObject *t = Py_BuildValue("(sN)", cv_dtype_name(v->dtype), shape);
    return cv_py_put(d, name, t);
}

static PyObject *Checkpoint_tensors(CheckpointObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    char name[64];
    if (add_entry(self, d, "embed") < 0 || add_entry(self, d, "final_norm") < 0 || add_entry(self, d, "lm_head") < 0)
        goto fail;
    for (int64_t i = 0; i < self->ck.cfg.n_layers; i++) {
        for (int k = 0; k < CV_LAYER_TENSORS; k++) {
            const char *field = cv_layer_slot_at(&self->ck.cfg, &self->ck.layers[i], k).name;
            snprintf(name, sizeof name, "layers.%lld.%s", (long long)i, field);
            if (add_entry(self, d, name) < 0) goto fail;
        }
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *Checkpoint_tensor(CheckpointObject *self, PyObject *arg) {
    if (!PyUnicode_Check(arg))
        return PyErr_Format(PyExc_TypeError, "tensor name must be a str, not %.100s", Py_TYPE(arg)->tp_name);
    if (check_open(self) < 0) return NULL;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    const cv_tensor_view *v = cv_checkpoint_find(&self->ck, name);
    if (!v) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    npy_intp dims[2] = {(npy_intp)v->shape[0], v->ndim == 2 ? (npy_intp)v->shape[1] : 0};
    PyObject *arr = PyArray_SimpleNew(v->ndim, dims, NPY_FLOAT32);
    if (!arr) return NULL;
    float *dst = PyArray_DATA((PyArrayObject *)arr); /* [numel] */
    size_t n = (size_t)cv_tensor_numel(v);
    /* busy keeps close() from unmapping while the copy runs without the GIL */
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    cv_convert_to_f32(dst, v->data, v->dtype, n);
    Py_END_ALLOW_THREADS
    self->busy--;
    return arr;
}

static PyObject *Checkpoint_repr(CheckpointObject *self) {
    if (!self->is_open) return PyUnicode_FromFormat("<Checkpoint %R (closed)>", self->path ? self->path : Py_None);
    const cv_model_config *c = &self->ck.cfg;
    return PyUnicode_FromFormat("<Checkpoint %s %R dim=%lld layers=%lld vocab=%lld>",
                                format_name(self->ck.format), self->path,
                                (long long)c->dim, (long long)c->n_layers, (long long)c->vocab_size);
}

static PyMethodDef Checkpoint_methods[] = {
    {"tensors", (PyCFunction)Checkpoint_tensors, METH_NOARGS,
     "tensors() -> dict: canonical name -> (dtype, shape) of every tensor present."},
    {"tensor", (PyCFunction)Checkpoint_tensor, METH_O,
     "tensor(name) -> numpy.ndarray: a new float32 copy of the named tensor (KeyError if absent)."},
    {"close", (PyCFunction)Checkpoint_close, METH_NOARGS, "close(): unmaps the files; idempotent."},
    {"__enter__", (PyCFunction)Checkpoint_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Checkpoint_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Checkpoint_getset[] = {
    {"format", (getter)Checkpoint_get_format, NULL, "\"hf\", \"llama2c\" or \"gguf\".", NULL},
    {"metadata", (getter)Checkpoint_get_metadata, NULL,
     "GGUF metadata: every key -> value (arrays as lists); {} for other formats.", NULL},
    {"config", (getter)Checkpoint_get_config, NULL, "The model hyper-parameters as a dict.", NULL},
    {"path", (getter)Checkpoint_get_path, NULL, "The path it was opened from.", NULL},
    {"closed", (getter)Checkpoint_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Checkpoint_slots[] = {
    {Py_tp_doc, "Checkpoint(path): a HF checkpoint directory, a llama2.c .bin or a GGUF file, opened read-only.\n\n"
                "Raises FileNotFoundError, conveyor.ModelFormatError or conveyor.UnsupportedError\n"
                "with a message naming the file and the problem."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Checkpoint_init},
    {Py_tp_dealloc, Checkpoint_dealloc},
    {Py_tp_repr, Checkpoint_repr},
    {Py_tp_methods, Checkpoint_methods},
    {Py_tp_getset, Checkpoint_getset},
    {0, NULL},
};

static PyType_Spec Checkpoint_spec = {
    .name = "conveyor._core.Checkpoint",
    .basicsize = sizeof(CheckpointObject),
    .flags = CV_PY_TYPE_FLAGS,
    .slots = Checkpoint_slots,
};

int cv_py_add_checkpoint(PyObject *m) { return cv_py_add_type(m, &Checkpoint_spec); }
