// memjax's float32 batched matrix product, Transformer-XL's span attention weights and the attention's
// weighted values for XLA:CPU, with their gradients, evaluation's attention in one pass, and the
// adaptive softmax's per-row logsumexp and its gradient (XLA FFI handlers; memjax/kernels/cpu.py).
//
// Why: XLA:CPU runs the attention's small batched products ([B*H] products of 128 x 64 x 256 at
// the peer shape) at about half the CPU's peak: half MKL's rate on a Zen 3, 198-214 GFLOP/s on a
// Zen 5 whose best kernels reach 470-490 (BENCHMARKS.md, ops). This register-blocked kernel,
// compiled for the host CPU (-march=native), runs them at 396-470 there.
//
// out[b] = lhs[b] @ rhs[b] for every b over the leading axes, all row-major: lhs [..., M, K] (or
// [..., K, M] with transpose_lhs, read as its transpose: a gradient's lhs^T @ g without a copy),
// rhs [..., K, N], out [..., M, N]. Products are spread over XLA's intra-op thread pool, and the
// columns of a product too where there are fewer products than threads (a weight gradient).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A register block of out: kRows x kVectors accumulators of kLanes floats plus the rhs row's
// vectors, within the vector registers: AVX-512 has 32 of 16 floats, AVX2 16 of 8 (GCC's vector
// extensions lower a vector of the register's width to single instructions).
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 8;
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 6;
#endif
constexpr int64_t kVectors = 2;
constexpr int64_t kCols = kLanes * kVectors;
typedef float vec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));  // A vector comparison's lanes: -1 or 0.

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, const vec& v) { std::memcpy(p, &v, sizeof(v)); }

// Rows [i, i + rows) of out x kCols columns, rows <= kRows, from the contraction's terms
// [k_begin, k_end): the K loop reads kCols floats of an rhs row per step (`rhs` points at the
// block's first column, rows `rhs_stride` apart) and broadcasts one lhs element per row (lhs's rows,
// or with lhs_t its columns, `lhs_stride` apart); `out` points at the block's first element, rows
// `out_stride` apart. With `accumulate` the block is added to out's.
template <int64_t rows, bool lhs_t>
inline void block(const float* lhs, int64_t lhs_stride, int64_t k_begin, int64_t k_end, int64_t i, const float* rhs,
                  int64_t rhs_stride, float* out, int64_t out_stride, bool accumulate) {
  vec acc[rows][kVectors] = {};
  if (accumulate) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = load(out + r * out_stride + kLanes * v);
    }
  }
  for (int64_t k = k_begin; k < k_end; ++k) {
    vec b[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) b[v] = load(rhs + k * rhs_stride + kLanes * v);
    for (int64_t r = 0; r < rows; ++r) {
      const float a = lhs_t ? lhs[k * lhs_stride + i + r] : lhs[(i + r) * lhs_stride + k];
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < kVectors; ++v) store(out + r * out_stride + kLanes * v, acc[r][v]);
  }
}

// Which part of a product a causal mask leaves to compute. Of out's column block [j, j + cols),
// the rows from first_row(j, cols) on: the rows above it are never read. Of its row block
// [i, i + rows), the contraction's terms in terms(i, rows) (clipped to the contraction): the
// others multiply zeros. A product with no mask computes everything.
inline int64_t every_row(int64_t, int64_t) { return 0; }
inline std::pair<int64_t, int64_t> every_term(int64_t, int64_t) { return {0, std::numeric_limits<int64_t>::max()}; }
inline std::pair<int64_t, int64_t> terms(int64_t begin, int64_t end) { return {begin, end}; }

struct Dense {
  int64_t first_row(int64_t j, int64_t cols) const { return every_row(j, cols); }
  std::pair<int64_t, int64_t> terms(int64_t i, int64_t rows) const { return every_term(i, rows); }
};

// A band from two functions of those signatures (lambdas).
template <typename FirstRow, typename Terms>
struct Band {
  FirstRow first_row;
  Terms terms;
};
template <typename FirstRow, typename Terms>
Band(FirstRow, Terms) -> Band<FirstRow, Terms>;

// One column block [j, j + cols) of every row the band keeps: kRows rows at a time, then one by one.
template <bool lhs_t, typename Band>
void column_block(const float* lhs, int64_t lhs_stride, int64_t m_len, int64_t k_len, const Band& band, int64_t j,
                  int64_t cols, const float* rhs, int64_t rhs_stride, float* out, int64_t out_stride, bool accumulate) {
  const auto clipped = [&](int64_t i, int64_t rows) {
    const auto [begin, end] = band.terms(i, rows);
    return std::pair<int64_t, int64_t>{std::max<int64_t>(begin, 0), std::min(end, k_len)};
  };
  int64_t i = std::max<int64_t>(0, band.first_row(j, cols));
  for (; i + kRows <= m_len; i += kRows) {
    const auto [k_begin, k_end] = clipped(i, kRows);
    block<kRows, lhs_t>(lhs, lhs_stride, k_begin, k_end, i, rhs, rhs_stride, out + i * out_stride, out_stride,
                        accumulate);
  }
  for (; i < m_len; ++i) {
    const auto [k_begin, k_end] = clipped(i, 1);
    block<1, lhs_t>(lhs, lhs_stride, k_begin, k_end, i, rhs, rhs_stride, out + i * out_stride, out_stride, accumulate);
  }
}

// out [M, N] = lhs [M, K] @ rhs [K, N] (lhs_t: lhs [K, M] read as its transpose), lhs's rows (or
// columns), rhs's rows and out's rows `lhs_stride`, `rhs_stride` and `out_stride` apart, so that
// one head of a [T, H, D] array is read or written in place; only the part `band` keeps. With
// `accumulate` the product is added to out.
template <bool lhs_t, typename Band = Dense>
void matmul(const float* lhs, int64_t lhs_stride, const float* rhs, int64_t rhs_stride, float* out,
            int64_t out_stride, int64_t m_len, int64_t k_len, int64_t n_len, const Band& band = Band{},
            bool accumulate = false) {
  const int64_t full_cols = n_len - n_len % kCols;
  for (int64_t j = 0; j < full_cols; j += kCols) {
    column_block<lhs_t>(lhs, lhs_stride, m_len, k_len, band, j, kCols, rhs + j, rhs_stride, out + j, out_stride,
                        accumulate);
  }
  const int64_t tail = n_len - full_cols;
  if (tail == 0) return;
  // The last n_len % kCols columns (a head size of 41, say) as one block of their own: rhs's
  // columns zero-padded to kCols, out computed into a buffer, its first `tail` columns kept.
  std::vector<float> padded(k_len * kCols, 0.0f), block_out(m_len * kCols);
  for (int64_t k = 0; k < k_len; ++k) {
    std::memcpy(&padded[k * kCols], rhs + k * rhs_stride + full_cols, tail * sizeof(float));
  }
  column_block<lhs_t>(lhs, lhs_stride, m_len, k_len, band, full_cols, tail, padded.data(), kCols, block_out.data(),
                      kCols, false);
  for (int64_t i = std::max<int64_t>(0, band.first_row(full_cols, tail)); i < m_len; ++i) {
    float* row = out + i * out_stride + full_cols;
    if (!accumulate) {
      std::memcpy(row, &block_out[i * kCols], tail * sizeof(float));
    } else {
      for (int64_t c = 0; c < tail; ++c) row[c] += block_out[i * kCols + c];
    }
  }
}

