//! The CUDA C sources of the GPU backend, compiled at run time by NVRTC (or loaded as PTX). They are plain strings so
//! that any build (even one without the `cuda` feature) can list them and a test can compile each one to PTX.
//!
//! Invariants: every kernel is `extern "C"` with a fixed, documented argument list that `cuda.rs` mirrors exactly;
//! grid-stride loops make every kernel correct for any grid size; the codec kernel performs the same IEEE operations
//! in the same order as the CPU scalar kernel (`__fmul_rn`/`__fadd_rn` forbid FMA contraction), draws from the same
//! xorshift32 lanes seeded by the same splitmix64 mixing, so a GPU frame is byte-identical to the CPU frame.

/// One compilation unit: a name (also the PTX file stem) and its CUDA C source.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// Unit name (`mlp`, `norm`, `quant`, `gemm`).
    pub name: &'static str,
    /// CUDA C source.
    pub source: &'static str,
    /// The `extern "C"` kernels it defines.
    pub functions: &'static [&'static str],
}

/// Dense-layer helpers: bias add (+ReLU), ReLU backward mask, softmax cross-entropy, column sums, row argmax.
pub const MLP_SRC: &str = r#"
// z[r, j] += b[j]; with relu, z = max(z, 0). rows x cols row-major.
extern "C" __global__ void bias_act(float* z, const float* b, int rows, int cols, int relu) {
    long long n = (long long)rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        float v = z[i] + b[i % cols];
        z[i] = relu ? fmaxf(v, 0.0f) : v;
    }
}

// ReLU'(z) = [relu(z) > 0]: zero the back-propagated error where the activation is zero.
extern "C" __global__ void relu_mask(float* d, const float* a, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        if (a[i] <= 0.0f) d[i] = 0.0f;
    }
}

// One thread per row: row_loss[r] = logsumexp(z) - z[y]; with want_grad, dlogits = (softmax - onehot) / rows.
extern "C" __global__ void softmax_xent(const float* logits, const unsigned int* y, int rows, int classes,
                                        int want_grad, float* dlogits, float* row_loss) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* z = logits + (long long)r * classes;
    float m = __int_as_float(0xff800000);
    for (int j = 0; j < classes; j++) m = fmaxf(m, z[j]);
    float s = 0.0f;
    for (int j = 0; j < classes; j++) s += expf(z[j] - m);
    unsigned int label = y[r];
    row_loss[r] = m + logf(s) - z[label];
    if (want_grad) {
        float inv_rows = 1.0f / (float)rows;
        float scale = inv_rows / s;
        float* d = dlogits + (long long)r * classes;
        for (int j = 0; j < classes; j++) d[j] = expf(z[j] - m) * scale;
        d[label] -= inv_rows;
    }
}

// out[j] = sum over rows of d[r, j] (bias gradients); one thread per column, coalesced across threads.
extern "C" __global__ void col_sums(const float* d, int rows, int cols, float* out) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float acc = 0.0f;
    for (int r = 0; r < rows; r++) acc += d[(long long)r * cols + j];
    out[j] = acc;
}

// Index of the largest value per row, the first one on ties.
extern "C" __global__ void argmax_rows(const float* z, int rows, int cols, unsigned int* out) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = z + (long long)r * cols;
    int best = 0;
    for (int j = 1; j < cols; j++) if (row[j] > row[best]) best = j;
    out[r] = (unsigned int)best;
}
"#;

/// Global L2 norm (deterministic two-level reduction in f64) and clip-by-norm scaling.
pub const NORM_SRC: &str = r#"
#define NORM_THREADS 256
// partials[block] = sum of x[i]^2 over this block's grid-stride share (f64, fixed tree order).
extern "C" __global__ void sumsq_partial(const float* x, long long n, double* partials) {
    __shared__ double sh[NORM_THREADS];
    double acc = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        double v = (double)x[i];
        acc += v * v;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}

// norm = sqrt(sum partials) (same order in every block); block 0 stores it; when clip > 0 and a finite norm exceeds
// clip, x *= clip / norm.
extern "C" __global__ void norm_clip(float* x, long long n, const double* partials, int nparts, float clip,
                                     float* norm_out) {
    __shared__ float norm_sh;
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int p = 0; p < nparts; p++) s += partials[p];
        norm_sh = (float)sqrt(s);
        if (blockIdx.x == 0) *norm_out = norm_sh;
    }
    __syncthreads();
    float norm = norm_sh;
    if (!(clip > 0.0f) || !isfinite(norm) || !(norm > clip)) return;
    float k = clip / norm;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        x[i] *= k;
    }
}
"#;

