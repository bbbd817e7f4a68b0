/* Online step-time model: see step_cost.h. */
#include "step_cost.h"

#include <math.h>

/* Each step weighs this much less than the one after it: the fit follows a
 * workload that changes over some hundred steps. */
#define DECAY 0.99

void cv_step_cost_observe(cv_step_cost *c, int64_t decode_tokens, int64_t prompt_tokens, double seconds) {
    if (!(seconds > 0.0) || !isfinite(seconds) || decode_tokens < 0 || prompt_tokens < 0) return;
    const double x[3] = {1.0, (double)decode_tokens, (double)prompt_tokens};
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) c->m[i][j] = DECAY * c->m[i][j] + x[i] * x[j];
        c->v[i] = DECAY * c->v[i] + x[i] * seconds;
    }
    c->n++;
}

/* Solves a x = b for 3x3 a by Gaussian elimination with partial pivoting;
 * 0 when a is (nearly) singular. */
static int solve3(double a[3][3], double b[3], double x[3]) {
    double scale = 0.0;
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) scale = fmax(scale, fabs(a[i][j]));
    if (scale == 0.0) return 0;
    for (int col = 0; col < 3; col++) {
        int p = col;
        for (int r = col + 1; r < 3; r++)
            if (fabs(a[r][col]) > fabs(a[p][col])) p = r;
        if (fabs(a[p][col]) < 1e-12 * scale) return 0;
        if (p != col) {
            for (int j = 0; j < 3; j++) { double t = a[col][j]; a[col][j] = a[p][j]; a[p][j] = t; }
            double t = b[col]; b[col] = b[p]; b[p] = t;
        }
        for (int r = col + 1; r < 3; r++) {
            double f = a[r][col] / a[col][col];
            for (int j = col; j < 3; j++) a[r][j] -= f * a[col][j];
            b[r] -= f * b[col];
        }
    }
    for (int r = 2; r >= 0; r--) {
        double s = b[r];
        for (int j = r + 1; j < 3; j++) s -= a[r][j] * x[j];
        x[r] = s / a[r][r];
    }
    return 1;
}

int cv_step_cost_fit(const cv_step_cost *c, double out[3]) {
    if (c->n < CV_STEP_COST_MIN_STEPS) return 0;
    /* A column without spread (every step the same decode count, or no
     * prompt work at all) leaves its coefficient undetermined; without
     * prompt work, fit t = A + B_d * D alone. */
    double a[3][3], b[3], x[3] = {0.0, 0.0, 0.0};
    const double w = c->m[0][0];
    const double var_p = c->m[2][2] / w - (c->m[0][2] / w) * (c->m[0][2] / w);
    const int k = var_p > 1e-9 ? 3 : 2;
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) a[i][j] = (i < k && j < k) ? c->m[i][j] : (i == j ? 1.0 : 0.0);
        b[i] = i < k ? c->v[i] : 0.0;
    }
    /* The decode count must vary (a standard deviation of a fifth of its
     * mean): while the batch sits at one size, A and B_d trade against
     * each other and the fit says nothing about other sizes. */
    const double mean_d = c->m[0][1] / w;
    const double var_d = c->m[1][1] / w - mean_d * mean_d;
    if (!(var_d > 1e-9) || var_d < 0.04 * mean_d * mean_d || !solve3(a, b, x)) return 0;
    for (int i = 0; i < 3; i++) out[i] = x[i];
    return 1;
}

int64_t cv_step_cost_knee(const cv_step_cost *c, int64_t cap) {
    double f[3];
    if (cap < 1 || !cv_step_cost_fit(c, f) || !(f[0] > 0.0) || !(f[1] > 0.0)) return cap;
    const double knee = ceil(CV_STEP_COST_KNEE * f[0] / f[1]);
    if (!(knee < (double)cap)) return cap;
    return knee < 1.0 ? 1 : (int64_t)knee;
}