// A dense product whose contraction is long (a weight gradient's, over a batch's rows) in chunks
// of kChunk terms: a chunk's lhs and rhs rows stay in cache while every block of out takes its
// share, where whole rows would be read again from memory for each column block.
constexpr int64_t kChunk = 128;

template <bool lhs_t>
void chunked_matmul(const float* lhs, int64_t lhs_stride, const float* rhs, int64_t rhs_stride, float* out,
                    int64_t out_stride, int64_t m_len, int64_t k_len, int64_t n_len) {
  // An empty contraction still runs one pass: out is written (zeros).
  for (int64_t k0 = 0; k0 < std::max<int64_t>(k_len, 1); k0 += kChunk) {
    matmul<lhs_t>(lhs + (lhs_t ? k0 * lhs_stride : k0), lhs_stride, rhs + k0 * rhs_stride, rhs_stride, out,
                  out_stride, m_len, std::min(kChunk, k_len - k0), n_len, Dense{}, k0 > 0);
  }
}

// Runs task(i, scratch) for every i in [0, count) on the calling thread and XLA's intra-op pool,
// `scratch` a buffer of the running thread's own. The state is shared with the pool's tasks by
// ownership: a task that starts after the call returned finds nothing left and touches nothing else.
template <typename Task>
void parallel_for(ffi::ThreadPool& pool, int64_t count, Task task) {
  struct Shared {
    Shared(Task task, int64_t count) : task(std::move(task)), count(count) {}
    Task task;
    int64_t count;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};

    void run() {
      std::vector<float> scratch;
      for (int64_t i; (i = next.fetch_add(1)) < count;) {
        task(i, scratch);
        finished.fetch_add(1);
      }
    }
  };
  auto shared = std::make_shared<Shared>(task, count);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared]() { shared->run(); });
  shared->run();
  // Only tasks some thread has claimed are left, and those threads are running: no task that never
  // started is waited for (the pool may be busy with other ops).
  while (shared->finished.load() < count) std::this_thread::yield();
}

ffi::Error BatchedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Result<ffi::AnyBuffer> out, bool transpose_lhs) {
  const auto lhs_dims = lhs.dimensions();
  const auto rhs_dims = rhs.dimensions();
  const int64_t rank = lhs_dims.size();
  if (rank < 2 || static_cast<int64_t>(rhs_dims.size()) != rank || lhs.element_type() != ffi::F32 ||
      rhs.element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("memjax_batched_matmul: float32 operands of equal rank >= 2");
  }
  const float* lhs_data = lhs.typed_data<float>();
  const float* rhs_data = rhs.typed_data<float>();
  float* out_data = out->typed_data<float>();
  const int64_t m_len = lhs_dims[transpose_lhs ? rank - 1 : rank - 2];
  const int64_t k_len = lhs_dims[transpose_lhs ? rank - 2 : rank - 1];
  const int64_t n_len = rhs_dims[rank - 1];
  int64_t count = 1;
  for (int64_t axis = 0; axis < rank - 2; ++axis) count *= lhs_dims[axis];
  // Fewer products than threads (a weight gradient is one): each product's columns are split in
  // blocks of whole register blocks, one task per thread.
  const int64_t blocks = std::max<int64_t>(1, (n_len + kCols - 1) / kCols);
  const int64_t parts = std::clamp<int64_t>(pool.num_threads() / std::max<int64_t>(count, 1), 1, blocks);
  parallel_for(pool, count * parts, [=](int64_t task, std::vector<float>&) {
    const int64_t b = task / parts, part = task % parts;
    const int64_t j_begin = blocks * part / parts * kCols, j_end = std::min(n_len, blocks * (part + 1) / parts * kCols);
    const float* lhs_b = lhs_data + b * m_len * k_len;
    const float* rhs_b = rhs_data + b * k_len * n_len + j_begin;
    float* out_b = out_data + b * m_len * n_len + j_begin;
    if (transpose_lhs) {
      chunked_matmul<true>(lhs_b, m_len, rhs_b, n_len, out_b, n_len, m_len, k_len, j_end - j_begin);
    } else {
      chunked_matmul<false>(lhs_b, k_len, rhs_b, n_len, out_b, n_len, m_len, k_len, j_end - j_begin);
    }
  });
  return ffi::Error::Success();
}

// Lanes of a and b interleaved: a's and b's first halves (high: their second halves) alternating;
// interleaved(i, high) is the lane of the pair (a's lanes first, then b's) that lane i takes.
constexpr int32_t interleaved(size_t lane, bool high) {
  return static_cast<int32_t>((lane % 2 ? kLanes : 0) + (high ? kLanes / 2 : 0) + lane / 2);
}

template <bool high, size_t... lane>
inline vec interleave(const vec& a, const vec& b, std::index_sequence<lane...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, interleaved(lane, high)...);
#else  // GCC has __builtin_shufflevector only from version 12; __builtin_shuffle is older.
  return __builtin_shuffle(a, b, ivec{interleaved(lane, high)...});
#endif
}

// A kLanes x kLanes tile transposed in registers: log2(kLanes) rounds, each pairing row i with row
// i + kLanes / 2 into rows 2i and 2i + 1 interleaved (each round moves one bit of an element's
// column index into its row index).
inline void transpose_tile(vec (&rows)[kLanes]) {
  constexpr auto lanes = std::make_index_sequence<kLanes>{};
  for (int64_t width = 1; width < kLanes; width *= 2) {
    vec out[kLanes];
    for (int64_t i = 0; i < kLanes / 2; ++i) {
      out[2 * i] = interleave<false>(rows[i], rows[i + kLanes / 2], lanes);
      out[2 * i + 1] = interleave<true>(rows[i], rows[i + kLanes / 2], lanes);
    }
    std::copy(out, out + kLanes, rows);
  }
}

