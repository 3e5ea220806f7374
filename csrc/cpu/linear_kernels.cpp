// The packed linear of ops.h (out = x W^T + bias over W in the panel layout), compiled once per
// ISA variant; see vec.h.
//
// Why not MKL (torch's F.linear): a decode step multiplies a few rows (one per running
// sequence) by every weight matrix. MKL packs the [out, in] matrix into its own blocked form
// inside every call, one more pass over every weight, and its few-row kernels reach a fraction
// of the FMA peak: measured on the embedded model's shapes (AMD EPYC, 2 cores, float32), a
// decode step's products ran 1.8-2.5x faster from 1 to 64 rows and 1.2x at 256
// (tools/bench_linear.py). 16-bit F.linear without AVX-512 BF16 / FP16 is slower still.
//
// The work: for a block of rows and a block of the input features, every panel (16 output
// features, stored [in][16]) is read once and multiplied into tiles of kTileRows rows x 16
// outputs held in registers (GotoBLAS's micro-kernel: per input feature, one broadcast of x per
// row and kTileRows x 16 FMAs). Threads split the panels (each reads its own part of the
// weights), and the rows too when there are few panels per thread.
//
// Every output is a function of its row of x, the weights and in_features only: one float32 FMA
// chain over the input features in index order, whatever the number of rows, the row blocking or
// the threads. So a request's logits never depend on what shares its batch. In float32 the
// features are blocked (the partial sum is stored in out and reloaded, exactly); in bfloat16 /
// float16 out cannot hold a float32 partial, so a tile runs over every feature at once, on rows
// of x widened to float32 once per row block (bf16 / fp16 weights widen as they load; the output
// rounds once, after the bias, as torch's F.linear rounds).
//
// int8 weights (weight-only quantization, one float32 scale per output feature): the panels hold
// int8 values, widened to float32 as they load (exact), summed as above over whole rows of x;
// the sum is multiplied by the output's scale, then the bias is added. A decode step reads every
// weight once per step, so at a few rows its time is the weights' bytes over the memory
// bandwidth: a quarter of float32's bytes.
#include "linear_kernels.h"

#include <omp.h>

#include <cstring>
#include <type_traits>
#include <utility>

#include "vec.h"

namespace pagedserve::cpu::PAGEDSERVE_ISA_NS {
namespace {

constexpr int kPanel = kLinearPanelWidth;
static_assert(kPanel % kWidth == 0, "a panel row is whole vectors");
constexpr int kVectorsPerPanelRow = kPanel / kWidth;

// Rows per register tile: the accumulators (kTileRows x kVectorsPerPanelRow) plus the panel
// row's vectors and one broadcast must fit in the vector registers.
#if defined(PAGEDSERVE_ISA_AVX512)
constexpr int kTileRows = 12;  // 12 x 1 accumulators of 32 zmm
#elif defined(PAGEDSERVE_ISA_AVX2)
constexpr int kTileRows = 6;  // 6 x 2 accumulators of 16 ymm
#else
constexpr int kTileRows = 4;
#endif

// float32 input features per block: a panel's block (kMaxFeatureBlock x 16 floats, 32 KiB)
// stays in the L1/L2 cache while every row tile of the row block reads it. The results do not
// depend on it (see the top of the file).
constexpr int64_t kMaxFeatureBlock = 512;
// Bytes of x per row block: it stays in the L2 cache while every panel reads it.
constexpr int64_t kRowBlockBytes = 128 * 1024;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

// c[Rows x 16] = (accumulate ? c : 0) + x[Rows, 0:features] . panel[0:features, 16], then
// * scale[16] when scale is set (int8 weights), then + bias[16] when bias is set. x rows x_stride
// apart, c rows c_stride apart. W: the weights' type (T, or int8_t); T: bias and c (accumulate
// only for float).
template <typename W, typename T, int Rows>
void tile(const float* x, int64_t x_stride, const W* panel, int64_t features, T* c,
          int64_t c_stride, bool accumulate, const T* bias, const float* scale) {
  VecF acc[Rows][kVectorsPerPanelRow];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVectorsPerPanelRow; ++v) {
      acc[r][v] = accumulate ? VecF::load(c + r * c_stride + v * kWidth) : VecF::zero();
    }
  }
  for (int64_t k = 0; k < features; ++k) {
    VecF w[kVectorsPerPanelRow];
#pragma GCC unroll 4
    for (int v = 0; v < kVectorsPerPanelRow; ++v)
      w[v] = VecF::load(panel + k * kPanel + v * kWidth);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const VecF a = VecF::broadcast(x[r * x_stride + k]);
#pragma GCC unroll 4
      for (int v = 0; v < kVectorsPerPanelRow; ++v) acc[r][v] = fma(a, w[v], acc[r][v]);
    }
  }
  if (scale != nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kVectorsPerPanelRow; ++v) {
        acc[r][v] = acc[r][v] * VecF::load(scale + v * kWidth);
      }
    }
  }
  if (bias != nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kVectorsPerPanelRow; ++v) {
        acc[r][v] = acc[r][v] + VecF::load(bias + v * kWidth);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVectorsPerPanelRow; ++v) acc[r][v].store(c + r * c_stride + v * kWidth);
  }
}

