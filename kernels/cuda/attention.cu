/* Attention over the paged KV cache, and the cache write.
 *
 * Cache layout (k and v): [num_blocks][n_kv_heads][block_size][head_dim];
 * token slot s lives in block s / block_size at offset s % block_size.
 *
 * paged_attention launches two kernels over the whole batch; each picks its
 * own sequences from query_start (device memory: the host does not know how
 * many new tokens each sequence has):
 *  - decode_kernel: sequences with exactly one new token. One block per
 *    (sequence, KV head, group of <= 8 query heads sharing it, split of 256
 *    context tokens); with more than one split, decode_reduce_kernel merges
 *    the partial softmax results. Splits depend only on the sequence's own
 *    context length, so a row's result does not depend on the batch.
 *  - prefill_kernel: sequences with two or more new tokens (prompt chunks
 *    over a cached prefix). Flash-style tiles: 16 (query token, head) rows of
 *    one KV head against 32-key tiles of K and V in shared memory, online
 *    softmax, causal mask. Key tiles start at position 0 in steps of 32
 *    whatever the chunking, so a row's result does not depend on how the
 *    prompt was split into chunks or batched. Persistent blocks walk the list
 *    of (tile, KV head) items; each block finds the tiles per sequence with a
 *    scan of query_start in shared memory.
 * Both use fp32 arithmetic on CUDA cores; the cache is widened on load. */
#include <climits>
#include <cstdio>
#include <cstring>

#include "cuda_internal.h"

#define ATT_MAX_HD 256   /* largest head_dim */
#define DEC_THREADS 128
#define DEC_PART 256     /* context tokens per decode split */
#define DEC_GH 8         /* query heads per decode block */
#define DEC_MAX_SPLITS 8192
#define PF_THREADS 128
#define PF_WARPS 4
#define PF_R 4                        /* rows per warp */
#define PF_ROWS (PF_WARPS * PF_R)     /* rows per tile */
#define PF_BK 32                      /* keys per step (one per lane) */
#define PF_MAX_SEQS 1024              /* sequences per prefill launch */

struct att_args {
    float *out;                /* [q_rows][n_heads * D] */
    const float *q;            /* [q_rows][q_stride]: head h at h * D */
    int64_t q_stride;
    const void *k, *v;         /* [num_blocks][n_kv][bs][D] of the cache dtype */
    int64_t num_blocks;
    int n_kv, bs, D, n_heads, g, n_hg;
    const int32_t *qstart;     /* [n_seqs + 1] */
    const int32_t *ctxlen;     /* [n_seqs] */
    const int32_t *btab;       /* [n_seqs][mbps] */
    int64_t mbps;
    float scale;
    int64_t s0;                /* first sequence of this launch */
    int ns;                    /* sequences in this launch */
    float *part;               /* [ns][n_heads][max_splits][D + 2]: m, l, acc[D] */
    int max_splits;
    int vec_ok;                /* k, v allow 16-byte loads of whole rows */
    int *flags;                /* [CVC_NFLAGS] */
};

/* ------------------------------------------------------------ load helpers */

