/* Opening a checkpoint: chooses the format's reader from what the path is
 * (a directory -> HF, a .gguf or a file with GGUF magic -> GGUF, another file
 * -> llama2.c). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "checkpoint.h"
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* 1 when the file's first four bytes are "GGUF" (an unreadable file is left
 * to the llama2.c loader, which reports it). */
static int starts_with_gguf_magic(const char *path) {
    unsigned char magic[4];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, magic, sizeof magic);
    close(fd);
    return n == 4 && cv_gguf_is_gguf(magic, 4);
}

int cv_checkpoint_open(cv_checkpoint *ck, const char *path, cv_err *err) {
    memset(ck, 0, sizeof *ck);
    if (!path || !path[0]) return cv_set_err(err, CV_ERR_INVALID, "checkpoint path is empty");
    struct stat st;
    if (stat(path, &st) != 0) {
        int e = errno;
        if (cv_errno_status(e) == CV_ERR_NOTFOUND)
            return cv_set_err(err, CV_ERR_NOTFOUND, "%s: no such file or directory", path);
        return cv_set_err(err, CV_ERR_IO, "%s: %s", path, strerror(e));
    }
    if (S_ISDIR(st.st_mode)) return cv_checkpoint_open_hf(ck, path, err);
    if (!S_ISREG(st.st_mode))
        return cv_set_err(err, CV_ERR_IO, "%s: neither a directory (HF) nor a regular file (llama2.c)", path);
    /* a file out of a HF directory is a common slip: say what to pass */
    if (ends_with(path, ".safetensors") || ends_with(path, ".json"))
        return cv_set_err(err, CV_ERR_FORMAT,
                          "%s: looks like part of a HF checkpoint; pass the directory that holds config.json",
                          path);
    if (ends_with(path, ".gguf") || starts_with_gguf_magic(path)) return cv_checkpoint_open_gguf(ck, path, err);
    return cv_checkpoint_open_llama2c(ck, path, err);
}
