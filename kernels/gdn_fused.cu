// A GDN layer's batch-1 decode mixer up to its output norm in one launch: the input norm,
// the in-projection, the causal conv (SiLU) with its tail shifted in the slot pool, and the
// gated delta rule's step with the state updated in its slot. CUDA C++ for Hopper (sm_90a),
// built on the GPU machine by `kernels.gdn_fused` (nvcc), where the Triton chain
// (`kernels.skinny`'s in-projection with its conv epilogue, then `kernels.gdn_decode`) is
// two kernels with a grid-wide boundary between them.
//
// One thread block cluster per key head: CL = 8 R blocks (R value heads per key head), each
// owning 8 of the key head's q rows and 8 of its k rows, 16 v rows and 16 z rows of one of
// its value heads (block rank r: value head hk R + r / 8, rows (r % 8) 16 ..), and the b or
// a row of that value head (ranks r % 8 == 0 / 1). A block holds its rows of the weight in
// registers, loaded before the programmatic-dependent-launch wait, so they stream while
// the kernels before it run; after the wait it norms the row, makes its rows' sums, convs
// its q / k / v channels, and hands them to the cluster through shared memory. After one
// cluster barrier each block reads the head's whole q and k from its peers (distributed
// shared memory) and runs the step for its 16 value columns: the same arithmetic as
// kernels/gdn_decode.py with use_qk_l2norm and raw gates.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace cg = cooperative_groups;