// The K rows of a head, `stride` apart, transposed into [D, K] (`out`): a product's rhs must
// have its rows contiguous, and a head of a [B, K, H, D] array has D contiguous. Per head in the
// kernel, in cache: XLA's transpose of the whole array was a pass over memory at a few GB/s.
// In tiles of kLanes x kLanes transposed in registers (element by element, the keys' transpose
// took a fifth of the time of the scores' products); rows a power of two apart share the few cache
// sets their addresses map to, and a whole column's 64 or 256 lines would evict each other.
// `out`'s rows are `out_stride` apart (default K): two blocks of keys fill one [D, K] side by side.
void transpose_head(const float* head, int64_t stride, int64_t k_len, int64_t d_len, float* out,
                    int64_t out_stride = 0) {
  if (out_stride == 0) out_stride = k_len;
  const int64_t k_tiles = k_len - k_len % kLanes, d_tiles = d_len - d_len % kLanes;
  for (int64_t j0 = 0; j0 < k_tiles; j0 += kLanes) {
    for (int64_t d0 = 0; d0 < d_tiles; d0 += kLanes) {
      vec rows[kLanes];
      for (int64_t r = 0; r < kLanes; ++r) rows[r] = load(head + (j0 + r) * stride + d0);
      transpose_tile(rows);
      for (int64_t r = 0; r < kLanes; ++r) store(out + (d0 + r) * out_stride + j0, rows[r]);
    }
  }
  // The edges a tile does not cover (K or D not a multiple of kLanes), element by element.
  for (int64_t j = 0; j < k_len; ++j) {
    for (int64_t d = j < k_tiles ? d_tiles : 0; d < d_len; ++d) out[d * out_stride + j] = head[j * stride + d];
  }
}

// Attention's weighted values with the heads in place: out [B, T, H, D] = probs [B, H, T, K] @
// value [B, K, H, D] per head, no transposed copies of either side. With `causal`, probs are
// weights over a causal span (the last T of the K keys are the queries'; (i, j) is zero beyond
// j = K - T + i) and their zeros' terms are skipped.
struct Attend {
  const float *probs, *value;
  int64_t heads, t_len, k_len, d_len;
  bool causal;

  int64_t past() const { return k_len - t_len; }
  int64_t stride() const { return heads * d_len; }
  const float* weights(int64_t bh) const { return probs + bh * t_len * k_len; }
  // Head h of batch row b in a [B, L, H, D] array.
  int64_t head(int64_t b, int64_t h, int64_t len) const { return (b * len * heads + h) * d_len; }
};

void attend_head(const Attend& a, float* out, int64_t bh) {
  const int64_t b = bh / a.heads, h = bh % a.heads, past = a.past(), stride = a.stride();
  const float* value = a.value + a.head(b, h, a.k_len);
  float* attended = out + a.head(b, h, a.t_len);
  if (a.causal) {
    matmul<false>(a.weights(bh), a.k_len, value, stride, attended, stride, a.t_len, a.k_len, a.d_len,
                  Band{every_row, [=](int64_t i, int64_t rows) { return terms(0, past + i + rows); }});
  } else {
    matmul<false>(a.weights(bh), a.k_len, value, stride, attended, stride, a.t_len, a.k_len, a.d_len);
  }
}

// Its gradient given g [B, T, H, D]: dprobs = g v^T (with `causal`, computed within the span and
// zero beyond it, where the softmax that made the weights passes nothing back) and dvalue = p^T g,
// written in place.
void attend_gradient_head(const Attend& a, const float* grad, float* grad_probs, float* grad_value, int64_t bh,
                          std::vector<float>& scratch) {
  const int64_t b = bh / a.heads, h = bh % a.heads, past = a.past(), stride = a.stride();
  const int64_t t_len = a.t_len, k_len = a.k_len, d_len = a.d_len;
  scratch.resize(d_len * k_len);
  float* vt = scratch.data();
  transpose_head(a.value + a.head(b, h, k_len), stride, k_len, d_len, vt);
  const float* g = grad + a.head(b, h, t_len);
  float* gp = grad_probs + bh * t_len * k_len;
  float* gv = grad_value + a.head(b, h, k_len);
  if (a.causal) {
    matmul<false>(g, stride, vt, k_len, gp, k_len, t_len, d_len, k_len,
                  Band{[=](int64_t j, int64_t) { return j - past; }, every_term});
    for (int64_t i = 0; i < t_len; ++i) {
      std::fill(gp + i * k_len + std::min(k_len, past + i + 1), gp + (i + 1) * k_len, 0.0f);
    }
    matmul<true>(a.weights(bh), k_len, g, stride, gv, stride, k_len, t_len, d_len,
                 Band{every_row, [=](int64_t j, int64_t) { return terms(j - past, t_len); }});
  } else {
    matmul<false>(g, stride, vt, k_len, gp, k_len, t_len, d_len, k_len);
    matmul<true>(a.weights(bh), k_len, g, stride, gv, stride, k_len, t_len, d_len);
  }
}

bool attend_shapes(ffi::Span<const int64_t> p, ffi::Span<const int64_t> v) {
  return p.size() == 4 && v.size() == 4 && v[0] == p[0] && v[1] == p[3] && v[2] == p[1] && p[2] <= p[3];
}

ffi::Error AttendValues(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> value,
                        ffi::Result<ffi::Buffer<ffi::F32>> out, bool causal) {
  const auto p = probs.dimensions();
  if (!attend_shapes(p, value.dimensions())) {
    return ffi::Error::InvalidArgument("memjax_attend: weights [B, H, T, K], values [B, K, H, D], T <= K");
  }
  const Attend a{probs.typed_data(), value.typed_data(), p[1], p[2], p[3], value.dimensions()[3], causal};
  float* out_data = out->typed_data();
  parallel_for(pool, p[0] * p[1], [=](int64_t bh, std::vector<float>&) { attend_head(a, out_data, bh); });
  return ffi::Error::Success();
}

ffi::Error AttendValuesGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> value,
                                ffi::Buffer<ffi::F32> grad, ffi::Result<ffi::Buffer<ffi::F32>> grad_probs,
                                ffi::Result<ffi::Buffer<ffi::F32>> grad_value, bool causal) {
  const auto p = probs.dimensions();
  if (!attend_shapes(p, value.dimensions())) {
    return ffi::Error::InvalidArgument("memjax_attend_gradient: weights [B, H, T, K], values [B, K, H, D], T <= K");
  }
  const Attend a{probs.typed_data(), value.typed_data(), p[1], p[2], p[3], value.dimensions()[3], causal};
  const float* g = grad.typed_data();
  float *gp = grad_probs->typed_data(), *gv = grad_value->typed_data();
  parallel_for(pool, p[0] * p[1],
               [=](int64_t bh, std::vector<float>& scratch) { attend_gradient_head(a, g, gp, gv, bh, scratch); });
  return ffi::Error::Success();
}

