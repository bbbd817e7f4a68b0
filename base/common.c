#define _POSIX_C_SOURCE 200809L
#include "common.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__) && defined(_GNU_SOURCE)
#include <pthread.h>
#endif

void cv_set_thread_name(const char *name) {
#if defined(__linux__) && defined(_GNU_SOURCE)
    (void)pthread_setname_np(pthread_self(), name);
#else
    (void)name;
#endif
}

/* The message, code and field (NULL: none) of an error record. */
static void fill_err(cv_err *err, int code, const char *field, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));
static void fill_err(cv_err *err, int code, const char *field, const char *fmt, va_list ap) {
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    err->code = code;
    snprintf(err->field, sizeof err->field, "%s", field ? field : "");
}

int cv_set_err(cv_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        fill_err(err, code, NULL, fmt, ap);
        va_end(ap);
    }
    return code;
}

int cv_set_field_err(cv_err *err, int code, const char *field, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        fill_err(err, code, field, fmt, ap);
        va_end(ap);
    }
    return code;
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float cv_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t cv_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float cv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* subnormal: value = man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t cv_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (au < 0x38800000u) {                                   /* subnormal or zero */
        float a = bits_f32(au);
        float scaled = a * 16777216.0f; /* a / 2^-24 */
        uint32_t m = (uint32_t)lrintf(scaled);
        return (uint16_t)(sign | m);
    }
    uint32_t exp = (au >> 23) - 112u;
    uint32_t man = au & 0x7fffffu;
    uint32_t h = (exp << 10) | (man >> 13);
    uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

double cv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int cv_mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *out = a * b;
    return 1;
}

int cv_grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 16;
    while (c < need) {
        if (c > SIZE_MAX / 2) return 0;
        c *= 2;
    }
    size_t bytes;
    if (!cv_mul_size(c, elem, &bytes)) return 0;
    void *q = realloc(*p, bytes);
    if (!q) return 0;
    *p = q;
    *cap = c;
    return 1;
}
