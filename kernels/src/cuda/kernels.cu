// Kindred's CUDA kernels, compiled at run time by NVRTC (see `kernels/src/cuda/mod.rs`).
//
// Every kernel mirrors a CPU kernel in `kernels/src/cpu/` and follows its arithmetic exactly where
// the result is meant to be bit-identical:
// - statistics and the sign-pack scale use the CPU's layout of partial sums: per 16384-element
//   chunk, 16 f32 lanes (lane j sums the elements at chunk positions p with p % 16 == j, in
//   order), combined in f64 in lane order; the host combines the chunk partials in chunk order;
// - int8 rounding uses the same 1.5 * 2^23 trick and the same counter hash for stochastic
//   rounding; scale and inverse are computed on the host by the CPU's formula;
// - top-k selects by magnitude bit pattern with ties towards the lower index.
// Rounded operations use explicit `__f*_rn` intrinsics and the module is compiled with
// `--fmad=false`, so no multiply-add is contracted into an FMA (the CPU does not contract either).
// Only the count-sketch accumulates with atomics, so its buckets match the CPU's up to the order of
// float additions.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define CHUNK 16384u
#define LANES 16u
#define LANE_STEPS (CHUNK / LANES)
#define STATS_TILE 1024u
#define ABS_MASK 0x7fffffffu
#define INF_BITS 0x7f800000u
#define MAGIC 12582912.0f
#define MAGIC_BITS 0x4b400000u
#define QMAX 127.0f
#define GOLDEN 0x9E3779B97F4A7C15ull
#define SIGN_SALT 0xD6E8FEB86659FD93ull
#define FULL 0xffffffffu

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 hash_index(u64 seed, u64 index) {
    return mix64(seed + GOLDEN + index * GOLDEN);
}

__device__ __forceinline__ float fmax_cpu(float a, float b) { return a > b ? a : b; }

// A chunk's partials from its 16 lane sums, combined in lane order in f64 as the CPU does:
// `s`, `q`, `m` point at lane 0's sum, sum of squares and abs-max.
__device__ void write_partial(const float* s, const float* q, const float* m, u64 chunk,
                              double* part_sum, double* part_sq, u32* part_max) {
    double sum = -0.0, sum_sq = -0.0;
    float max = 0.0f;
    for (u32 j = 0; j < LANES; j++) {
        sum = __dadd_rn(sum, (double)s[j]);
        sum_sq = __dadd_rn(sum_sq, (double)q[j]);
        // f32::max: ignores NaN.
        max = (m[j] > max) ? m[j] : max;
    }
    part_sum[chunk] = sum;
    part_sq[chunk] = sum_sq;
    part_max[chunk] = (isnan(sum) || isnan(sum_sq)) ? INF_BITS : __float_as_uint(max);
}

// Statistics of one (chunk, lane) thread group of 16, reduced in lane order by lane 0.
// `s`, `q`, `m` are this lane's partials; shared arrays hold one entry per thread (256).
__device__ void lanes_to_partial(float s, float q, float m, u64 chunk, u64 nchunks,
                                 double* part_sum, double* part_sq, u32* part_max) {
    __shared__ float ss[256];
    __shared__ float sq[256];
    __shared__ float sm[256];
    u32 t = threadIdx.x;
    ss[t] = s;
    sq[t] = q;
    sm[t] = m;
    __syncthreads();
    if ((t % LANES) == 0 && chunk < nchunks) {
        write_partial(ss + t, sq + t, sm + t, chunk, part_sum, part_sq, part_max);
    }
}

