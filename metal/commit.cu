// One-launch commit for ALL GDN layers (CUDA twin of the .metal kernel, body for mx.fast.cuda_kernel).
//
// For each layer l: inputs states_l [B,T,Hv,Dv,Dk] f32, conv_l [B,K-1+T,C] CT;
// outputs window_l [B,K-1,C] CT, state_l [B,Hv,Dv,Dk] f32; plus one input
// consumed [1] int32 (tokens kept, 1..T; clamped), read on the device, so no
// host sync. The Python side expands the //@cases line into one `case l:`
// per layer (one kernel parameter per buffer), so every layer shares one dispatch.
// template: CT, T, KW (= conv kernel size K), C, S (= Hv*Dv*Dk)
// grid (X, B, L), threadgroup (256, 1, 1): X threads stride over the S + (K-1)*C
// elements of one (layer, batch) pair.
//@header
template <typename CT_, int T_, int KW_, int C_, int S_>
__device__ inline void mtp_commit_layer(
    const float* states,
    const CT_* conv_input,
    CT_* window,
    float* state,
    uint bi,
    uint i0,
    uint stride,
    int n) {
  constexpr int W = KW_ - 1;
  const size_t total = size_t(S_) + size_t(W) * C_;
  const float* src = states + (size_t(bi) * T_ + (n - 1)) * S_;
  for (size_t i = i0; i < total; i += stride) {
    if (i < size_t(S_)) {
      state[size_t(bi) * S_ + i] = src[i];
    } else {
      const size_t j = i - S_;  // row-major over (K-1, C)
      window[size_t(bi) * W * C_ + j] =
          conv_input[(size_t(bi) * (W + T_) + n) * C_ + j];
    }
  }
}
//@body
  const uint3 thread_position_in_grid = make_uint3(
      blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y,
      blockIdx.z * blockDim.z + threadIdx.z);
  const uint i0 = thread_position_in_grid.x;
  const uint stride = gridDim.x * blockDim.x;
  const uint bi = thread_position_in_grid.y;
  const uint layer = thread_position_in_grid.z;
  int n = consumed[0];
  n = n < 1 ? 1 : (n > T ? T : n);
  switch (layer) {
//@cases
    default:
      break;
  }
