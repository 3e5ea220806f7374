// The packed float32 linear of ops.h (out = x W^T + bias over W in the panel layout), compiled
// once per ISA variant; see vec.h.
//
// Why not MKL (torch's F.linear): a decode step multiplies a few rows (one per running
// sequence) by every weight matrix. MKL packs the [out, in] matrix into its own blocked form
// inside every call, one more pass over every weight, and its few-row kernels reach a fraction
// of the FMA peak: measured on the embedded model's shapes (2 cores), this kernel runs 1.5-5x
// faster from 1 to 64 rows and 1.2-1.7x at 256-2048 (tools/bench_ops.py --linear).
//
// The work: for a block of rows and a block of the input features, every panel (16 output
// features, stored [in][16]) is read once and multiplied into tiles of kTileRows rows x 16
// outputs held in registers (GotoBLAS's micro-kernel: per input feature, one broadcast of x per
// row and kTileRows x 16 FMAs). Threads split the panels (each reads its own part of the
// weights), and the rows too when there are few panels per thread.
//
// Every output is a function of its row of x, the weights and in_features only: the sum over
// the input features runs in index order within blocks fixed by in_features alone (a partial
// sum is stored and reloaded between blocks, exactly), whatever the number of rows, the row
// blocking or the threads. So a request's logits never depend on what shares its batch.
#include "linear_kernels.h"

#include <omp.h>

#include <cstring>
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

// Input features per block: a panel's block (kMaxFeatureBlock x 16 floats, 32 KiB) stays in
// the L1/L2 cache while every row tile of the row block reads it. Depends on in_features only
// (see the top of the file).
constexpr int64_t kMaxFeatureBlock = 512;
// Bytes of x per row block: it stays in the L2 cache while every panel reads it.
constexpr int64_t kRowBlockBytes = 128 * 1024;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

// c[Rows x 16] = (accumulate ? c : 0) + x[Rows, 0:features] . panel[0:features, 16], then
// + bias[16] when bias is set. x rows x_stride apart, c rows c_stride apart.
template <int Rows>
void tile(const float* x, int64_t x_stride, const float* panel, int64_t features, float* c,
          int64_t c_stride, bool accumulate, const float* bias) {
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

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool,
                        const float*);

template <int... Rows>
constexpr TileFn kTilesByRows[] = {nullptr, tile<Rows + 1>...};

template <size_t... I>
constexpr const TileFn* tiles_by_rows(std::index_sequence<I...>) {
  return kTilesByRows<static_cast<int>(I)...>;
}

// kTiles[r]: the tile of r rows, 1 <= r <= kTileRows.
constexpr const TileFn* kTiles = tiles_by_rows(std::make_index_sequence<kTileRows>{});

// The rows [0, rows) of x against one panel over one block of input features. A panel of fewer
// than 16 outputs (the last, when out_features is not a multiple of 16) goes through a 16-wide
// scratch tile, so every tile computes all 16 columns the same way.
void rows_times_panel(const LinearProblem& p, const float* x, const float* panel, int64_t features,
                      float* out, int64_t columns, bool accumulate, const float* bias,
                      int64_t rows) {
  if (columns == kPanel) {
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int64_t n = smaller(kTileRows, rows - r);
      kTiles[n](x + r * p.x_row_stride, p.x_row_stride, panel, features, out + r * p.out_row_stride,
                p.out_row_stride, accumulate, bias);
    }
    return;
  }
  alignas(64) float scratch[kTileRows * kPanel];
  alignas(64) float scratch_bias[kPanel] = {};
  if (bias != nullptr) std::memcpy(scratch_bias, bias, columns * sizeof(float));
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int64_t n = smaller(kTileRows, rows - r);
    for (int64_t i = 0; i < n; ++i) {
      float* row = scratch + i * kPanel;
      std::memset(row, 0, sizeof(float) * kPanel);
      if (accumulate) std::memcpy(row, out + (r + i) * p.out_row_stride, columns * sizeof(float));
    }
    kTiles[n](x + r * p.x_row_stride, p.x_row_stride, panel, features, scratch, kPanel, accumulate,
              bias != nullptr ? scratch_bias : nullptr);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(out + (r + i) * p.out_row_stride, scratch + i * kPanel, columns * sizeof(float));
    }
  }
}

// One thread's share: panels [panel_begin, panel_end) x rows [row_begin, row_end).
void linear_part(const LinearProblem& p, int64_t panel_begin, int64_t panel_end, int64_t row_begin,
                 int64_t row_end) {
  const int64_t feature_blocks = ceil_div(p.in_features, kMaxFeatureBlock);
  const int64_t feature_block = ceil_div(p.in_features, feature_blocks);
  const int64_t block_rows =
      larger(kTileRows, kRowBlockBytes / (feature_block * static_cast<int64_t>(sizeof(float))) /
                            kTileRows * kTileRows);
  for (int64_t row = row_begin; row < row_end; row += block_rows) {
    const int64_t rows = smaller(block_rows, row_end - row);
    for (int64_t k0 = 0; k0 < p.in_features; k0 += feature_block) {
      const int64_t features = smaller(feature_block, p.in_features - k0);
      const bool last = k0 + features == p.in_features;
      for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
        const int64_t column = panel * kPanel;
        rows_times_panel(p, p.x + row * p.x_row_stride + k0,
                         p.packed_weight + (panel * p.in_features + k0) * kPanel, features,
                         p.out + row * p.out_row_stride + column,
                         smaller(kPanel, p.out_features - column), k0 > 0,
                         last && p.bias != nullptr ? p.bias + column : nullptr, rows);
      }
    }
  }
}

void linear_f32_packed(const LinearProblem& p) {
  const int64_t panels = ceil_div(p.out_features, kPanel);
  if (p.num_threads <= 1) {
    linear_part(p, 0, panels, 0, p.num_rows);
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
      linear_part(p, panels * panel_group / panel_groups, panels * (panel_group + 1) / panel_groups,
                  row_begin, row_end);
    }
  }
}

}  // namespace

extern const LinearKernels kLinearKernels = {linear_f32_packed};

}  // namespace pagedserve::cpu::PAGEDSERVE_ISA_NS
