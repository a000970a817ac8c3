// GDN verify with per-position state capture (body for mx.fast.metal_kernel).
//
// inputs : q, k [B,T,Hk,Dk] InT (conv output, NOT normalized); v [B,T,Hv,Dv] InT;
//          a, b [B,T,Hv] GT; A_log, dt_bias [Hv] PT; state_in [B,Hv,Dv,Dk] f32;
//          scal [3] f32 = {InT(Dk^-1), InT(Dk^-0.5), 1e-6/Dk}
// outputs: y [B,T,Hv,Dv] InT; states [B,T,Hv,Dv,Dk] f32 (state after each token)
// template: InT, GT, AT (dtype of a + dt_bias), PT, Dk, Dv, Hk, Hv, T
// grid (32, Dv, B*Hv), threadgroup (32, 4, 1): one SIMD-group per value row;
// lane l owns state elements [NPT*l, NPT*l + NPT).
//
// Fused: q/k L2 normalization (mlx_lm normalize_qk, including its rounding
// to InT), g = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b)
// (rounded to GT like the ops path). The recurrence is mlx_lm's gated delta
// step in fp32.
// Numerics: the four Dk-reductions per token use simd_sum; its lane order on
// Apple GPUs is the hardware's (the Linux emulator uses the xor-butterfly
// 1,2,4,8,16), so y and the states differ from the ops path by reduction
// rounding only (~1e-6 relative in fp32), not bit-for-bit.
  constexpr int NPT = (Dk + 31) / 32;
  const uint n = thread_position_in_grid.z;
  const uint b_idx = n / Hv;
  const uint hv = n % Hv;
  const uint hk = hv / (Hv / Hk);
  const uint lane = thread_index_in_simdgroup;
  const uint dv = thread_position_in_grid.y;

  const float s_q = scal[0];
  const float s_k = scal[1];
  const float eps = scal[2];

  float st[NPT];
  const device float* s_in = state_in + (size_t(n) * Dv + dv) * Dk;
  for (int i = 0; i < NPT; ++i) {
    const int e = NPT * lane + i;
    st[i] = (e < Dk) ? s_in[e] : 0.0f;
  }
  const float A = metal::exp(static_cast<float>(A_log[hv]));
  const float dtb = static_cast<float>(dt_bias[hv]);

  for (int t = 0; t < T; ++t) {
    const size_t qk_off = ((size_t(b_idx) * T + t) * Hk + hk) * Dk;
    const size_t hv_off = (size_t(b_idx) * T + t) * Hv + hv;

    // q/k L2 normalization: x * rsqrt(mean(x^2) + eps), rounded to InT, then
    // scaled by InT(Dk^-1) (q) or InT(Dk^-0.5) (k) and rounded again.
    float qv[NPT];
    float kv[NPT];
    float qs = 0.0f;
    float ks = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      const int e = NPT * lane + i;
      qv[i] = (e < Dk) ? static_cast<float>(q[qk_off + e]) : 0.0f;
      kv[i] = (e < Dk) ? static_cast<float>(k[qk_off + e]) : 0.0f;
      qs += qv[i] * qv[i];
      ks += kv[i] * kv[i];
    }
    qs = simd_sum(qs);
    ks = simd_sum(ks);
    const float rq = metal::precise::rsqrt(qs / Dk + eps);
    const float rk = metal::precise::rsqrt(ks / Dk + eps);
    for (int i = 0; i < NPT; ++i) {
      qv[i] = static_cast<float>(static_cast<InT>(
          static_cast<float>(static_cast<InT>(qv[i] * rq)) * s_q));
      kv[i] = static_cast<float>(static_cast<InT>(
          static_cast<float>(static_cast<InT>(kv[i] * rk)) * s_k));
    }

    // gates
    const float x = static_cast<float>(static_cast<AT>(static_cast<float>(a[hv_off]) + dtb));
    // softplus = max(x, 0) + log1p(exp(-|x|)); Metal has no log1p, so use
    // the exact-rounding identity log1p(z) = log(u) * z / (u - 1), u = 1 + z.
    const float z = metal::exp(-metal::abs(x));
    const float u = 1.0f + z;
    const float l1p = (u == 1.0f) ? z : metal::log(u) * z / (u - 1.0f);
    const float sp = static_cast<float>(static_cast<AT>(metal::max(x, 0.0f) + l1p));
    const float g = metal::exp(-A * sp);
    const float beta = static_cast<float>(static_cast<GT>(
        1.0f / (1.0f + metal::exp(-static_cast<float>(b[hv_off])))));

    // gated delta step
    float kv_mem = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      st[i] = st[i] * g;
      kv_mem += st[i] * kv[i];
    }
    kv_mem = simd_sum(kv_mem);
    const float delta = (static_cast<float>(v[hv_off * Dv + dv]) - kv_mem) * beta;
    float out = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      st[i] = st[i] + kv[i] * delta;
      out += st[i] * qv[i];
    }
    out = simd_sum(out);
    if (lane == 0) {
      y[hv_off * Dv + dv] = static_cast<InT>(out);
    }
    device float* s_out = states + (hv_off * Dv + dv) * Dk;
    for (int i = 0; i < NPT; ++i) {
      const int e = NPT * lane + i;
      if (e < Dk) {
        s_out[e] = st[i];
      }
    }
  }
