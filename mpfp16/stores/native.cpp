// The fused step's CPU kernels for Adam and AdamW, hand-vectorized on ATen's at::vec
// as torch's own fused CPU Adam is (mpfp16/stores/native.py builds this file at first
// use and calls it through ctypes; it includes torch's headers only, and links to
// nothing of torch).
//
// Exactness: every element goes through the operations of mpfp16/stores/kernels.py's
// adam_update, which are those of torch.optim.Adam's for-loop step, with the same
// roundings: the same multiplies, divides, square roots and fused multiply-adds, in
// the same order, in fp32. The build passes -ffp-contract=off, so that the compiler
// never fuses a multiply and an add that torch rounds twice. 16-bit values are
// widened exactly and rounded to nearest-even with at::vec's conversions, those of
// eager .to() (bf16 with AVX512-BF16's instruction where it gives the same bits:
// narrow, below); the square root and the division are IEEE, correctly rounded.
//
// exp_avg and exp_avg_sq are each fp32 or bf16 (FP16Optimizer's state_dtypes). A bf16
// moment is widened exactly, the step computed from the fp32 values as for fp32 moments
// (the new parameter from the new moments unrounded), and the new moment stored rounded
// once to nearest-even: torch's fp32 step from the widened states, its new states then
// rounded with .to(torch.bfloat16), bit for bit.
//
// A segment is cut into blocks of two vectors. Each thread steps a contiguous run of
// blocks; a last, partial block is stepped from zero-padded copies on the stack, with
// the same code as the others, and only its real elements are copied back.

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 2 * Vec::size();
// Below this many elements per thread, a segment is stepped by fewer threads: the
// split is the only thing threads change (every element is stepped alike).
constexpr int64_t kGrain = 1 << 15;

template <typename T>
inline void load(const T* p, Vec& a, Vec& b) {
  at::vec::load_to_float<T>(p, a, b);
}
template <>
inline void load<float>(const float* p, Vec& a, Vec& b) {
  a = Vec::loadu(p);
  b = Vec::loadu(p + Vec::size());
}
// a and b (2 vectors of fp32) rounded to nearest-even into one vector of T, by
// at::vec's conversion, that of eager .to().
template <typename T>
inline at::vec::Vectorized<T> narrow(const Vec& a, const Vec& b) {
  return at::vec::convert_from_float<T>(a, b);
}
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// On a CPU with AVX512-BF16 (native.py then builds with -mavx512bf16), bf16 in one
// instruction: VCVTNE2PS2BF16 rounds to nearest-even as at::vec's integer arithmetic
// does, except that it reads a denormal input as zero and quiets a NaN its own way. A
// pair of vectors holding either (one VFPCLASSPS each tells) takes at::vec's conversion,
// so the bits are those of .to() for every input. Against at::vec's: docs/BENCHMARKS.md,
// "The kernels alone".
template <>
inline at::vec::Vectorized<c10::BFloat16> narrow<c10::BFloat16>(const Vec& a, const Vec& b) {
  constexpr int kOdd = 0x01 | 0x20 | 0x80;  // fpclass: quiet NaN, denormal, signalling NaN
  if (__builtin_expect((_mm512_fpclass_ps_mask(a, kOdd) | _mm512_fpclass_ps_mask(b, kOdd)) != 0, 0)) {
    return at::vec::convert_from_float<c10::BFloat16>(a, b);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);  // b in the high half
}
#endif
template <typename T>
inline void store(T* p, const Vec& a, const Vec& b) {
  narrow<T>(a, b).store(p);
}
template <>
inline void store<float>(float* p, const Vec& a, const Vec& b) {
  a.store(p);
  b.store(p + Vec::size());
}

// 16-bit weights stored around the cache (non-temporal), where the step only writes
// them: with masters the weights are never read, and an ordinary store would first read
// each line it fills (2 of the step's bytes per parameter). `p` is aligned to a whole
// vector of 16-bit values (kBlock of them). Against ordinary stores: docs/BENCHMARKS.md
// ("The kernels alone").
#ifndef MPFP16_STREAM_WEIGHTS
#define MPFP16_STREAM_WEIGHTS 1
#endif
template <typename T>
inline void store_streaming(T* p, const Vec& a, const Vec& b) {
  static_assert(sizeof(T) == 2, "streaming stores are for 16-bit weights");
  const auto v = narrow<T>(a, b);
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), static_cast<__m512i>(v));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), static_cast<__m256i>(v));
#else
#error "native.cpp is built for AVX2 or AVX512"
#endif
}