// e^x, float32, within about 2 ulp for x <= 0 (a softmax's exponents) and 0 below -87.3 where
// float32 goes subnormal: e^x = 2^n e^r, |r| <= ln 2 / 2, e^r by Cephes' expf polynomial. Written
// once for a vector and a lone float (a row's tail); GCC's vector extensions give a vector the
// same operators, selects included.
inline vec to_float_bits(const vec&, const vec& n) {
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float to_float_bits(float, float n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename F>
inline F exp_nonpositive(F x) {
  const F underflow = x < -87.3f ? F{} + 1 : F{};  // 1 where e^x is taken as 0.
  x = x < -87.3f ? F{} - 87.3f : x;
  F n = x * 1.44269504088896341f + 12582912.0f;  // Rounded to the nearest integer by the add of 1.5 * 2^23.
  n = n - 12582912.0f;
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F y = (p * r * r + r + 1.0f) * to_float_bits(x, n);
  return underflow > 0.5f ? F{} : y;
}

// Transformer-XL's attention weights over a span of keys, scores to softmax in one pass per head:
//   scores[b, h, i, j] = (cq[b, i, h] . k[b, j, h] + pq[b, i, h] . r[T - 1 - i + j, h]) * scale
// where key j is visible to query i (j <= K - T + i) and valid[b, j]; probs = softmax over j of the
// visible scores (0 elsewhere; a row with none visible is uniform, as a softmax of equal scores),
// log_norm = the softmax's log-denominator (the scores' logsumexp). r's rows are the distance table
// (row p: distance K - 1 - p). A head's content scores go straight to probs, its positional scores
// P = pq @ r^T to a [T, K] buffer that stays in cache; then each row, in cache, takes P's row at
// its rel-shift offset (query i reads P[i, T - 1 - i + j]), is scaled and masked, and becomes its
// softmax: XLA's version makes five passes over the [B, H, T, K] scores in memory.
// What the forward and the gradient share: the queries cq, pq [B, T, H, D], the keys k [B, K, H, D]
// and distance rows r [K, H, D] (all read in place), the keys' validity [B, K], the sizes and the
// scale.
struct Scores {
  const float *cq, *pq, *k, *r;
  const bool* valid;
  int64_t heads, t_len, k_len, d_len;
  float scale;

  // Where head h of batch row b starts in a [B, T, H, D] query array, and in a [B, K, H, D] key one;
  // rows of both are `stride` apart.
  int64_t query(int64_t b, int64_t h) const { return (b * t_len * heads + h) * d_len; }
  int64_t key(int64_t b, int64_t h) const { return (b * k_len * heads + h) * d_len; }
  int64_t stride() const { return heads * d_len; }
};

// Row i of a head: `row` holds its content scores, `shifted` its positional ones at their offset,
// `shown` the keys' validity as 1 or 0 (floats, which a vector compares in one instruction where
// GCC widens bools lane by lane).
float softmax_row(const Scores& s, const float* shown, float* row, const float* shifted, int64_t seen) {
  const float lowest = std::numeric_limits<float>::lowest();
  vec tops = vec{} + lowest;
  int64_t j = 0;
  for (; j + kLanes <= seen; j += kLanes) {
    const vec x = load(shown + j) != 0.0f ? (load(row + j) + load(shifted + j)) * s.scale : lowest;
    store(row + j, x);
    tops = x > tops ? x : tops;
  }
  float top = lowest;
  for (int64_t lane = 0; lane < kLanes; ++lane) top = std::max(top, tops[lane]);
  for (; j < seen; ++j) {
    row[j] = shown[j] != 0.0f ? (row[j] + shifted[j]) * s.scale : lowest;
    top = std::max(top, row[j]);
  }
  if (top == lowest) {  // Nothing visible: every key, the future's too, equally likely.
    std::fill(row, row + s.k_len, 1.0f / s.k_len);
    return lowest;
  }
  vec sums = {};
  for (j = 0; j + kLanes <= seen; j += kLanes) {
    const vec e = exp_nonpositive(load(row + j) - top);
    store(row + j, e);
    sums += e;
  }
  float sum = 0.0f;
  for (; j < seen; ++j) sum += row[j] = exp_nonpositive(row[j] - top);
  for (int64_t lane = 0; lane < kLanes; ++lane) sum += sums[lane];
  const float inverse = 1.0f / sum;
  for (j = 0; j < seen; ++j) row[j] *= inverse;
  std::fill(row + seen, row + s.k_len, 0.0f);
  return top + std::log(sum);
}

// Layouts: probs [B, H, T, K], log_norm [B, H, T]; rt [H, D, K], the distance rows transposed (once
// per head, for every batch row). A head's weights [T, K] into `out` from its keys transposed (kt
// [D, K]: a product's rhs has its rows contiguous), `shown` its keys' validity as floats and
// `position` a [T, K] buffer.
void head_weights(const Scores& s, const float* rt, const float* kt, const float* shown, float* position, float* out,
                  float* log_norm, int64_t bh) {
  const int64_t h = bh % s.heads, t_len = s.t_len, k_len = s.k_len, d_len = s.d_len;
  const int64_t b = bh / s.heads;
  // Query i sees keys j <= past + i, and reads the positional columns c >= T - 1 - i: a column
  // block is computed only for the rows that read it (the mask hides a quarter of each product at
  // T = K / 2; whole register blocks, a fifth, are skipped).
  const int64_t past = k_len - t_len;
  matmul<false>(s.cq + s.query(b, h), s.stride(), kt, k_len, out, k_len, t_len, d_len, k_len,
                Band{[=](int64_t j, int64_t) { return j - past; }, every_term});
  matmul<false>(s.pq + s.query(b, h), s.stride(), rt + h * d_len * k_len, k_len, position, k_len, t_len, d_len, k_len,
                Band{[=](int64_t c, int64_t cols) { return t_len - c - cols; }, every_term});
  for (int64_t i = 0; i < t_len; ++i) {
    log_norm[bh * t_len + i] = softmax_row(s, shown, out + i * k_len, position + i * k_len + (t_len - 1 - i),
                                           past + i + 1);
  }
}

// The head's scratch: a [T, K] buffer for the positional scores, the keys' validity [K] and their
// transpose [D, K]; `weights` more floats in front of them (a [T, K] buffer, or none).
struct HeadScratch {
  float *weights, *position, *shown, *kt;

  HeadScratch(const Scores& s, int64_t b, int64_t weights_size, std::vector<float>& scratch) {
    scratch.resize(weights_size + (s.t_len + 1 + s.d_len) * s.k_len);
    weights = scratch.data();
    position = weights + weights_size;
    shown = position + s.t_len * s.k_len;
    kt = shown + s.k_len;
    for (int64_t j = 0; j < s.k_len; ++j) shown[j] = s.valid[b * s.k_len + j];
  }
};

void softmax_head(const Scores& s, const float* rt, float* probs, float* log_norm, int64_t bh,
                  std::vector<float>& scratch) {
  const int64_t b = bh / s.heads, h = bh % s.heads;
  const HeadScratch buffers(s, b, 0, scratch);
  transpose_head(s.k + s.key(b, h), s.stride(), s.k_len, s.d_len, buffers.kt);
  head_weights(s, rt, buffers.kt, buffers.shown, buffers.position, probs + bh * s.t_len * s.k_len, log_norm, bh);
}

// The gradient of (probs, log_norm) with respect to cq, k, pq and r, given theirs (gp, gl), per head:
// the scores' gradient dS = p (gp - <p, gp> + gl) * scale where visible (0 elsewhere), in cache;
// its rows shifted back to the positional scores' columns (dP[i, T - 1 - i + j] = dS[i, j]); then
// the four products dcq = dS k, dk = dS^T cq, dpq = dP r, dr_b = dP^T pq, written in place into
// [B, T, H, D], [B, K, H, D], [B, T, H, D] and a [B, K, H, D] buffer whose batch rows the caller
// then sums in order: added as heads finished, the sum would depend on the threads' timing, and a
// resumed run would not repeat its gradients bit for bit.
struct Gradients {
  const float *probs, *grad_probs, *grad_log_norm;
  float *grad_cq, *grad_k, *grad_pq, *grad_r_per_row;
};

void gradient_head(const Scores& s, const Gradients& g, int64_t bh, std::vector<float>& scratch) {
  const int64_t b = bh / s.heads, h = bh % s.heads, t_len = s.t_len, k_len = s.k_len, d_len = s.d_len;
  scratch.resize((2 * t_len + 1) * k_len);
  float* scores = scratch.data();
  float* position = scores + t_len * k_len;
  float* shown = position + t_len * k_len;  // As in the forward.
  for (int64_t j = 0; j < k_len; ++j) shown[j] = s.valid[b * k_len + j];
  const int64_t past = k_len - t_len;
  for (int64_t i = 0; i < t_len; ++i) {
    const float* p = g.probs + (bh * t_len + i) * k_len;
    const float* gp = g.grad_probs + (bh * t_len + i) * k_len;
    float* row = scores + i * k_len;
    const int64_t seen = past + i + 1;
    vec dots = {};
    int64_t j = 0;
    for (; j + kLanes <= seen; j += kLanes) dots += load(p + j) * load(gp + j);
    float dot = 0.0f;
    for (; j < seen; ++j) dot += p[j] * gp[j];
    for (int64_t lane = 0; lane < kLanes; ++lane) dot += dots[lane];
    const float shift = g.grad_log_norm[bh * t_len + i] - dot;
    for (j = 0; j + kLanes <= seen; j += kLanes) {
      store(row + j, load(shown + j) != 0.0f ? load(p + j) * (load(gp + j) + shift) * s.scale : 0.0f);
    }
    for (; j < seen; ++j) row[j] = shown[j] != 0.0f ? p[j] * (gp[j] + shift) * s.scale : 0.0f;
    std::fill(row + seen, row + k_len, 0.0f);
    float* shifted = position + i * k_len;
    std::fill(shifted, shifted + (t_len - 1 - i), 0.0f);
    std::memcpy(shifted + (t_len - 1 - i), row, seen * sizeof(float));
  }
  // Each product sums only the terms the mask leaves nonzero: dS[i, j] needs j <= past + i, dP[i, c]
  // needs c >= T - 1 - i.
  const int64_t stride = s.stride(), q = s.query(b, h), k = s.key(b, h);
  matmul<false>(scores, k_len, s.k + k, stride, g.grad_cq + q, stride, t_len, k_len, d_len,
                Band{every_row, [=](int64_t i, int64_t rows) { return terms(0, past + i + rows); }});
  matmul<true>(scores, k_len, s.cq + q, stride, g.grad_k + k, stride, k_len, t_len, d_len,
               Band{every_row, [=](int64_t j, int64_t) { return terms(j - past, t_len); }});
  matmul<false>(position, k_len, s.r + h * d_len, stride, g.grad_pq + q, stride, t_len, k_len, d_len,
                Band{every_row, [=](int64_t i, int64_t rows) { return terms(t_len - i - rows, k_len); }});
  matmul<true>(position, k_len, s.pq + q, stride, g.grad_r_per_row + k, stride, k_len, t_len, d_len,
               Band{every_row, [=](int64_t c, int64_t rows) { return terms(t_len - c - rows, t_len); }});
}

// The distance rows transposed, [H, D, K]: once per head, for every batch row.
std::vector<float> transposed_table(ffi::ThreadPool& pool, const Scores& s) {
  std::vector<float> transposed(s.heads * s.d_len * s.k_len);
  float* rt = transposed.data();
  parallel_for(pool, s.heads, [=](int64_t h, std::vector<float>&) {
    transpose_head(s.r + h * s.d_len, s.stride(), s.k_len, s.d_len, rt + h * s.d_len * s.k_len);
  });
  return transposed;
}

bool span_shapes(ffi::Span<const int64_t> q_dims, ffi::Span<const int64_t> k_dims,
                 ffi::Span<const int64_t> r_dims, ffi::Span<const int64_t> v_dims) {
  return q_dims.size() == 4 && k_dims.size() == 4 && r_dims.size() == 3 && v_dims.size() == 2 &&
         r_dims[0] == k_dims[1] && v_dims[0] == q_dims[0] && v_dims[1] == k_dims[1] && q_dims[1] <= k_dims[1];
}

ffi::Error RelativeSoftmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> cq, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> pq, ffi::Buffer<ffi::F32> r, ffi::Buffer<ffi::PRED> valid,
                           ffi::Result<ffi::Buffer<ffi::F32>> probs, ffi::Result<ffi::Buffer<ffi::F32>> log_norm,
                           float scale) {
  const auto q = cq.dimensions();
  if (!span_shapes(q, k.dimensions(), r.dimensions(), valid.dimensions())) {
    return ffi::Error::InvalidArgument("memjax_relative_softmax: queries [B, T, H, D], keys [B, K, H, D], "
                                       "table [K, H, D], validity [B, K], T <= K");
  }
  const Scores s{cq.typed_data(), pq.typed_data(), k.typed_data(), r.typed_data(), valid.typed_data(),
                 q[2], q[1], k.dimensions()[1], q[3], scale};
  float *probs_data = probs->typed_data(), *log_norm_data = log_norm->typed_data();
  const std::vector<float> transposed = transposed_table(pool, s);  // Every task has finished when it goes.
  const float* rt = transposed.data();
  parallel_for(pool, q[0] * q[2], [=](int64_t bh, std::vector<float>& scratch) {
    softmax_head(s, rt, probs_data, log_norm_data, bh, scratch);
  });
  return ffi::Error::Success();
}

// Evaluation's attention over a span, weights to weighted values in one pass per head: the span
// comes as two blocks of keys and values, the memory's (M, maybe 0) and the segment's (T), and a
// head's weights [T, K] never leave its thread's cache. The weights are those of RelativeSoftmax
// (the same code), out [B, T, H, D] = weights @ [memory values; segment values] in two products
// (the second, causal, skips the terms the mask zeroes), log_norm [B, H, T] as RelativeSoftmax's.
// Against RelativeSoftmax then AttendValues on the blocks concatenated, this writes and reads no
// [B, H, T, K] weights and no [B, K, H, D] concatenations in memory.
void attention_head(const Scores& s, const float* rt, const float* memory_k, const float* segment_k,
                    const float* memory_v, const float* segment_v, float* out, float* log_norm, int64_t bh,
                    std::vector<float>& scratch) {
  const int64_t b = bh / s.heads, h = bh % s.heads, t_len = s.t_len, k_len = s.k_len, d_len = s.d_len;
  const int64_t m_len = k_len - t_len, stride = s.stride();
  const HeadScratch buffers(s, b, t_len * k_len, scratch);
  const int64_t memory_head = (b * m_len * s.heads + h) * d_len, segment_head = s.query(b, h);
  transpose_head(memory_k + memory_head, stride, m_len, d_len, buffers.kt, k_len);
  transpose_head(segment_k + segment_head, stride, t_len, d_len, buffers.kt + m_len, k_len);
  head_weights(s, rt, buffers.kt, buffers.shown, buffers.position, buffers.weights, log_norm, bh);
  float* attended = out + segment_head;
  matmul<false>(buffers.weights, k_len, memory_v + memory_head, stride, attended, stride, t_len, m_len, d_len);
  matmul<false>(buffers.weights + m_len, k_len, segment_v + segment_head, stride, attended, stride, t_len, t_len, d_len,
                Band{every_row, [](int64_t i, int64_t rows) { return terms(0, i + rows); }}, true);
}

bool block_shapes(ffi::Span<const int64_t> q, ffi::Span<const int64_t> memory, ffi::Span<const int64_t> segment) {
  return memory.size() == 4 && segment.size() == 4 && memory[0] == q[0] && memory[2] == q[2] && memory[3] == q[3] &&
         std::equal(q.begin(), q.end(), segment.begin());
}

ffi::Error SpanAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> cq, ffi::Buffer<ffi::F32> memory_k,
                         ffi::Buffer<ffi::F32> segment_k, ffi::Buffer<ffi::F32> pq, ffi::Buffer<ffi::F32> r,
                         ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> memory_v, ffi::Buffer<ffi::F32> segment_v,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> log_norm,
                         float scale) {
  const auto q = cq.dimensions(), m = memory_k.dimensions();
  const int64_t k_len = m.size() == 4 && q.size() == 4 ? m[1] + q[1] : 0;
  const auto r_dims = r.dimensions(), v_dims = valid.dimensions();
  if (q.size() != 4 || !block_shapes(q, m, segment_k.dimensions()) || !block_shapes(q, memory_v.dimensions(),
      segment_v.dimensions()) || memory_v.dimensions()[1] != m[1] || r_dims.size() != 3 || r_dims[0] != k_len ||
      v_dims.size() != 2 || v_dims[0] != q[0] || v_dims[1] != k_len) {
    return ffi::Error::InvalidArgument("memjax_span_attention: queries, segment keys and values [B, T, H, D], memory "
                                       "keys and values [B, M, H, D], table [M + T, H, D], validity [B, M + T]");
  }
  const Scores s{cq.typed_data(), pq.typed_data(), nullptr, r.typed_data(), valid.typed_data(),
                 q[2], q[1], k_len, q[3], scale};
  const float *mk = memory_k.typed_data(), *sk = segment_k.typed_data();
  const float *mv = memory_v.typed_data(), *sv = segment_v.typed_data();
  float *out_data = out->typed_data(), *log_norm_data = log_norm->typed_data();
  const std::vector<float> transposed = transposed_table(pool, s);
  const float* rt = transposed.data();
  parallel_for(pool, q[0] * q[2], [=](int64_t bh, std::vector<float>& scratch) {
    attention_head(s, rt, mk, sk, mv, sv, out_data, log_norm_data, bh, scratch);
  });
  return ffi::Error::Success();
}