/// Bucketed stochastic quantization (q8/q4/q2) with error feedback, bit-identical to the CPU codec.
pub const QUANT_SRC: &str = r#"
#define LANES 16
#define GAMMA 0x9E3779B97F4A7C15ULL

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + GAMMA;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned int xorshift32(unsigned int s) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
}

// Encodes g (+ r_in when r_in != 0) into the raw frame body: nb f32 scales, then the packed codes of every bucket.
// One thread per (bucket, lane): lane j of a bucket handles elements j, j+16, j+32, ... and owns RNG lane j, exactly
// as the CPU kernel does. 16 buckets per 256-thread block. Every thread runs the same number of loop iterations (the
// bucket size is the same for all) so the width-16 shuffles are always converged. With r_in, r_out = (g + r_in) -
// decode(code) for every element. A non-finite input stores the smallest offending index into *first_bad
// (initialised to ~0 by the host).
//
// G > 0: the bucket holds exactly G groups of 16 (512 values for G = 32, the default bucket). The loops are unrolled,
// every load of a thread is in flight at once and g + r stays in registers between the passes, so each input is read
// once; the first pass issues its loads before any test, and a thread reports a non-finite value with one atomic
// after its loop. On the H200 this took q4 from 0.36x to 0.38x of a device copy's input rate, and q4 with error
// feedback from 0.20x to 0.26x (docs/gpu.md). G = 0: any bucket size; the second pass reads the inputs again.
template <int G>
__device__ __forceinline__ void quant_bucket(const float* __restrict__ g, const float* __restrict__ r_in,
                                             float* __restrict__ r_out, unsigned char* __restrict__ body,
                                             unsigned long long* __restrict__ first_bad, unsigned long long n,
                                             unsigned int bucket, unsigned long long nb, int bits, int stochastic,
                                             unsigned long long seed) {
    const unsigned int FULL = 0xffffffffu;
    unsigned int lane = threadIdx.x & (LANES - 1);
    unsigned long long b = (unsigned long long)blockIdx.x * (blockDim.x / LANES) + threadIdx.x / LANES;
    unsigned long long base = b * bucket;
    unsigned int blen = 0;
    if (b < nb) blen = (unsigned int)((n - base) < bucket ? (n - base) : bucket);
    const unsigned int groups = G > 0 ? (unsigned int)G : bucket / LANES;
    int L = bits == 8 ? 127 : (bits == 4 ? 7 : 1);
    float cache[G > 0 ? G : 1];

    // Pass 1: load every value first (all loads in flight), then max |g + r| as order-preserving bits;
    // non-finite values have bits >= 0x7f800000 and the smallest such index goes to *first_bad once.
    unsigned int m = 0;
    unsigned long long bad = ~0ULL;
    if (G > 0) {
#pragma unroll
        for (unsigned int gi = 0; gi < groups; gi++) {
            unsigned int i = gi * LANES + lane;
            cache[G > 0 ? gi : 0] = i < blen ? g[base + i] : 0.0f;
        }
        if (r_in) {
#pragma unroll
            for (unsigned int gi = 0; gi < groups; gi++) {
                unsigned int i = gi * LANES + lane;
                if (i < blen) cache[G > 0 ? gi : 0] = __fadd_rn(cache[G > 0 ? gi : 0], r_in[base + i]);
            }
        }
#pragma unroll
        for (unsigned int gi = 0; gi < groups; gi++) {
            unsigned int a = __float_as_uint(cache[G > 0 ? gi : 0]) & 0x7fffffffu;
            if (a >= 0x7f800000u && bad == ~0ULL) bad = base + gi * LANES + lane;
            m = max(m, a);
        }
    } else {
#pragma unroll 4
        for (unsigned int gi = 0; gi < groups; gi++) {
            unsigned int i = gi * LANES + lane;
            if (i < blen) {
                float s = g[base + i];
                if (r_in) s = __fadd_rn(s, r_in[base + i]);
                unsigned int a = __float_as_uint(s) & 0x7fffffffu;
                if (a >= 0x7f800000u && bad == ~0ULL) bad = base + i;
                m = max(m, a);
            }
        }
    }
    if (bad != ~0ULL) atomicMin(first_bad, bad);
    for (int off = 8; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(FULL, m, off, LANES));
    float scale = __uint_as_float(m);
    if (b < nb && lane == 0) ((float*)body)[b] = scale;

    // RNG lane state: bucket_lanes(seed, b)[lane], never zero.
    unsigned int st = 0;
    if (stochastic) {
        unsigned long long bb = splitmix64(seed ^ (b * 0xA24BAED4963EE407ULL));
        unsigned long long z = splitmix64(bb + (unsigned long long)(lane / 2) * GAMMA);
        st = (lane & 1) ? (unsigned int)(z >> 32) : (unsigned int)z;
        if (st == 0) st = 0x6C078965u;
    }
    float inv = __fdiv_rn((float)L, scale);
    int tiny = m != 0 && isinf(inv);
    double kt = tiny ? __ddiv_rn((double)L, (double)scale) : 0.0;
    float step = __fdiv_rn(scale, (float)L);
    int per = 8 / bits;
    unsigned long long codes0 = 4ULL * nb + b * (unsigned long long)(bucket * bits / 8);
    unsigned int nbytes = (blen * bits + 7) / 8;

    // Pass 2: codes, packing, residual.
#pragma unroll
    for (unsigned int gi = 0; gi < groups; gi++) {
        unsigned int i = gi * LANES + lane;
        int live = i < blen;
        float s = 0.0f;
        if (G > 0) {
            s = cache[G > 0 ? gi : 0];
        } else if (live) {
            s = g[base + i];
            if (r_in) s = __fadd_rn(s, r_in[base + i]);
        }
        float u = 0.5f;
        if (stochastic) {
            st = xorshift32(st);
            u = __fmul_rn((float)(st >> 8), 5.9604644775390625e-8f);
        }
        int q = 0;
        if (m != 0 && m < 0x7f800000u) {
            float t;
            if (tiny) {
                float y = __double2float_rn(__dmul_rn((double)s, kt));
                t = __fadd_rn(__fmul_rn(y, 1.0f), u);
            } else {
                t = __fadd_rn(__fmul_rn(s, inv), u);
            }
            q = (int)floorf(t);
            q = q < -L ? -L : (q > L ? L : q);
        }
        if (live && r_out) r_out[base + i] = __fsub_rn(s, __fmul_rn((float)q, step));
        // Gather `per` neighbouring codes into one byte (two's complement, low bits first).
        unsigned int byte = (unsigned int)q & ((1u << bits) - 1u);
        for (int t = 1; t < per; t++) {
            int qt = __shfl_down_sync(FULL, q, t, LANES);
            byte |= ((unsigned int)qt & ((1u << bits) - 1u)) << (t * bits);
        }
        if (b < nb && (lane % per) == 0) {
            unsigned int at = i * bits / 8;
            if (at < nbytes) body[codes0 + at] = (unsigned char)byte;
        }
    }
}