// The step's scalars, each an fp32 value rounded from Python's double as eager kernels
// round a Python scalar; the order of mpfp16/stores/native.py's SCALARS.
struct Scalars {
  float inv_scale, clip_coef, weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2,
      bias_correction2_sqrt, eps, neg_step_size;
};

// Flags, the bits of native.py's FLAGS.
enum : int { kCoupled = 1, kDecoupled = 2, kMaximize = 4, kLerpLow = 8, kUnscale = 16, kClip = 32 };

// W, M, V: the types of the weights, exp_avg and exp_avg_sq, each combination a copy of
// the code of its own. The gradients are fp32 or of W's type, a choice made per call
// (`fp32_grad`) and taken the same way at every block: as a template parameter too, it
// doubled the copies and the build's time at first use.
template <typename W, typename M, typename V, bool kMaster>
struct Adam {
  const void* grad;
  bool fp32_grad;
  float* master;
  M* exp_avg;
  V* exp_avg_sq;
  W* weights;
  Scalars s;
  int flags;

  // The block of kBlock elements at element i; kStream: store the weights with
  // store_streaming.
  template <bool kStream>
  __attribute__((always_inline)) inline void block(int64_t i) const {
    Vec g[2], p[2], m[2], v[2];
    if (fp32_grad) {
      load<float>(static_cast<const float*>(grad) + i, g[0], g[1]);
    } else {
      load<W>(static_cast<const W*>(grad) + i, g[0], g[1]);
    }
    if (kMaster) {
      load<float>(master + i, p[0], p[1]);
    } else {
      load<W>(weights + i, p[0], p[1]);
    }
    load<M>(exp_avg + i, m[0], m[1]);
    load<V>(exp_avg_sq + i, v[0], v[1]);
    const Vec inv_scale(s.inv_scale), clip_coef(s.clip_coef), weight_decay(s.weight_decay),
        decay_factor(s.decay_factor), w_low(s.one_minus_beta1), w_high(s.one_minus_beta1 - 1.0f), beta2(s.beta2),
        one_minus_beta2(s.one_minus_beta2), bias_correction2_sqrt(s.bias_correction2_sqrt), eps(s.eps),
        neg_step_size(s.neg_step_size);
    for (int k = 0; k < 2; ++k) {
      // g = grad.float() * inv_scale * clip_coef: a multiply by 1 is exact, so it is left out.
      Vec gk = g[k];
      if (flags & kUnscale) gk = gk * inv_scale;
      if (flags & kClip) gk = gk * clip_coef;
      if (flags & kMaximize) gk = gk.neg();
      Vec param = p[k];
      if (flags & kCoupled) gk = at::vec::fmadd(param, weight_decay, gk);  // add(g, param, alpha=wd)
      if (flags & kDecoupled) param = param * decay_factor;
      // lerp(exp_avg, g, 1 - beta1), by eager CPU lerp's formula for |weight| < 0.5 or not
      const Vec diff = gk - m[k];
      m[k] = (flags & kLerpLow) ? at::vec::fmadd(w_low, diff, m[k]) : at::vec::fmadd(w_high, diff, gk);
      // addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
      v[k] = at::vec::fmadd(one_minus_beta2 * gk, gk, v[k] * beta2);
      // addcdiv(param, exp_avg, sqrt(exp_avg_sq) / bias_correction2_sqrt + eps, value=-step_size):
      // from the new moments in fp32, before a 16-bit moment is rounded
      p[k] = param + (neg_step_size * m[k]) / (v[k].sqrt() / bias_correction2_sqrt + eps);
    }
    store<M>(exp_avg + i, m[0], m[1]);
    store<V>(exp_avg_sq + i, v[0], v[1]);
    if (kMaster) store<float>(master + i, p[0], p[1]);
    if constexpr (kStream) {
      store_streaming<W>(weights + i, p[0], p[1]);
    } else {
      store<W>(weights + i, p[0], p[1]);
    }
  }

