// Draft-head output projection fused with arg-max / top-k, stage 1 of 2
// (CUDA twin of the .metal kernel, body for mx.fast.cuda_kernel). Never materializes the logits.
//
// inputs : hidden [N,H] InT; weight [Vw,H] WT (float) or [Vw,H*BITS/32]
//          uint32 (mlx_lm affine quantization, value j of a word at bits
//          BITS*j); scales, biases [Vw,H/GS] ST (1-element dummies for float);
//          vocab_ids [V] int32 (1-element dummy unless HAS_IDS)
// outputs: part_vals [N,G,K] f32, part_pos [N,G,K] int32: each threadgroup's
//          top-K (logit, position in the scored list), sorted best first
// template: InT, WT, ST, OT (the matmul result dtype the reference rounds
//          logits to), N (<= 8), H, V (rows scored), K (<= 32), BITS (0: float
//          weight, 2, 4 or 8), GS, HAS_IDS, SG (SIMD-groups per threadgroup), RPT
//          (rows per threadgroup, a multiple of SG), G
// grid (32*SG*G, 1, 1), threadgroup (32*SG, 1, 1). SIMD-group s of threadgroup
// g scores rows g*RPT + s + j*SG; each row's dot products are lane-strided
// partial sums reduced with simd_sum (xor-butterfly, cuda_compat.cu); every lane keeps the same top-K list,
// lanes 0..N-1 of SIMD-group 0 merge the SG lists through threadgroup memory.
// Order: larger logit first, ties -> smaller position (= the reference's
// arg-max / stable-sort order).
//@header
__device__ inline bool mtp_better(float v, int p, float bv, int bp) {
  return v > bv || (v == bv && p < bp);
}
template <int K_>
__device__ inline void mtp_insert(float* tv, int* tp, float v, int p) {
  if (!mtp_better(v, p, tv[K_ - 1], tp[K_ - 1])) {
    return;
  }
  int j = K_ - 1;
  while (j > 0 && mtp_better(v, p, tv[j - 1], tp[j - 1])) {
    tv[j] = tv[j - 1];
    tp[j] = tp[j - 1];
    --j;
  }
  tv[j] = v;
  tp[j] = p;
}
//@body
  __shared__ float sh_v[SG * N * K];
  __shared__ int sh_p[SG * N * K];
  constexpr int NEG_POS = 0x7fffffff;
  const uint lane = threadIdx.x & 31;
  const uint sg = threadIdx.x / 32;
  const uint gid = blockIdx.x;

  float tv[N * K];
  int tp[N * K];
  for (int i = 0; i < N * K; ++i) {
    tv[i] = mtl::neg_inf();
    tp[i] = NEG_POS;
  }

  for (int j = 0; j < RPT / SG; ++j) {
    const int r = int(gid) * RPT + int(sg) + j * SG;
    if (r >= V) {
      break;  // uniform across the SIMD-group
    }
    const size_t wrow = HAS_IDS ? size_t(vocab_ids[r]) : size_t(r);
    float acc[N];
    for (int n = 0; n < N; ++n) {
      acc[n] = 0.0f;
    }
    if (BITS == 0) {
      // each lane reads VEC contiguous weights per step (128 per SIMD-group)
      constexpr int VEC = (H % 128 == 0) ? 4 : 1;
      for (int e0 = lane * VEC; e0 < H; e0 += 32 * VEC) {
        for (int i = 0; i < VEC; ++i) {
          const float w = static_cast<float>(weight[wrow * H + e0 + i]);
          for (int n = 0; n < N; ++n) {
            acc[n] += w * static_cast<float>(hidden[n * H + e0 + i]);
          }
        }
      }
    } else {
      constexpr int VPW = BITS == 0 ? 1 : 32 / BITS;
      constexpr int WPR = BITS == 0 ? 1 : H / VPW;
      constexpr uint MASK = BITS == 0 ? 0u : (1u << BITS) - 1u;
      for (int w = lane; w < WPR; w += 32) {
        const uint word = static_cast<uint>(weight[wrow * WPR + w]);
        const int e0 = w * VPW;
        const size_t gi = wrow * (H / GS) + e0 / GS;
        const float s = static_cast<float>(scales[gi]);
        const float bb = static_cast<float>(biases[gi]);
        for (int n = 0; n < N; ++n) {
          float qx = 0.0f;
          float xs = 0.0f;
          for (int i = 0; i < VPW; ++i) {
            const float xv = static_cast<float>(hidden[n * H + e0 + i]);
            qx += static_cast<float>((word >> (BITS * i)) & MASK) * xv;
            xs += xv;
          }
          acc[n] += s * qx + bb * xs;
        }
      }
    }
    for (int n = 0; n < N; ++n) {
      const float logit = static_cast<float>(static_cast<OT>(warp_sum(acc[n])));
      mtp_insert<K>(tv + n * K, tp + n * K, logit, r);
    }
  }

  if (lane == 0) {
    for (int i = 0; i < N * K; ++i) {
      sh_v[sg * N * K + i] = tv[i];
      sh_p[sg * N * K + i] = tp[i];
    }
  }
  __syncthreads();
  if (sg == 0 && lane < N) {
    const int n = lane;
    float mv[K];
    int mp[K];
    for (int i = 0; i < K; ++i) {
      mv[i] = sh_v[n * K + i];
      mp[i] = sh_p[n * K + i];
    }
    for (int s = 1; s < SG; ++s) {
      for (int i = 0; i < K; ++i) {
        mtp_insert<K>(mv, mp, sh_v[(s * N + n) * K + i], sh_p[(s * N + n) * K + i]);
      }
    }
    for (int i = 0; i < K; ++i) {
      part_vals[(size_t(n) * G + gid) * K + i] = mv[i];
      part_pos[(size_t(n) * G + gid) * K + i] = mp[i];
    }
  }