extern "C" __global__ void quant_encode(const float* __restrict__ g, const float* __restrict__ r_in,
                                        float* __restrict__ r_out, unsigned char* __restrict__ body,
                                        unsigned long long* __restrict__ first_bad, unsigned long long n,
                                        unsigned int bucket, unsigned long long nb, int bits, int stochastic,
                                        unsigned long long seed) {
    if (bucket == 32 * LANES) {
        quant_bucket<32>(g, r_in, r_out, body, first_bad, n, bucket, nb, bits, stochastic, seed);
    } else {
        quant_bucket<0>(g, r_in, r_out, body, first_bad, n, bucket, nb, bits, stochastic, seed);
    }
}
"#;

/// A shared-memory tiled row-major sgemm, used when cuBLAS is not installed: `C[M,N] = op(A) · op(B)`.
pub const GEMM_SRC: &str = r#"
#define TILE 16
// A is [M,K] row-major (or [K,M] when ta), B is [K,N] (or [N,K] when tb), C is [M,N]; C is overwritten.
extern "C" __global__ void sgemm_tiled(int M, int N, int K, const float* A, int ta, const float* B, int tb, float* C) {
    __shared__ float As[TILE][TILE + 1];
    __shared__ float Bs[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        int ka = k0 + threadIdx.x;
        As[threadIdx.y][threadIdx.x] =
            (row < M && ka < K) ? (ta ? A[(long long)ka * M + row] : A[(long long)row * K + ka]) : 0.0f;
        int kb = k0 + threadIdx.y;
        Bs[threadIdx.y][threadIdx.x] =
            (kb < K && col < N) ? (tb ? B[(long long)col * K + kb] : B[(long long)kb * N + col]) : 0.0f;
        __syncthreads();
        for (int t = 0; t < TILE; t++) acc += As[threadIdx.y][t] * Bs[t][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}
"#;

/// Every compilation unit of the backend.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "mlp",
        source: MLP_SRC,
        functions: &[
            "bias_act",
            "relu_mask",
            "softmax_xent",
            "col_sums",
            "argmax_rows",
        ],
    },
    KernelSource {
        name: "norm",
        source: NORM_SRC,
        functions: &["sumsq_partial", "norm_clip"],
    },
    KernelSource {
        name: "quant",
        source: QUANT_SRC,
        functions: &["quant_encode"],
    },
    KernelSource {
        name: "gemm",
        source: GEMM_SRC,
        functions: &["sgemm_tiled"],
    },
];
