// Linux execution layer for the Metal (and CUDA) kernel bodies in kernels/.
//
// Each GPU thread of a threadgroup is a fiber (own stack, cooperative
// switching on one OS thread). A fiber runs until it reaches a SIMD-group
// operation (simd_*, __shfl_*_sync) or a threadgroup barrier, deposits its
// value and yields; when every live lane of the SIMD-group (every live thread
// of the threadgroup, for barriers) has arrived, all of them continue with the
// exchanged values. Scheduling is round-robin in thread order, so a run is
// deterministic. Lanes that reach different SIMD operations (or the same one
// from different source lines) are reported as divergence; a threadgroup in
// which no fiber can progress is reported as a deadlock.
//
// Deliberately no <cmath>/<cstdlib>: their global overloads would make the
// Metal-style unqualified math calls (exp, max, ...) ambiguous.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {
void* malloc(size_t);
void free(void*);
void* memset(void*, int, size_t);
void* memcpy(void*, const void*, size_t);
int snprintf(char*, size_t, const char*, ...);
}

#include <setjmp.h>
#include <signal.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// ---------------------------------------------------------------- types
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);  // quiet NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      bits = uint16_t(u >> 16);
    }
  }
  bfloat16_t(double d) : bfloat16_t(float(d)) {}
  bfloat16_t(int i) : bfloat16_t(float(i)) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};
typedef _Float16 half;
typedef _Float16 float16_t;
typedef bfloat16_t bfloat;
typedef bfloat16_t __nv_bfloat16;
typedef _Float16 __half;

struct uint3 {
  uint x, y, z;
};
typedef uint3 dim3;