__device__ __forceinline__ float f4get(const float4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* Block id of position pos; ids outside the cache raise a flag and read block 0. */
__device__ __forceinline__ int64_t block_of(const att_args &a, const int32_t *bt, int pos) {
    int64_t blk = bt[pos / a.bs];
    if (blk < 0 || blk >= a.num_blocks) {
        a.flags[CVC_FLAG_BLOCK] = 1;
        blk = 0;
    }
    return blk;
}

/* ------------------------------------------------------------------ decode */

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(DEC_THREADS) decode_kernel(att_args a) {
    __shared__ __align__(16) float q_s[DEC_GH * ATT_MAX_HD]; /* [gh][D] query, row stride ATT_MAX_HD */
    __shared__ float sc[DEC_GH * DEC_PART];                  /* [gh][nt] scores, then probabilities */
    __shared__ __align__(16) float red[DEC_THREADS * 8];     /* [rows][D] partial sums of P.V */
    __shared__ float ml[2 * DEC_GH];                         /* [gh] max, sum */

    const int64_t s = a.s0 + blockIdx.x;
    const int kvh = blockIdx.y / a.n_hg, hg = blockIdx.y - kvh * a.n_hg;
    const int sp = blockIdx.z;
    const int tid = threadIdx.x;
    const bool leader = tid == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    const int q0 = a.qstart[s], n_new = a.qstart[s + 1] - q0;
    if (n_new != 1) return; /* prefill_kernel's (or no new token) */
    const int ctx = a.ctxlen[s];
    if (ctx < 1) {
        if (leader) a.flags[CVC_FLAG_QUERY] = 1;
        return;
    }
    if ((int64_t)ctx > a.mbps * a.bs) {
        if (leader) a.flags[CVC_FLAG_TABLE] = 1;
        return;
    }
    const int n_splits = (ctx + DEC_PART - 1) / DEC_PART;
    if (n_splits > a.max_splits) {
        if (leader) a.flags[CVC_FLAG_MAXCTX] = 1;
        return;
    }
    if (sp >= n_splits) return;

    const int D = a.D;
    const int t0 = sp * DEC_PART, nt = min(ctx - t0, DEC_PART);
    const int h0 = kvh * a.g + hg * DEC_GH, gh = min(DEC_GH, a.g - hg * DEC_GH);
    const float *qrow = a.q + (int64_t)q0 * a.q_stride + (int64_t)h0 * D;
    for (int i = tid; i < gh * D; i += DEC_THREADS) {
        const int h = i / D;
        q_s[h * ATT_MAX_HD + (i - h * D)] = qrow[i];
    }
    __syncthreads();

    const int32_t *bt = a.btab + s * a.mbps;
    const int64_t head_off = (int64_t)kvh * a.bs * D, blk_stride = (int64_t)a.n_kv * a.bs * D;

    /* 1. Scores: one thread per context token, all gh heads at once. */
    const T *K = (const T *)a.k + head_off;
    for (int t = tid; t < nt; t += DEC_THREADS) {
        const int pos = t0 + t;
        const T *kp = K + block_of(a, bt, pos) * blk_stride + (int64_t)(pos % a.bs) * D;
        float acc[DEC_GH];
#pragma unroll
        for (int h = 0; h < DEC_GH; h++) acc[h] = 0.f;
        for (int d = 0; d < D; d += VEC) {
            float kv[VEC];
            cvc_load_vec<T, VEC>(kv, kp + d);
#pragma unroll
            for (int h = 0; h < DEC_GH; h++) {
                if (h < gh) {
                    const float *qh = q_s + h * ATT_MAX_HD + d;
                    if constexpr (VEC % 4 == 0) {
#pragma unroll
                        for (int e = 0; e < VEC; e += 4) {
                            CVC_ALIGNED(qh + e, 16);
                            const float4 q4 = *reinterpret_cast<const float4 *>(qh + e);
                            acc[h] = fmaf(q4.x, kv[e], acc[h]);
                            acc[h] = fmaf(q4.y, kv[e + 1], acc[h]);
                            acc[h] = fmaf(q4.z, kv[e + 2], acc[h]);
                            acc[h] = fmaf(q4.w, kv[e + 3], acc[h]);
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < VEC; e++) acc[h] = fmaf(qh[e], kv[e], acc[h]);
                    }
                }
            }
        }
#pragma unroll
        for (int h = 0; h < DEC_GH; h++)
            if (h < gh) sc[h * DEC_PART + t] = acc[h] * a.scale;
    }
    __syncthreads();

    /* 2. Softmax within the split: one warp per head. */
    const int warp = tid >> 5, lane = tid & 31;
    for (int h = warp; h < gh; h += DEC_THREADS / 32) {
        float *row = sc + h * DEC_PART;
        float m = -INFINITY;
        for (int t = lane; t < nt; t += 32) m = fmaxf(m, row[t]);
        m = cvc_warp_max(m);
        float l = 0.f;
        for (int t = lane; t < nt; t += 32) {
            const float p = expf(row[t] - m);
            row[t] = p;
            l += p;
        }
        l = cvc_warp_sum(l);
        if (lane == 0) {
            ml[2 * h] = m;
            ml[2 * h + 1] = l;
        }
    }
    __syncthreads();

    /* 3. P.V: tpr threads cover one V row (VEC elements each, NC chunks),
     * `rows` rows are in flight; then the rows are summed in shared memory. */
    const int cpr = D / VEC, tpr = cpr < DEC_THREADS ? cpr : DEC_THREADS, rows = DEC_THREADS / tpr;
    const int r = tid / tpr, c0 = tid - r * tpr;
    float acc[DEC_GH][NC][VEC];
#pragma unroll
    for (int h = 0; h < DEC_GH; h++)
#pragma unroll
        for (int ci = 0; ci < NC; ci++)
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[h][ci][e] = 0.f;
    const T *V = (const T *)a.v + head_off;
    if (r < rows) {
        for (int t = r; t < nt; t += rows) {
            const int pos = t0 + t;
            const T *vp = V + block_of(a, bt, pos) * blk_stride + (int64_t)(pos % a.bs) * D;
#pragma unroll
            for (int ci = 0; ci < NC; ci++) {
                const int ch = c0 + ci * tpr;
                if (ch < cpr) {
                    float vv[VEC];
                    cvc_load_vec<T, VEC>(vv, vp + ch * VEC);
#pragma unroll
                    for (int h = 0; h < DEC_GH; h++) {
                        if (h < gh) {
                            const float p = sc[h * DEC_PART + t];
#pragma unroll
                            for (int e = 0; e < VEC; e++) acc[h][ci][e] = fmaf(p, vv[e], acc[h][ci][e]);
                        }
                    }
                }
            }
        }
    }
    const int64_t out_stride = (int64_t)a.n_heads * D;
#pragma unroll
    for (int h = 0; h < DEC_GH; h++) {
        if (h < gh) { /* gh is the same for the whole block */
            __syncthreads();
            if (r < rows) {
#pragma unroll
                for (int ci = 0; ci < NC; ci++) {
                    const int ch = c0 + ci * tpr;
                    if (ch < cpr) {
#pragma unroll
                        for (int e = 0; e < VEC; e++) red[r * D + ch * VEC + e] = acc[h][ci][e];
                    }
                }
            }
            __syncthreads();
            const float m = ml[2 * h], l = ml[2 * h + 1];
            if (n_splits == 1) {
                float *o = a.out + (int64_t)q0 * out_stride + (int64_t)(h0 + h) * D;
                for (int d = tid; d < D; d += DEC_THREADS) {
                    float sum = 0.f;
                    for (int rr = 0; rr < rows; rr++) sum += red[rr * D + d];
                    o[d] = sum / l;
                }
            } else {
                float *rec = a.part + (((s - a.s0) * a.n_heads + (h0 + h)) * a.max_splits + sp) * (int64_t)(D + 2);
                if (tid == 0) {
                    rec[0] = m;
                    rec[1] = l;
                }
                for (int d = tid; d < D; d += DEC_THREADS) {
                    float sum = 0.f;
                    for (int rr = 0; rr < rows; rr++) sum += red[rr * D + d];
                    rec[2 + d] = sum;
                }
            }
        }
    }
}

/* Merges the splits of one (sequence, head): out = sum_i acc_i e^(m_i - M) /
 * sum_i l_i e^(m_i - M). */
__global__ void __launch_bounds__(DEC_THREADS) decode_reduce_kernel(att_args a) {
    extern __shared__ float w[]; /* [n_splits] weights e^(m_i - M) */
    __shared__ float sh[33];
    const int64_t s = a.s0 + blockIdx.x;
    const int h = blockIdx.y, tid = threadIdx.x, D = a.D;
    const int q0 = a.qstart[s], n_new = a.qstart[s + 1] - q0;
    if (n_new != 1) return;
    const int ctx = a.ctxlen[s];
    if (ctx < 1 || (int64_t)ctx > a.mbps * a.bs) return;
    const int n_splits = (ctx + DEC_PART - 1) / DEC_PART;
    if (n_splits <= 1 || n_splits > a.max_splits) return;
    const float *rec = a.part + ((s - a.s0) * a.n_heads + h) * (int64_t)a.max_splits * (D + 2);
    float m = -INFINITY;
    for (int i = tid; i < n_splits; i += DEC_THREADS) m = fmaxf(m, rec[(int64_t)i * (D + 2)]);
    m = cvc_block_max(m, sh);
    float l = 0.f;
    for (int i = tid; i < n_splits; i += DEC_THREADS) {
        const float wi = expf(rec[(int64_t)i * (D + 2)] - m);
        w[i] = wi;
        l += rec[(int64_t)i * (D + 2) + 1] * wi;
    }
    l = cvc_block_sum(l, sh); /* its barriers also publish w[] */
    float *o = a.out + (int64_t)q0 * a.n_heads * D + (int64_t)h * D;
    for (int d = tid; d < D; d += DEC_THREADS) {
        float sum = 0.f;
        for (int i = 0; i < n_splits; i++) sum = fmaf(w[i], rec[(int64_t)i * (D + 2) + 2 + d], sum);
        o[d] = sum / l;
    }
}

/* ----------------------------------------------------------------- prefill */

/* Shared memory of prefill_kernel, in floats from a 16-byte aligned base. */
struct pf_layout {
    int Dp, ks;                        /* padded head_dim; K row stride */
    int q_off, k_off, v_off, p_off, i_off;
    size_t bytes;
};

__host__ __device__ inline pf_layout pf_layout_for(int D) {
    pf_layout L;
    L.Dp = (D + 3) & ~3;
    /* An odd number of float4 per K row: lanes reading float4 of different
     * rows hit different banks. */
    L.ks = ((L.Dp / 4) % 2 == 1) ? L.Dp : L.Dp + 4;
    L.q_off = 0;                                  /* q_s [PF_ROWS][Dp] */
    L.k_off = L.q_off + PF_ROWS * L.Dp;           /* k_s [PF_BK][ks] */
    L.v_off = L.k_off + PF_BK * L.ks;             /* v_s [PF_BK][Dp] */
    L.p_off = L.v_off + PF_BK * L.Dp;             /* p_s [PF_ROWS][PF_BK] */
    L.i_off = L.p_off + PF_ROWS * PF_BK;          /* ints: pre[PF_MAX_SEQS + 1], wsum[PF_WARPS] */
    L.bytes = (size_t)L.i_off * 4 + (size_t)(PF_MAX_SEQS + 1 + PF_WARPS) * 4;
    return L;
}

/* Loads keys k0 .. k0 + PF_BK - 1 (zeros past kmax) of one KV head as fp32. */
template <typename T>
__device__ __forceinline__ void load_kv_tile(const att_args &a, const int32_t *bt, int kvh, int k0, int kmax,
                                             float *k_s, float *v_s, int ks, int Dp) {
    const int D = a.D;
    const int64_t head_off = (int64_t)kvh * a.bs * D, blk_stride = (int64_t)a.n_kv * a.bs * D;
    const T *K = (const T *)a.k + head_off, *V = (const T *)a.v + head_off;
    constexpr int VEC = 16 / (int)sizeof(T);
    if (a.vec_ok) { /* D % VEC == 0 and 16-byte aligned cache */
        const int cpr = D / VEC;
        for (int idx = threadIdx.x; idx < PF_BK * cpr; idx += PF_THREADS) {
            const int j = idx / cpr, c = idx - j * cpr, pos = k0 + j;
            float kv[VEC], vv[VEC];
            if (pos <= kmax) {
                const int64_t off = block_of(a, bt, pos) * blk_stride + (int64_t)(pos % a.bs) * D + c * VEC;
                cvc_load_vec<T, VEC>(kv, K + off);
                cvc_load_vec<T, VEC>(vv, V + off);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; e++) kv[e] = vv[e] = 0.f;
            }
            float4 *kd = reinterpret_cast<float4 *>(k_s + j * ks + c * VEC);
            float4 *vd = reinterpret_cast<float4 *>(v_s + j * Dp + c * VEC);
            CVC_ALIGNED(kd, 16);
            CVC_ALIGNED(vd, 16);
#pragma unroll
            for (int e = 0; e < VEC; e += 4) {
                kd[e / 4] = make_float4(kv[e], kv[e + 1], kv[e + 2], kv[e + 3]);
                vd[e / 4] = make_float4(vv[e], vv[e + 1], vv[e + 2], vv[e + 3]);
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < PF_BK * D; idx += PF_THREADS) {
            const int j = idx / D, d = idx - j * D, pos = k0 + j;
            float kv = 0.f, vv = 0.f;
            if (pos <= kmax) {
                const int64_t off = block_of(a, bt, pos) * blk_stride + (int64_t)(pos % a.bs) * D + d;
                kv = cvc_f32(K[off]);
                vv = cvc_f32(V[off]);
            }
            k_s[j * ks + d] = kv;
            v_s[j * Dp + d] = vv;
        }
    }
}

/* ND = accumulators per lane and row (head dims lane, lane + 32, ...). */
template <typename T, int ND>
__global__ void __launch_bounds__(PF_THREADS) prefill_kernel(att_args a) {
    extern __shared__ __align__(16) float sm[];
    const pf_layout L = pf_layout_for(a.D);
    float *q_s = sm + L.q_off, *k_s = sm + L.k_off, *v_s = sm + L.v_off, *p_s = sm + L.p_off;
    int *pre = reinterpret_cast<int *>(sm + L.i_off); /* [PF_MAX_SEQS + 1] first tile of each sequence */
    int *wsum = pre + PF_MAX_SEQS + 1;                 /* [PF_WARPS] */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int D = a.D, Dp = L.Dp, ks = L.ks, g = a.g;

    /* 1. Tiles per sequence and their exclusive prefix sum (8 sequences per thread). */
    constexpr int PER = PF_MAX_SEQS / PF_THREADS;
    int cnt[PER], local = 0;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int si = tid * PER + i;
        int tiles = 0;
        if (si < a.ns) {
            const int64_t s = a.s0 + si;
            const int q0 = a.qstart[s], n_new = a.qstart[s + 1] - q0, ctx = a.ctxlen[s];
            if (n_new >= 2) {
                if (n_new > ctx) a.flags[CVC_FLAG_QUERY] = 1;
                else if ((int64_t)ctx > a.mbps * a.bs) a.flags[CVC_FLAG_TABLE] = 1;
                else tiles = (int)(((int64_t)n_new * g + PF_ROWS - 1) / PF_ROWS);
            } else if (n_new < 0) {
                a.flags[CVC_FLAG_QUERY] = 1;
            }
        }
        cnt[i] = tiles;
        local += tiles;
    }
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int run = incl - local;
    for (int w2 = 0; w2 < warp; w2++) run += wsum[w2];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        pre[tid * PER + i] = run;
        run += cnt[i];
    }
    if (tid == PF_THREADS - 1) pre[PF_MAX_SEQS] = run;
    /* Padding columns [D, Dp) of q and k stay zero: loads only write d < D. */
    for (int i = tid; i < PF_ROWS * (Dp - D); i += PF_THREADS) q_s[(i / (Dp - D)) * Dp + D + i % (Dp - D)] = 0.f;
    for (int i = tid; i < PF_BK * (Dp - D); i += PF_THREADS) k_s[(i / (Dp - D)) * ks + D + i % (Dp - D)] = 0.f;
    __syncthreads();
    const int total = pre[PF_MAX_SEQS];
    const int64_t items = (int64_t)total * a.n_kv;

    for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
        const int tile = (int)(it / a.n_kv), kvh = (int)(it - (int64_t)tile * a.n_kv);
        /* The sequence owning the tile: the last one whose first tile <= tile. */
        int lo = 0, hi = a.ns - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (pre[mid] <= tile) lo = mid;
            else hi = mid - 1;
        }
        const int64_t s = a.s0 + lo;
        const int q0 = a.qstart[s], n_new = a.qstart[s + 1] - q0, ctx = a.ctxlen[s];
        const int v0 = (tile - pre[lo]) * PF_ROWS; /* first (token, head) row: v = token * g + head */
        const int nv = n_new * g, pos0 = ctx - n_new;
        const int kmax = pos0 + (min(v0 + PF_ROWS, nv) - 1) / g; /* last key any row needs */
        int rpos[PF_R];
        bool rok[PF_R];
