/* Binding of the model runner test hooks (placeholder until that part lands). */
#include "binding.h"

int cv_py_add_model(PyObject *m) {
    (void)m;
    return 0;
}