namespace emu {

// ---------------------------------------------------------------- fibers
struct Fiber {
  void* sp;
  uint lin;   // linear index in threadgroup
  uint lane;  // index in simdgroup
  uint sg;    // simdgroup index
  bool done;
  uint3 tpitg;  // thread position in threadgroup
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
};

struct Sync {
  int active;
  int arrived;
  unsigned gen;
  long kind;
  uint32_t mask[2];
  alignas(16) unsigned char slots[2][32][16];
};

struct ThreadInfo {
  uint3 tpig, tpitg, tgpig, tptg, tpg, tgpg;
  uint lin, lane, sg, nsg;
};

typedef void (*BodyFn)(void** bufs, const ThreadInfo& ti);

struct Ctx {
  Fiber* fibers;
  int nthreads;
  Fiber* cur;
  void* sched_sp;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  Sync sgs[32];
  Sync tg;
  long progress;
  bool failed;
  char err[512];
  long tg_serial;
  BodyFn body;
  void** bufs;
  uint3 grid, tgsize, ntg, tgid, tgactual;
};

inline thread_local Ctx* ctx = nullptr;
inline thread_local long tg_serial_counter = 0;

#if defined(__x86_64__)
extern "C" void emu_ctx_switch(void** from_sp, void* to_sp);
asm(R"(
.text
.globl emu_ctx_switch
.hidden emu_ctx_switch
.type emu_ctx_switch,@function
emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_ctx_switch, .-emu_ctx_switch
)");
#endif

inline void fail(const char* msg, long a = 0, long b = 0) {
  if (!ctx->failed) {
    ctx->failed = true;
    snprintf(ctx->err, sizeof(ctx->err), "%s (%ld, %ld) at threadgroup (%u,%u,%u)", msg, a,
             b, ctx->tgid.x, ctx->tgid.y, ctx->tgid.z);
  }
}

inline void yield() {
  Ctx* c = ctx;
#if defined(__x86_64__)
  emu_ctx_switch(&c->cur->sp, c->sched_sp);
#else
  swapcontext(&c->cur->uc, &c->sched_uc);
#endif
}

// Arrive at a sync point; returns the slot buffer index holding the values.
inline int arrive(Sync& s, const void* v, size_t n, uint lane, long kind) {
  Ctx* c = ctx;
  int buf = s.gen & 1;
  if (v) memcpy(s.slots[buf][lane], v, n);
  if (s.arrived == 0) {
    s.kind = kind;
    s.mask[buf] = 0;
  } else if (s.kind != kind) {
    fail("divergent SIMD/barrier operations (source lines)", s.kind, kind);
  }
  s.mask[buf] |= 1u << (lane & 31);
  s.arrived++;
  c->progress++;
  unsigned g = s.gen;
  if (s.arrived >= s.active) {
    s.arrived = 0;
    s.gen++;
  } else {
    while (s.gen == g && !c->failed) yield();
  }
  return buf;
}

inline void finish_fiber(Fiber* f) {
  Ctx* c = ctx;
  f->done = true;
  c->progress++;
  Sync* ss[2] = {&c->sgs[f->sg], &c->tg};
  for (Sync* s : ss) {
    s->active--;
    if (s->arrived > 0 && s->arrived >= s->active) {
      s->arrived = 0;
      s->gen++;
    }
  }
}

inline void fiber_main() {
  Ctx* c = ctx;
  Fiber* f = c->cur;
  ThreadInfo ti;
  ti.tpitg = f->tpitg;
  ti.tgpig = c->tgid;
  ti.tptg = c->tgactual;
  ti.tpig = {c->tgid.x * c->tgsize.x + f->tpitg.x, c->tgid.y * c->tgsize.y + f->tpitg.y,
             c->tgid.z * c->tgsize.z + f->tpitg.z};
  ti.tpg = c->grid;
  ti.tgpg = c->ntg;
  ti.lin = f->lin;
  ti.lane = f->lane;
  ti.sg = f->sg;
  ti.nsg = (c->nthreads + 31) / 32;
  c->body(c->bufs, ti);
  finish_fiber(f);
  for (;;) yield();  // never resumed
}

#if defined(__x86_64__)
extern "C" inline void emu_fiber_trampoline() { fiber_main(); }
#endif

constexpr size_t kStack = 256 * 1024;
constexpr size_t kStackPoison = 8 * 1024;

// Buffers sit right before a PROT_NONE page (see __init__.py): an access past
// the end of any buffer faults; the handler jumps back out of the launch.
inline thread_local sigjmp_buf* fault_jmp = nullptr;
inline thread_local void* fault_addr = nullptr;
inline void on_fault(int, siginfo_t* si, void*) {
  fault_addr = si->si_addr;
  siglongjmp(*fault_jmp, 1);
}

inline int launch(BodyFn body, void** bufs, const int64_t* grid, const int64_t* tg,
                  int cuda, char* err, int errlen) {
  Ctx c;
  memset(&c, 0, sizeof(c));
  ctx = &c;
  c.body = body;
  c.bufs = bufs;
  c.grid = {uint(grid[0]), uint(grid[1]), uint(grid[2])};
  c.tgsize = {uint(tg[0]), uint(tg[1]), uint(tg[2])};
  c.ntg = {uint((grid[0] + tg[0] - 1) / tg[0]), uint((grid[1] + tg[1] - 1) / tg[1]),
           uint((grid[2] + tg[2] - 1) / tg[2])};
  int maxthreads = int(tg[0] * tg[1] * tg[2]);
  if (maxthreads > 1024 || maxthreads <= 0) {
    snprintf(err, errlen, "threadgroup of %d threads (max 1024)", maxthreads);
    ctx = nullptr;
    return 1;
  }
  char* stacks = (char*)malloc(kStack * maxthreads);
  Fiber* fibers = (Fiber*)malloc(sizeof(Fiber) * maxthreads);
  c.fibers = fibers;
  struct sigaction sa, old_segv, old_bus;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigjmp_buf jb;
  fault_jmp = &jb;
  if (sigsetjmp(jb, 1) != 0) {
    snprintf(c.err, sizeof(c.err), "out-of-bounds access at address 0x%lx in threadgroup (%u,%u,%u)",
             (unsigned long)fault_addr, c.tgid.x, c.tgid.y, c.tgid.z);
    c.failed = true;
    goto done;
  }
  for (uint gz = 0; gz < c.ntg.z && !c.failed; ++gz)
    for (uint gy = 0; gy < c.ntg.y && !c.failed; ++gy)
      for (uint gx = 0; gx < c.ntg.x && !c.failed; ++gx) {
        c.tgid = {gx, gy, gz};
        // Metal dispatchThreads: edge threadgroups are partial. CUDA (as MLX
        // launches it): whole blocks, threads past the grid run too.
        uint3 act = c.tgsize;
        if (!cuda) {
          act.x = uint(grid[0] - int64_t(gx) * tg[0] < tg[0] ? grid[0] - int64_t(gx) * tg[0] : tg[0]);
          act.y = uint(grid[1] - int64_t(gy) * tg[1] < tg[1] ? grid[1] - int64_t(gy) * tg[1] : tg[1]);
          act.z = uint(grid[2] - int64_t(gz) * tg[2] < tg[2] ? grid[2] - int64_t(gz) * tg[2] : tg[2]);
        }
        c.tgactual = act;
        int n = int(act.x * act.y * act.z);
        c.nthreads = n;
        c.tg_serial = ++tg_serial_counter;
        memset(c.sgs, 0, sizeof(c.sgs));
        memset(&c.tg, 0, sizeof(c.tg));
        c.tg.active = n;
        for (int i = 0; i < n; ++i) {
          Fiber* f = &fibers[i];
          f->lin = uint(i);
          f->lane = uint(i % 32);
          f->sg = uint(i / 32);
          f->done = false;
          f->tpitg = {uint(i % act.x), uint((i / act.x) % act.y), uint(i / (act.x * act.y))};
          c.sgs[f->sg].active++;
          char* top = stacks + kStack * size_t(i + 1);
          // poison where the body's locals will live: an uninitialized float
          // local reads NaN, as poisoned outputs and threadgroup memory do
          memset(top - kStackPoison, 0xff, kStackPoison);
#if defined(__x86_64__)
          void** sp = (void**)top;
          *--sp = nullptr;                              // fake return address
          *--sp = (void*)&emu_fiber_trampoline;         // popped by ret
          for (int r = 0; r < 6; ++r) *--sp = nullptr;  // rbp rbx r12-r15
          f->sp = sp;
#else
          getcontext(&f->uc);
          f->uc.uc_stack.ss_sp = top - kStack;
          f->uc.uc_stack.ss_size = kStack;
          f->uc.uc_link = nullptr;
          makecontext(&f->uc, (void (*)())fiber_main, 0);
#endif
        }
        for (;;) {
          bool any = false;
          long before = c.progress;
          for (int i = 0; i < n; ++i) {
            Fiber* f = &fibers[i];
            if (f->done) continue;
            any = true;
            c.cur = f;
#if defined(__x86_64__)
            emu_ctx_switch(&c.sched_sp, f->sp);
#else
            swapcontext(&c.sched_uc, &f->uc);
#endif
            if (c.failed) break;
          }
          if (!any || c.failed) break;
          if (c.progress == before) {
            fail("deadlock: threads wait at a barrier/SIMD op others never reach");
            break;
          }
        }
      }
done:
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  fault_jmp = nullptr;
  free(stacks);
  free(fibers);
  int rc = c.failed ? 1 : 0;
  if (rc) snprintf(err, errlen, "%s", c.err);
  ctx = nullptr;
  return rc;
}

// ---------------------------------------------------------------- SIMD ops
enum Op : long {
  kSum = 1, kMax, kMin, kProd, kShuffle, kShuffleXor, kShuffleDown, kShuffleUp,
  kBroadcast, kBroadcastFirst, kPrefixExcl, kPrefixIncl, kAny, kAll, kBarrier,
  kSimdBarrier, kBallot
};

template <typename T>
struct Gathered {
  T v[32];
  uint32_t mask;
  uint lane;
};

template <typename T>
inline Gathered<T> gather(T v, long op, int line) {
  static_assert(sizeof(T) <= 16, "simd op on a type wider than 16 bytes");
  Ctx* c = ctx;
  Fiber* f = c->cur;
  Sync& s = c->sgs[f->sg];
  int buf = arrive(s, &v, sizeof(T), f->lane, op * 1000000 + line);
  Gathered<T> g;
  g.mask = s.mask[buf];
  g.lane = f->lane;
  for (int j = 0; j < 32; ++j) {
    if (g.mask & (1u << j))
      memcpy(&g.v[j], s.slots[buf][j], sizeof(T));
    else
      g.v[j] = v;
  }
  return g;
}

// Butterfly reduction, levels xor 1,2,4,8,16 (same tree on every lane, so all
// lanes get bitwise-identical results). Inactive lanes contribute `ident`.
template <typename T, typename F>
inline T butterfly(Gathered<T>& g, T ident, F op) {
  T a[32];
  for (int j = 0; j < 32; ++j) a[j] = (g.mask & (1u << j)) ? g.v[j] : ident;
  for (int m = 1; m < 32; m <<= 1) {
    T b[32];
    for (int j = 0; j < 32; ++j) b[j] = op(a[j], a[j ^ m]);
    for (int j = 0; j < 32; ++j) a[j] = b[j];
  }
  return a[g.lane];
}

inline void barrier(long op, int line) {
  Ctx* c = ctx;
  arrive(c->tg, nullptr, 0, c->cur->lin, op * 1000000 + line);
}

template <typename T>
struct Lowest {
  static T get() { return T(-3.402823466e+38f); }
};
template <>
struct Lowest<float> {
  static float get() { return -__builtin_inff(); }
};
template <>
struct Lowest<int> {
  static int get() { return int(0x80000000u); }
};
template <>
struct Lowest<uint> {
  static uint get() { return 0u; }
};

}  // namespace emu