#pragma unroll
        for (int r = 0; r < PF_R; r++) {
            const int v = v0 + warp * PF_R + r;
            rok[r] = v < nv;
            rpos[r] = rok[r] ? pos0 + v / g : -1;
        }

        __syncthreads(); /* the previous item is done with q_s, k_s, v_s */
        for (int i = tid; i < PF_ROWS * D; i += PF_THREADS) {
            const int rr = i / D, d = i - rr * D, v = v0 + rr;
            float val = 0.f;
            if (v < nv) {
                const int qi = v / g, hh = v - qi * g;
                val = a.q[(int64_t)(q0 + qi) * a.q_stride + (int64_t)(kvh * g + hh) * D + d];
            }
            q_s[rr * Dp + d] = val;
        }

        float m[PF_R], l[PF_R], acc[PF_R][ND];
#pragma unroll
        for (int r = 0; r < PF_R; r++) {
            m[r] = -INFINITY;
            l[r] = 0.f;
#pragma unroll
            for (int i = 0; i < ND; i++) acc[r][i] = 0.f;
        }
        const int32_t *bt = a.btab + s * a.mbps;
        float *pw = p_s + warp * PF_R * PF_BK;

        for (int k0 = 0; k0 <= kmax; k0 += PF_BK) {
            __syncthreads(); /* q_s is written / the last tile's k_s, v_s are read */
            load_kv_tile<T>(a, bt, kvh, k0, kmax, k_s, v_s, ks, Dp);
            __syncthreads();

            /* Scores: lane j takes key k0 + j for the warp's PF_R rows. */
            float sc[PF_R];
#pragma unroll
            for (int r = 0; r < PF_R; r++) sc[r] = 0.f;
            const float *kr = k_s + lane * ks;
            const float *qw = q_s + warp * PF_R * Dp;
            CVC_ALIGNED(kr, 16);
            CVC_ALIGNED(qw, 16);
            CVC_ALIGNED(pw, 16);
            for (int d = 0; d < Dp; d += 4) {
                const float4 kv = *reinterpret_cast<const float4 *>(kr + d);
#pragma unroll
                for (int r = 0; r < PF_R; r++) {
                    const float4 qv = *reinterpret_cast<const float4 *>(qw + r * Dp + d);
                    sc[r] = fmaf(qv.x, kv.x, sc[r]);
                    sc[r] = fmaf(qv.y, kv.y, sc[r]);
                    sc[r] = fmaf(qv.z, kv.z, sc[r]);
                    sc[r] = fmaf(qv.w, kv.w, sc[r]);
                }
            }
            /* Online softmax; a row with no visible key in this tile is left as is. */
            const int kpos = k0 + lane;
#pragma unroll
            for (int r = 0; r < PF_R; r++) {
                const bool valid = rok[r] && kpos <= rpos[r];
                const float x = valid ? sc[r] * a.scale : -INFINITY;
                const float tmax = cvc_warp_max(x);
                float p = 0.f;
                if (tmax != -INFINITY) { /* the same for the whole warp */
                    const float mn = fmaxf(m[r], tmax);
                    const float alpha = expf(m[r] - mn); /* 0 on the first visible tile */
                    p = valid ? expf(x - mn) : 0.f;
                    l[r] = l[r] * alpha + p;
#pragma unroll
                    for (int i = 0; i < ND; i++) acc[r][i] *= alpha;
                    m[r] = mn;
                }
                pw[r * PF_BK + lane] = p;
            }
            __syncwarp();
            /* P.V: lane owns head dims lane + 32 i. */
            for (int j = 0; j < PF_BK; j += 4) {
                float4 pr[PF_R];
#pragma unroll
                for (int r = 0; r < PF_R; r++) pr[r] = *reinterpret_cast<const float4 *>(pw + r * PF_BK + j);
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    const float *vr = v_s + (j + jj) * Dp;
#pragma unroll
                    for (int i = 0; i < ND; i++) {
                        const int d = lane + 32 * i;
                        if (d < D) {
                            const float vv = vr[d];
#pragma unroll
                            for (int r = 0; r < PF_R; r++) acc[r][i] = fmaf(f4get(pr[r], jj), vv, acc[r][i]);
                        }
                    }
                }
            }
            __syncwarp();
        }