template <typename W, typename T>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, T*, int64_t, bool, const T*,
                        const float*);

template <typename W, typename T, int... Rows>
constexpr TileFn<W, T> kTilesByRows[] = {nullptr, tile<W, T, Rows + 1>...};

template <typename W, typename T, size_t... I>
constexpr const TileFn<W, T>* tiles_by_rows(std::index_sequence<I...>) {
  return kTilesByRows<W, T, static_cast<int>(I)...>;
}

// kTiles<W, T>[r]: the tile of r rows, 1 <= r <= kTileRows.
template <typename W, typename T>
constexpr const TileFn<W, T>* kTiles = tiles_by_rows<W, T>(std::make_index_sequence<kTileRows>{});

// The rows [0, rows) of x against one panel over one block of input features. A panel of fewer
// than 16 outputs (the last, when out_features is not a multiple of 16) goes through a 16-wide
// scratch tile, so every tile computes all 16 columns the same way.
template <typename W, typename T>
void rows_times_panel(const float* x, int64_t x_stride, const W* panel, int64_t features, T* out,
                      int64_t out_stride, int64_t columns, bool accumulate, const T* bias,
                      const float* scale, int64_t rows) {
  if (columns == kPanel) {
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int64_t n = smaller(kTileRows, rows - r);
      kTiles<W, T>[n](x + r* x_stride, x_stride, panel, features, out + r* out_stride, out_stride,
                      accumulate, bias, scale);
    }
    return;
  }
  alignas(64) T scratch[kTileRows * kPanel];
  alignas(64) T scratch_bias[kPanel];
  alignas(64) float scratch_scale[kPanel];
  std::memset(scratch_bias, 0, sizeof(scratch_bias));
  std::memset(scratch_scale, 0, sizeof(scratch_scale));
  if (bias != nullptr) std::memcpy(scratch_bias, bias, columns * sizeof(T));
  if (scale != nullptr) std::memcpy(scratch_scale, scale, columns * sizeof(float));
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int64_t n = smaller(kTileRows, rows - r);
    for (int64_t i = 0; i < n; ++i) {
      T* row = scratch + i * kPanel;
      std::memset(row, 0, sizeof(T) * kPanel);
      if (accumulate) std::memcpy(row, out + (r + i) * out_stride, columns * sizeof(T));
    }
    kTiles<W, T>[n](x + r* x_stride, x_stride, panel, features, scratch, kPanel, accumulate,
                    bias != nullptr ? scratch_bias : nullptr,
                    scale != nullptr ? scratch_scale : nullptr);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(out + (r + i) * out_stride, scratch + i * kPanel, columns * sizeof(T));
    }
  }
}

// Rows of x per row block, for a block of `features` input features.
int64_t row_block(int64_t features) {
  const int64_t fitting = kRowBlockBytes / (features * static_cast<int64_t>(sizeof(float)));
  return larger(kTileRows, fitting / kTileRows * kTileRows);
}

// One thread's share in float32: panels [panel_begin, panel_end) x rows [row_begin, row_end),
// the features in blocks.
void float_part(const LinearProblem& p, int64_t panel_begin, int64_t panel_end, int64_t row_begin,
                int64_t row_end) {
  const float* x = static_cast<const float*>(p.x);
  const float* weight = static_cast<const float*>(p.packed_weight);
  const float* bias = static_cast<const float*>(p.bias);
  float* out = static_cast<float*>(p.out);
  const int64_t feature_blocks = ceil_div(p.in_features, kMaxFeatureBlock);
  const int64_t feature_block = ceil_div(p.in_features, feature_blocks);
  const int64_t block_rows = row_block(feature_block);
  for (int64_t row = row_begin; row < row_end; row += block_rows) {
    const int64_t rows = smaller(block_rows, row_end - row);
    for (int64_t k0 = 0; k0 < p.in_features; k0 += feature_block) {
      const int64_t features = smaller(feature_block, p.in_features - k0);
      const bool last = k0 + features == p.in_features;
      for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
        const int64_t column = panel * kPanel;
        rows_times_panel<float, float>(x + row * p.x_row_stride + k0, p.x_row_stride,
                                       weight + (panel * p.in_features + k0) * kPanel, features,
                                       out + row * p.out_row_stride + column, p.out_row_stride,
                                       smaller(kPanel, p.out_features - column), k0 > 0,
                                       last && bias != nullptr ? bias + column : nullptr, nullptr,
                                       rows);
      }
    }
  }
}

