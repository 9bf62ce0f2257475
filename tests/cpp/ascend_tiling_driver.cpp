// Test driver for csrc/ascend/tiling: reads one case per stdin line and prints the tiling as one JSON
// object per line (tests/test_ascend_tiling.py checks coverage, alignment and UB budgets in Python).
//   permute   N T H dtype maxTile
//   unpermute T S N H dtype withProbs maxTile
//   grad      T S N H xDtype gDtype withProbs maxTile
// dtype: 0 = fp32, 1 = fp16, 2 = bf16. Optional chip overrides come first on the line as
//   chip aiv ubBytes ubReserved ; ... (then the case).
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "tiling/moe_permute_tiling.h"
#include "tiling/moe_unpermute_tiling.h"

using namespace amo_ascend;

static std::string rows_json(const RowSplit& r) {
  std::ostringstream o;
  o << "\"blockDim\":" << r.blockDim << ",\"formerNum\":" << r.formerNum << ",\"formerRows\":" << r.formerRows
    << ",\"tailRows\":" << r.tailRows << ",\"blocks\":[";
  for (uint32_t b = 0; b < r.blockDim; ++b) {
    int64_t first, count;
    block_rows(r, b, &first, &count);
    o << (b ? "," : "") << "[" << first << "," << count << "]";
  }
  o << "]";
  return o.str();
}

static std::string cols_json(const HiddenSplit& c) {
  std::ostringstream o;
  o << "\"tileCols\":" << c.tileCols << ",\"tileNum\":" << c.tileNum << ",\"tailCols\":" << c.tailCols
    << ",\"alignElems\":" << c.alignElems;
  return o.str();
}

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    std::istringstream in(line);
    std::string op;
    in >> op;
    ChipInfo chip = Ascend910B2();
    if (op == "chip") {
      in >> chip.aivNum >> chip.ubBytes >> chip.ubReservedBytes >> op;
    }
    std::ostringstream o;
    try {
      if (op == "permute") {
        int64_t N, T, H, slots = 0; uint32_t d, cap;
        in >> N >> T >> H >> d >> cap;
        if (!(in >> slots)) slots = 0;  // optional: the token-major loop's slots per token
        auto t = compute_moe_permute_tiling(N, T, H, static_cast<DType>(d), chip, cap, slots);
        o << "{\"key\":" << static_cast<uint32_t>(t.key) << ",\"tailMode\":" << static_cast<uint32_t>(t.tailMode)
          << ",\"elemBytes\":" << t.elemBytes << ",\"bufferNum\":" << t.bufferNum << ",\"ubBytes\":" << t.ubBytes
          << ",\"tokenMajor\":" << t.tokenMajor << ",\"launchDim\":" << t.blockDim << ",\"slots\":" << t.slots
          << ",\"tokens\":{" << rows_json(t.tokens) << "}," << rows_json(t.rows) << "," << cols_json(t.cols);
      } else if (op == "unpermute") {
        int64_t T, S, N, H; uint32_t d, p, cap;
        in >> T >> S >> N >> H >> d >> p >> cap;
        auto t = compute_moe_unpermute_tiling(T, S, N, H, static_cast<DType>(d), p != 0, chip, cap);
        o << "{\"key\":" << static_cast<uint32_t>(t.key) << ",\"tailMode\":" << static_cast<uint32_t>(t.tailMode)
          << ",\"bufferNum\":" << t.bufferNum << ",\"ubBytes\":" << t.ubBytes << "," << rows_json(t.rows) << ","
          << cols_json(t.cols);
      } else if (op == "grad") {
        int64_t T, S, N, H; uint32_t xd, gd, p, cap;
        in >> T >> S >> N >> H >> xd >> gd >> p >> cap;
        auto t = compute_moe_unpermute_grad_tiling(T, S, N, H, static_cast<DType>(xd), static_cast<DType>(gd),
                                                   p != 0, chip, cap);
        o << "{\"key\":" << static_cast<uint32_t>(t.key) << ",\"tailMode\":" << static_cast<uint32_t>(t.tailMode)
          << ",\"bufferNum\":" << t.bufferNum << ",\"ubBytes\":" << t.ubBytes << ",\"dotChunk\":" << t.dotChunk
          << "," << rows_json(t.rows) << "," << cols_json(t.cols);
      } else {
        throw std::invalid_argument("unknown op " + op);
      }
      o << ",\"budget\":" << ub_budget(chip) << ",\"aiv\":" << chip.aivNum << "}";
    } catch (const std::exception& e) {
      o.str("");
      std::string msg = e.what();
      for (auto& ch : msg) if (ch == '"') ch = '\'';
      o << "{\"error\":\"" << msg << "\"}";
    }
    std::cout << o.str() << "\n";
  }
  return 0;
}