#pragma unroll
        for (int r = 0; r < PF_R; r++) {
            const float lt = cvc_warp_sum(l[r]);
            if (rok[r]) {
                const int v = v0 + warp * PF_R + r, qi = v / g, hh = v - qi * g;
                float *o = a.out + (int64_t)(q0 + qi) * ((int64_t)a.n_heads * D) + (int64_t)(kvh * g + hh) * D;
#pragma unroll
                for (int i = 0; i < ND; i++) {
                    const int d = lane + 32 * i;
                    if (d < D) o[d] = acc[r][i] / lt;
                }
            }
        }
    }
}

/* --------------------------------------------------------------- kv_write */

template <typename T>
__global__ void kv_write_kernel(T *kc, T *vc, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                                const int64_t *slots, int n_kv, int bs, int D, int64_t num_slots, int *flags) {
    const int64_t i = blockIdx.x;
    const int64_t slot = slots[i];
    if (slot < 0) return; /* padding token: nothing to store */
    if (slot >= num_slots) {
        if (threadIdx.x == 0) flags[CVC_FLAG_SLOT] = 1;
        return;
    }
    const int64_t blk = slot / bs, off = slot - blk * bs;
    const int per = n_kv * D;
    for (int e = threadIdx.x; e < per; e += blockDim.x) {
        const int h = e / D, d = e - h * D;
        const int64_t dst = ((blk * n_kv + h) * bs + off) * D + d;
        kc[dst] = cvc_from_f32<T>(k[i * k_stride + e]);
        vc[dst] = cvc_from_f32<T>(v[i * v_stride + e]);
    }
}

