/* json_value_count(data, limit): how many values a JSON text holds, counted
 * without the GIL before json.loads builds them (which holds the GIL for the
 * whole parse: a quarter of a second for 8 MB of small values). Each value
 * after the first follows a ',' ':' '[' or '{' outside a string, so counting
 * those bytes outside strings (plus one) bounds the number of values from
 * above; the scan stops once past limit. Malformed JSON is json.loads's to
 * report: the count is only a bound on its work. */
#include "binding.h"

static Py_ssize_t count_values(const unsigned char *p, Py_ssize_t n, Py_ssize_t limit) {
    Py_ssize_t count = 1;
    int in_string = 0;
    for (Py_ssize_t i = 0; i < n && count <= limit; i++) {
        const unsigned char c = p[i];
        if (in_string) {
            if (c == '\\')
                i++; /* the escaped byte cannot end the string */
            else if (c == '"')
                in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c == ',' || c == ':' || c == '[' || c == '{') {
            count++;
        }
    }
    return count;
}

static PyObject *json_value_count(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *data;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On:json_value_count", &data, &limit)) return NULL;
    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "json_value_count takes bytes, got %s", Py_TYPE(data)->tp_name);
        return NULL;
    }
    if (limit < 0) {
        PyErr_SetString(PyExc_ValueError, "json_value_count: limit must be >= 0");
        return NULL;
    }
    /* bytes are immutable and the caller holds a reference: safe to read unlocked */
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data);
    const Py_ssize_t n = PyBytes_GET_SIZE(data);
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = count_values(p, n, limit);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(count);
}

static PyMethodDef json_scan_methods[] = {
    {"json_value_count", json_value_count, METH_VARARGS,
     "json_value_count(data: bytes, limit: int) -> int\n\n"
     "An upper bound on the number of values in the JSON text data (1 + the ',' ':' '[' '{'\n"
     "outside strings), counted without the GIL; counting stops past limit."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_json_scan(PyObject *m) { return PyModule_AddFunctions(m, json_scan_methods); }