namespace {

constexpr int DK = 128, DV = 128, R = 2;  // head sizes; value heads per key head
constexpr int CL = 8 * R;                 // blocks per cluster (per key head)
constexpr int QKR = DK / CL;              // q rows (and k rows) per block: 8
constexpr int VSUB = 8;                   // blocks per value head
constexpr int VR = DV / VSUB;             // v rows (and z rows) per block: 16
constexpr int ROWS = 2 * QKR + 2 * VR + 1;  // + b or a: 49 (the last is empty on ranks 2..7)
constexpr int THREADS = 320, WARPS = THREADS / 32;  // 10 warps: 5 rows each
constexpr int RPW = (ROWS + WARPS - 1) / WARPS;
constexpr int STEP_WARPS = 8;  // the step's 256 threads: (Dk row, half of the 16 columns)
constexpr float L2_EPS = 1e-6f;
#ifndef MAXREG
#define MAXREG 168
#endif

struct Params {
  const __nv_bfloat16* h;       // [K]: the residual stream's row
  const __nv_bfloat16* norm_w;  // [K]: the input norm's weight (zero-centred: offset + w)
  const __nv_bfloat16* w;       // [N, K] the packed in-projection: q, k, v, z, b, a rows
  const __nv_bfloat16* conv_w;  // [C, 4]
  __nv_bfloat16* conv_pool;     // [slots, C, 3]
  const int64_t* slots;         // [1]: the lane's slot (negative: a padding lane)
  const int64_t* dests;         // [1]: where its new conv tail and state go
  float* rec;                   // [slots, Hv, DK, DV]
  const void* a_log;            // [Hv]
  const void* dt_bias;          // [Hv]
  __nv_bfloat16* o;             // [Hv, DV]: the step's output
  __nv_bfloat16* z;             // [Hv, DV]: the output gate's projection
  long long s_w, s_cwc, s_cwk, s_cn, s_cc, s_sn, s_sh, s_sk;
  float eps, offset, scale;
  int hk_heads, hv_heads, gates_f32, fence;
};

__device__ __forceinline__ float lo_bf(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_bf(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float round_bf(float x) {
  return __bfloat162float(__float2bfloat16(x));
}
__device__ __forceinline__ float load_param(const void* p, int i, int f32) {
  return f32 ? static_cast<const float*>(p)[i]
             : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ __forceinline__ uint4 load_nc(const void* p) {  // streamed once: no L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float warp_sum(float v, int from) {
#pragma unroll
  for (int m = from; m < 32; m <<= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// The packed row of local row lr of block rank r in key head hk (-1: none).
__device__ __forceinline__ int packed_row(int lr, int hk, int r, int Hk, int Hv) {
  const int hv = hk * R + r / VSUB, sub = r % VSUB;
  if (lr < QKR) return hk * DK + r * QKR + lr;                            // q
  if (lr < 2 * QKR) return Hk * DK + hk * DK + r * QKR + (lr - QKR);      // k
  if (lr < 2 * QKR + VR) return 2 * Hk * DK + hv * DV + sub * VR + (lr - 2 * QKR);  // v
  if (lr < 2 * QKR + 2 * VR)                                              // z
    return 2 * Hk * DK + Hv * DV + hv * DV + sub * VR + (lr - 2 * QKR - VR);
  if (sub < 2) return 2 * Hk * DK + 2 * Hv * DV + sub * Hv + hv;          // b, then a
  return -1;
}

template <int K>
__global__ void __maxnreg__(MAXREG) gdn_in_step_kernel(const __grid_constant__ Params p) {
  constexpr int CH = K / 256;  // 16-byte chunks of a row per lane
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hk = blockIdx.x / CL, r = static_cast<int>(cluster.block_rank());
  const int hv = hk * R + r / VSUB, sub = r % VSUB;
  const int Hk = p.hk_heads, Hv = p.hv_heads;

  __shared__ float ysm[ROWS];            // this block's rows' sums
  __shared__ float exch[2 * QKR + VR + 1];  // q, k, v after the conv, and b or a: the cluster's
  __shared__ float red[STEP_WARPS][2][16];    // per warp: S^T k and S^T q partial sums
  __shared__ float scal[STEP_WARPS][3];       // per warp: |q|^2, |k|^2, q.k
  __shared__ float usm[VR];
  __shared__ float bcast[2];             // decay, 1 / |k|

  if (!p.fence) cudaTriggerProgrammaticLaunchCompletion();

  // before the wait: this block's weights (never written by a kernel)
  uint4 wr[RPW][CH];
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int lr = warp + WARPS * j;
    const int gr = lr < ROWS ? packed_row(lr, hk, r, Hk, Hv) : -1;
#pragma unroll
    for (int c = 0; c < CH; ++c)
      wr[j][c] = gr >= 0 ? load_nc(p.w + gr * p.s_w + c * 256 + lane * 8) : make_uint4(0, 0, 0, 0);
  }
  // the conv of rows 0 .. 2 QKR + VR - 1 (thread t: row t): its weights now, its tail below
  const bool conv_row = tid < 2 * QKR + VR;
  const int ch = conv_row ? packed_row(tid, hk, r, Hk, Hv) : 0;
  float cw[4] = {0.f, 0.f, 0.f, 0.f};
  if (conv_row) {
#pragma unroll
    for (int j = 0; j < 4; ++j) cw[j] = __bfloat162float(p.conv_w[ch * p.s_cwc + j * p.s_cwk]);
  }
  const bool stepper = tid < 2 * DK;
  const int i = (tid >> 1) % DK, j0 = (tid & 1) * 8;  // the step: Dk row i, columns j0 .. j0+7
  float a_rate = 0.f, dtb = 0.f;
  if (tid < VR) {
    a_rate = -__expf(load_param(p.a_log, hv, p.gates_f32));
    dtb = load_param(p.dt_bias, hv, p.gates_f32);
  }
  // the slot pools: written only by earlier forwards, so read before the wait unless the
  // kernel before this one fetched the slots themselves (fence)
  int64_t slot = 0, dest = 0;
  float old[3] = {0.f, 0.f, 0.f}, S[8];
  auto load_pools = [&]() {
    slot = p.slots[0];
    dest = p.dests[0];
    if (conv_row && slot >= 0) {
      const __nv_bfloat16* t = p.conv_pool + slot * p.s_cn + ch * p.s_cc;
#pragma unroll
      for (int j = 0; j < 3; ++j) old[j] = __bfloat162float(t[j]);
    }
    if (slot >= 0 && stepper) {
      const float4* s = reinterpret_cast<const float4*>(
          p.rec + slot * p.s_sn + hv * p.s_sh + i * p.s_sk + sub * VR + j0);
      const float4 a = s[0], b = s[1];
      S[0] = a.x; S[1] = a.y; S[2] = a.z; S[3] = a.w;
      S[4] = b.x; S[5] = b.y; S[6] = b.z; S[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) S[j] = 0.f;
    }
  };
  if (!p.fence) load_pools();

  cudaGridDependencySynchronize();  // from here on: what earlier kernels wrote, and writes
  if (p.fence) {
    cudaTriggerProgrammaticLaunchCompletion();
    load_pools();
  }

  // the input norm, every warp over the whole row: x = bf16(h / rms(h) * (offset + w))
  uint32_t x[CH * 4];
  float ss = 0.f;
  {
    uint4 hr[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) hr[c] = *reinterpret_cast<const uint4*>(p.h + c * 256 + lane * 8);
    uint4 nw[CH];  // (after the wait, beside h's load: 2 KB that every block reads, from L2)
#pragma unroll
    for (int c = 0; c < CH; ++c)
      nw[c] = *reinterpret_cast<const uint4*>(p.norm_w + c * 256 + lane * 8);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const uint32_t u[4] = {hr[c].x, hr[c].y, hr[c].z, hr[c].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) ss += lo_bf(u[q]) * lo_bf(u[q]) + hi_bf(u[q]) * hi_bf(u[q]);
    }
    const float inv = rsqrtf(warp_sum(ss, 1) / K + p.eps);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const uint32_t u[4] = {hr[c].x, hr[c].y, hr[c].z, hr[c].w};
      const uint32_t g[4] = {nw[c].x, nw[c].y, nw[c].z, nw[c].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo_bf(u[q]) * inv * (p.offset + lo_bf(g[q])),
                                                       hi_bf(u[q]) * inv * (p.offset + hi_bf(g[q])));
        x[c * 4 + q] = *reinterpret_cast<const uint32_t*>(&v);
      }
    }
  }
  // this block's rows: a warp a row at a time, each lane 8 K-elements of each chunk
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const uint32_t* wv = reinterpret_cast<const uint32_t*>(&wr[j][0]);
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < CH * 4; ++e)
      acc += lo_bf(wv[e]) * lo_bf(x[e]) + hi_bf(wv[e]) * hi_bf(x[e]);
    acc = warp_sum(acc, 1);
    const int lr = warp + WARPS * j;
    if (lane == 0 && lr < ROWS) ysm[lr] = acc;
  }
  __syncthreads();

