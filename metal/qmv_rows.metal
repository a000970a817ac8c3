// Quantized matmul of 2..8 activation rows that reads each packed weight once
// (Metal; body for mx.fast.metal_kernel). On chips before the M3 generation
// MLX runs its one-row kernel (affine_qmv_fast, mlx/backend/metal/kernels/
// quantized.h) once per row for small row counts, and on newer ones a
// different kernel (qmv_wide) whose rows need not equal the one-row kernel's;
// this kernel reads the weights once and gives every row the arithmetic
// qmv_fast gives it alone, so a verified row is the decode step's row.
//
// inputs : x [M,K] InT; w [N,K*BITS/32] uint32; scales, biases [N,K/GS] InT
// outputs: y [M,N] InT
// template: InT, M (rows, 1..8), N (multiple of 8), K (multiple of 32*VPT),
//          GS, BITS (4/8)
// grid (32, 2 * N / 8, 1), threadgroup (32, 2, 1): as qmv_fast, SIMD-group s of
// threadgroup t owns the 4 output columns t*8 + s*4 + c.
//
// Per (row, column) the arithmetic is qmv_fast's, with its expressions: each
// lane loads VPT values of x into floats pre-divided by 16^i (4-bit) and their
// sum, takes the column's scale and bias per group, accumulates
// scale * accum + sum * bias over K in steps of 32*VPT, and the columns are
// reduced with simd_sum and cast to InT once. The packed words of the 4
// columns are read once per step into registers and serve all M rows.
//@header
template <typename T, int VPT, int BITS>
inline float mtp_load_x(const device T* x, thread float* xt) {
  float sum = 0;
  if (BITS == 4) {
    for (int i = 0; i < VPT; i += 4) {
      sum += x[i] + x[i + 1] + x[i + 2] + x[i + 3];
      xt[i] = x[i];
      xt[i + 1] = x[i + 1] / 16.0f;
      xt[i + 2] = x[i + 2] / 256.0f;
      xt[i + 3] = x[i + 3] / 4096.0f;
    }
  } else {
    for (int i = 0; i < VPT; i++) {
      sum += x[i];
      xt[i] = x[i];
    }
  }
  return sum;
}

template <int VPT, int BITS>
inline float mtp_qdot(const thread uint8_t* w, const thread float* xt, float scale, float bias,
                      float sum) {
  float accum = 0;
  if (BITS == 4) {
    const thread uint16_t* ws = (const thread uint16_t*)w;
    for (int i = 0; i < (VPT / 4); i++) {
      accum +=
          (xt[4 * i] * (ws[i] & 0x000f) + xt[4 * i + 1] * (ws[i] & 0x00f0) +
           xt[4 * i + 2] * (ws[i] & 0x0f00) + xt[4 * i + 3] * (ws[i] & 0xf000));
    }
  } else {
    for (int i = 0; i < VPT; i++) {
      accum += xt[i] * w[i];
    }
  }
  return scale * accum + sum * bias;
}
//@body
  constexpr int PPT = 2;              // packs (uint32) per thread, as qmv_fast for 4/8 bits
  constexpr int VPT = (32 / BITS) * PPT;
  constexpr int BLOCK = VPT * 32;
  constexpr int SSPT = GS / VPT;      // lanes per scale group
  constexpr int KW = K / (32 / BITS); // words per weight row
  constexpr int KG = K / GS;

  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int out_col = threadgroup_position_in_grid.y * 8 + sg * 4;

  const device uint32_t* wp = w + size_t(out_col) * KW + lane * PPT;
  const device InT* sp = scales + size_t(out_col) * KG + lane / SSPT;
  const device InT* bp = biases + size_t(out_col) * KG + lane / SSPT;
  const device InT* xp = x + lane * VPT;

  float result[M][4];
  for (int m = 0; m < M; m++) {
    for (int c = 0; c < 4; c++) {
      result[m][c] = 0;
    }
  }
  float xt[VPT];
  uint32_t wr[4][PPT];
  float s[4];
  float b[4];

  for (int k = 0; k < K; k += BLOCK) {
    for (int c = 0; c < 4; c++) {
      for (int p = 0; p < PPT; p++) {
        wr[c][p] = wp[c * KW + p];
      }
      s[c] = sp[c * KG];
      b[c] = bp[c * KG];
    }
    for (int m = 0; m < M; m++) {
      float sum = mtp_load_x<InT, VPT, BITS>(xp + m * K, xt);
      for (int c = 0; c < 4; c++) {
        result[m][c] += mtp_qdot<VPT, BITS>((const thread uint8_t*)wr[c], xt, s[c], b[c], sum);
      }
    }
    wp += BLOCK / (32 / BITS);
    sp += BLOCK / GS;
    bp += BLOCK / GS;
    xp += BLOCK;
  }

  for (int m = 0; m < M; m++) {
    for (int c = 0; c < 4; c++) {
      float r = simd_sum(result[m][c]);
      if (lane == 0) {
        y[m * N + out_col + c] = static_cast<InT>(r);
      }
    }
  }
