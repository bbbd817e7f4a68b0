/* Read-only memory maps of whole files: how model files are read. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "mapped_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int cv_errno_status(int e) {
    return (e == ENOENT || e == ENOTDIR) ? CV_ERR_NOTFOUND : CV_ERR_IO;
}

int cv_map_file(void **map, size_t *len, const char *path, cv_err *err) {
    int rc = 0, fd = -1;
    *map = NULL;
    *len = 0;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        rc = cv_set_err(err, cv_errno_status(e), "%s: cannot open: %s", path, strerror(e));
        goto done;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        rc = cv_set_err(err, CV_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
        goto done;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = cv_set_err(err, CV_ERR_IO, "%s: not a regular file", path);
        goto done;
    }
    if (st.st_size < 0 || (uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        rc = cv_set_err(err, CV_ERR_IO, "%s: file too large to map", path);
        goto done;
    }
    if (st.st_size == 0) goto done; /* mmap refuses length 0; callers see an empty buffer */
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        rc = cv_set_err(err, e == ENOMEM ? CV_ERR_NOMEM : CV_ERR_IO, "%s: cannot mmap %lld bytes: %s", path,
                        (long long)st.st_size, strerror(e));
        goto done;
    }
    *map = p;
    *len = (size_t)st.st_size;
done:
    if (fd >= 0) close(fd);
    return rc;
}

void cv_unmap_file(void *map, size_t len) {
    if (map && len) munmap(map, len);
}