// residual += update (update may be null: statistics of residual only), with the CPU's chunked
// statistics. One block of 256 threads per chunk: the block streams its chunk through shared
// memory 1024 elements at a time with coalesced loads (all issued before the first use), and
// thread j < 16 (lane j) then sums the positions p = j (mod 16) in order, as the CPU's lane j
// does. (One thread per lane reading global memory directly left a single load in flight per
// thread: 8 ms at 100M elements on an H200, against 0.5 ms for torch's add.)
extern "C" __global__ void accumulate_stats(float* __restrict__ residual,
                                            const float* __restrict__ update, u64 n,
                                            double* part_sum, double* part_sq, u32* part_max) {
    __shared__ float tile[STATS_TILE];
    __shared__ float ls[LANES], lq[LANES], lm[LANES];
    u64 chunk = blockIdx.x;
    u64 start = chunk * CHUNK;
    if (start >= n) {
        return;
    }
    u32 len = n - start < CHUNK ? (u32)(n - start) : CHUNK;
    u32 t = threadIdx.x;
    float s = 0.0f, q = 0.0f, m = 0.0f;
    for (u32 base = 0; base < len; base += STATS_TILE) {
        float v[STATS_TILE / 256];
#pragma unroll
        for (u32 c = 0; c < STATS_TILE / 256; c++) {
            u32 p = base + c * 256 + t;
            float x = 0.0f;
            if (p < len) {
                x = residual[start + p];
                if (update != 0) {
                    x = __fadd_rn(x, update[start + p]);
                }
            }
            v[c] = x;
        }
#pragma unroll
        for (u32 c = 0; c < STATS_TILE / 256; c++) {
            u32 p = base + c * 256 + t;
            if (update != 0 && p < len) {
                residual[start + p] = v[c];
            }
            tile[c * 256 + t] = v[c];
        }
        __syncthreads();
        if (t < LANES) {
            u32 count = len - base < STATS_TILE ? len - base : STATS_TILE;
            for (u32 j = t; j < count; j += LANES) {
                float x = tile[j];
                s = __fadd_rn(s, x);
                q = __fadd_rn(q, __fmul_rn(x, x));
                m = fmax_cpu(m, fabsf(x));
            }
        }
        __syncthreads();
    }
    if (t < LANES) {
        ls[t] = s;
        lq[t] = q;
        lm[t] = m;
    }
    __syncthreads();
    if (t == 0) {
        write_partial(ls, lq, lm, chunk, part_sum, part_sq, part_max);
    }
}

// Sign packing with the CPU's mean-|x| partials: bit p % 64 of word p / 64 is x[p]'s sign bit.
// One thread per (chunk, lane); a warp covers two chunks, one per half; blockDim.x must be 256.
extern "C" __global__ void sign_pack(const float* x, u64 n, u64* words, double* part_sum,
                                     u32* part_max) {
    u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 chunk = tid / LANES;
    u32 lane = (u32)(tid % LANES);
    u32 half = (threadIdx.x % 32) / 16;
    u64 nchunks = (n + CHUNK - 1) / CHUNK;
    u64 nwords = (n + 63) / 64;
    u64 start = chunk * CHUNK;
    u64 len = chunk < nchunks ? (n - start < CHUNK ? n - start : CHUNK) : 0;
    float s = 0.0f;
    u32 m = 0;
    u64 word = 0;
    for (u32 step = 0; step < LANE_STEPS; step++) {
        u64 p = (u64)step * LANES + lane;
        u32 bit = 0;
        if (p < len) {
            u32 b = __float_as_uint(x[start + p]);
            bit = b >> 31;
            u32 mag = b & ABS_MASK;
            m = mag > m ? mag : m;
            s = __fadd_rn(s, __uint_as_float(mag));
        }
        u32 ballot = __ballot_sync(FULL, bit);
        u64 bits16 = (u64)((ballot >> (16 * half)) & 0xffffu);
        word |= bits16 << (16 * (step % 4));
        if (step % 4 == 3) {
            u64 w = (start + (u64)step * LANES) / 64;
            if (lane == 0 && chunk < nchunks && w < nwords) {
                words[w] = word;
            }
            word = 0;
        }
    }
    __shared__ u32 mm[256];
    mm[threadIdx.x] = m;
    lanes_to_partial(s, 0.0f, 0.0f, chunk, nchunks, part_sum, part_sum + nchunks, part_max);
    __syncthreads();
    if (lane == 0 && chunk < nchunks) {
        u32 mx = 0;
        for (u32 j = 0; j < LANES; j++) {
            u32 v = mm[threadIdx.x + j];
            mx = v > mx ? v : mx;
        }
        part_max[chunk] = mx;
    }
}

// Largest magnitude bit pattern of residual (+ update when not null), atomically maxed into
// `*max_bits` (integer max is order-independent, so this is exact). NaN and infinities give
// patterns >= INF_BITS.
extern "C" __global__ void abs_max_bits(const float* residual, const float* update, u64 n,
                                        u32* max_bits) {
    u32 m = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float v = residual[i];
        if (update != 0) {
            v = __fadd_rn(v, update[i]);
        }
        u32 b = __float_as_uint(v) & ABS_MASK;
        m = b > m ? b : m;
    }
    for (int off = 16; off > 0; off /= 2) {
        u32 o = __shfl_down_sync(FULL, m, off);
        m = o > m ? o : m;
    }
    if ((threadIdx.x % 32) == 0) {
        atomicMax(max_bits, m);
    }
}

__device__ __forceinline__ int round_even_int(float y) {
    return (int)(__float_as_uint(__fadd_rn(y, MAGIC)) - MAGIC_BITS);
}