  // the conv (SiLU) of the q / k / v rows, their tails shifted into the dest slot; z out
  if (conv_row) {
    const float y = round_bf(ysm[tid]);
    const float acc = cw[0] * old[0] + cw[1] * old[1] + cw[2] * old[2] + cw[3] * y;
    exch[tid] = round_bf(acc / (1.f + __expf(-acc)));
    if (slot >= 0) {
      __nv_bfloat16* t = p.conv_pool + dest * p.s_cn + ch * p.s_cc;
      t[0] = __float2bfloat16(old[1]);
      t[1] = __float2bfloat16(old[2]);
      t[2] = __float2bfloat16(y);
    }
  } else if (tid < 2 * QKR + 2 * VR) {
    p.z[hv * DV + sub * VR + (tid - 2 * QKR - VR)] = __float2bfloat16(ysm[tid]);
  } else if (tid == 2 * QKR + 2 * VR && sub < 2) {
    exch[2 * QKR + VR] = round_bf(ysm[tid]);  // b (sub 0) or a (sub 1)
  }
  cluster.sync();  // every block's q, k, v, b, a visible to the cluster

  // the step: thread (i, j0) reads q_i, k_i from the block that made them
  const float* peer = cluster.map_shared_rank(exch, i / QKR);
  const float qi = peer[i % QKR], ki = peer[QKR + i % QKR];
  const int base = (r / VSUB) * VSUB;
  const float bb = cluster.map_shared_rank(exch, base)[2 * QKR + VR];
  const float aa = cluster.map_shared_rank(exch, base + 1)[2 * QKR + VR];
  cluster.barrier_arrive();  // (this block's part read by its peers: wait before exiting)