// Metal SIMD-group functions (global, as Metal's are found unqualified).
template <typename T>
inline T simd_sum(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kSum, line);
  return emu::butterfly(g, T(0), [](T a, T b) { return T(a + b); });
}
template <typename T>
inline T simd_product(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kProd, line);
  return emu::butterfly(g, T(1), [](T a, T b) { return T(a * b); });
}
template <typename T>
inline T simd_max(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kMax, line);
  return emu::butterfly(g, emu::Lowest<T>::get(), [](T a, T b) { return a > b ? a : b; });
}
template <typename T>
inline T simd_min(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kMin, line);
  return emu::butterfly(g, T(-emu::Lowest<T>::get()), [](T a, T b) { return a < b ? a : b; });
}
template <typename T>
inline T simd_shuffle(T v, uint src, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kShuffle, line);
  return g.v[src & 31];
}
template <typename T>
inline T simd_shuffle_xor(T v, uint m, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kShuffleXor, line);
  return g.v[(g.lane ^ m) & 31];
}
template <typename T>
inline T simd_shuffle_down(T v, uint d, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kShuffleDown, line);
  return g.lane + d < 32 ? g.v[g.lane + d] : v;
}
template <typename T>
inline T simd_shuffle_up(T v, uint d, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kShuffleUp, line);
  return g.lane >= d ? g.v[g.lane - d] : v;
}
template <typename T>
inline T simd_broadcast(T v, uint src, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kBroadcast, line);
  return g.v[src & 31];
}
template <typename T>
inline T simd_broadcast_first(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kBroadcastFirst, line);
  return g.v[__builtin_ctz(g.mask)];
}
template <typename T>
inline T simd_prefix_exclusive_sum(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kPrefixExcl, line);
  T acc = T(0);
  for (uint j = 0; j < g.lane; ++j)
    if (g.mask & (1u << j)) acc = T(acc + g.v[j]);
  return acc;
}
template <typename T>
inline T simd_prefix_inclusive_sum(T v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kPrefixIncl, line);
  T acc = T(0);
  for (uint j = 0; j <= g.lane; ++j)
    if (g.mask & (1u << j)) acc = T(acc + g.v[j]);
  return acc;
}
inline bool simd_any(bool v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kAny, line);
  bool r = false;
  for (int j = 0; j < 32; ++j) r = r || ((g.mask >> j) & 1 ? g.v[j] : false);
  return r;
}
inline bool simd_all(bool v, int line = __builtin_LINE()) {
  auto g = emu::gather(v, emu::kAll, line);
  bool r = true;
  for (int j = 0; j < 32; ++j) r = r && ((g.mask >> j) & 1 ? g.v[j] : true);
  return r;
}

