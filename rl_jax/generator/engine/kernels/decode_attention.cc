// Decode attention over a slot or a paged KV cache, as XLA FFI custom calls for the CPU backend.
//
// One query per slot attends over its cache up to its own position: positions past it are
// never read, so a slot pays for its live context only, not for the cache's length.
//
//   q         f32 [S, K, G, D]   G query heads per key/value head, scale not applied
//   keys      f32 [S, K, D, T]   (the runner's key cache layout: positions innermost)
//   values    f32 [S, K, T, D]
//   positions s32 [S]            cache positions 0..positions[s] are attended
//   out       f32 [S, K, G, D]
//
// The paged form (PagedDecodeAttention, below) reads keys and values from pages through a page
// table instead; both share the per-slot loops.
//
// Slots are split over the intra-op thread pool XLA hands to custom calls.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 64;  // query heads per key/value head
// Keys and values a call must read before its slots are split over threads (~40 us of work).
constexpr int64_t kMinParallelBytes = 1 << 20;

// Sixteen floats, in as many vector registers as the target needs (one with AVX-512).
typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline Vec Load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

// Softmax of each of the G rows of `scores` ([G, L], in place, left unnormalised); writes the
// reciprocal of each row's sum to `inverse`.
inline void Softmax(float* scores, int64_t G, int64_t L, float* inverse) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inverse[g] = 1.f / sum;
  }
}

// A slot's cache for one key/value head, as blocks of positions: block b holds positions
// b*P .. b*P+P-1, its keys [D, P] at keys[b] and its values [P, D] at values[b]. A contiguous
// cache of T positions is one block with P = T; a paged one has a block per page.
struct Blocks {
  const float* const* keys;
  const float* const* values;
  int64_t P;
};

// Scores of G query heads over the first L positions of `kv` into `scores` [G, L]. Key rows
// are read one after another within each block (one stream: reading the rows' 16-position
// blocks side by side defeats the hardware prefetcher).
inline void Scores(const float* q, const Blocks& kv, int64_t G, int64_t D, int64_t L,
                   float scale, float* scores) {
  for (int64_t i = 0; i < G * L; ++i) scores[i] = 0.f;
  for (int64_t b = 0, t0 = 0; t0 < L; ++b, t0 += kv.P) {
    const int64_t n = std::min(kv.P, L - t0);
    for (int64_t x = 0; x < D; ++x) {
      const float* k = kv.keys[b] + x * kv.P;
      for (int64_t g = 0; g < G; ++g) {
        const float qx = q[g * D + x] * scale;
        float* s = scores + g * L + t0;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) s[t] += qx * k[t];
      }
    }
  }
}

