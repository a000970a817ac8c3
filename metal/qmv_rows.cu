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

// x * y + a with one rounding, in the accumulator's type
__device__ __forceinline__ float mtp_fma(float x, float y, float a) { return __fmaf_rn(x, y, a); }
__device__ __forceinline__ __nv_bfloat16 mtp_fma(__nv_bfloat16 x, __nv_bfloat16 y, __nv_bfloat16 a) {
  return __hfma(x, y, a);
}
__device__ __forceinline__ __half mtp_fma(__half x, __half y, __half a) { return __hfma(x, y, a); }

// q * s + b in the activation type: fused or rounded after each operation
template <bool FUSED>
__device__ __forceinline__ float mtp_dequant(float q, float s, float b) {
  return FUSED ? __fmaf_rn(q, s, b) : __fadd_rn(__fmul_rn(q, s), b);
}
template <bool FUSED>
__device__ __forceinline__ __nv_bfloat16 mtp_dequant(__nv_bfloat16 q, __nv_bfloat16 s, __nv_bfloat16 b) {
  return FUSED ? __hfma(q, s, b) : __hadd_rn(__hmul_rn(q, s), b);
}
template <bool FUSED>
__device__ __forceinline__ __half mtp_dequant(__half q, __half s, __half b) {
  return FUSED ? __hfma(q, s, b) : __hadd_rn(__hmul_rn(q, s), b);
}

template <typename A, typename T>
__device__ __forceinline__ A mtp_as(T v) {
  return static_cast<A>(static_cast<float>(v));
}
template <>
__device__ __forceinline__ float mtp_as<float, float>(float v) {
  return v;
}
//@body
  using Acc = typename mtp_if<(BITS >= 8), float, InT>::type;
  constexpr int STEP = 32 * E;               // values per warp per step
  constexpr int WORDS = E * BITS / 32;       // packed words a lane reads per step
  constexpr int VPW = 32 / BITS;             // values per word
  constexpr uint MASK = (1u << BITS) - 1u;
  constexpr int REST = K % STEP;
  constexpr int KW = K / VPW;                // words per weight row
  constexpr int KG = K / GS;                 // groups per weight row

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x / 32;
  const int col0 = (blockIdx.x * 8 + warp) * COLS;
  if (col0 >= N) {
    return;  // the whole warp: columns come in warp-sized units
  }

  Acc sums[COLS][M][E];
  for (int c = 0; c < COLS; ++c) {
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < E; ++j) {
        sums[c][m][j] = Acc(0.0f);
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
      const uint* wp = w + size_t(n) * KW + idx / VPW;
      uint words[WORDS];
      for (int i = 0; i < WORDS; ++i) {
        words[i] = wp[i];
      }
      const InT scale = scales[size_t(n) * KG + idx / GS];
      const InT bias = biases[size_t(n) * KG + idx / GS];
      InT wdq[E];
      for (int j = 0; j < E; ++j) {
        const uint q = (words[j / VPW] >> ((j % VPW) * BITS)) & MASK;
        wdq[j] = mtp_dequant<DQ_FMA>(static_cast<InT>(float(q)), scale, bias);
      }
      for (int m = 0; m < M; ++m) {
        const InT* xp = x + size_t(m) * K + idx;
        for (int j = 0; j < E; ++j) {
          sums[c][m][j] = mtp_fma(mtp_as<Acc>(xp[j]), mtp_as<Acc>(wdq[j]), sums[c][m][j]);
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
      for (int j = 0; j < E; ++j) {
        s += static_cast<float>(sums[c][m][j]);
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