ffi::Error RelativeSoftmaxGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs,
                                   ffi::Buffer<ffi::F32> grad_probs, ffi::Buffer<ffi::F32> grad_log_norm,
                                   ffi::Buffer<ffi::F32> cq, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> pq,
                                   ffi::Buffer<ffi::F32> r, ffi::Buffer<ffi::PRED> valid,
                                   ffi::Result<ffi::Buffer<ffi::F32>> grad_cq, ffi::Result<ffi::Buffer<ffi::F32>> grad_k,
                                   ffi::Result<ffi::Buffer<ffi::F32>> grad_pq,
                                   ffi::Result<ffi::Buffer<ffi::F32>> grad_r, float scale) {
  const auto q = cq.dimensions();
  if (!span_shapes(q, k.dimensions(), r.dimensions(), valid.dimensions())) {
    return ffi::Error::InvalidArgument("memjax_relative_softmax_gradient: queries [B, T, H, D], keys [B, K, H, D], "
                                       "table [K, H, D], validity [B, K], T <= K");
  }
  const Scores s{cq.typed_data(), pq.typed_data(), k.typed_data(), r.typed_data(), valid.typed_data(),
                 q[2], q[1], k.dimensions()[1], q[3], scale};
  // Every task that uses it has finished when parallel_for returns.
  const int64_t row_size = grad_r->element_count(), batch = q[0];
  std::vector<float> per_row(batch * row_size);
  const Gradients g{probs.typed_data(), grad_probs.typed_data(), grad_log_norm.typed_data(), grad_cq->typed_data(),
                    grad_k->typed_data(), grad_pq->typed_data(), per_row.data()};
  parallel_for(pool, batch * q[2], [=](int64_t bh, std::vector<float>& scratch) { gradient_head(s, g, bh, scratch); });
  float* grad_r_data = grad_r->typed_data();
  const float* rows = per_row.data();
  const int64_t k_len = s.k_len, stride = s.stride();
  parallel_for(pool, k_len, [=](int64_t c, std::vector<float>&) {
    float* total = grad_r_data + c * stride;
    std::copy(rows + c * stride, rows + (c + 1) * stride, total);
    for (int64_t b = 1; b < batch; ++b) {
      for (int64_t i = 0; i < stride; ++i) total[i] += rows[b * row_size + c * stride + i];
    }
  });
  return ffi::Error::Success();
}


