/* Loads the CUDA backend on demand.
 *
 * The kernels live in _conveyor_cuda.so beside the conveyor._core and
 * conveyor._testing modules (built by build_support/cuda_build.py when nvcc was
 * found). This file, linked into each module as plain C, dlopen()s it on the
 * first cv_cuda_backend_create(), so that the modules never depend on the CUDA
 * runtime or a driver.
 * CONVEYOR_CUDA_LIB=/path/to/lib.so overrides the location (development). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "cuda/cv_cuda.h"

typedef int (*abi_fn)(void);
typedef cv_backend *(*create_fn)(int, cv_err *);
typedef int (*last_error_fn)(cv_backend *, cv_err *);
typedef void (*clear_error_fn)(cv_backend *);
typedef double (*bandwidth_fn)(cv_backend *, size_t, int, cv_err *);
typedef void (*name_fn)(cv_backend *, char *, size_t);

/* Filled once under `once`; the library is never unloaded (CUDA does not
 * like being torn down under live contexts). */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct {
    void *lib;
    create_fn create;
    last_error_fn last_error;
    clear_error_fn clear_error;
    bandwidth_fn bandwidth;
    name_fn name;
    cv_err err; /* why loading failed (code 0: loaded) */
} L;

/* Resolves a symbol into a function pointer without a cast between object
 * and function pointers (POSIX guarantees the representation). */
static int sym(void *lib, const char *name, void *fp, size_t fp_size) {
    void *p = dlsym(lib, name);
    if (!p) return -1;
    memcpy(fp, &p, fp_size);
    return 0;
}

static void load_once(void) {
    char path[4096];
    const char *env = getenv("CONVEYOR_CUDA_LIB");
    if (env && env[0]) {
        size_t n = strlen(env);
        if (n >= sizeof path) {
            cv_set_err(&L.err, CV_ERR_INVALID, "CONVEYOR_CUDA_LIB is too long");
            return;
        }
        memcpy(path, env, n + 1);
    } else {
        /* The directory of the module that holds this code (conveyor/_core*.so or _testing*.so). */
        Dl_info info;
        void *self = NULL;
        cv_backend *(*fn)(int, cv_err *) = cv_cuda_backend_create;
        memcpy(&self, &fn, sizeof self < sizeof fn ? sizeof self : sizeof fn);
        if (!dladdr(self, &info) || !info.dli_fname) {
            cv_set_err(&L.err, CV_ERR_UNSUPPORTED, "device='cuda': cannot locate the conveyor module that holds the CUDA loader");
            return;
        }
        const char *slash = strrchr(info.dli_fname, '/');
        size_t dir = slash ? (size_t)(slash - info.dli_fname) : 0;
        const size_t name_len = strlen(CV_CUDA_LIB_NAME);
        if (dir + 1 + name_len + 1 > sizeof path) {
            cv_set_err(&L.err, CV_ERR_UNSUPPORTED, "device='cuda': module path too long");
            return;
        }
        if (slash) {
            memcpy(path, info.dli_fname, dir);
            path[dir] = '/';
            memcpy(path + dir + 1, CV_CUDA_LIB_NAME, name_len + 1);
        } else {
            memcpy(path, CV_CUDA_LIB_NAME, name_len + 1);
        }
    }
    if (access(path, F_OK) != 0) {
        cv_set_err(&L.err, CV_ERR_UNSUPPORTED,
                   "device='cuda': this build of conveyor has no CUDA backend (nvcc was not found at build "
                   "time, or CONVEYOR_CUDA=0; expected %s)",
                   path);
        return;
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        cv_set_err(&L.err, CV_ERR_UNSUPPORTED,
                   "device='cuda': cannot load the CUDA backend (is the CUDA runtime/driver installed?): %s",
                   why ? why : path);
        return;
    }
    abi_fn abi = NULL;
    if (sym(lib, "cv_cuda_abi_version_impl", &abi, sizeof abi) < 0 ||
        sym(lib, "cv_cuda_backend_create_impl", &L.create, sizeof L.create) < 0 ||
        sym(lib, "cv_cuda_last_error_impl", &L.last_error, sizeof L.last_error) < 0 ||
        sym(lib, "cv_cuda_clear_error_impl", &L.clear_error, sizeof L.clear_error) < 0 ||
        sym(lib, "cv_cuda_memcpy_bandwidth_impl", &L.bandwidth, sizeof L.bandwidth) < 0 ||
        sym(lib, "cv_cuda_device_name_impl", &L.name, sizeof L.name) < 0) {
        cv_set_err(&L.err, CV_ERR_UNSUPPORTED, "device='cuda': %s is not a conveyor CUDA backend (missing symbols)",
                   path);
        L.create = NULL;
        dlclose(lib);
        return;
    }
    if (abi() != CV_CUDA_ABI_VERSION) {
        cv_set_err(&L.err, CV_ERR_UNSUPPORTED,
                   "device='cuda': %s was built for another version of conveyor (ABI %d, need %d); rebuild it",
                   path, abi(), CV_CUDA_ABI_VERSION);
        L.create = NULL;
        dlclose(lib);
        return;
    }
    L.lib = lib;
    L.err.code = 0;
}

cv_backend *cv_cuda_backend_create(int device, cv_err *err) {
    pthread_once(&once, load_once);
    if (!L.lib) {
        cv_set_err(err, L.err.code ? L.err.code : CV_ERR_UNSUPPORTED, "%s",
                   L.err.msg[0] ? L.err.msg : "device='cuda': CUDA backend unavailable");
        return NULL;
    }
    cv_err e = {0};
    cv_backend *b = L.create(device, &e);
    if (!b) {
        cv_set_err(err, e.code ? e.code : CV_ERR_UNSUPPORTED, "device='cuda': %s",
                   e.msg[0] ? e.msg : "the CUDA backend could not start");
        return NULL;
    }
    return b;
}

int cv_cuda_is_backend(const cv_backend *b) {
    return b && L.lib && b->name && strcmp(b->name, "cuda") == 0;
}

int cv_cuda_last_error(cv_backend *b, cv_err *err) {
    if (!cv_cuda_is_backend(b)) return 0;
    return L.last_error(b, err);
}

void cv_cuda_clear_error(cv_backend *b) {
    if (cv_cuda_is_backend(b)) L.clear_error(b);
}

double cv_cuda_memcpy_bandwidth(cv_backend *b, size_t bytes, int repeats, cv_err *err) {
    if (!cv_cuda_is_backend(b)) {
        cv_set_err(err, CV_ERR_INVALID, "memcpy_bandwidth: not a CUDA backend");
        return -1.0;
    }
    return L.bandwidth(b, bytes, repeats, err);
}

void cv_cuda_device_name(cv_backend *b, char *buf, size_t len) {
    if (!buf || len == 0) return;
    buf[0] = '\0';
    if (cv_cuda_is_backend(b)) L.name(b, buf, len);
}