static bool cache_ok(const cv_kv_layer *c) {
    return c && c->k && c->v && c->num_blocks > 0 && c->n_kv_heads > 0 && c->block_size > 0 &&
           c->head_dim > 0 && c->n_kv_heads * c->head_dim <= INT_MAX && c->block_size <= INT_MAX &&
           (c->dtype == CV_F32 || c->dtype == CV_F16 || c->dtype == CV_BF16);
}

void cvc_kv_write(cv_backend *b, cv_kv_layer *cache, const float *k, int64_t k_stride, const float *v,
                  int64_t v_stride, const int64_t *slot_mapping, int64_t n) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n <= 0) return;
    if (cvc_enter(c) < 0) return;
    if (!cache_ok(cache) || !k || !v || !slot_mapping || n > INT_MAX) {
        cvc_fail(c, CV_ERR_INVALID, "CUDA kv_write: bad cache or arguments");
        return;
    }
    const int n_kv = (int)cache->n_kv_heads, bs = (int)cache->block_size, D = (int)cache->head_dim;
    const int64_t num_slots = cache->num_blocks * cache->block_size;
    const int threads = n_kv * D >= 256 ? 256 : 128;
    switch (cache->dtype) {
    case CV_F32:
        kv_write_kernel<float><<<(unsigned)n, threads, 0, c->stream>>>((float *)cache->k, (float *)cache->v, k,
                                                                        k_stride, v, v_stride, slot_mapping, n_kv,
                                                                        bs, D, num_slots, c->flags_d);
        break;
    case CV_F16:
        kv_write_kernel<__half><<<(unsigned)n, threads, 0, c->stream>>>((__half *)cache->k, (__half *)cache->v, k,
                                                                         k_stride, v, v_stride, slot_mapping,
                                                                         n_kv, bs, D, num_slots, c->flags_d);
        break;
    default:
        kv_write_kernel<__nv_bfloat16><<<(unsigned)n, threads, 0, c->stream>>>(
            (__nv_bfloat16 *)cache->k, (__nv_bfloat16 *)cache->v, k, k_stride, v, v_stride, slot_mapping, n_kv, bs,
            D, num_slots, c->flags_d);
        break;
    }
    cvc_check_launch(c, "kv_write");
}