__device__ __forceinline__ float unit_u32(u32 key, u32 i) {
    u32 h = (i ^ key) * 0x9E3779B1u;
    h ^= h >> 16;
    h *= 0x85EBCA77u;
    h ^= h >> 13;
    h *= 0xC2B2AE3Du;
    h ^= h >> 16;
    return __fmul_rn((float)(h >> 8), 1.0f / 16777216.0f);
}

// Int8 quantisation fused with error feedback: v = residual (+ update); q = round(v * inv) in
// [-127, 127]; with `write_residual`, residual = v - q * scale (what the payload did not carry).
// One read of update and residual, one write of residual and payload. `stochastic` selects
// floor(v * inv + u) with the CPU's per-position uniform.
extern "C" __global__ void quantize_ef(float* residual, const float* update, u64 n, float inv,
                                       float scale, int stochastic, u64 seed, int write_residual,
                                       signed char* q) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float v = residual[i];
        if (update != 0) {
            v = __fadd_rn(v, update[i]);
        }
        float y = __fmul_rn(v, inv);
        y = y < -QMAX ? -QMAX : (y > QMAX ? QMAX : y);
        int qi;
        if (stochastic) {
            u32 key = (u32)hash_index(seed, i >> 32);
            float t = __fadd_rn(y, unit_u32(key, (u32)i));
            float r = __fsub_rn(__fadd_rn(t, MAGIC), MAGIC);
            qi = round_even_int(t) - (r > t ? 1 : 0);
            qi = qi < -127 ? -127 : (qi > 127 ? 127 : qi);
        } else {
            qi = round_even_int(y);
        }
        q[i] = (signed char)qi;
        if (write_residual) {
            residual[i] = __fsub_rn(v, __fmul_rn((float)qi, scale));
        }
    }
}

// One magnitude into a radix histogram (shared-memory counters).
__device__ __forceinline__ void radix_add(u32* local, u32 mag, bool valid, u32 match_shift,
                                          u32 prefix, u32 shift, u32 bins) {
    if (valid && (match_shift >= 32 || (mag >> match_shift) == prefix)) {
        atomicAdd(&local[(mag >> shift) & (bins - 1)], 1u);
    }
}

// Radix-select histogram pass: counts magnitudes whose bits above `shift + width` equal `prefix`
// (all of them when `match_shift` is 32), binned by the `width` bits at `shift`. Reads 16 bytes
// per thread and step when `x` is 16-byte aligned.
extern "C" __global__ void radix_histogram(const float* __restrict__ x, u64 n, u32 match_shift,
                                           u32 prefix, u32 shift, u32 bins, u32* hist) {
    extern __shared__ u32 local[];
    for (u32 b = threadIdx.x; b < bins; b += blockDim.x) {
        local[b] = 0;
    }
    __syncthreads();
    u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 nv = (((u64)x) % 16 == 0) ? n / 4 : 0;
    const float4* x4 = (const float4*)x;
    u64 rounds = (nv + stride - 1) / stride;
    for (u64 r = 0; r < rounds; r++) {
        u64 i = tid + r * stride;
        bool valid = i < nv;
        float4 v = valid ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        radix_add(local, __float_as_uint(v.x) & ABS_MASK, valid, match_shift, prefix, shift, bins);
        radix_add(local, __float_as_uint(v.y) & ABS_MASK, valid, match_shift, prefix, shift, bins);
        radix_add(local, __float_as_uint(v.z) & ABS_MASK, valid, match_shift, prefix, shift, bins);
        radix_add(local, __float_as_uint(v.w) & ABS_MASK, valid, match_shift, prefix, shift, bins);
    }
    u64 tail = n - nv * 4;
    rounds = (tail + stride - 1) / stride;
    for (u64 r = 0; r < rounds; r++) {
        u64 i = nv * 4 + tid + r * stride;
        bool valid = i < n;
        u32 mag = valid ? (__float_as_uint(x[i]) & ABS_MASK) : 0;
        radix_add(local, mag, valid, match_shift, prefix, shift, bins);
    }
    __syncthreads();
    for (u32 b = threadIdx.x; b < bins; b += blockDim.x) {
        if (local[b] != 0) {
            atomicAdd(&hist[b], local[b]);
        }
    }
}

#define TILE 4096u