  // The blocks from element `begin` to `end`. Not inlined, so that the vector loop and
  // the partial block share one copy of the block's code. The loop steps a local copy
  // of this struct, whose scalars and pointers no store through the buffers can alias:
  // the scalars' broadcasts and the flags' tests then leave the loop (stepping `this`,
  // each block reloaded them, a call per block of 200 instructions: docs/BENCHMARKS.md,
  // "The kernels alone").
  template <bool kStream = false>
  __attribute__((noinline)) void blocks(int64_t begin, int64_t end) const {
    const Adam local = *this;
    for (int64_t i = begin; i < end; i += kBlock) local.template block<kStream>(i);
  }

  // The partial block at element i: k < kBlock elements, stepped in zero-padded copies.
  void tail(int64_t i, int64_t k) const {
    alignas(64) float g[kBlock] = {}, p[kBlock] = {};  // g: fp32 or 16-bit gradients
    alignas(64) M m[kBlock] = {};
    alignas(64) V v[kBlock] = {};
    alignas(64) W w[kBlock] = {};
    const size_t grad_size = fp32_grad ? sizeof(float) : sizeof(W);
    std::memcpy(g, static_cast<const char*>(grad) + i * grad_size, k * grad_size);
    if (kMaster) std::memcpy(p, master + i, k * sizeof(float));
    std::memcpy(m, exp_avg + i, k * sizeof(M));
    std::memcpy(v, exp_avg_sq + i, k * sizeof(V));
    std::memcpy(w, weights + i, k * sizeof(W));
    Adam{g, fp32_grad, p, m, v, w, s, flags}.blocks(0, kBlock);
    if (kMaster) std::memcpy(master + i, p, k * sizeof(float));
    std::memcpy(exp_avg + i, m, k * sizeof(M));
    std::memcpy(exp_avg_sq + i, v, k * sizeof(V));
    std::memcpy(weights + i, w, k * sizeof(W));
  }

  void run(int64_t n, int threads) const {
    const int64_t count = n / kBlock;
    const int used = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, n / kGrain)));
#pragma omp parallel num_threads(used)
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t begin = count * t / T * kBlock, end = count * (t + 1) / T * kBlock;
      bool streamed = false;
      if constexpr (kMaster && sizeof(W) == 2 && MPFP16_STREAM_WEIGHTS) {
        // every block starts a multiple of kBlock elements after `weights`: all are
        // aligned for store_streaming or none is
        if (reinterpret_cast<std::uintptr_t>(weights) % (kBlock * sizeof(W)) == 0) {
          blocks<true>(begin, end);
          _mm_sfence();  // the streamed lines are written before the threads join
          streamed = true;
        }
      }
      if (!streamed) blocks(begin, end);
      if (t == T - 1 && end < n) tail(end, n - end);
    }
  }
};

// The buffers of one call, as the C ABI passes them.
struct Buffers {
  const void* grad;
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
  void* weights;
};

// 0, or -1 for fp32 weights with masters (an fp32 group keeps none: not instantiated).
template <typename W, typename M, typename V>
int adam(int64_t n, bool fp32_grad, const Buffers& b, const Scalars& s, int flags, int threads) {
  const auto m = static_cast<M*>(b.exp_avg);
  const auto v = static_cast<V*>(b.exp_avg_sq);
  const auto w = static_cast<W*>(b.weights);
  if (b.master == nullptr) {
    Adam<W, M, V, false>{b.grad, fp32_grad, nullptr, m, v, w, s, flags}.run(n, threads);
  } else if constexpr (sizeof(W) == 2) {
    Adam<W, M, V, true>{b.grad, fp32_grad, b.master, m, v, w, s, flags}.run(n, threads);
  } else {
    return -1;
  }
  return 0;
}

// The moments' dtype codes (fp32 or bf16 each) to their types; -1 for any other.
template <typename W>
int adam(int64_t n, bool fp32_grad, int m_dtype, int v_dtype, const Buffers& b, const Scalars& s, int flags,
         int threads) {
  using BF16 = c10::BFloat16;
  switch (m_dtype * 3 + v_dtype) {
    case 0: return adam<W, float, float>(n, fp32_grad, b, s, flags, threads);
    case 2: return adam<W, float, BF16>(n, fp32_grad, b, s, flags, threads);
    case 6: return adam<W, BF16, float>(n, fp32_grad, b, s, flags, threads);
    case 8: return adam<W, BF16, BF16>(n, fp32_grad, b, s, flags, threads);
    default: return -1;
  }
}

