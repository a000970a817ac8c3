// Quantized matmul of 2..8 activation rows that reads each packed weight once
// (CUDA; body for mx.fast.cuda_kernel). MLX's CUDA backend runs its one-row
// kernel (qmv, mlx/backend/cuda/quantized/qmm/qmv.cu) once per row for
// 2 <= rows < 8, so a verify of k+1 tokens reads the weights k+1 times; this
// kernel reads them once and gives every row the bits qmv gives it alone.
//
// inputs : x [M,K] InT; w [N,K*BITS/32] uint32 (mlx affine packing, value j of
//          a word at bits BITS*j); scales, biases [N,K/GS] InT
// outputs: y [M,N] InT
// template: InT, M (rows, 1..8), N, K, GS (32/64/128), BITS (4/8), E (values
//          a lane takes per step: qmv's elems_per_thread, 16 for 4-bit 16-bit
//          types, else 8), COLS (output columns per warp), DQ_FMA
// grid (256 * ceil(N / (8 * COLS)), 1, 1), threadgroup (256, 1, 1): warp v of
// block b owns columns (b * 8 + v) * COLS + c, c < COLS.
//
// Per (row, column) the arithmetic is qmv's, operation for operation:
// - lane l takes values l*E + j (+ 32*E per step, then the K % (32*E) tail at
//   K - rest + l*E); a value dequantizes in InT as q * scale + bias;
// - accumulation per j: 16-bit InT at 4 bits accumulates in InT with a fused
//   multiply-add (cutlass's fma.rn.bf16x2 / hfma2); 8 bits or fp32 accumulate
//   in fp32 with fmaf (on 16-bit types: of the values converted to float);
// - the E accumulators are summed in fp32 in j order, then over the warp by
//   xor-shuffles 16, 8, 4, 2, 1 (cg::reduce's tree), cast to InT once.
// qmv writes `w * scale + bias` with cutlass operators that the compiler may
// contract into one fma; DQ_FMA picks the fused (true) or the separately
// rounded (false) form, and the self-check keeps whichever equals MLX's.
// 16-bit values go in pairs (bf16x2 / half2 instructions, as cutlass's Array
// operators): each half of a pair rounds as its scalar operation would.
// Each weight word is read once per column and used for all M rows; the rows'
// x values come from L1.
//@header
template <bool C, typename A, typename B>
struct mtp_if {
  using type = A;
};
template <typename A, typename B>
struct mtp_if<false, A, B> {
  using type = B;
};
// 16-bit types in pairs (bf16x2 / half2 instructions, as cutlass's Array ops):
// each lane of a pair rounds exactly as the scalar operation
__device__ __forceinline__ __nv_bfloat162 mtp_pair(__nv_bfloat16, float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ __half2 mtp_pair(__half, float a, float b) { return __floats2half2_rn(a, b); }
template <typename T> struct mtp_pair_of { using type = float; };
template <> struct mtp_pair_of<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct mtp_pair_of<__half> { using type = __half2; };

// N values read as one (up to 16-byte) load, as qmv's cutlass::Array reads
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) mtp_vec {
  T v[N];
};
template <typename T, int N>
__device__ __forceinline__ mtp_vec<T, N> mtp_load(const void* p) {
  return *reinterpret_cast<const mtp_vec<T, N>*>(p);
}