// Per tile of TILE elements: how many magnitudes are above the threshold and how many equal it.
extern "C" __global__ void topk_count(const float* x, u64 n, u32 threshold, u32* gt, u32* eq) {
    __shared__ u32 sg, se;
    if (threadIdx.x == 0) {
        sg = 0;
        se = 0;
    }
    __syncthreads();
    u64 start = (u64)blockIdx.x * TILE;
    u32 g = 0, e = 0;
    for (u32 p = threadIdx.x; p < TILE; p += blockDim.x) {
        u64 i = start + p;
        if (i < n) {
            u32 mag = __float_as_uint(x[i]) & ABS_MASK;
            g += mag > threshold ? 1 : 0;
            e += mag == threshold ? 1 : 0;
        }
    }
    atomicAdd(&sg, g);
    atomicAdd(&se, e);
    __syncthreads();
    if (threadIdx.x == 0) {
        gt[blockIdx.x] = sg;
        eq[blockIdx.x] = se;
    }
}

// Exclusive prefix sum of `v` over the block in thread order, and the block total.
// blockDim.x must be 256 (8 warps).
__device__ u32 block_exclusive_sum(u32 v, u32* total) {
    __shared__ u32 warp_totals[8];
    u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    u32 inc = v;
    for (u32 off = 1; off < 32; off *= 2) {
        u32 y = __shfl_up_sync(FULL, inc, off);
        inc += lane >= off ? y : 0u;
    }
    if (lane == 31) {
        warp_totals[warp] = inc;
    }
    __syncthreads();
    u32 before = 0, sum = 0;
    for (u32 w = 0; w < 8; w++) {
        u32 c = warp_totals[w];
        before += w < warp ? c : 0u;
        sum += c;
    }
    __syncthreads();
    *total = sum;
    return before + inc - v;
}

// Magnitude bit patterns of `count` elements at evenly spaced positions (sample j is element
// floor(j * n / count)): the host picks from them a window of magnitudes that holds the k-th
// largest with high probability.
extern "C" __global__ void topk_sample(const float* x, u64 n, u32 count, u32* out) {
    for (u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < count; j += gridDim.x * blockDim.x) {
        u64 i = (u64)j * n / count;
        out[j] = __float_as_uint(x[i]) & ABS_MASK;
    }
}

// One pass over the slice for a magnitude window [lo, hi]: per tile of TILE elements, the count
// of magnitudes above `hi` goes to `gt[tile]` (all of them are selected); every magnitude in the
// window is appended with its index to the candidate lists (at most `cap`; the order is the
// blocks' arrival order). `totals` collects [above hi, candidates, non-finite], one atomic per
// block each. One block of 256 per tile, 16 elements per thread, all loads issued first.
extern "C" __global__ void topk_gather(const float* __restrict__ x, u64 n, u32 lo, u32 hi,
                                       u32* gt, u32* totals, float* __restrict__ cand_mag,
                                       u32* __restrict__ cand_idx, u32 cap) {
    __shared__ u32 base;
    u64 start = (u64)blockIdx.x * TILE;
    u32 mags[TILE / 256];
#pragma unroll
    for (u32 r = 0; r < TILE / 256; r++) {
        u64 i = start + (u64)r * 256 + threadIdx.x;
        mags[r] = i < n ? (__float_as_uint(x[i]) & ABS_MASK) : 0u;
    }
    u32 g = 0, c = 0, bad = 0;
#pragma unroll
    for (u32 r = 0; r < TILE / 256; r++) {
        bool valid = start + (u64)r * 256 + threadIdx.x < n;
        u32 m = mags[r];
        g += (valid && m > hi) ? 1u : 0u;
        c += (valid && m >= lo && m <= hi) ? 1u : 0u;
        bad += (valid && m >= INF_BITS) ? 1u : 0u;
    }
    u32 g_total, c_total, bad_total;
    block_exclusive_sum(g, &g_total);
    block_exclusive_sum(bad, &bad_total);
    u32 slot = block_exclusive_sum(c, &c_total);
    if (threadIdx.x == 0) {
        gt[blockIdx.x] = g_total;
        if (g_total != 0) {
            atomicAdd(&totals[0], g_total);
        }
        if (bad_total != 0) {
            atomicAdd(&totals[2], bad_total);
        }
        base = c_total != 0 ? atomicAdd(&totals[1], c_total) : 0u;
    }
    __syncthreads();
    slot += base;
    if (c != 0) {
#pragma unroll
        for (u32 r = 0; r < TILE / 256; r++) {
            u64 i = start + (u64)r * 256 + threadIdx.x;
            u32 m = mags[r];
            if (i < n && m >= lo && m <= hi) {
                if (slot < cap) {
                    cand_mag[slot] = __uint_as_float(m);
                    cand_idx[slot] = (u32)i;
                }
                slot++;
            }
        }
    }
}