// The adaptive softmax's log-denominators with no logits in memory: for each selected row n of
// x [N, D] (rows[n]), lse[n] = log sum_v e^(x[n] . table[v] + bias[v]) over a cluster's V tokens
// and picked[n] = x[n] . table[index[n]] + bias[index[n]]; 0 for the other rows. Rows go kCols at
// a time, transposed into [D, kCols] (a product's rhs); the table in chunks of kVocabChunk tokens,
// each chunk's logits [chunk, kCols] in cache and folded into a running max and sum per row (a
// vector's lanes are rows: no reduction across lanes). A task takes up to kGroups such groups, so
// that each chunk of the table, read from memory once, serves all of them. XLA writes the logits
// [N, V] out and reads them twice (max, then sum); evaluation needs only these two numbers a row.
constexpr int64_t kVocabChunk = 128;
constexpr int64_t kGroups = 4;

struct Cluster {
  const float *x, *table, *bias;
  const int32_t* index;
  int64_t v_len, d_len;
};

void cluster_rows(const Cluster& c, const int64_t* rows, int64_t count, float* lse, float* picked,
                  std::vector<float>& scratch) {
  const int64_t groups = (count + kCols - 1) / kCols, d_len = c.d_len;
  scratch.assign((groups * d_len + kVocabChunk) * kCols, 0.0f);  // A group's missing rows: zeros.
  float* xt = scratch.data();
  float* logits = xt + groups * d_len * kCols;
  for (int64_t n = 0; n < count; ++n) {
    const float* row = c.x + rows[n] * d_len;
    float* column = xt + (n / kCols) * d_len * kCols + n % kCols;
    for (int64_t k = 0; k < d_len; ++k) column[k * kCols] = row[k];
  }
  const float lowest = std::numeric_limits<float>::lowest();
  vec top[kGroups][kVectors], sum[kGroups][kVectors];
  for (int64_t g = 0; g < kGroups; ++g) {
    for (int64_t v = 0; v < kVectors; ++v) top[g][v] = vec{} + lowest, sum[g][v] = vec{};
  }
  for (int64_t v0 = 0; v0 < c.v_len; v0 += kVocabChunk) {
    const int64_t chunk = std::min(kVocabChunk, c.v_len - v0);
    for (int64_t g = 0; g < groups; ++g) {
      matmul<false>(c.table + v0 * d_len, d_len, xt + g * d_len * kCols, kCols, logits, kCols, chunk, d_len, kCols);
      for (int64_t v = 0; v < kVectors; ++v) {
        vec chunk_top = vec{} + lowest;
        for (int64_t t = 0; t < chunk; ++t) {
          float* at = logits + t * kCols + v * kLanes;
          const vec x = load(at) + c.bias[v0 + t];
          store(at, x);
          chunk_top = x > chunk_top ? x : chunk_top;
        }
        const vec new_top = chunk_top > top[g][v] ? chunk_top : top[g][v];
        vec total = sum[g][v] * exp_nonpositive(top[g][v] - new_top);
        for (int64_t t = 0; t < chunk; ++t) total += exp_nonpositive(load(logits + t * kCols + v * kLanes) - new_top);
        top[g][v] = new_top, sum[g][v] = total;
      }
    }
  }
  for (int64_t n = 0; n < count; ++n) {
    const int64_t g = n / kCols, v = n % kCols / kLanes, lane = n % kLanes, row = rows[n];
    lse[row] = top[g][v][lane] + std::log(sum[g][v][lane]);
    const float* x = c.x + row * d_len;
    const float* token = c.table + static_cast<int64_t>(c.index[row]) * d_len;
    float dot = c.bias[c.index[row]];
    for (int64_t k = 0; k < d_len; ++k) dot += x[k] * token[k];
    picked[row] = dot;
  }
}