/* ------------------------------------------------------- paged_attention */

typedef void (*att_kernel)(att_args);

template <typename T>
static att_kernel decode_for(int D, bool vec) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if (vec && D % VEC == 0) return decode_kernel<T, VEC, 1>;
    return decode_kernel<T, 1, 2>; /* D <= 256 = 2 chunks of 128 threads */
}

template <typename T>
static att_kernel prefill_for(int D) {
    if (D <= 64) return prefill_kernel<T, 2>;
    if (D <= 96) return prefill_kernel<T, 3>;
    if (D <= 128) return prefill_kernel<T, 4>;
    return prefill_kernel<T, 8>;
}

static att_kernel pick_decode(cv_dtype dt, int D, bool vec) {
    switch (dt) {
    case CV_F32: return decode_for<float>(D, vec);
    case CV_F16: return decode_for<__half>(D, vec);
    default: return decode_for<__nv_bfloat16>(D, vec);
    }
}

static att_kernel pick_prefill(cv_dtype dt, int D) {
    switch (dt) {
    case CV_F32: return prefill_for<float>(D);
    case CV_F16: return prefill_for<__half>(D);
    default: return prefill_for<__nv_bfloat16>(D);
    }
}

int cvc_attention_setup(cv_cuda_ctx *c, cv_err *err) {
    static const cv_dtype dts[3] = {CV_F32, CV_F16, CV_BF16};
    static const int dims[4] = {64, 96, 128, ATT_MAX_HD}; /* the largest D of each prefill variant */
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 4; j++) {
            const size_t bytes = pf_layout_for(dims[j]).bytes;
            if (bytes > c->smem_optin) {
                if (err) {
                    snprintf(err->msg, sizeof err->msg,
                             "CUDA backend: attention needs %zu bytes of shared memory per block, the GPU allows %zu",
                             bytes, c->smem_optin);
                    err->code = CV_ERR_UNSUPPORTED;
                }
                return CV_ERR_UNSUPPORTED;
            }
            cudaError_t e = cudaFuncSetAttribute((const void *)pick_prefill(dts[i], dims[j]),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
            if (e != cudaSuccess) {
                (void)cudaGetLastError();
                if (err) {
                    snprintf(err->msg, sizeof err->msg, "CUDA backend: cudaFuncSetAttribute failed: %s",
                             cudaGetErrorString(e));
                    err->code = CV_ERR_UNSUPPORTED;
                }
                return CV_ERR_UNSUPPORTED;
            }
        }
    }
    return CV_OK;
}

