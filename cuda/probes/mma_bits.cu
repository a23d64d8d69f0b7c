// Probe (not part of the library): which tensor-core instructions give the same bits.
//   1. mma.sync m16n8k16 bf16 -> f32 under a permutation of k inside one instruction
//      (the same permutation applied to A's columns and B's rows).
//   2. wgmma m64n8k16 and m64n64k16 (A and B from shared memory, no swizzle) against
//      mma.sync m16n8k16 over the same logical k, one step and chains of 32 steps.
// Build: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o mma_bits mma_bits.cu
// Prints one line per comparison: outputs compared, outputs whose bits differ, and the
// largest relative distance of each instruction from an f64 reference (a layout check).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pair(const u16* p) { return (u32)p[0] | ((u32)p[1] << 16); }

// D (rows x n, f32) = C + A (rows x K) B^T (B: n x K), both bf16 K-major, by mma.sync in
// k16 steps. One warp per 16 rows; grid.x = trials.
extern "C" __global__ void by_mma(const u16* A, const u16* B, const float* C, float* D, int rows, int n, int K) {
    const int trial = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    A += (size_t)trial * rows * K; B += (size_t)trial * n * K; C += (size_t)trial * rows * n; D += (size_t)trial * rows * n;
    const int r = 16 * warp + g;
    for (int j = 0; j < n / 8; j++) {
        float d[4] = {C[r * n + 8 * j + 2 * t], C[r * n + 8 * j + 2 * t + 1], C[(r + 8) * n + 8 * j + 2 * t], C[(r + 8) * n + 8 * j + 2 * t + 1]};
        for (int k0 = 0; k0 < K; k0 += 16) {
            const u16* a = A + (size_t)r * K + k0;
            const u16* b = B + (size_t)(8 * j + g) * K + k0;
            mma_bf16(d, pair(a + 2 * t), pair(a + 8 * K + 2 * t), pair(a + 2 * t + 8), pair(a + 8 * K + 2 * t + 8),
                     pair(b + 2 * t), pair(b + 2 * t + 8));
        }
        D[r * n + 8 * j + 2 * t] = d[0]; D[r * n + 8 * j + 2 * t + 1] = d[1];
        D[(r + 8) * n + 8 * j + 2 * t] = d[2]; D[(r + 8) * n + 8 * j + 2 * t + 1] = d[3];
    }
}

__device__ __forceinline__ u64 desc(const void* smem, u32 lbo, u32 sbo) {
    const u32 addr = (u32)__cvta_generic_to_shared(smem);
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)((sbo & 0x3FFFF) >> 4) << 32);
}
// Core matrices of 8 rows x 16 bytes, (row group rg, k half kc) at (2 rg + kc) 128 bytes.
__device__ void stage(u16* s, const u16* src, int rows, int K, int k0) {
    for (int i = threadIdx.x; i < rows * 16; i += blockDim.x) {
        const int r = i / 16, k = i % 16;
        s[((r / 8) * 2 + k / 8) * 64 + (r % 8) * 8 + k % 8] = src[(size_t)r * K + k0 + k];
    }
}

