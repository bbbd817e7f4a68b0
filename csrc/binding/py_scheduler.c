/* Binding of the scheduler part (placeholder until that part lands). */
#include "binding.h"

int cv_py_add_scheduler(PyObject *m) {
    (void)m;
    return 0;
}
