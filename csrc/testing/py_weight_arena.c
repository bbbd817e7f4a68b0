/* Test hook of the CPU backend's weight arena (kernels/cpu/weight_arena.h):
 *
 *   weight_arena_trace(ops, separate=False) -> [(address, reserved bytes), ...]
 *       runs ops on a fresh arena: op >= 0 allocates op bytes, op < 0 frees
 *       allocation number -op - 1 (allocations numbered from 0 in order).
 *       Each allocation is filled with its own byte, checked whole when it
 *       is freed and at the end: a ValueError if any byte was overwritten
 *       (two allocations overlapping). One tuple per op: the address
 *       allocated (0 for a free), then the bytes of chunks held after it.
 *
 * Bad ops (a free of an unknown or freed number) raise ValueError; the arena
 * is destroyed on every path. */
#include "../binding/arrays.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/cpu/weight_arena.h"

typedef struct wa_block {
    unsigned char *p;
    size_t bytes;
    int live;
} wa_block;

static int block_intact(const wa_block *b, size_t i) {
    const unsigned char v = (unsigned char)(i * 37u + 1u);
    for (size_t k = 0; k < b->bytes; k++)
        if (b->p[k] != v) return 0;
    return 1;
}

static void free_live(cv_weight_arena *a, wa_block *blocks, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (blocks[k].live) cv_weight_arena_free(a, blocks[k].p);
}

static PyObject *py_weight_arena_trace(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"ops", "separate", NULL};
    PyObject *ops_obj;
    int separate = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &ops_obj, &separate)) return NULL;
    PyObject *ops = PySequence_Fast(ops_obj, "ops must be a sequence of ints");
    if (!ops) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(ops);
    PyObject *out = PyList_New(n);
    wa_block *blocks = calloc((size_t)n + 1, sizeof *blocks);
    size_t nblocks = 0;
    cv_weight_arena a;
    memset(&a, 0, sizeof a);
    if (!out || !blocks) {
        if (out) PyErr_NoMemory();
        goto fail;
    }
    if (cv_weight_arena_init(&a, separate) < 0) {
        PyErr_SetString(PyExc_MemoryError, "weight arena: cannot make its mutex");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long op = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ops, i));
        if (op == -1 && PyErr_Occurred()) goto fail;
        uintptr_t addr = 0;
        if (op >= 0) {
            if ((unsigned long long)op > ((size_t)1 << 34)) {
                PyErr_Format(PyExc_ValueError, "ops[%zd]: %lld bytes is more than this hook allocates", i, op);
                goto fail;
            }
            wa_block *b = &blocks[nblocks];
            b->bytes = (size_t)op;
            b->p = cv_weight_arena_alloc(&a, b->bytes);
            if (!b->p) {
                PyErr_Format(PyExc_MemoryError, "ops[%zd]: out of memory for %lld bytes", i, op);
                goto fail;
            }
            memset(b->p, (int)(unsigned char)(nblocks * 37u + 1u), b->bytes);
            b->live = 1;
            addr = (uintptr_t)b->p;
            nblocks++;
        } else {
            const unsigned long long k = (unsigned long long)(-(op + 1));
            if (k >= nblocks || !blocks[k].live) {
                PyErr_Format(PyExc_ValueError, "ops[%zd]: allocation %llu is not live", i, k);
                goto fail;
            }
            if (!block_intact(&blocks[k], (size_t)k)) {
                PyErr_Format(PyExc_ValueError, "allocation %llu was overwritten before its free", k);
                goto fail;
            }
            cv_weight_arena_free(&a, blocks[k].p);
            blocks[k].live = 0;
        }
        PyObject *t = Py_BuildValue("(KK)", (unsigned long long)addr,
                                    (unsigned long long)cv_weight_arena_reserved(&a));
        if (!t) goto fail;
        PyList_SET_ITEM(out, i, t);
    }
    for (size_t k = 0; k < nblocks; k++)
        if (blocks[k].live && !block_intact(&blocks[k], k)) {
            PyErr_Format(PyExc_ValueError, "allocation %zu was overwritten", k);
            goto fail;
        }
    free_live(&a, blocks, nblocks);
    cv_weight_arena_destroy(&a);
    free(blocks);
    Py_DECREF(ops);
    return out;
fail:
    free_live(&a, blocks, nblocks);
    cv_weight_arena_destroy(&a);
    free(blocks);
    Py_DECREF(ops);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef arena_methods[] = {
    {"weight_arena_trace", (PyCFunction)(void (*)(void))py_weight_arena_trace, METH_VARARGS | METH_KEYWORDS,
     "weight_arena_trace(ops, separate=False) -> [(address, reserved bytes)] of each op on a fresh arena: "
     "op >= 0 allocates op bytes, op < 0 frees allocation -op - 1"},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_weight_arena(PyObject *m) { return PyModule_AddFunctions(m, arena_methods); }
