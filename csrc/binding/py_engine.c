/* Binding of the engine part (placeholder until that part lands). */
#include "binding.h"

int cv_py_add_engine(PyObject *m) {
    (void)m;
    return 0;
}
