/* Read-only memory maps of whole files. */
#ifndef CV_MAPPED_FILE_H
#define CV_MAPPED_FILE_H

#include <stddef.h>
#include "../../base/common.h"

/* Maps a whole file read-only (an empty file gives *map NULL, *len 0).
 * CV_ERR_NOTFOUND when it does not exist, CV_ERR_IO when unreadable. */
int cv_map_file(void **map, size_t *len, const char *path, cv_err *err);
void cv_unmap_file(void *map, size_t len);
/* CV_ERR_NOTFOUND for a missing path (ENOENT, ENOTDIR), else CV_ERR_IO. */
int cv_errno_status(int e);

#endif
