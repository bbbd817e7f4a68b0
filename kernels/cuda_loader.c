/* Placeholder: the CUDA backend is not built yet. */
#include "backend.h"

cv_backend *cv_cuda_backend_create(int device, cv_err *err) {
    (void)device;
    cv_set_err(err, CV_ERR_UNSUPPORTED, "device='cuda': this build of conveyor has no CUDA backend");
    return NULL;
}
