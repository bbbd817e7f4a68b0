/* Online step-time model: see step_cost.h. */
#include "step_cost.h"

#include <math.h>

#define N CV_STEP_COST_TERMS
enum { T_FIXED, T_DECODE, T_PROMPT, T_CONTEXT };

/* Each step weighs this much less than the one after it: the fit follows a
 * workload that changes over some hundred steps. */
#define DECAY 0.99

void cv_step_cost_observe(cv_step_cost *c, int64_t decode_tokens, int64_t prompt_tokens, int64_t context_tokens,
                          double seconds) {
    if (!(seconds > 0.0) || !isfinite(seconds) || decode_tokens < 0 || prompt_tokens < 0 || context_tokens < 0)
        return;
    const double x[N] = {1.0, (double)decode_tokens, (double)prompt_tokens, (double)context_tokens / 1024.0};
    const double w = 1.0 / (seconds * seconds);
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < N; j++) c->m[i][j] = DECAY * c->m[i][j] + w * x[i] * x[j];
        c->v[i] = DECAY * c->v[i] + w * x[i] * seconds;
    }
    c->tt = DECAY * c->tt + w * seconds * seconds;
    c->age = DECAY * c->age + 1.0;
    c->age_sq = DECAY * DECAY * c->age_sq + 1.0;
    c->age_sq_w = DECAY * DECAY * c->age_sq_w + w;
    if (decode_tokens > 0) c->context_now = x[T_CONTEXT] / x[T_DECODE];
    c->n++;
}

/* Solves a x = b by Gaussian elimination with partial pivoting, on copies;
 * 0 when a is (nearly) singular. */
static int solve(const double a_in[N][N], const double b_in[N], double x[N]) {
    double a[N][N], b[N], scale = 0.0;
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < N; j++) {
            a[i][j] = a_in[i][j];
            scale = fmax(scale, fabs(a[i][j]));
        }
        b[i] = b_in[i];
    }
    if (scale == 0.0) return 0;
    for (int col = 0; col < N; col++) {
        int p = col;
        for (int r = col + 1; r < N; r++)
            if (fabs(a[r][col]) > fabs(a[p][col])) p = r;
        if (fabs(a[p][col]) < 1e-12 * scale) return 0;
        if (p != col) {
            for (int j = 0; j < N; j++) { double t = a[col][j]; a[col][j] = a[p][j]; a[p][j] = t; }
            double t = b[col]; b[col] = b[p]; b[p] = t;
        }
        for (int r = col + 1; r < N; r++) {
            double f = a[r][col] / a[col][col];
            for (int j = col; j < N; j++) a[r][j] -= f * a[col][j];
            b[r] -= f * b[col];
        }
    }
    for (int r = N - 1; r >= 0; r--) {
        double s = b[r];
        for (int j = r + 1; j < N; j++) s -= a[r][j] * x[j];
        x[r] = s / a[r][r];
    }
    return 1;
}

/* The weighted covariance of terms i and j over the steps. */
static double covariance(const cv_step_cost *c, int i, int j) {
    const double w = c->m[0][0];
    return c->m[i][j] / w - (c->m[0][i] / w) * (c->m[0][j] / w);
}

/* The normal equations of the fit into a and b, with active[] the terms fitted:
 * a term without spread of its own is left out (its row the identity, its
 * coefficient 0): no prompt work at all, or contexts that move only with the
 * decode count (the same context per decode). Returns the number of active
 * terms, 0 while the steps seen cannot determine A and B_d. */
static int normal_equations(const cv_step_cost *c, double a[N][N], double b[N], int active[N]) {
    if (c->n < CV_STEP_COST_MIN_STEPS) return 0;
    const double mean_d = c->m[0][T_DECODE] / c->m[0][0];
    const double var_d = covariance(c, T_DECODE, T_DECODE);
    /* a decode count without spread leaves A and B_d singular */
    if (!(var_d > 1e-9) || var_d < 4e-4 * mean_d * mean_d) return 0;
    const double var_c = covariance(c, T_CONTEXT, T_CONTEXT), cov_dc = covariance(c, T_DECODE, T_CONTEXT);
    active[T_FIXED] = active[T_DECODE] = 1;
    active[T_PROMPT] = covariance(c, T_PROMPT, T_PROMPT) > 1e-9;
    /* the part of the contexts' spread the decode count does not explain */
    active[T_CONTEXT] = var_c > 1e-12 && var_c - cov_dc * cov_dc / var_d > 1e-3 * var_c;
    int k = 0;
    for (int i = 0; i < N; i++) {
        k += active[i];
        for (int j = 0; j < N; j++) a[i][j] = active[i] && active[j] ? c->m[i][j] : (i == j ? 1.0 : 0.0);
        b[i] = active[i] ? c->v[i] : 0.0;
    }
    return k;
}

int cv_step_cost_fit(const cv_step_cost *c, double out[N]) {
    double a[N][N], b[N], x[N] = {0.0};
    int active[N];
    if (!normal_equations(c, a, b, active) || !solve(a, b, x)) return 0;
    for (int i = 0; i < N; i++) out[i] = x[i];
    return 1;
}

/* The covariance of the fit's coefficients: with noise of variance s^2 t^2 on
 * a step of time t, the 1/t^2 weights are the exact ones and the decay's are
 * not: s^2 comes from the weighted residuals over the decayed count of steps,
 * and the covariance is s^2 times the inverse of the normal matrix times the
 * decay's correction (its sum of squared over its sum of plain weights); the
 * effective number of steps is age^2 / age_sq. 0 when it cannot be estimated. */
static int fit_covariance(const cv_step_cost *c, const double a[N][N], int k, const int active[N],
                          const double f[N], double cov[N][N]) {
    double ss = c->tt;
    for (int i = 0; i < N; i++) {
        if (!active[i]) continue;
        ss -= 2.0 * f[i] * c->v[i];
        for (int j = 0; j < N; j++)
            if (active[j]) ss += f[i] * c->m[i][j] * f[j];
    }
    const double n_eff = c->age * c->age / c->age_sq;
    if (!(n_eff > k + 1.0)) return 0;
    const double s2 = (ss > 0.0 ? ss : 0.0) / c->age * n_eff / (n_eff - k);
    const double scale = s2 * c->age_sq_w / c->m[0][0];
    for (int j = 0; j < N; j++) {
        double e[N] = {0.0}, col[N] = {0.0};
        e[j] = 1.0;
        if (!solve(a, e, col)) return 0;
        for (int i = 0; i < N; i++) cov[i][j] = active[i] && active[j] ? scale * col[i] : 0.0;
    }
    return 1;
}

int64_t cv_step_cost_knee(const cv_step_cost *c, int64_t cap) {
    double a[N][N], b[N], f[N] = {0.0}, cov[N][N];
    int active[N];
    if (cap < 1) return cap;
    const int k = normal_equations(c, a, b, active);
    if (!k || !solve(a, b, f) || !fit_covariance(c, a, k, active, f, cov)) return 0;
    /* a decode's cost at the contexts the batch holds now: B_d + B_c * context */
    const double ctx = c->context_now, A = f[T_FIXED], B = f[T_DECODE] + ctx * f[T_CONTEXT];
    const double var_a = cov[T_FIXED][T_FIXED];
    const double var_b = cov[T_DECODE][T_DECODE] + 2.0 * ctx * cov[T_DECODE][T_CONTEXT] +
                         ctx * ctx * cov[T_CONTEXT][T_CONTEXT];
    const double cov_ab = cov[T_FIXED][T_DECODE] + ctx * cov[T_FIXED][T_CONTEXT];
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
