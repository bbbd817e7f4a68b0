/* Online step-time model: see step_cost.h. */
#include "step_cost.h"

#include <math.h>

/* Each step weighs this much less than the one after it: the fit follows a
 * workload that changes over some hundred steps. */
#define DECAY 0.99

void cv_step_cost_observe(cv_step_cost *c, int64_t decode_tokens, int64_t prompt_tokens, double seconds) {
    if (!(seconds > 0.0) || !isfinite(seconds) || decode_tokens < 0 || prompt_tokens < 0) return;
    const double x[3] = {1.0, (double)decode_tokens, (double)prompt_tokens};
    const double w = 1.0 / (seconds * seconds);
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) c->m[i][j] = DECAY * c->m[i][j] + w * x[i] * x[j];
        c->v[i] = DECAY * c->v[i] + w * x[i] * seconds;
    }
    c->tt = DECAY * c->tt + w * seconds * seconds;
    c->age = DECAY * c->age + 1.0;
    c->age_sq = DECAY * DECAY * c->age_sq + 1.0;
    c->age_sq_w = DECAY * DECAY * c->age_sq_w + w;
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

/* The normal equations of the fit into a and b, and the number of terms k:
 * 3, or 2 where no step had prompt work (t = A + B_d * D alone; the third row
 * is the identity). 0 while the steps seen cannot determine them. */
static int normal_equations(const cv_step_cost *c, double a[3][3], double b[3]) {
    if (c->n < CV_STEP_COST_MIN_STEPS) return 0;
    const double w = c->m[0][0];
    const double mean_p = c->m[0][2] / w, mean_d = c->m[0][1] / w;
    const double var_p = c->m[2][2] / w - mean_p * mean_p;
    const double var_d = c->m[1][1] / w - mean_d * mean_d;
    /* a decode count without spread leaves A and B_d singular */
    if (!(var_d > 1e-9) || var_d < 4e-4 * mean_d * mean_d) return 0;
    const int k = var_p > 1e-9 ? 3 : 2;
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) a[i][j] = (i < k && j < k) ? c->m[i][j] : (i == j ? 1.0 : 0.0);
        b[i] = i < k ? c->v[i] : 0.0;
    }
    return k;
}

/* solve3 on copies, so that the system can be solved again. */
static int solve3_copy(double a[3][3], const double b[3], double x[3]) {
    double ac[3][3], bc[3];
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) ac[i][j] = a[i][j];
        bc[i] = b[i];
    }
    return solve3(ac, bc, x);
}

int cv_step_cost_fit(const cv_step_cost *c, double out[3]) {
    double a[3][3], b[3], x[3] = {0.0, 0.0, 0.0};
    if (!normal_equations(c, a, b) || !solve3(a, b, x)) return 0;
    for (int i = 0; i < 3; i++) out[i] = x[i];
    return 1;
}

/* The covariance of (A, B_d) into var_a, var_b, cov_ab; 0 when it cannot be
 * estimated. With noise of variance s^2 t^2 on a step of time t, the 1/t^2
 * weights are the exact ones and the decay's are not: s^2 comes from the
 * weighted residuals over the decayed count of steps, and the covariance is
 * s^2 times the inverse of the normal matrix times the decay's correction
 * (its sum of squared over its sum of plain weights); the effective number of
 * steps is age^2 / age_sq. */
static int fit_covariance(const cv_step_cost *c, double a[3][3], int k, const double f[3], double *var_a,
                          double *var_b, double *cov_ab) {
    double ss = c->tt;
    for (int i = 0; i < k; i++) {
        ss -= 2.0 * f[i] * c->v[i];
        for (int j = 0; j < k; j++) ss += f[i] * c->m[i][j] * f[j];
    }
    const double n_eff = c->age * c->age / c->age_sq;
    if (!(n_eff > k + 1.0)) return 0;
    const double s2 = (ss > 0.0 ? ss : 0.0) / c->age * n_eff / (n_eff - k);
    const double e0[3] = {1.0, 0.0, 0.0}, e1[3] = {0.0, 1.0, 0.0};
    double y[3] = {0.0, 0.0, 0.0}, z[3] = {0.0, 0.0, 0.0};
    if (!solve3_copy(a, e0, y) || !solve3_copy(a, e1, z)) return 0;
    const double scale = s2 * c->age_sq_w / c->m[0][0];
    *var_a = scale * y[0];
    *var_b = scale * z[1];
    *cov_ab = scale * y[1];
    return 1;
}

int64_t cv_step_cost_knee(const cv_step_cost *c, int64_t cap) {
    double a[3][3], b[3], f[3] = {0.0, 0.0, 0.0}, var_a, var_b, cov_ab;
    if (cap < 1) return cap;
    const int k = normal_equations(c, a, b);
    if (!k || !solve3_copy(a, b, f) || !fit_covariance(c, a, k, f, &var_a, &var_b, &cov_ab)) return 0;
    const double A = f[0], B = f[1];
    if (!(A > 0.0)) return 0;
    /* Even with B_d two standard errors higher the knee lies beyond cap: a step
     * time that hardly grows with the batch (memory-bound) */
    const double b_high = B + 2.0 * sqrt(var_b > 0.0 ? var_b : 0.0);
    if (!(CV_STEP_COST_KNEE * A < (double)cap * b_high)) return cap;
    if (!(B > 0.0)) return 0;
    const double rel_var = var_a / (A * A) + var_b / (B * B) - 2.0 * cov_ab / (A * B);
    if (!(rel_var <= CV_STEP_COST_MAX_KNEE_ERROR * CV_STEP_COST_MAX_KNEE_ERROR)) return 0;
    const double knee = ceil(CV_STEP_COST_KNEE * A / B);
    if (!(knee < (double)cap)) return cap;
    return knee < 1.0 ? 1 : (int64_t)knee;
}