// The same with every feature in one tile: x in bfloat16 / float16 (out cannot hold a float32
// partial), or int8 weights (their scale applies to the whole sum; a panel of int8 is a quarter
// of a float32 one, so a whole one stays in the cache). Rows of 16-bit x are widened into
// `widened` (min(row_block(in_features), row_end - row_begin) x in_features floats) once per row
// block; float32 x is read in place.
template <typename W, typename T>
void whole_feature_part(const LinearProblem& p, float* widened, int64_t panel_begin,
                        int64_t panel_end, int64_t row_begin, int64_t row_end) {
  const T* x = static_cast<const T*>(p.x);
  const W* weight = static_cast<const W*>(p.packed_weight);
  const T* bias = static_cast<const T*>(p.bias);
  const float* scales = p.weight_scales;
  T* out = static_cast<T*>(p.out);
  const int64_t k = p.in_features;
  const int64_t block_rows = row_block(k);
  for (int64_t row = row_begin; row < row_end; row += block_rows) {
    const int64_t rows = smaller(block_rows, row_end - row);
    const float* block_x;
    int64_t block_x_stride;
    if constexpr (std::is_same_v<T, float>) {
      block_x = x + row * p.x_row_stride;
      block_x_stride = p.x_row_stride;
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const T* source = x + (row + r) * p.x_row_stride;
        float* target = widened + r * k;
        int64_t i = 0;
        for (; i + kWidth <= k; i += kWidth) VecF::load(source + i).store(target + i);
        for (; i < k; ++i) target[i] = to_float(source[i]);
      }
      block_x = widened;
      block_x_stride = k;
    }
    for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
      const int64_t column = panel * kPanel;
      rows_times_panel<W, T>(block_x, block_x_stride, weight + panel * k * kPanel, k,
                             out + row * p.out_row_stride + column, p.out_row_stride,
                             smaller(kPanel, p.out_features - column), false,
                             bias != nullptr ? bias + column : nullptr,
                             scales != nullptr ? scales + column : nullptr, rows);
    }
  }
}

// Runs one thread's share, with its own buffer for widened rows where x needs one.
template <typename W, typename T>
void run_part(const LinearProblem& p, int64_t panel_begin, int64_t panel_end, int64_t row_begin,
              int64_t row_end) {
  if constexpr (std::is_same_v<W, float>) {
    float_part(p, panel_begin, panel_end, row_begin, row_end);
  } else if constexpr (std::is_same_v<T, float>) {
    whole_feature_part<W, T>(p, nullptr, panel_begin, panel_end, row_begin, row_end);
  } else {
    // A decode step's few rows need far less than a whole row block.
    const int64_t rows = smaller(row_block(p.in_features), row_end - row_begin);
    float* widened = new float[rows * p.in_features];
    whole_feature_part<W, T>(p, widened, panel_begin, panel_end, row_begin, row_end);
    delete[] widened;
  }
}

template <typename W, typename T>
void linear_packed_typed(const LinearProblem& p) {
  const int64_t panels = ceil_div(p.out_features, kPanel);
  if (p.num_threads <= 1) {
    run_part<W, T>(p, 0, panels, 0, p.num_rows);
    return;
  }
#pragma omp parallel num_threads(p.num_threads)
  {
    // Split the panels over as many threads as have 4 or more panels each; the rest of the
    // threads split the rows (in whole tiles) in each panel group.
    const int64_t threads = omp_get_num_threads();
    const int64_t thread = omp_get_thread_num();
    const int64_t panel_groups = larger(1, smaller(threads, panels / 4));
    const int64_t row_groups = threads / panel_groups;
    const int64_t panel_group = thread % panel_groups;
    const int64_t row_group = thread / panel_groups;
    if (row_group < row_groups) {
      const int64_t tiles = ceil_div(p.num_rows, kTileRows);
      const int64_t row_begin = smaller(p.num_rows, tiles * row_group / row_groups * kTileRows);
      const int64_t row_end = smaller(p.num_rows, tiles * (row_group + 1) / row_groups * kTileRows);
      if (row_begin < row_end) {
        run_part<W, T>(p, panels * panel_group / panel_groups,
                       panels * (panel_group + 1) / panel_groups, row_begin, row_end);
      }
    }
  }
}

void linear_packed(const LinearProblem& p) {
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.weight_scales != nullptr) {
      linear_packed_typed<int8_t, T>(p);
    } else {
      linear_packed_typed<T, T>(p);
    }
  });
}

}  // namespace

extern const LinearKernels kLinearKernels = {linear_packed};

}  // namespace pagedserve::cpu::PAGEDSERVE_ISA_NS