// q * s + b in the activation type: fused, or rounded after each operation
template <bool FUSED>
__device__ __forceinline__ float mtp_dequant(float q, float s, float b) {
  return FUSED ? __fmaf_rn(q, s, b) : __fadd_rn(__fmul_rn(q, s), b);
}
template <bool FUSED>
__device__ __forceinline__ __nv_bfloat162 mtp_dequant(__nv_bfloat162 q, __nv_bfloat162 s, __nv_bfloat162 b) {
  return FUSED ? __hfma2(q, s, b) : __hadd2_rn(__hmul2_rn(q, s), b);
}
template <bool FUSED>
__device__ __forceinline__ __half2 mtp_dequant(__half2 q, __half2 s, __half2 b) {
  return FUSED ? __hfma2(q, s, b) : __hadd2_rn(__hmul2_rn(q, s), b);
}
// The kernel, a template so that only its own arithmetic's branches compile.
template <typename InT, int M, int N, int K, int GS, int BITS, int E, int COLS, bool DQ_FMA>
__device__ void mtp_qmv_rows(const InT* x, const uint* w, const InT* scales, const InT* biases,
                             InT* y, int lane, int warp, int block) {
  // three arithmetics, as qmv's: fp32 throughout; 16-bit x at 4 bits (pairs,
  // accumulated in x's type); 16-bit x at 8 bits (dequantized in pairs,
  // accumulated in fp32)
  constexpr bool WIDE = sizeof(InT) == 4;
  constexpr bool ACC16 = !WIDE && BITS < 8;
  using P = typename mtp_pair_of<InT>::type;  // float when WIDE
  constexpr int STEP = 32 * E;               // values per warp per step
  constexpr int WORDS = E * BITS / 32;       // packed words a lane reads per step
  constexpr int VPW = 32 / BITS;             // values per word
  constexpr uint MASK = (1u << BITS) - 1u;
  constexpr int REST = K % STEP;
  constexpr int KW = K / VPW;                // words per weight row
  constexpr int KG = K / GS;                 // groups per weight row
  constexpr int NA = ACC16 ? E / 2 : E;      // accumulators per (column, row)
  using Acc = typename mtp_if<ACC16, P, float>::type;

  const int col0 = (block * 8 + warp) * COLS;
  if (col0 >= N) {
    return;  // the whole warp: columns come in warp-sized units
  }

  Acc sums[COLS][M][NA];
  for (int c = 0; c < COLS; ++c) {
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < NA; ++j) {
        if constexpr (ACC16) {
          sums[c][m][j] = mtp_pair(InT(0.0f), 0.0f, 0.0f);
        } else {
          sums[c][m][j] = 0.0f;
        }
      }
    }
  }

  // one step: values idx..idx+E-1 of every column, each weight read once
  auto step = [&](int idx) {
    for (int c = 0; c < COLS; ++c) {
      const int n = col0 + c;
      if (n >= N) {
        break;
      }
      const auto words = mtp_load<uint, WORDS>(w + size_t(n) * KW + idx / VPW);
      auto q = [&](int j) { return float((words.v[j / VPW] >> ((j % VPW) * BITS)) & MASK); };
      const InT scale = scales[size_t(n) * KG + idx / GS];
      const InT bias = biases[size_t(n) * KG + idx / GS];
      if constexpr (WIDE) {
        float wdq[E];
        for (int j = 0; j < E; ++j) {
          wdq[j] = mtp_dequant<DQ_FMA>(q(j), float(scale), float(bias));
        }
        for (int m = 0; m < M; ++m) {
          const auto xv = mtp_load<float, E>(x + size_t(m) * K + idx);
          for (int j = 0; j < E; ++j) {
            sums[c][m][j] = __fmaf_rn(xv.v[j], wdq[j], sums[c][m][j]);
          }
        }
      } else {
        const P s2 = mtp_pair(scale, float(scale), float(scale));
        const P b2 = mtp_pair(scale, float(bias), float(bias));
        P wdq[E / 2];
        for (int j = 0; j < E / 2; ++j) {
          wdq[j] = mtp_dequant<DQ_FMA>(mtp_pair(scale, q(2 * j), q(2 * j + 1)), s2, b2);
        }
        for (int m = 0; m < M; ++m) {
          const auto xv = mtp_load<P, E / 2>(x + size_t(m) * K + idx);
          for (int j = 0; j < E / 2; ++j) {
            if constexpr (ACC16) {
              sums[c][m][j] = __hfma2(xv.v[j], wdq[j], sums[c][m][j]);
            } else {
              sums[c][m][2 * j] = __fmaf_rn(float(xv.v[j].x), float(wdq[j].x), sums[c][m][2 * j]);
              sums[c][m][2 * j + 1] =
                  __fmaf_rn(float(xv.v[j].y), float(wdq[j].y), sums[c][m][2 * j + 1]);
            }
          }
        }
      }
    }
  };

  for (int r = 0; r < K / STEP; ++r) {
    step(lane * E + r * STEP);
  }
  if (REST != 0) {
    const int idx = lane * E + K - REST;
    if (idx < K) {
      step(idx);
    }
  }

  for (int c = 0; c < COLS; ++c) {
    const int n = col0 + c;
    for (int m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int j = 0; j < NA; ++j) {
        if constexpr (ACC16) {
          s += float(sums[c][m][j].x);
          s += float(sums[c][m][j].y);
        } else {
          s += sums[c][m][j];
        }
      }
      s = s + __shfl_xor_sync(0xffffffffu, s, 16);
      s = s + __shfl_xor_sync(0xffffffffu, s, 8);
      s = s + __shfl_xor_sync(0xffffffffu, s, 4);
      s = s + __shfl_xor_sync(0xffffffffu, s, 2);
      s = s + __shfl_xor_sync(0xffffffffu, s, 1);
      if (lane == 0 && n < N) {
        y[size_t(m) * N + n] = static_cast<InT>(s);
      }
    }
  }
}
//@body
  mtp_qmv_rows<InT, M, N, K, GS, BITS, E, COLS, DQ_FMA>(
      x, w, scales, biases, y, threadIdx.x & 31, threadIdx.x / 32, blockIdx.x);
