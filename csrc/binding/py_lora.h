/* Engine.lora_load / Engine.lora_unload: an adapter's arrays into an engine slot. */
#ifndef CV_PY_LORA_H
#define CV_PY_LORA_H

#include <Python.h>
#include "../core/engine.h"

/* lora_load(slot, scale, pairs): pairs is a list of (layer, module, A, B),
 * module a cv_lora_module index, A [rank][in] and B [out][rank] float32. */
PyObject *cv_py_lora_load(cv_engine *e, PyObject *args);
/* lora_unload(slot) */
PyObject *cv_py_lora_unload(cv_engine *e, PyObject *args);

#endif
