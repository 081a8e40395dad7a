// The index arithmetic of the kernels' 16-byte vector loads (vector_access.h), run on the CPU:
// the same ForEachShare loops the GELU, residual, layernorm and cross-entropy kernels run, over
// simulated grids, warps and blocks, for many lengths, element sizes and base misalignments.
// Every element must be visited exactly once, every vector must start 16-byte aligned and lie
// inside the range, and an unaligned pointer must take the scalar path. No GPU is needed.
#include "gpu_trainer/cuda/kernels/vector_access.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

namespace va = vector_access;

// A fake device address: 256-byte aligned plus `offset_bytes`; never dereferenced.
uintptr_t Base(int offset_bytes) { return uintptr_t{0x7f0000000000} + offset_bytes; }

// Runs every thread's share of [0, n) for a range that starts at address `base` with elements
// of elem_bytes, and checks the visits: each element once, each vector aligned and inside.
// Returns how many elements went through vectors (for the callers' path checks).
int64_t CheckCoverage(int64_t n, int elem_bytes, uintptr_t base,
                      const std::vector<va::Stride>& threads, const std::string& what) {
  const int width = va::VectorWidth(elem_bytes);
  const bool aligned = va::IsAligned16(reinterpret_cast<const void*>(base));
  const va::VectorSplit split = va::SplitVectors(n, width, aligned);
  std::vector<int> visits(static_cast<size_t>(n), 0);
  int64_t vector_elements = 0;
  bool ok = true;
  for (const va::Stride& stride : threads) {
    va::ForEachShare(
        split, n, stride,
        [&](int64_t offset) {
          if (offset % width != 0 || offset < 0 || offset + width > n) {
            ADD_FAILURE() << what << ": vector at " << offset << " of width " << width
                          << " outside [0, " << n << ")";
            ok = false;
            return;
          }
          if ((base + static_cast<uintptr_t>(offset) * elem_bytes) % va::kVectorBytes != 0) {
            ADD_FAILURE() << what << ": vector at " << offset << " is not 16-byte aligned";
            ok = false;
          }
          for (int j = 0; j < width; ++j) ++visits[static_cast<size_t>(offset + j)];
          vector_elements += width;
        },
        [&](int64_t i) {
          if (i < 0 || i >= n) {
            ADD_FAILURE() << what << ": element " << i << " outside [0, " << n << ")";
            ok = false;
            return;
          }
          ++visits[static_cast<size_t>(i)];
        });
  }
  for (int64_t i = 0; i < n && ok; ++i) {
    if (visits[static_cast<size_t>(i)] != 1) {
      ADD_FAILURE() << what << ": element " << i << " visited " << visits[static_cast<size_t>(i)]
                    << " times";
      break;
    }
  }
  return vector_elements;
}

std::vector<va::Stride> Grid(int grid_dim, int block_dim) {
  std::vector<va::Stride> threads;
  for (int b = 0; b < grid_dim; ++b) {
    for (int t = 0; t < block_dim; ++t)
      threads.push_back(va::GridStride(b, block_dim, grid_dim, t));
  }
  return threads;
}

std::vector<va::Stride> Lanes(int lanes) {
  std::vector<va::Stride> threads;
  for (int l = 0; l < lanes; ++l) threads.push_back(va::LaneStride(l, lanes));
  return threads;
}

TEST(VectorAccess, WidthIsSixteenBytes) {
  EXPECT_EQ(va::VectorWidth(2), 8);
  EXPECT_EQ(va::VectorWidth(4), 4);
}

TEST(VectorAccess, AlignmentIsCheckedOnTheAddress) {
  EXPECT_TRUE(va::IsAligned16(reinterpret_cast<const void*>(Base(0))));
  EXPECT_TRUE(va::IsAligned16(reinterpret_cast<const void*>(Base(48))));
  EXPECT_TRUE(va::IsAligned16(nullptr));  // an absent pointer does not turn vectors off
  for (int offset = 1; offset < 16; ++offset) {
    EXPECT_FALSE(va::IsAligned16(reinterpret_cast<const void*>(Base(offset)))) << offset;
  }
}

