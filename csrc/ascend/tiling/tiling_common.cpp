#include "tiling_common.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace amo_ascend {

uint32_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
  }
  throw std::invalid_argument("dtype_bytes: unknown DType");
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint64_t reduce_max_work_bytes(uint64_t count) { return align_up(2 * ((count + 63) / 64), 8) * 4; }

uint64_t ub_budget(const ChipInfo& chip) {
  if (chip.ubReservedBytes >= chip.ubBytes) throw std::invalid_argument("ChipInfo: ubReservedBytes >= ubBytes");
  return chip.ubBytes - chip.ubReservedBytes;
}

RowSplit split_rows(int64_t rows, uint32_t maxCores) {
  if (rows < 0) throw std::invalid_argument("split_rows: rows must be >= 0, got " + std::to_string(rows));
  if (maxCores == 0) throw std::invalid_argument("split_rows: maxCores must be >= 1");
  RowSplit s{};
  s.blockDim = static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>(maxCores, rows)));
  s.tailRows = rows / s.blockDim;
  int64_t rem = rows % s.blockDim;
  s.formerNum = static_cast<uint32_t>(rem);
  s.formerRows = s.tailRows + (rem ? 1 : 0);
  if (rem == 0) s.formerNum = 0;
  return s;
}

void block_rows(const RowSplit& s, uint32_t b, int64_t* first, int64_t* count) {
  if (b < s.formerNum) {
    *first = static_cast<int64_t>(b) * s.formerRows;
    *count = s.formerRows;
  } else {
    *first = static_cast<int64_t>(s.formerNum) * s.formerRows + static_cast<int64_t>(b - s.formerNum) * s.tailRows;
    *count = s.tailRows;
  }
}

HiddenSplit split_hidden(int64_t hidden, uint64_t bytesPerCol, uint64_t fixedBytes, uint32_t alignElems,
                         uint64_t budget, uint32_t maxCols) {
  if (hidden < 0) throw std::invalid_argument("split_hidden: hidden must be >= 0");
  if (alignElems == 0 || bytesPerCol == 0) throw std::invalid_argument("split_hidden: zero alignment or width");
  HiddenSplit h{};
  h.alignElems = alignElems;
  if (fixedBytes + bytesPerCol * alignElems > budget) {
    throw std::invalid_argument("split_hidden: one aligned column group (" + std::to_string(alignElems) +
                                " columns x " + std::to_string(bytesPerCol) + " B + " + std::to_string(fixedBytes) +
                                " B fixed) exceeds the UB budget of " + std::to_string(budget) + " B");
  }
  uint64_t fit = (budget - fixedBytes) / bytesPerCol / alignElems * alignElems;
  uint64_t cap = std::max<uint64_t>(alignElems, static_cast<uint64_t>(maxCols) / alignElems * alignElems);
  uint64_t want = align_up(static_cast<uint64_t>(std::max<int64_t>(hidden, 1)), alignElems);
  h.tileCols = static_cast<uint32_t>(std::min({fit, cap, want}));
  if (hidden == 0) {
    h.tileNum = 0;
    h.tailCols = 0;
    return h;
  }
  h.tileNum = static_cast<uint32_t>((hidden + h.tileCols - 1) / h.tileCols);
  h.tailCols = static_cast<uint32_t>(hidden - static_cast<int64_t>(h.tileNum - 1) * h.tileCols);
  return h;
}

}  // namespace amo_ascend