// Once the threshold is known: each candidate above it adds one to its tile's `gt`, each equal
// to it one to its tile's `eq` (the tiles' counts for the ordered compaction).
extern "C" __global__ void topk_candidate_counts(const float* cand_mag, const u32* cand_idx,
                                                 u64 count, u32 threshold, u32* gt, u32* eq) {
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < count;
         c += (u64)gridDim.x * blockDim.x) {
        u32 mag = __float_as_uint(cand_mag[c]);
        u32 tile = cand_idx[c] / TILE;
        if (mag > threshold) {
            atomicAdd(&gt[tile], 1u);
        } else if (mag == threshold) {
            atomicAdd(&eq[tile], 1u);
        }
    }
}

// Ordered compaction of the selection: every magnitude above `threshold`, plus the first
// `eq_take[tile]` equal to it in the tile, written at `offsets[tile]` onwards in index order;
// the selected entries are zeroed in `x`. One block of 256 per tile; thread t holds the 16
// consecutive elements from t * 16, so two block-wide prefix sums (ties, then selections) place
// every entry.
extern "C" __global__ void topk_compact(float* __restrict__ x, u64 n, u32 threshold,
                                        const u32* offsets, const u32* eq_take,
                                        u32* __restrict__ out_idx, float* __restrict__ out_val) {
    const u32 PER = TILE / 256;
    u64 start = (u64)blockIdx.x * TILE + (u64)threadIdx.x * PER;
    float v[PER];
    if (((u64)x) % 16 == 0 && start + PER <= n) {
        const float4* x4 = (const float4*)(x + start);
#pragma unroll
        for (u32 j = 0; j < PER / 4; j++) {
            float4 f = x4[j];
            v[4 * j] = f.x;
            v[4 * j + 1] = f.y;
            v[4 * j + 2] = f.z;
            v[4 * j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (u32 j = 0; j < PER; j++) {
            v[j] = start + j < n ? x[start + j] : 0.0f;
        }
    }
    u32 eq = 0;
#pragma unroll
    for (u32 j = 0; j < PER; j++) {
        bool valid = start + j < n;
        eq += (valid && (__float_as_uint(v[j]) & ABS_MASK) == threshold) ? 1u : 0u;
    }
    u32 eq_total;
    u32 eq_before = block_exclusive_sum(eq, &eq_total);
    u32 ties = eq_take[blockIdx.x];
    u32 sel = 0, seen = eq_before;
#pragma unroll
    for (u32 j = 0; j < PER; j++) {
        bool valid = start + j < n;
        u32 mag = __float_as_uint(v[j]) & ABS_MASK;
        if (valid && mag > threshold) {
            sel++;
        } else if (valid && mag == threshold) {
            sel += seen < ties ? 1u : 0u;
            seen++;
        }
    }
    u32 sel_total;
    u32 out = offsets[blockIdx.x] + block_exclusive_sum(sel, &sel_total);
    if (sel != 0) {
        seen = eq_before;
#pragma unroll
        for (u32 j = 0; j < PER; j++) {
            bool valid = start + j < n;
            u32 mag = __float_as_uint(v[j]) & ABS_MASK;
            bool take = false;
            if (valid && mag > threshold) {
                take = true;
            } else if (valid && mag == threshold) {
                take = seen < ties;
                seen++;
            }
            if (take) {
                out_idx[out] = (u32)(start + j);
                out_val[out] = v[j];
                x[start + j] = 0.0f;
                out++;
            }
        }
    }
}

// Count-sketch of x - center (center may be null) into `out` (`buckets` entries, added to),
// by the blocked scheme of `CountSketch::locate`; `sum_sq` accumulates (x - center)^2.
extern "C" __global__ void count_sketch(const float* x, const float* center, u64 n, u64 first,
                                        u64 seed, u64 buckets, float* out, double* sum_sq) {
    double sq = 0.0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 g = first + i;
        u64 h = hash_index(seed, g / 64);
        u64 signs = mix64(h ^ SIGN_SALT);
        u64 pos = g % 64;
        u64 offset = __umul64hi(h, buckets);
        u64 bucket = (offset + pos) % buckets;
        float v = x[i];
        if (center != 0) {
            v = __fsub_rn(v, center[i]);
        }
        sq += (double)__fmul_rn(v, v);
        u32 flip = (u32)((signs >> pos) & 1ull) << 31;
        atomicAdd(&out[bucket], __uint_as_float(__float_as_uint(v) ^ flip));
    }
    for (int off = 16; off > 0; off /= 2) {
        sq += __shfl_down_sync(FULL, sq, off);
    }
    if ((threadIdx.x % 32) == 0) {
        atomicAdd(sum_sq, sq);
    }
}