// Whether any of grad * inv_scale is inf or NaN: x - x is 0 for every finite x and
// NaN otherwise, and a sum stays NaN once it has met one. Each thread reads its run
// of blocks as kStreams interleaved sub-runs at once. Against one stream this made no
// clear difference here (mpfp16.bench.kernels, "native check, 1 stream"): on this
// CPU a pass that only reads draws about 0.6 of the update's bandwidth either way.
#ifndef MPFP16_CHECK_STREAMS
#define MPFP16_CHECK_STREAMS 4
#endif
constexpr int64_t kStreams = MPFP16_CHECK_STREAMS;

template <typename G>
inline Vec finite_sum(const G* p, const Vec& scale) {
  Vec a, c;
  load<G>(p, a, c);
  a = a * scale;
  c = c * scale;
  return (a - a) + (c - c);
}

template <typename G>
bool nonfinite(int64_t n, const G* grad, float inv_scale, int threads) {
  const int64_t blocks = n / kBlock;
  int used = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, n / kGrain)));
  int found = 0;
#pragma omp parallel num_threads(used) reduction(| : found)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t begin = blocks * t / T, end = blocks * (t + 1) / T;
    const int64_t stride = (end - begin) / kStreams;
    const Vec scale(inv_scale);
    Vec acc[kStreams];
    for (int64_t s = 0; s < kStreams; ++s) acc[s] = Vec(0.0f);
    for (int64_t b = 0; b < stride; ++b) {
      for (int64_t s = 0; s < kStreams; ++s) {
        acc[s] = acc[s] + finite_sum(grad + (begin + s * stride + b) * kBlock, scale);
      }
    }
    for (int64_t b = begin + kStreams * stride; b < end; ++b) acc[0] = acc[0] + finite_sum(grad + b * kBlock, scale);
    if (t == T - 1 && blocks * kBlock < n) {
      alignas(64) G g[kBlock] = {};
      std::memcpy(g, grad + blocks * kBlock, (n - blocks * kBlock) * sizeof(G));
      acc[0] = acc[0] + finite_sum(g, scale);
    }
    for (int64_t s = 1; s < kStreams; ++s) acc[0] = acc[0] + acc[s];
    alignas(64) float lanes[Vec::size()];
    acc[0].store(lanes);
    for (int j = 0; j < Vec::size(); ++j) found |= std::isnan(lanes[j]) ? 1 : 0;
  }
  return found != 0;
}

}  // namespace

// dtype codes: 0 fp32, 1 fp16, 2 bf16 (native.py's DTYPES). 0, or -1 for dtypes (or
// fp32 weights with masters) that no kernel steps: gradients of the weights' dtype or
// fp32, each moment fp32 or bf16.
extern "C" int mpfp16_adam(int64_t n, int weight_dtype, int grad_dtype, int exp_avg_dtype, int exp_avg_sq_dtype,
                           const void* grad, float* master, void* exp_avg, void* exp_avg_sq, void* weights,
                           const float* scalars, int flags, int threads) {
  Scalars s;
  std::memcpy(&s, scalars, sizeof(Scalars));
  const Buffers b{grad, master, exp_avg, exp_avg_sq, weights};
  const int m = exp_avg_dtype, v = exp_avg_sq_dtype;
  if (grad_dtype != 0 && grad_dtype != weight_dtype) return -1;
  switch (weight_dtype) {
    case 0: return adam<float>(n, true, m, v, b, s, flags, threads);
    case 1: return adam<c10::Half>(n, grad_dtype == 0, m, v, b, s, flags, threads);
    case 2: return adam<c10::BFloat16>(n, grad_dtype == 0, m, v, b, s, flags, threads);
    default: return -1;
  }
}

// 1 if any element of grad * inv_scale is inf or NaN, 0 if none, -1 for an unknown dtype.
extern "C" int mpfp16_nonfinite(int64_t n, int grad_dtype, const void* grad, float inv_scale, int threads) {
  switch (grad_dtype) {
    case 0: return nonfinite(n, static_cast<const float*>(grad), inv_scale, threads);
    case 1: return nonfinite(n, static_cast<const c10::Half*>(grad), inv_scale, threads);
    case 2: return nonfinite(n, static_cast<const c10::BFloat16*>(grad), inv_scale, threads);
    default: return -1;
  }
}