void cvc_paged_attention(cv_backend *b, float *out, const float *q, int64_t q_stride, const cv_kv_layer *cache,
                         const cv_attn_batch *bt) {
    cv_cuda_ctx *c = cvc_of(b);
    if (!bt || bt->n_seqs <= 0) return;
    if (cvc_enter(c) < 0) return;
    const int64_t D = bt->head_dim, nh = bt->n_heads, nkv = bt->n_kv_heads;
    if (!cache_ok(cache) || !out || !q || !bt->query_start || !bt->context_lens || !bt->block_tables ||
        bt->max_blocks_per_seq <= 0 || nh <= 0 || nkv <= 0 || nh % nkv != 0 || cache->n_kv_heads != nkv ||
        cache->head_dim != D || nh * D > INT_MAX) {
        cvc_fail(c, CV_ERR_INVALID, "CUDA paged_attention: bad cache or batch (heads %lld/%lld, head_dim %lld)",
                 (long long)nh, (long long)nkv, (long long)D);
        return;
    }
    if (D > ATT_MAX_HD) {
        cvc_fail(c, CV_ERR_UNSUPPORTED, "CUDA paged_attention: head_dim %lld > %d is not supported", (long long)D,
                 ATT_MAX_HD);
        return;
    }
    att_args a;
    memset(&a, 0, sizeof a);
    a.out = out;
    a.q = q;
    a.q_stride = q_stride;
    a.k = cache->k;
    a.v = cache->v;
    a.num_blocks = cache->num_blocks;
    a.n_kv = (int)nkv;
    a.bs = (int)cache->block_size;
    a.D = (int)D;
    a.n_heads = (int)nh;
    a.g = (int)(nh / nkv);
    a.n_hg = (a.g + DEC_GH - 1) / DEC_GH;
    a.qstart = bt->query_start;
    a.ctxlen = bt->context_lens;
    a.btab = bt->block_tables;
    a.mbps = bt->max_blocks_per_seq;
    a.scale = bt->scale;
    a.flags = c->flags_d;
    const size_t esz = cache->dtype == CV_F32 ? 4 : 2;
    const int vec_elems = (int)(16 / esz);
    a.vec_ok = D % vec_elems == 0 && ((uintptr_t)cache->k % 16) == 0 && ((uintptr_t)cache->v % 16) == 0;

    /* Prompt chunks (two or more new tokens). */
    {
        const att_kernel kern = pick_prefill(cache->dtype, a.D);
        const size_t smem = pf_layout_for(a.D).bytes;
        const unsigned grid = (unsigned)c->num_sms * 4;
        for (int64_t s0 = 0; s0 < bt->n_seqs; s0 += PF_MAX_SEQS) {
            a.s0 = s0;
            a.ns = (int)(bt->n_seqs - s0 < PF_MAX_SEQS ? bt->n_seqs - s0 : PF_MAX_SEQS);
            kern<<<grid, PF_THREADS, smem, c->stream>>>(a);
            if (cvc_check_launch(c, "paged_attention (prefill)") < 0) return;
        }
    }

    /* Decode rows (one new token). */
    const int64_t max_ctx = bt->max_context_len > 0 ? bt->max_context_len : 1;
    const int64_t max_splits = (max_ctx + DEC_PART - 1) / DEC_PART;
    const int64_t grid_y = nkv * a.n_hg;
    if (max_splits > DEC_MAX_SPLITS || grid_y > 65535) {
        cvc_fail(c, CV_ERR_UNSUPPORTED, "CUDA paged_attention: context %lld or %lld KV heads too large",
                 (long long)max_ctx, (long long)nkv);
        return;
    }
    a.max_splits = (int)max_splits;
    int64_t chunk = bt->n_seqs;
    if (max_splits > 1) {
        const size_t per = (size_t)nh * (size_t)max_splits * (size_t)(D + 2);
        if (per > c->part_floats) { /* rare: very long contexts with many heads */
            cvc_check(c, cudaStreamSynchronize(c->stream), "paged_attention (grow)");
            cudaFree(c->part);
            c->part = nullptr;
            c->part_floats = 0;
            if (cvc_check(c, cudaMalloc(&c->part, per * sizeof(float)), "paged_attention (partials)") < 0) return;
            c->part_floats = per;
        }
        chunk = (int64_t)(c->part_floats / per);
        if (chunk > bt->n_seqs) chunk = bt->n_seqs;
    }
    if (chunk > INT_MAX) chunk = INT_MAX;
    a.part = c->part;
    const att_kernel dkern = pick_decode(cache->dtype, a.D, a.vec_ok != 0);
    for (int64_t s0 = 0; s0 < bt->n_seqs; s0 += chunk) {
        const int64_t cnt = bt->n_seqs - s0 < chunk ? bt->n_seqs - s0 : chunk;
        a.s0 = s0;
        a.ns = (int)cnt;
        dkern<<<dim3((unsigned)cnt, (unsigned)grid_y, (unsigned)max_splits), DEC_THREADS, 0, c->stream>>>(a);
        if (cvc_check_launch(c, "paged_attention (decode)") < 0) return;
        if (max_splits > 1) {
            decode_reduce_kernel<<<dim3((unsigned)cnt, (unsigned)nh), DEC_THREADS, (size_t)max_splits * sizeof(float),
                                   c->stream>>>(a);
            if (cvc_check_launch(c, "paged_attention (decode merge)") < 0) return;
        }
    }
}
