/* Binding of the sampler part (placeholder until that part lands). */
#include "binding.h"

int cv_py_add_sampler(PyObject *m) {
    (void)m;
    return 0;
}