template <int N>
__device__ __forceinline__ void wgmma_step(float* d, u64 da, u64 db);
template <>
__device__ __forceinline__ void wgmma_step<8>(float* d, u64 da, u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_step<64>(float* d, u64 da, u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "%32, %33, 1, 1, 1, 0, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db));
}

// Same as by_mma with rows = 64, one warpgroup, wgmma m64nNk16.
template <int N>
__device__ void by_wgmma_impl(const u16* A, const u16* B, const float* C, float* D, int K, int lbo, int sbo) {
    __shared__ __align__(128) u16 sa[64 * 16], sb[N * 16];
    const int trial = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    A += (size_t)trial * 64 * K; B += (size_t)trial * N * K; C += (size_t)trial * 64 * N; D += (size_t)trial * 64 * N;
    const int r = 16 * warp + g;
    float d[N / 2];
    for (int j = 0; j < N / 8; j++) {
        d[4 * j] = C[r * N + 8 * j + 2 * t]; d[4 * j + 1] = C[r * N + 8 * j + 2 * t + 1];
        d[4 * j + 2] = C[(r + 8) * N + 8 * j + 2 * t]; d[4 * j + 3] = C[(r + 8) * N + 8 * j + 2 * t + 1];
    }
    for (int k0 = 0; k0 < K; k0 += 16) {
        __syncthreads();
        stage(sa, A, 64, K, k0);
        stage(sb, B, N, K, k0);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        wgmma_step<N>(d, desc(sa, lbo, sbo), desc(sb, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    for (int j = 0; j < N / 8; j++) {
        D[r * N + 8 * j + 2 * t] = d[4 * j]; D[r * N + 8 * j + 2 * t + 1] = d[4 * j + 1];
        D[(r + 8) * N + 8 * j + 2 * t] = d[4 * j + 2]; D[(r + 8) * N + 8 * j + 2 * t + 1] = d[4 * j + 3];
    }
}
extern "C" __global__ void by_wgmma8(const u16* A, const u16* B, const float* C, float* D, int K, int lbo, int sbo) {
    by_wgmma_impl<8>(A, B, C, D, K, lbo, sbo);
}
extern "C" __global__ void by_wgmma64(const u16* A, const u16* B, const float* C, float* D, int K, int lbo, int sbo) {
    by_wgmma_impl<64>(A, B, C, D, K, lbo, sbo);
}

static u16 bf16(float f) { u32 u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (u16)(u >> 16); }
static double wide(u16 h) { u32 u = (u32)h << 16; float f; memcpy(&f, &u, 4); return f; }

struct Case { int rows, n, K, trials; bool wide_exp; };

static std::mt19937_64 rng(7);
static float sample(bool wide_exp) {
    std::normal_distribution<float> nd(0.f, 1.f);
    float v = nd(rng);
    if (wide_exp) v = ldexpf(v, (int)(rng() % 41) - 20);
    return v;
}

template <class T> static T* up(const std::vector<T>& v) { T* p; CK(cudaMalloc(&p, v.size() * sizeof(T))); CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice)); return p; }
static std::vector<float> down(const float* p, size_t n) { std::vector<float> v(n); CK(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost)); return v; }

static void report(const char* what, const std::vector<float>& x, const std::vector<float>& y) {
    size_t diff = 0; double worst = 0;
    for (size_t i = 0; i < x.size(); i++) {
        u32 a, b; memcpy(&a, &x[i], 4); memcpy(&b, &y[i], 4);
        if (a != b) { diff++; worst = std::max(worst, fabs((double)x[i] - y[i]) / std::max(1e-30, fabs((double)x[i]))); }
    }
    printf("%-64s outputs %8zu  differ %8zu  worst rel %.3g\n", what, x.size(), diff, worst);
}
// Max over outputs of |got - ref| / (sum |terms|), ref in f64.
static double refdist(const std::vector<u16>& A, const std::vector<u16>& B, const std::vector<float>& C, const std::vector<float>& D, int rows, int n, int K, int trials) {
    double worst = 0;
    for (int tr = 0; tr < trials; tr++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < n; c++) {
                double s = C[((size_t)tr * rows + r) * n + c], mag = fabs(s);
                for (int k = 0; k < K; k++) {
                    double p = wide(A[((size_t)tr * rows + r) * K + k]) * wide(B[((size_t)tr * n + c) * K + k]);
                    s += p; mag += fabs(p);
                }
                worst = std::max(worst, fabs(D[((size_t)tr * rows + r) * n + c] - s) / std::max(mag, 1e-30));
            }
    return worst;
}

int main() {
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, cc %d.%d\n", prop.name, prop.major, prop.minor);
    for (int wide_exp = 0; wide_exp < 2; wide_exp++) {
        for (int K : {16, 512}) {
            const int trials = K == 16 ? 4096 : 256;
            // ---- 1. mma.sync under permutations of k inside each 16-step.
            const int rows = 64, n = 64;
            std::vector<u16> A((size_t)trials * rows * K), B((size_t)trials * n * K);
            std::vector<float> C((size_t)trials * rows * n);
            for (auto& v : A) v = bf16(sample(wide_exp));
            for (auto& v : B) v = bf16(sample(wide_exp));
            for (auto& v : C) v = sample(wide_exp) * (K == 16 ? 4.f : 1.f);
            float* dC = up(C); float* dD; CK(cudaMalloc(&dD, C.size() * 4));
            u16* dA = up(A); u16* dB = up(B);
            by_mma<<<trials, 128>>>(dA, dB, dC, dD, rows, n, K); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
            auto base = down(dD, C.size());
            char label[160];
            snprintf(label, sizeof label, "[K=%d %s] mma.sync vs f64 (rel to sum|terms|): %.3g", K, wide_exp ? "wide exp" : "normal", refdist(A, B, C, base, rows, n, K, std::min(trials, 64)));
            printf("%s\n", label);
            const char* names[] = {"swap k halves 0-7 <-> 8-15", "reverse within k 0-7 and 8-15", "random permutation of 16", "canonical pairs (0,1,8,9,..) -> contiguous"};
            for (int pi = 0; pi < 4; pi++) {
                int perm[16];
                for (int i = 0; i < 16; i++) perm[i] = i;
                if (pi == 0) for (int i = 0; i < 16; i++) perm[i] = (i + 8) % 16;
                if (pi == 1) for (int i = 0; i < 16; i++) perm[i] = (i / 8) * 8 + 7 - i % 8;
                if (pi == 2) std::shuffle(perm, perm + 16, rng);
                if (pi == 3) { int q[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15}; memcpy(perm, q, sizeof q); }
                std::vector<u16> A2(A), B2(B);
                for (size_t row = 0; row < A.size() / K; row++) for (int k = 0; k < K; k++) A2[row * K + k] = A[row * K + (k / 16) * 16 + perm[k % 16]];
                for (size_t row = 0; row < B.size() / K; row++) for (int k = 0; k < K; k++) B2[row * K + k] = B[row * K + (k / 16) * 16 + perm[k % 16]];
                u16* dA2 = up(A2); u16* dB2 = up(B2);
                by_mma<<<trials, 128>>>(dA2, dB2, dC, dD, rows, n, K); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
                snprintf(label, sizeof label, "[K=%d %s] mma.sync, %s", K, wide_exp ? "wide exp" : "normal", names[pi]);
                report(label, base, down(dD, C.size()));
                cudaFree(dA2); cudaFree(dB2);
            }
            // ---- 2. wgmma against mma.sync, same logical k (rows 64, n 64 then n 8 on the first 8 columns).
            if (prop.major == 9) {
                for (int lay = 0; lay < 2; lay++) {
                    const int lbo = lay == 0 ? 128 : 256, sbo = lay == 0 ? 256 : 128;
                    by_wgmma64<<<trials, 128>>>(dA, dB, dC, dD, K, lbo, sbo); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
                    auto w = down(dD, C.size());
                    snprintf(label, sizeof label, "[K=%d %s] wgmma m64n64k16 (lbo %d sbo %d) vs mma.sync; f64 dist %.3g", K, wide_exp ? "wide exp" : "normal", lbo, sbo, refdist(A, B, C, w, rows, n, K, std::min(trials, 64)));
                    report(label, base, w);
                }
                // n8: first 8 columns of each trial's B and C.
                std::vector<u16> B8((size_t)trials * 8 * K); std::vector<float> C8((size_t)trials * 64 * 8);
                for (int tr = 0; tr < trials; tr++) {
                    memcpy(&B8[(size_t)tr * 8 * K], &B[(size_t)tr * n * K], 8 * K * 2);
                    for (int r = 0; r < 64; r++) for (int c = 0; c < 8; c++) C8[((size_t)tr * 64 + r) * 8 + c] = C[((size_t)tr * 64 + r) * n + c];
                }
                u16* dB8 = up(B8); float* dC8 = up(C8); float* dD8; CK(cudaMalloc(&dD8, C8.size() * 4));
                by_wgmma8<<<trials, 128>>>(dA, dB8, dC8, dD8, K, 128, 256); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
                auto w8 = down(dD8, C8.size());
                std::vector<float> b8(C8.size());
                for (int tr = 0; tr < trials; tr++) for (int r = 0; r < 64; r++) for (int c = 0; c < 8; c++) b8[((size_t)tr * 64 + r) * 8 + c] = base[((size_t)tr * 64 + r) * n + c];
                snprintf(label, sizeof label, "[K=%d %s] wgmma m64n8k16 vs mma.sync", K, wide_exp ? "wide exp" : "normal");
                report(label, b8, w8);
                cudaFree(dB8); cudaFree(dC8); cudaFree(dD8);
            }
            cudaFree(dA); cudaFree(dB); cudaFree(dC); cudaFree(dD);
        }
    }
    return 0;
}