// One (slot, key/value head) over its first L positions, for G query heads of D dimensions
// known at compile time: the outputs of every head stay in registers while the value rows
// stream by, each read once. `scores` holds [G, L] floats.
template <int64_t G, int64_t D>
void AttendFixed(const float* q, const Blocks& kv, float* out, int64_t L, float scale,
                 float* scores) {
  static_assert(D % kLanes == 0, "head dimension must be a multiple of 16");
  Scores(q, kv, G, D, L, scale, scores);
  float inverse[G];
  Softmax(scores, G, L, inverse);
  constexpr int64_t kParts = D / kLanes;
  Vec acc[G][kParts] = {};
  for (int64_t b = 0, t0 = 0; t0 < L; ++b, t0 += kv.P) {
    const int64_t n = std::min(kv.P, L - t0);
    const float* values = kv.values[b];
    for (int64_t t = 0; t < n; ++t) {
      Vec v[kParts];
      for (int64_t j = 0; j < kParts; ++j) v[j] = Load(values + t * D + j * kLanes);
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[g * L + t0 + t];
        for (int64_t j = 0; j < kParts; ++j) acc[g][j] += w * v[j];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < kParts; ++j) Store(out + g * D + j * kLanes, acc[g][j] * inverse[g]);
}

// The same for any G and D (shapes without a compiled specialisation).
void AttendAny(const float* q, const Blocks& kv, float* out, int64_t G, int64_t D, int64_t L,
               float scale, float* scores) {
  Scores(q, kv, G, D, L, scale, scores);
  float inverse[kMaxGroup];
  Softmax(scores, G, L, inverse);
  for (int64_t i = 0; i < G * D; ++i) out[i] = 0.f;
  for (int64_t b = 0, t0 = 0; t0 < L; ++b, t0 += kv.P) {
    const int64_t n = std::min(kv.P, L - t0);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = kv.values[b] + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[g * L + t0 + t];
        float* o = out + g * D;
#pragma omp simd
        for (int64_t x = 0; x < D; ++x) o[x] += w * v[x];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t x = 0; x < D; ++x) out[g * D + x] *= inverse[g];
}

using AttendFn = void (*)(const float*, const Blocks&, float*, int64_t, float, float*);

template <int64_t G>
AttendFn ForDim(int64_t D) {
  switch (D) {
    case 32: return AttendFixed<G, 32>;
    case 64: return AttendFixed<G, 64>;
    case 128: return AttendFixed<G, 128>;
    default: return nullptr;
  }
}

// The specialisation for (G, D), or null.
AttendFn Specialised(int64_t G, int64_t D) {
  switch (G) {
    case 1: return ForDim<1>(D);
    case 2: return ForDim<2>(D);
    case 4: return ForDim<4>(D);
    case 8: return ForDim<8>(D);
    default: return nullptr;
  }
}

// Positions a slot attends: 0..position, within the cache.
inline int64_t LiveLength(int32_t position, int64_t T) {
  return std::min<int64_t>(std::max<int64_t>(int64_t{position} + 1, 1), T);
}

// Runs `run(s0, s1)` over slots 0..S-1 whose live lengths are `live`: on this thread alone for
// small calls (a decode step makes one per layer; waking a helper costs more than their work),
// else in pieces of about equal live context (slots differ in their positions), claimed from a
// shared counter by this thread and by helpers scheduled on the pool. The caller never waits
// for a helper that has not started: the pool's threads may all be busy (this call itself runs
// on one, and other programs' calls may hold the others), so a helper may start only after
// this call returned and then finds nothing left to do.
template <typename Run>
void Split(ffi::ThreadPool& pool, const std::vector<int64_t>& live, int64_t bytes_per_position,
           Run run) {
  const int64_t S = static_cast<int64_t>(live.size());
  int64_t total = 0;
  for (int64_t l : live) total += l;
  const int64_t threads = total * bytes_per_position < kMinParallelBytes
                              ? 1
                              : std::max<int64_t>(1, std::min(pool.num_threads(), S));
  if (threads == 1) {
    run(0, S);
    return;
  }
  struct Work {
    std::vector<int64_t> bounds{0};
    std::atomic<int64_t> next{0};
    int64_t finished = 0;
    std::mutex mu;
    std::condition_variable done;
  };
  auto work = std::make_shared<Work>();
  const int64_t pieces = 4 * threads;
  int64_t acc = 0;
  for (int64_t s = 0; s < S; ++s) {
    acc += live[s];
    if (acc * pieces >= total * static_cast<int64_t>(work->bounds.size()) && s + 1 < S)
      work->bounds.push_back(s + 1);
  }
  work->bounds.push_back(S);
  const int64_t n = static_cast<int64_t>(work->bounds.size()) - 1;
  auto drain = [run, n](Work& w) {
    for (int64_t i; (i = w.next.fetch_add(1)) < n;) {
      run(w.bounds[i], w.bounds[i + 1]);
      std::lock_guard<std::mutex> lock(w.mu);
      if (++w.finished == n) w.done.notify_all();
    }
  };
  for (int64_t i = 1; i < threads; ++i) pool.Schedule([work, drain] { drain(*work); });
  drain(*work);
  std::unique_lock<std::mutex> lock(work->mu);
  work->done.wait(lock, [&] { return work->finished == n; });
}

// Attention of every (slot, key/value head): `blocks(s, k, keys, values)` fills the block
// pointers of one and returns false where its cache cannot be read (its output is then zero).
template <typename Locate>
void AttendAll(ffi::ThreadPool& pool, const float* qp, const int32_t* pp, float* op, int64_t S,
               int64_t K, int64_t G, int64_t D, int64_t T, int64_t P, Locate blocks) {
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const AttendFn fixed = Specialised(G, D);
  const int64_t max_blocks = (T + P - 1) / P;
  auto run = [=](int64_t s0, int64_t s1) {
    int64_t longest = 1;
    for (int64_t s = s0; s < s1; ++s) longest = std::max(longest, LiveLength(pp[s], T));
    std::vector<float> scores(G * longest);
    std::vector<const float*> keys(max_blocks), values(max_blocks);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t L = LiveLength(pp[s], T);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t sk = s * K + k;
        float* o = op + sk * G * D;
        if (!blocks(s, k, L, keys.data(), values.data())) {
          for (int64_t i = 0; i < G * D; ++i) o[i] = 0.f;
          continue;
        }
        const Blocks kv{keys.data(), values.data(), P};
        if (fixed != nullptr)
          fixed(qp + sk * G * D, kv, o, L, scale, scores.data());
        else
          AttendAny(qp + sk * G * D, kv, o, G, D, L, scale, scores.data());
      }
    }
  };
  std::vector<int64_t> live(S);
  for (int64_t s = 0; s < S; ++s) live[s] = LiveLength(pp[s], T);
  Split(pool, live, K * D * 2 * static_cast<int64_t>(sizeof(float)), run);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                           ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  const auto vd = values.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || positions.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("decode attention: q, keys, values must be rank 4 and "
                                       "positions rank 1");
  const int64_t S = qd[0], K = qd[1], G = qd[2], D = qd[3], T = kd[3];
  if (kd[0] != S || kd[1] != K || kd[2] != D || vd[0] != S || vd[1] != K || vd[2] != T ||
      vd[3] != D || positions.dimensions()[0] != S)
    return ffi::Error::InvalidArgument("decode attention: q [S,K,G,D], keys [S,K,D,T], "
                                       "values [S,K,T,D] and positions [S] disagree");
  if (G > kMaxGroup)
    return ffi::Error::InvalidArgument("decode attention: more than 64 query heads per "
                                       "key/value head");
  if (S == 0 || T == 0) return ffi::Error::Success();
  const float* kp = keys.typed_data();
  const float* vp = values.typed_data();
  // One block per slot and head: the whole cache row.
  auto locate = [=](int64_t s, int64_t k, int64_t, const float** kb, const float** vb) {
    kb[0] = kp + (s * K + k) * D * T;
    vb[0] = vp + (s * K + k) * T * D;
    return true;
  };
  AttendAll(pool, q.typed_data(), positions.typed_data(), out->typed_data(), S, K, G, D, T, T,
            locate);
  return ffi::Error::Success();
}

