// Causal depthwise conv1d over the verify window (CUDA twin of the .metal kernel, body for mx.fast.cuda_kernel).
//
// inputs : conv_state [B,K-1,C] InT; qkv [B,T,C] InT; weight [C,K,1] WT
// outputs: out [B,T,C] OT = silu(conv); conv_input [B,K-1+T,C] InT (the window
//          after consuming n tokens is conv_input[:, n:n+K-1])
// template: InT, WT, OT, K, C, T
// grid (C, K-1+T, B), threadgroup (min(C,256), 1, 1): thread (c, r, b) copies
// row r of the conv input and, for r >= K-1, computes output t = r-(K-1).
// Numerics: fp32 accumulation over the K taps in tap order, rounded to OT,
// then silu as x * OT(sigmoid(x)) like nn.silu on an OT array.
  const uint3 thread_position_in_grid = make_uint3(
      blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y,
      blockIdx.z * blockDim.z + threadIdx.z);
  constexpr int W = K - 1;
  const uint c = thread_position_in_grid.x;
  const uint r = thread_position_in_grid.y;
  const uint bi = thread_position_in_grid.z;
  if (c >= C) {
    return;
  }
  const InT xr = (r < W) ? conv_state[(size_t(bi) * W + r) * C + c]
                         : qkv[(size_t(bi) * T + (r - W)) * C + c];
  conv_input[(size_t(bi) * (W + T) + r) * C + c] = xr;
  if (r >= W) {
    const int t = int(r) - W;
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int row = t + j;  // row of conv_input
      const float xv = (row < W)
          ? static_cast<float>(conv_state[(size_t(bi) * W + row) * C + c])
          : static_cast<float>(qkv[(size_t(bi) * T + (row - W)) * C + c]);
      acc += xv * static_cast<float>(weight[size_t(c) * K + j]);
    }
    const float cv = static_cast<float>(static_cast<OT>(acc));
    const float sg = static_cast<float>(static_cast<OT>(1.0f / (1.0f + mtl::exp(-cv))));
    out[(size_t(bi) * T + t) * C + c] = static_cast<OT>(cv * sg);
  }