// Threadgroup memory: one instance per (declaration, OS thread), poisoned
// (0xFF bytes: NaN for floats) at the start of every threadgroup.
namespace emu {
template <typename A, int ID>
inline A& tg_mem() {
  alignas(16) static thread_local A buf;
  static thread_local long serial = -1;
  if (serial != ctx->tg_serial) {
    memset(&buf, 0xff, sizeof(A));
    serial = ctx->tg_serial;
  }
  return buf;
}
}  // namespace emu

// ---------------------------------------------------------------- math
#define EMU_MATH_1(name, builtin)                          \
  inline float name(float x) { return builtin(x); }        \
  inline float name(bfloat16_t x) { return builtin(float(x)); } \
  inline half name(half x) { return half(builtin(float(x))); }

namespace metal {
EMU_MATH_1(exp, __builtin_expf)
EMU_MATH_1(exp2, __builtin_exp2f)
EMU_MATH_1(log, __builtin_logf)
EMU_MATH_1(log2, __builtin_log2f)
EMU_MATH_1(sqrt, __builtin_sqrtf)
EMU_MATH_1(tanh, __builtin_tanhf)
EMU_MATH_1(abs, __builtin_fabsf)
EMU_MATH_1(fabs, __builtin_fabsf)
EMU_MATH_1(floor, __builtin_floorf)
EMU_MATH_1(ceil, __builtin_ceilf)
EMU_MATH_1(sin, __builtin_sinf)
EMU_MATH_1(cos, __builtin_cosf)
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float pow(float x, float y) { return __builtin_powf(x, y); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
namespace precise {
using metal::exp; using metal::log; using metal::sqrt; using metal::rsqrt; 
using metal::tanh;
}
namespace fast {
using metal::exp; using metal::log; using metal::sqrt; using metal::rsqrt; 
using metal::tanh;
}
enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal

inline void threadgroup_barrier(metal::mem_flags, int line = __builtin_LINE()) {
  emu::barrier(emu::kBarrier, line);
}
inline void simdgroup_barrier(metal::mem_flags, int line = __builtin_LINE()) {
  auto g = emu::gather(0, emu::kSimdBarrier, line);
  (void)g;
}

// CUDA device functions used by the .cu twins.
namespace emu_cuda {
inline float expf(float x) { return __builtin_expf(x); }
inline float __expf(float x) { return __builtin_expf(x); }
inline float logf(float x) { return __builtin_logf(x); }
inline float log1pf(float x) { return __builtin_log1pf(x); }
inline float sqrtf(float x) { return __builtin_sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fabsf(float x) { return __builtin_fabsf(x); }
inline float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fminf(float a, float b) { return __builtin_fminf(a, b); }
inline float tanhf(float x) { return __builtin_tanhf(x); }
inline bool isnan(float x) { return __builtin_isnan(x); }
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
inline uint3 make_uint3(uint x, uint y, uint z) { return uint3{x, y, z}; }
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, 4);
  return f;
}
inline float __bfloat162float(__nv_bfloat16 x) { return float(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16(x); }
inline float __half2float(__half x) { return float(x); }
inline __half __float2half(float x) { return __half(x); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int m, int w = 32, int line = __builtin_LINE()) {
  if (w != 32) emu::fail("__shfl_xor_sync width != 32 not modeled");
  return simd_shuffle_xor(v, uint(m), line);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int w = 32, int line = __builtin_LINE()) {
  if (w != 32) emu::fail("__shfl_sync width != 32 not modeled");
  return simd_shuffle(v, uint(src), line);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int w = 32, int line = __builtin_LINE()) {
  if (w != 32) emu::fail("__shfl_down_sync width != 32 not modeled");
  return simd_shuffle_down(v, d, line);
}
// Correctly rounded float / bf16 / fp16 operations (CUDA's *_rn intrinsics and
// __hfma). A result is formed exactly in double (a bf16 or fp16 product has at
// most 22 significant bits) and rounded once; to bf16 through round-to-odd
// float, which keeps the one rounding exact.
inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline __nv_bfloat16 emu_bf16_from_double(double d) {
  float f = float(d);
  if (double(f) != d && f == f) {  // inexact: round toward zero, then set the sticky bit
    uint32_t u;
    memcpy(&u, &f, 4);
    if (__builtin_fabs(double(f)) > __builtin_fabs(d)) u -= 1;
    u |= 1u;
    memcpy(&f, &u, 4);
  }
  return __nv_bfloat16(f);
}
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return emu_bf16_from_double(double(float(a)) * double(float(b)) + double(float(c)));
}
inline __nv_bfloat16 __hmul_rn(__nv_bfloat16 a, __nv_bfloat16 b) {
  return emu_bf16_from_double(double(float(a)) * double(float(b)));
}
inline __nv_bfloat16 __hadd_rn(__nv_bfloat16 a, __nv_bfloat16 b) {
  return emu_bf16_from_double(double(float(a)) + double(float(b)));
}
inline __half __hfma(__half a, __half b, __half c) {
  return __half(double(a) * double(b) + double(c));
}
inline __half __hmul_rn(__half a, __half b) { return __half(double(a) * double(b)); }
inline __half __hadd_rn(__half a, __half b) { return __half(double(a) + double(b)); }
// bf16x2 / half2: each lane rounds as the scalar operation
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half2 {
  __half x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
#define EMU_PAIR_OPS(P)                                                                    \
  inline P __hfma2(P a, P b, P c) { return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; } \
  inline P __hmul2_rn(P a, P b) { return {__hmul_rn(a.x, b.x), __hmul_rn(a.y, b.y)}; }      \
  inline P __hadd2_rn(P a, P b) { return {__hadd_rn(a.x, b.x), __hadd_rn(a.y, b.y)}; }
EMU_PAIR_OPS(__nv_bfloat162)
EMU_PAIR_OPS(__half2)
#undef EMU_PAIR_OPS
inline void __syncthreads(int line = __builtin_LINE()) { emu::barrier(emu::kBarrier, line); }
inline void __syncwarp(unsigned = 0xffffffffu, int line = __builtin_LINE()) {
  auto g = emu::gather(0, emu::kSimdBarrier, line);
  (void)g;
}
}  // namespace emu_cuda