  float pk[8], pq[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    pk[j] = warp_sum(S[j] * ki, 2);
    pq[j] = warp_sum(S[j] * qi, 2);
  }
  const bool even = (tid & 1) == 0;
  const float sq = warp_sum(even ? qi * qi : 0.f, 1), sk = warp_sum(even ? ki * ki : 0.f, 1),
              sqk = warp_sum(even ? qi * ki : 0.f, 1);
  if (lane < 2 && stepper) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      red[warp][0][j0 + j] = pk[j];
      red[warp][1][j0 + j] = pq[j];
    }
  }
  if (lane == 0 && stepper) {
    scal[warp][0] = sq;
    scal[warp][1] = sk;
    scal[warp][2] = sqk;
  }
  __syncthreads();
  if (tid < VR) {
    float rk_ = 0.f, rq_ = 0.f, qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int w = 0; w < STEP_WARPS; ++w) {
      rk_ += red[w][0][tid];
      rq_ += red[w][1][tid];
      qq += scal[w][0];
      kk += scal[w][1];
      qk += scal[w][2];
    }
    const float rq = p.scale * rsqrtf(qq + L2_EPS), rk = rsqrtf(kk + L2_EPS);
    const float xg = aa + dtb;
    const float softplus = xg > 20.f ? xg : logf(1.f + expf(fminf(xg, 20.f)));
    const float decay = expf(a_rate * softplus);
    const float beta = 1.f / (1.f + expf(-bb));
    const float v = exch[2 * QKR + tid];
    const float u = beta * (v - decay * (rk_ * rk));
    const float o = decay * (rq_ * rq) + (qk * (rq * rk)) * u;
    p.o[hv * DV + sub * VR + tid] = __float2bfloat16(o);
    usm[tid] = u;
    if (tid == 0) {
      bcast[0] = decay;
      bcast[1] = rk;
    }
  }
  __syncthreads();
  if (slot >= 0 && stepper) {
    const float decay = bcast[0], kn = ki * bcast[1];
    float4 a, b;
    a.x = S[0] * decay + kn * usm[j0 + 0]; a.y = S[1] * decay + kn * usm[j0 + 1];
    a.z = S[2] * decay + kn * usm[j0 + 2]; a.w = S[3] * decay + kn * usm[j0 + 3];
    b.x = S[4] * decay + kn * usm[j0 + 4]; b.y = S[5] * decay + kn * usm[j0 + 5];
    b.z = S[6] * decay + kn * usm[j0 + 6]; b.w = S[7] * decay + kn * usm[j0 + 7];
    float4* s = reinterpret_cast<float4*>(p.rec + dest * p.s_sn + hv * p.s_sh + i * p.s_sk +
                                          sub * VR + j0);
    s[0] = a;
    s[1] = b;
  }
  cluster.barrier_wait();
}

template <int K>
cudaError_t launch(const Params& p, int pdl, cudaStream_t stream) {
  auto kernel = gdn_in_step_kernel<K>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.hk_heads * CL);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = CL;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int K>
int clusters(int* out) {
  auto kernel = gdn_in_step_kernel<K>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(8 * CL);
  cfg.blockDim = dim3(THREADS);
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = CL;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(out, kernel, &cfg);
}

}  // namespace

extern "C" {

// The layout of Params, for the caller's check: its size in bytes.
int ninfer_gdn_in_step_params_size() { return static_cast<int>(sizeof(Params)); }

// How many clusters of this kernel can be resident at once (hidden size K), or -error.
int ninfer_gdn_in_step_clusters(int K) {
  int n = 0;
  int e = K == 1024 ? clusters<1024>(&n) : -1;
  return e == 0 ? n : -(e == -1 ? 1 : e);
}

// Launch on `stream` (a cudaStream_t): 0, or a CUDA error code (-1: unsupported K).
int ninfer_gdn_in_step(const void* params, int K, int pdl, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const Params& p = *static_cast<const Params*>(params);
  if (K == 1024) return launch<1024>(p, pdl, s);
  return -1;
}

}  // extern "C"
