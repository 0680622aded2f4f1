/* The ordered reduction kernel of the nccl backend: the device twin of ddp_reduce_fold
 * (src/algo/reduce.c), so canonical collectives keep their data on the GPU.
 *
 * Contract: dst[i] = (((src_0[i] op src_1[i]) op src_2[i]) ... op src_{W-1}[i]), then the
 * AVG division by W, where src_j = base + j * stride_bytes. Every element is computed by one
 * thread in rank order, with exactly the host kernel's arithmetic: fp32/fp64 operations in
 * their own type (compiled with -fmad=false so no addition is fused into a multiply-add, and
 * IEEE division), fp16/bf16 widened to fp32 and rounded back after every operation with the
 * same bit-level round-to-nearest-even (and NaN encoding) as src/common/half.c, integer sums
 * and products on unsigned types (wrapping), float MIN/MAX propagating NaN. The results are
 * therefore bitwise equal to the host fold. dst may alias source 0 (each thread reads all its
 * sources before it writes). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

namespace {

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5, U8 = 6 };
enum { SUM = 0, AVG = 1, MIN = 2, MAX = 3, PRODUCT = 4 };

/* Bit casts usable on host and device (the conversions are host-callable for testing). */
__host__ __device__ float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
__host__ __device__ uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

__host__ __device__ float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0) {
    if (m == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      e = 127 - 15 + 1;
      while (!(m & 0x400u)) {
        m <<= 1;
        e--;
      }
      u = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e + 127 - 15) << 23) | (m << 13);
  }
  return u2f(u);
}

__host__ __device__ uint16_t f32_to_f16(float f) {
  uint32_t u = f2u(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
  if (a < 0x38800000u) {
    if (a < 0x33000000u) return sign;
    uint32_t exp = a >> 23, mant = (a & 0x007fffffu) | 0x00800000u, shift = 126u - exp;
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = a - 0x38000000u, lsb = (r >> 13) & 1u;
  r += 0x0fffu + lsb;
  return (uint16_t)(sign | (r >> 13));
}

__host__ __device__ float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

__host__ __device__ uint16_t f32_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return (uint16_t)(u >> 16);
}

template <typename T> __host__ __device__ T fmin_(T a, T b) { return isnan(b) ? b : (b < a ? b : a); }
template <typename T> __host__ __device__ T fmax_(T a, T b) { return isnan(b) ? b : (b > a ? b : a); }

template <typename T> __host__ __device__ T fop(int op, T a, T b) {
  switch (op) {
    case PRODUCT: return a * b;
    case MIN: return fmin_(a, b);
    case MAX: return fmax_(a, b);
    default: return a + b;
  }
}

template <typename T, typename U> __host__ __device__ T iop(int op, T a, T b) {
  switch (op) {
    case PRODUCT: return (T)((U)a * (U)b);
    case MIN: return b < a ? b : a;
    case MAX: return b > a ? b : a;
    default: return (T)((U)a + (U)b);
  }
}

template <typename T>
__host__ __device__ const T *src(const unsigned char *base, size_t stride, int j) {
  return reinterpret_cast<const T *>(base + (size_t)j * stride);
}

/* Element i of the fold (host-callable, so its arithmetic can be checked without a GPU). */
__host__ __device__ void fold_one(int dt, int op, int W, const unsigned char *base, size_t stride,
                                  void *dst, size_t i) {
  switch (dt) {
    case F32: {
      float a = src<float>(base, stride, 0)[i];
      for (int j = 1; j < W; j++) a = fop(op, a, src<float>(base, stride, j)[i]);
      if (op == AVG) a = a / (float)W;
      static_cast<float *>(dst)[i] = a;
      break;
    }
    case F64: {
      double a = src<double>(base, stride, 0)[i];
      for (int j = 1; j < W; j++) a = fop(op, a, src<double>(base, stride, j)[i]);
      if (op == AVG) a = a / (double)W;
      static_cast<double *>(dst)[i] = a;
      break;
    }
    case F16:
    case BF16: {
      bool h = dt == F16;
      uint16_t a = src<uint16_t>(base, stride, 0)[i];
      for (int j = 1; j < W; j++) {
        uint16_t b = src<uint16_t>(base, stride, j)[i];
        float r = fop(op, h ? f16_to_f32(a) : bf16_to_f32(a), h ? f16_to_f32(b) : bf16_to_f32(b));
        a = h ? f32_to_f16(r) : f32_to_bf16(r);
      }
      if (op == AVG) {
        float r = (h ? f16_to_f32(a) : bf16_to_f32(a)) / (float)W;
        a = h ? f32_to_f16(r) : f32_to_bf16(r);
      }
      static_cast<uint16_t *>(dst)[i] = a;
      break;
    }
    case I32: {
      int32_t a = src<int32_t>(base, stride, 0)[i];
      for (int j = 1; j < W; j++) a = iop<int32_t, uint32_t>(op, a, src<int32_t>(base, stride, j)[i]);
      if (op == AVG) a = a / W;
      static_cast<int32_t *>(dst)[i] = a;
      break;
    }
    case I64: {
      int64_t a = src<int64_t>(base, stride, 0)[i];
      for (int j = 1; j < W; j++) a = iop<int64_t, uint64_t>(op, a, src<int64_t>(base, stride, j)[i]);
      if (op == AVG) a = a / W;
      static_cast<int64_t *>(dst)[i] = a;
      break;
    }
    default: {
      uint8_t a = src<uint8_t>(base, stride, 0)[i];
      for (int j = 1; j < W; j++) a = iop<uint8_t, uint32_t>(op, a, src<uint8_t>(base, stride, j)[i]);
      if (op == AVG) a = (uint8_t)(a / W);
      static_cast<uint8_t *>(dst)[i] = a;
      break;
    }
  }
}

__global__ void fold(int dt, int op, int W, const unsigned char *base, size_t stride, void *dst,
                     size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    fold_one(dt, op, W, base, stride, dst, i);
}

}  // namespace

extern "C" bool ddp__nccl_have_fold_kernel(void) { return true; }

/* Enqueues the fold on `stream` (declared in nccl.h; dtype and op are the ddp_dtype_t and
 * ddp_redop_t values). Returns the launch's error. */
extern "C" cudaError_t ddp__nccl_fold_launch(int dtype, int op, int world, const void *base,
                                             size_t stride_bytes, void *dst, size_t n,
                                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  size_t blocks = (n + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  fold<<<(unsigned)blocks, 256, 0, stream>>>(dtype, op, world,
                                             static_cast<const unsigned char *>(base),
                                             stride_bytes, dst, n);
  return cudaGetLastError();
}
