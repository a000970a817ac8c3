// Draft-head top-k, stage 2 of 2: merge the per-threadgroup candidates of
// draft_project.metal (body for mx.fast.metal_kernel).
//
// inputs : part_vals [N,G,K] f32, part_pos [N,G,K] int32, vocab_ids [V] int32
//          (1-element dummy unless HAS_IDS)
// outputs: values [N,K] f32, ids [N,K] int32 (full-vocabulary ids)
// template: N, G, K (<= 32), HAS_IDS
// grid (32, N, 1), threadgroup (32, 1, 1): lane l merges groups l, l+32, ...
// into its own list; lane 0 merges the 32 lists (threadgroup memory).
// Same order as stage 1: larger logit first, ties -> smaller position.
//@header
inline bool mtp_better2(float v, int p, float bv, int bp) {
  return v > bv || (v == bv && p < bp);
}
template <int K_>
inline void mtp_insert2(thread float* tv, thread int* tp, float v, int p) {
  if (!mtp_better2(v, p, tv[K_ - 1], tp[K_ - 1])) {
    return;
  }
  int j = K_ - 1;
  while (j > 0 && mtp_better2(v, p, tv[j - 1], tp[j - 1])) {
    tv[j] = tv[j - 1];
    tp[j] = tp[j - 1];
    --j;
  }
  tv[j] = v;
  tp[j] = p;
}
//@body
  threadgroup float sh_v[32 * K];
  threadgroup int sh_p[32 * K];
  const uint lane = thread_position_in_threadgroup.x;
  const uint n = thread_position_in_grid.y;
  float tv[K];
  int tp[K];
  for (int i = 0; i < K; ++i) {
    tv[i] = -INFINITY;
    tp[i] = 0x7fffffff;
  }
  for (int g = lane; g < G; g += 32) {
    for (int i = 0; i < K; ++i) {
      const size_t o = (size_t(n) * G + g) * K + i;
      mtp_insert2<K>(tv, tp, part_vals[o], part_pos[o]);
    }
  }
  for (int i = 0; i < K; ++i) {
    sh_v[lane * K + i] = tv[i];
    sh_p[lane * K + i] = tp[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    for (int l = 1; l < 32; ++l) {
      for (int i = 0; i < K; ++i) {
        mtp_insert2<K>(tv, tp, sh_v[l * K + i], sh_p[l * K + i]);
      }
    }
    for (int i = 0; i < K; ++i) {
      values[size_t(n) * K + i] = tv[i];
      const int p = tp[i];
      ids[size_t(n) * K + i] = HAS_IDS ? vocab_ids[p] : p;
    }
  }
