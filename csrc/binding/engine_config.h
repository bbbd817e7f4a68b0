/* An EngineArgs object read into the C engine config (the strings the config
 * points into stay owned here until cv_py_engine_config_free). */
#ifndef CV_BINDING_ENGINE_CONFIG_H
#define CV_BINDING_ENGINE_CONFIG_H

#include "binding.h"
#include "../core/engine_config.h"

typedef struct cv_py_engine_config {
    cv_engine_config cfg;
    PyObject *model_path;  /* bytes (os.fsencode of the model) */
    PyObject *draft_path;  /* bytes, or NULL without a draft model */
} cv_py_engine_config;

/* Reads the config fields by their EngineArgs names: from `config` (any
 * object with those attributes; or a path, which names the model and leaves
 * every other field at its default), where `overrides` (a dict, or NULL)
 * does not name them. speculative_config is None, a dict or an object with
 * its keys as attributes. A field neither names keeps its default. Only type
 * conversion happens here (TypeError/ValueError with .field); every range is
 * cv_engine_config_check's. Returns 0, or -1 with an exception set; free
 * with cv_py_engine_config_free either way. */
int cv_py_engine_config_read(cv_py_engine_config *c, PyObject *config, PyObject *overrides);
void cv_py_engine_config_free(cv_py_engine_config *c);

#endif
