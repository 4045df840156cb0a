// memjax's float32 batched matrix product for XLA:CPU (an XLA FFI handler; memjax/kernels/cpu.py).
//
// Why: XLA:CPU runs the attention's small batched products ([B*H] products of 128 x 64 x 256 at
// the peer shape) at about half the rate MKL reaches on the same shapes (BENCHMARKS.md, ops). This
// register-blocked kernel, compiled for the host CPU (-march=native), reaches that rate.
//
// out[b] = lhs[b] @ rhs[b] for every b over the leading axes, all row-major: lhs [..., M, K] (or
// [..., K, M] with transpose_lhs, read as its transpose: a gradient's lhs^T @ g without a copy),
// rhs [..., K, N], out [..., M, N]. Products are spread over XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
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

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, const vec& v) { std::memcpy(p, &v, sizeof(v)); }

// Rows [i, i + rows) of out x kCols columns, rows <= kRows: the K loop reads kCols floats of an rhs
// row per step (`rhs` points at the block's first column, rows `rhs_stride` apart) and broadcasts
// one lhs element per row; `out` points at the block's first element, rows `out_stride` apart.
template <int64_t rows, bool lhs_t>
inline void block(const float* lhs, int64_t m_len, int64_t k_len, int64_t i, const float* rhs, int64_t rhs_stride,
                  float* out, int64_t out_stride) {
  vec acc[rows][kVectors] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    vec b[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) b[v] = load(rhs + k * rhs_stride + kLanes * v);
    for (int64_t r = 0; r < rows; ++r) {
      const float a = lhs_t ? lhs[k * m_len + i + r] : lhs[(i + r) * k_len + k];
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < kVectors; ++v) store(out + r * out_stride + kLanes * v, acc[r][v]);
  }
}

// One column block of every row: kRows rows at a time, then one by one.
template <bool lhs_t>
void column_block(const float* lhs, int64_t m_len, int64_t k_len, const float* rhs, int64_t rhs_stride, float* out,
                  int64_t out_stride) {
  int64_t i = 0;
  for (; i + kRows <= m_len; i += kRows) {
    block<kRows, lhs_t>(lhs, m_len, k_len, i, rhs, rhs_stride, out + i * out_stride, out_stride);
  }
  for (; i < m_len; ++i) block<1, lhs_t>(lhs, m_len, k_len, i, rhs, rhs_stride, out + i * out_stride, out_stride);
}

template <bool lhs_t>
void matmul(const float* lhs, const float* rhs, float* out, int64_t m_len, int64_t k_len, int64_t n_len) {
  const int64_t full_cols = n_len - n_len % kCols;
  for (int64_t j = 0; j < full_cols; j += kCols) {
    column_block<lhs_t>(lhs, m_len, k_len, rhs + j, n_len, out + j, n_len);
  }
  const int64_t tail = n_len - full_cols;
  if (tail == 0) return;
  // The last n_len % kCols columns (a head size of 41, say) as one block of their own: rhs's
  // columns zero-padded to kCols, out computed into a buffer, its first `tail` columns kept.
  std::vector<float> padded(k_len * kCols, 0.0f), block_out(m_len * kCols);
  for (int64_t k = 0; k < k_len; ++k) {
    std::memcpy(&padded[k * kCols], rhs + k * n_len + full_cols, tail * sizeof(float));
  }
  column_block<lhs_t>(lhs, m_len, k_len, padded.data(), kCols, block_out.data(), kCols);
  for (int64_t i = 0; i < m_len; ++i) {
    std::memcpy(out + i * n_len + full_cols, &block_out[i * kCols], tail * sizeof(float));
  }
}

// Shared with the pool's tasks by ownership: a task that starts after the call returned finds no
// product left and touches nothing else.
struct Work {
  const float* lhs;
  const float* rhs;
  float* out;
  int64_t count, m_len, k_len, n_len;
  bool lhs_t;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void run() {
    for (int64_t b; (b = next.fetch_add(1)) < count;) {
      (lhs_t ? matmul<true> : matmul<false>)(lhs + b * m_len * k_len, rhs + b * k_len * n_len,
                                             out + b * m_len * n_len, m_len, k_len, n_len);
      finished.fetch_add(1);
    }
  }
};

ffi::Error BatchedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Result<ffi::AnyBuffer> out, bool transpose_lhs) {
  const auto lhs_dims = lhs.dimensions();
  const auto rhs_dims = rhs.dimensions();
  const int64_t rank = lhs_dims.size();
  if (rank < 2 || static_cast<int64_t>(rhs_dims.size()) != rank || lhs.element_type() != ffi::F32 ||
      rhs.element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("memjax_batched_matmul: float32 operands of equal rank >= 2");
  }
  auto work = std::make_shared<Work>();
  work->lhs = lhs.typed_data<float>();
  work->rhs = rhs.typed_data<float>();
  work->out = out->typed_data<float>();
  work->lhs_t = transpose_lhs;
  work->m_len = lhs_dims[transpose_lhs ? rank - 1 : rank - 2];
  work->k_len = lhs_dims[transpose_lhs ? rank - 2 : rank - 1];
  work->n_len = rhs_dims[rank - 1];
  work->count = 1;
  for (int64_t axis = 0; axis < rank - 2; ++axis) work->count *= lhs_dims[axis];
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work->run(); });
  work->run();
  // Only products some thread has claimed are left, and those threads are running: no task that
  // never started is waited for (the pool may be busy with other ops).
  while (work->finished.load() < work->count) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(memjax_batched_matmul, BatchedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_lhs"));