ffi::Error ClusterLogsumexp(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> table,
                            ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::PRED> rows,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::F32>> picked) {
  const auto x_dims = x.dimensions(), t_dims = table.dimensions();
  const int64_t n_len = x_dims.size() == 2 ? x_dims[0] : -1;
  if (x_dims.size() != 2 || t_dims.size() != 2 || t_dims[1] != x_dims[1] || t_dims[0] < 1 ||
      bias.dimensions().size() != 1 || bias.dimensions()[0] != t_dims[0] || index.element_count() != n_len ||
      rows.element_count() != n_len) {
    return ffi::Error::InvalidArgument("memjax_cluster_logsumexp: rows [N, D], table [V, D], bias [V], "
                                       "index and selection [N]");
  }
  const Cluster c{x.typed_data(), table.typed_data(), bias.typed_data(), index.typed_data(), t_dims[0], x_dims[1]};
  float *lse_data = lse->typed_data(), *picked_data = picked->typed_data();
  std::fill(lse_data, lse_data + n_len, 0.0f);
  std::fill(picked_data, picked_data + n_len, 0.0f);
  auto selected = std::make_shared<std::vector<int64_t>>();
  for (int64_t n = 0; n < n_len; ++n) {
    if (rows.typed_data()[n]) selected->push_back(n);
  }
  for (int64_t n : *selected) {
    if (c.index[n] < 0 || c.index[n] >= c.v_len) {
      return ffi::Error::InvalidArgument("memjax_cluster_logsumexp: a selected row's index is outside the table");
    }
  }
  // At least two tasks a thread where there are rows enough, up to kGroups groups each.
  const int64_t groups = (static_cast<int64_t>(selected->size()) + kCols - 1) / kCols;
  const int64_t per_task = std::clamp<int64_t>(groups / (2 * pool.num_threads()), 1, kGroups);
  const int64_t tasks = (groups + per_task - 1) / per_task, size = selected->size();
  parallel_for(pool, tasks, [=](int64_t task, std::vector<float>& scratch) {
    const int64_t first = task * per_task * kCols, count = std::min(size - first, per_task * kCols);
    cluster_rows(c, selected->data() + first, count, lse_data, picked_data, scratch);
  });
  return ffi::Error::Success();
}

// Its gradient, given g [N], the cotangent of picked - lse on the selected rows: with
// p = e^(logit - lse) and dlogit[n, v] = g[n] ([v == index[n]] - p[n, v]),
//   dx[n] = sum_v dlogit[n, v] table[v],  dtable[v] = sum_n dlogit[n, v] x[n],  dbias[v] = sum_n dlogit[n, v].
// The logits are computed again, a chunk of the table and a group of rows at a time, in cache. A
// task owns kTaskChunks or more chunks of the table (their gradient is its alone) and takes every
// selected row; its share of dx is summed over the tasks in their order afterwards. At most
// kMaxTasks tasks, so that their shares stay small beside a large vocabulary's table (WikiText-103's
// 160k-word cluster is 1,250 chunks). The tasks do not depend on the thread count: the sums are the
// same from run to run and machine to machine.
constexpr int64_t kTaskChunks = 4;
constexpr int64_t kMaxTasks = 16;

// The selected rows by groups of kCols: their transpose xt [groups, D, kCols] (the logits' rhs),
// the rows themselves xg [groups * kCols, D] (the table gradient's rhs), and per lane the row's
// lse, cotangent and index (a group's missing rows: zero cotangent, index -1).
struct Selected {
  std::vector<float> xt, xg, lse, grad;
  std::vector<int32_t> index;
  int64_t groups;
};