// The same over a paged cache: pages of P positions shared by all slots, and a page table.
//
//   q         f32 [S, K, G, D]
//   keys      f32 [N, K, D, P]   N pages of P positions (positions innermost)
//   values    f32 [N, K, P, D]
//   table     s32 [S, W]         slot s's position t lies in page table[s, t / P], at t % P
//   positions s32 [S]            positions 0..positions[s] (at most W*P - 1) are attended
//   out       f32 [S, K, G, D]
//
// A slot whose attended positions name a page outside 0..N-1 (a free slot's row) gets zeros.
ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                                ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> positions,
                                ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  const auto vd = values.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 ||
      positions.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged decode attention: q, keys, values must be rank "
                                       "4, table rank 2 and positions rank 1");
  const int64_t S = qd[0], K = qd[1], G = qd[2], D = qd[3], N = kd[0], P = kd[3], W = td[1];
  if (kd[1] != K || kd[2] != D || vd[0] != N || vd[1] != K || vd[2] != P || vd[3] != D ||
      td[0] != S || positions.dimensions()[0] != S)
    return ffi::Error::InvalidArgument("paged decode attention: q [S,K,G,D], keys [N,K,D,P], "
                                       "values [N,K,P,D], table [S,W] and positions [S] "
                                       "disagree");
  if (G > kMaxGroup)
    return ffi::Error::InvalidArgument("paged decode attention: more than 64 query heads per "
                                       "key/value head");
  if (S == 0 || W == 0 || P == 0) return ffi::Error::Success();
  const float* kp = keys.typed_data();
  const float* vp = values.typed_data();
  const int32_t* tp = table.typed_data();
  auto locate = [=](int64_t s, int64_t k, int64_t L, const float** kb, const float** vb) {
    for (int64_t b = 0; b * P < L; ++b) {
      const int64_t page = tp[s * W + b];
      if (page < 0 || page >= N) return false;
      kb[b] = kp + (page * K + k) * D * P;
      vb[b] = vp + (page * K + k) * P * D;
    }
    return true;
  };
  AttendAll(pool, q.typed_data(), positions.typed_data(), out->typed_data(), S, K, G, D, W * P,
            P, locate);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