TEST(VectorAccess, SplitCutsWholeVectorsThenTheTail) {
  for (int64_t n : {0, 1, 7, 8, 9, 63, 64, 65, 50257}) {
    for (int width : {4, 8}) {
      const va::VectorSplit s = va::SplitVectors(n, width, true);
      EXPECT_EQ(s.width, width);
      EXPECT_EQ(s.vectors, n / width) << n;
      EXPECT_EQ(s.tail_begin, n / width * width) << n;
      EXPECT_LT(n - s.tail_begin, width);
      const va::VectorSplit u = va::SplitVectors(n, width, false);
      EXPECT_EQ(u.vectors, 0);
      EXPECT_EQ(u.tail_begin, 0);  // the scalar path takes everything
    }
  }
}

TEST(VectorAccess, ThreadsWantedCoversTheLongerLoop) {
  EXPECT_EQ(va::ThreadsWanted(va::SplitVectors(0, 8, true), 0), 1);
  EXPECT_EQ(va::ThreadsWanted(va::SplitVectors(1003, 8, true), 1003), 125);
  EXPECT_EQ(va::ThreadsWanted(va::SplitVectors(5, 8, true), 5), 5);
  EXPECT_EQ(va::ThreadsWanted(va::SplitVectors(1003, 8, false), 1003), 1003);
}

// The elementwise kernels (GELU, residual): grid-stride over the whole array, grids from one
// block to more threads than vectors, every length up to a few vectors past a block and some
// large odd ones, every misalignment of a 16-bit and an fp32 base.
TEST(VectorAccess, GridStrideVisitsEveryElementOnce) {
  const std::pair<int, int> kGrids[] = {{1, 32}, {3, 64}, {7, 256}};  // (blocks, threads)
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (int64_t n : {1023, 1024, 1025, 4095, 10007, 65543}) lengths.push_back(n);
  for (const int elem_bytes : {2, 4}) {
    for (int misalign = 0; misalign < 16; misalign += elem_bytes) {
      for (const int64_t n : lengths) {
        for (const auto& [grid_dim, block_dim] : kGrids) {
          const std::string what =
              "n=" + std::to_string(n) + " bytes=" + std::to_string(elem_bytes) +
              " misalign=" + std::to_string(misalign) + " grid=" + std::to_string(grid_dim);
          const int64_t vectored =
              CheckCoverage(n, elem_bytes, Base(misalign), Grid(grid_dim, block_dim), what);
          if (misalign == 0) {
            EXPECT_EQ(vectored, n / va::VectorWidth(elem_bytes) * va::VectorWidth(elem_bytes))
                << what;
          } else {
            EXPECT_EQ(vectored, 0) << what << ": an unaligned base must take the scalar path";
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// The row kernels: layernorm (a warp per row of C) and cross-entropy (a block of 512 per row of
// V, or of ld with the padding). Rows of a (rows, ld) matrix start at base + r * ld elements, so
// some are aligned and some not when ld * elem_bytes is not a multiple of 16: both paths.
TEST(VectorAccess, RowsVisitEveryElementOnceWhateverTheirAlignment) {
  struct Shape {
    int64_t C, ld;
    int lanes;
  };
  const Shape shapes[] = {{96, 96, 32},        {771, 771, 32},  {31, 31, 32},    {5, 5, 32},
                          {768, 768, 32},      {1, 1, 32},      {257, 264, 512}, {257, 257, 512},
                          {50257, 50304, 512}, {264, 264, 512}, {7, 7, 512}};
  for (const int elem_bytes : {2, 4}) {
    for (const Shape& shape : shapes) {
      int64_t aligned_rows = 0, vectored_rows = 0;
      for (int64_t row = 0; row < 16; ++row) {
        const uintptr_t base = Base(0) + static_cast<uintptr_t>(row * shape.ld * elem_bytes);
        const std::string what = "C=" + std::to_string(shape.C) +
                                 " ld=" + std::to_string(shape.ld) + " row=" + std::to_string(row) +
                                 " bytes=" + std::to_string(elem_bytes);
        const int64_t vectored = CheckCoverage(shape.C, elem_bytes, base, Lanes(shape.lanes), what);
        const bool aligned = base % va::kVectorBytes == 0;
        aligned_rows += aligned;
        vectored_rows += vectored > 0;
        if (!aligned) {
          EXPECT_EQ(vectored, 0) << what;
        }
        if (::testing::Test::HasFailure()) return;
      }
      // Row 0 is always aligned: the vector path runs wherever a row holds a vector.
      EXPECT_GE(aligned_rows, 1);
      if (shape.C >= va::VectorWidth(elem_bytes)) {
        EXPECT_GE(vectored_rows, 1);
      }
    }
  }
}

}  // namespace
}  // namespace offload
