// GDN verify with per-position state capture, a tape or its replay (body for mx.fast.metal_kernel).
//
// inputs : q, k [B,T,Hk,Dk] InT; v [B,T,Hv,Dv] InT; gate_a, gate_b [B,T,Hv];
//          A_log, dt_bias [Hv] PT; state_in [B,Hv,Dv,Dk] f32; scal [3] f32;
//          consumed [B] int32 (REPLAY only)
// outputs: y [B,T,Hv,Dv] InT; states [B,T,Hv,Dv,Dk] f32 (state after each token)
// template: InT, GT (gate_b dtype), AT (dtype of a + dt_bias), Dk, Dv, Hk, Hv,
//           T, FUSED, MODE
//
// MODE (one source, so a replayed update is the verify's arithmetic):
//   0 capture: y and the state after every position, as above;
//   1 tape: y only (states a 1-element placeholder): the caller keeps what
//     the updates consumed (k, v, gate_a, gate_b) as a tape;
//   2 replay: from a tape, the updates of the first consumed[b] (1..T,
//     clamped) positions of row b only, from state_in (the state before the
//     cycle); q is a placeholder (not read), y too (not written) and
//     states is [B,Hv,Dv,Dk]: the state after those positions.
// grid (32, Dv, B*Hv), threadgroup (32, 4, 1): one SIMD-group per value row;
// lane l owns state elements [NPT*l, NPT*l + NPT).
//
// FUSED = false ("exact", the default): q, k arrive normalized by mlx_lm's
// normalize_qk and gate_a = g (f32), gate_b = beta, computed by the same MLX
// ops plain decoding runs. The recurrence then performs exactly the
// arithmetic of mlx_lm's Metal decode kernels (gated_delta_step_xtree and the
// packed Dk=128 kernel that mlx_lm pins bitwise to it): per-lane sequential
// partials over NPT contiguous elements, reduced by the explicit xor-butterfly
// 1,2,4,8,16 in mtp_xor_sum rather than simd_sum, so the reduction order is a
// property of this file, not of how simd_sum is lowered. Each verified
// position then reproduces plain decoding's y and state bit for bit (unless
// the Metal compiler contracts a*b+c into fma differently in the two kernels;
// both are compiled from the same expression shapes).
//
// FUSED = true: q, k are the raw conv outputs and gate_a = a, gate_b = b; the
// kernel does the L2 normalization (normalize_qk's numerics, including its
// roundings to InT; scal = {InT(Dk^-1), InT(Dk^-0.5), 1e-6/Dk}) and
// g = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b) itself,
// saving the separate normalization and gate passes. Its sum of squares and
// transcendentals round differently from MLX's rms_norm and compiled gate
// kernels: it matches the ops path to ~1e-6 relative (fp32), not bitwise.
//@header
inline float mtp_xor_sum(float v) {
  v += simd_shuffle_xor(v, 1);
  v += simd_shuffle_xor(v, 2);
  v += simd_shuffle_xor(v, 4);
  v += simd_shuffle_xor(v, 8);
  v += simd_shuffle_xor(v, 16);
  return v;
}
//@body
  constexpr int NPT = (Dk + 31) / 32;
  const uint n = thread_position_in_grid.z;
  const uint b_idx = n / Hv;
  const uint hv = n % Hv;
  const uint hk = hv / (Hv / Hk);
  const uint lane = thread_index_in_simdgroup;
  const uint dv = thread_position_in_grid.y;

  float st[NPT];
  const device float* s_in = state_in + (size_t(n) * Dv + dv) * Dk;
  for (int i = 0; i < NPT; ++i) {
    const int e = NPT * lane + i;
    st[i] = (e < Dk) ? s_in[e] : 0.0f;
  }
  const float A = FUSED ? metal::exp(static_cast<float>(A_log[hv])) : 0.0f;
  const float dtb = FUSED ? static_cast<float>(dt_bias[hv]) : 0.0f;

  int steps = T;
  if (MODE == 2) {
    const int c = consumed[b_idx];
    steps = c < 1 ? 1 : (c > T ? T : c);
  }
  for (int t = 0; t < steps; ++t) {
    const size_t qk_off = ((size_t(b_idx) * T + t) * Hk + hk) * Dk;
    const size_t hv_off = (size_t(b_idx) * T + t) * Hv + hv;

    float qv[NPT];
    float kv[NPT];
    for (int i = 0; i < NPT; ++i) {
      const int e = NPT * lane + i;
      qv[i] = (MODE != 2 && e < Dk) ? static_cast<float>(q[qk_off + e]) : 0.0f;
      kv[i] = (e < Dk) ? static_cast<float>(k[qk_off + e]) : 0.0f;
    }
    float g;
    float beta;
    if (FUSED) {
      // q/k L2 normalization: x * rsqrt(mean(x^2) + eps), rounded to InT,
      // scaled by InT(Dk^-1) (q) or InT(Dk^-0.5) (k) and rounded again.
      float qs = 0.0f;
      float ks = 0.0f;
      for (int i = 0; i < NPT; ++i) {
        qs += qv[i] * qv[i];
        ks += kv[i] * kv[i];
      }
      qs = mtp_xor_sum(qs);
      ks = mtp_xor_sum(ks);
      const float rq = metal::precise::rsqrt(qs / Dk + scal[2]);
      const float rk = metal::precise::rsqrt(ks / Dk + scal[2]);
      for (int i = 0; i < NPT; ++i) {
        qv[i] = static_cast<float>(static_cast<InT>(
            static_cast<float>(static_cast<InT>(qv[i] * rq)) * scal[0]));
        kv[i] = static_cast<float>(static_cast<InT>(
            static_cast<float>(static_cast<InT>(kv[i] * rk)) * scal[1]));
      }
      // g = exp(-exp(A_log) * softplus(a + dt_bias)), the sum and softplus
      // rounded to AT; softplus = max(x, 0) + log1p(exp(-|x|)) with Metal's
      // missing log1p as log(u) * z / (u - 1), u = 1 + z.
      const float x = static_cast<float>(
          static_cast<AT>(static_cast<float>(gate_a[hv_off]) + dtb));
      const float z = metal::exp(-metal::abs(x));
      const float u = 1.0f + z;
      const float l1p = (u == 1.0f) ? z : metal::log(u) * z / (u - 1.0f);
      const float sp = static_cast<float>(static_cast<AT>(metal::max(x, 0.0f) + l1p));
      g = metal::exp(-A * sp);
      beta = static_cast<float>(static_cast<GT>(
          1.0f / (1.0f + metal::exp(-static_cast<float>(gate_b[hv_off])))));
    } else {
      g = static_cast<float>(gate_a[hv_off]);
      beta = static_cast<float>(gate_b[hv_off]);
    }

    // gated delta step: mlx_lm's arithmetic, operand order included
    float kv_mem = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      st[i] = st[i] * g;
      kv_mem += st[i] * kv[i];
    }
    kv_mem = mtp_xor_sum(kv_mem);
    const float delta = (static_cast<float>(v[hv_off * Dv + dv]) - kv_mem) * beta;
    float out = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      st[i] = st[i] + kv[i] * delta;
      out += st[i] * qv[i];
    }
    if (MODE != 2) {
      out = mtp_xor_sum(out);
      if (lane == 0) {
        y[hv_off * Dv + dv] = static_cast<InT>(out);
      }
    }
    if (MODE == 0) {
      device float* s_out = states + (hv_off * Dv + dv) * Dk;
      for (int i = 0; i < NPT; ++i) {
        const int e = NPT * lane + i;
        if (e < Dk) {
          s_out[e] = st[i];
        }
      }
    }
  }
  if (MODE == 2) {
    device float* s_out = states + (size_t(n) * Dv + dv) * Dk;
    for (int i = 0; i < NPT; ++i) {
      const int e = NPT * lane + i;
      if (e < Dk) {
        s_out[e] = st[i];
      }
    }
  }
