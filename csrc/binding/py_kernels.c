/* Binding of the kernels part (placeholder until that part lands). */
#include "binding.h"

int cv_py_add_kernels(PyObject *m) {
    (void)m;
    return 0;
}