void cluster_gradient_task(const Cluster& c, const Selected& r, int64_t chunk_begin, int64_t chunk_end, float* dtable,
                           float* dbias, float* dxt, std::vector<float>& scratch) {
  const int64_t d_len = c.d_len, group_size = d_len * kCols;
  scratch.assign(kVocabChunk * kCols, 0.0f);
  float* dlogits = scratch.data();
  std::fill(dxt, dxt + r.groups * group_size, 0.0f);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const int64_t v0 = chunk * kVocabChunk, rows = std::min(kVocabChunk, c.v_len - v0);
    const float* table = c.table + v0 * d_len;
    std::fill(dbias + v0, dbias + v0 + rows, 0.0f);
    for (int64_t g = 0; g < r.groups; ++g) {
      matmul<false>(table, d_len, r.xt.data() + g * group_size, kCols, dlogits, kCols, rows, d_len, kCols);
      for (int64_t v = 0; v < kVectors; ++v) {
        const int64_t lanes = g * kCols + v * kLanes;
        const vec lse = load(r.lse.data() + lanes), grad = load(r.grad.data() + lanes);
        ivec index;
        std::memcpy(&index, r.index.data() + lanes, sizeof(index));
        for (int64_t t = 0; t < rows; ++t) {
          float* at = dlogits + t * kCols + v * kLanes;
          const vec p = exp_nonpositive(load(at) + c.bias[v0 + t] - lse);
          store(at, grad * ((index == static_cast<int32_t>(v0 + t) ? vec{} + 1.0f : vec{}) - p));
        }
      }
      for (int64_t t = 0; t < rows; ++t) {
        float total = 0.0f;
        for (int64_t lane = 0; lane < kCols; ++lane) total += dlogits[t * kCols + lane];
        dbias[v0 + t] += total;
      }
      matmul<true>(table, d_len, dlogits, kCols, dxt + g * group_size, kCols, d_len, rows, kCols, Dense{}, true);
      matmul<false>(dlogits, kCols, r.xg.data() + g * kCols * d_len, d_len, dtable + v0 * d_len, d_len, rows, kCols,
                    d_len, Dense{}, g > 0);
    }
  }
}

ffi::Error ClusterLogsumexpGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> table,
                                    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> index,
                                    ffi::Buffer<ffi::PRED> rows, ffi::Buffer<ffi::F32> lse,
                                    ffi::Buffer<ffi::F32> grad, ffi::Result<ffi::Buffer<ffi::F32>> grad_x,
                                    ffi::Result<ffi::Buffer<ffi::F32>> grad_table,
                                    ffi::Result<ffi::Buffer<ffi::F32>> grad_bias) {
  const auto x_dims = x.dimensions(), t_dims = table.dimensions();
  const int64_t n_len = x_dims.size() == 2 ? x_dims[0] : -1;
  if (x_dims.size() != 2 || t_dims.size() != 2 || t_dims[1] != x_dims[1] || t_dims[0] < 1 ||
      bias.element_count() != t_dims[0] || index.element_count() != n_len || rows.element_count() != n_len ||
      lse.element_count() != n_len || grad.element_count() != n_len) {
    return ffi::Error::InvalidArgument("memjax_cluster_logsumexp_gradient: rows [N, D], table [V, D], bias [V], "
                                       "index, selection, lse and cotangent [N]");
  }
  const Cluster c{x.typed_data(), table.typed_data(), bias.typed_data(), index.typed_data(), t_dims[0], x_dims[1]};
  const int64_t d_len = c.d_len;
  std::vector<int64_t> selected;
  for (int64_t n = 0; n < n_len; ++n) {
    if (rows.typed_data()[n]) selected.push_back(n);
  }
  auto r = std::make_shared<Selected>();
  r->groups = (static_cast<int64_t>(selected.size()) + kCols - 1) / kCols;
  const int64_t lanes = r->groups * kCols;
  r->xt.assign(lanes * d_len, 0.0f), r->xg.assign(lanes * d_len, 0.0f);
  r->lse.assign(lanes, 0.0f), r->grad.assign(lanes, 0.0f), r->index.assign(lanes, -1);
  for (int64_t n = 0; n < static_cast<int64_t>(selected.size()); ++n) {
    const int64_t row = selected[n];
    if (c.index[row] < 0 || c.index[row] >= c.v_len) {
      return ffi::Error::InvalidArgument("memjax_cluster_logsumexp_gradient: a selected row's index is outside the table");
    }
    const float* from = c.x + row * d_len;
    std::copy(from, from + d_len, r->xg.begin() + n * d_len);
    float* column = r->xt.data() + (n / kCols) * d_len * kCols + n % kCols;
    for (int64_t k = 0; k < d_len; ++k) column[k * kCols] = from[k];
    r->lse[n] = lse.typed_data()[row], r->grad[n] = grad.typed_data()[row], r->index[n] = c.index[row];
  }
  const int64_t chunks = (c.v_len + kVocabChunk - 1) / kVocabChunk;
  const int64_t tasks = std::min(kMaxTasks, (chunks + kTaskChunks - 1) / kTaskChunks);
  std::vector<float> shares(tasks * lanes * d_len);  // Every task has finished when it goes.
  float *dtable = grad_table->typed_data(), *dbias = grad_bias->typed_data(), *dxt = shares.data();
  if (r->groups == 0) {
    std::fill(dtable, dtable + c.v_len * d_len, 0.0f);
    std::fill(dbias, dbias + c.v_len, 0.0f);
  } else {
    parallel_for(pool, tasks, [=](int64_t task, std::vector<float>& scratch) {
      cluster_gradient_task(c, *r, chunks * task / tasks, chunks * (task + 1) / tasks, dtable, dbias,
                            dxt + task * lanes * d_len, scratch);
    });
  }
  float* dx = grad_x->typed_data();
  std::fill(dx, dx + n_len * d_len, 0.0f);
  for (int64_t n = 0; n < static_cast<int64_t>(selected.size()); ++n) {
    float* out = dx + selected[n] * d_len;
    for (int64_t task = 0; task < tasks; ++task) {
      const float* share = dxt + task * lanes * d_len + (n / kCols) * d_len * kCols + n % kCols;
      for (int64_t k = 0; k < d_len; ++k) out[k] += share[k * kCols];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// The floats per vector this library was built for: which of the two register layouts above runs.
extern "C" int64_t memjax_vector_lanes() { return kLanes; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_batched_matmul, BatchedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_lhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_attend, AttendValues,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_attend_gradient, AttendValuesGradient,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_relative_softmax, RelativeSoftmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_relative_softmax_gradient, RelativeSoftmaxGradient,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_span_attention, SpanAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_cluster_logsumexp, ClusterLogsumexp,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_cluster_logsumexp_gradient, ClusterLogsumexpGradient,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
