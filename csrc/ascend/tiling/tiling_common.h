// Chip facts and the shared tiling arithmetic of the AscendC kernels (plain C++17, no CANN include).
//
// This header is included by three kinds of code: the host tiling functions (*_tiling.cpp), the
// kernels in csrc/ascend/kernels (compiled by bisheng for the device, or by g++ against the emulation
// layer in csrc/ascend/emu), and the tests. Kernels only use the POD structs and enums; every
// function declared here runs on the host.
#pragma once

#include <cstdint>

namespace amo_ascend {

// ---------------------------------------------------------------------------------------------
// Chip facts. Defaults are Ascend 910B2 (Atlas A2 training) as listed in CANN's platform file
// ${ASCEND_HOME_PATH}/<arch>-linux/data/platform_config/Ascend910B2.ini:
//   [SoCInfo]     ai_core_cnt=24 (= cube_core_cnt, the AIC count), vector_core_cnt=48 (2 AIV per AIC)
//   [AICoreSpec]  ub_size=196608 (192 KiB), ubblock_size=32, l1_size=524288 (512 KiB),
//                 l0_a_size=65536, l0_b_size=65536 (64 KiB each), l0_c_size=131072 (128 KiB)
// We could not read that file here (no CANN toolkit on this machine); the figures are those quoted
// from it in public Ascend documentation and open-source projects. Other 910B bins differ only in
// the core counts (910B3/B4: 20 AIC / 40 AIV), so a host on a real NPU should fill this struct from
// platform_ascendc::PlatformAscendC (GetCoreNumAiv / GetCoreMemSize) instead of the defaults.
// ---------------------------------------------------------------------------------------------
struct ChipInfo {
  uint32_t aicNum = 24;            // Cube cores (AIC)
  uint32_t aivNum = 48;            // Vector cores (AIV); vector kernels launch at most this many blocks
  uint64_t ubBytes = 196608;       // Unified Buffer per AIV core
  uint64_t l1Bytes = 524288;       // L1 per AIC core
  uint64_t l0aBytes = 65536;       // L0A per AIC core
  uint64_t l0bBytes = 65536;       // L0B per AIC core
  uint64_t l0cBytes = 131072;      // L0C per AIC core
  // UB kept free by our tilings: some of UB is used by the AscendC runtime / compiler as scratch on
  // A2 (open-source PTO headers reserve the top 8 KiB). Our vector tilings never plan into it.
  uint64_t ubReservedBytes = 8192;
};

inline ChipInfo Ascend910B2() { return ChipInfo{}; }

constexpr uint32_t kBlockBytes = 32;   // DataCopy granularity and UB address alignment
constexpr uint32_t kDoubleBuffer = 2;  // TQue depth used by every vector kernel here

// Element types of the tensors a kernel touches. Typed: no magic numbers in the tiling keys.
enum class DType : uint32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// How the last H-tile of a row moves between GM and UB: with DataCopy when its byte size is a
// multiple of 32, else with DataCopyPad (ragged row).
enum class CopyMode : uint32_t { kAligned = 0, kPadded = 1 };

// Split of `rows` work items over `blockDim` cores: blocks [0, formerNum) take formerRows items,
// the others tailRows (= formerRows - 1, or formerRows when the split is even).
struct RowSplit {
  uint32_t blockDim;
  uint32_t formerNum;
  int64_t formerRows;
  int64_t tailRows;
};

// Split of a row of `hidden` elements into tileNum tiles of tileCols elements; the last one holds
// tailCols (1..tileCols) elements. tileCols is a multiple of alignElems (32 bytes of the narrowest
// buffer type), so every UB buffer is 32-byte aligned. hidden == 0 gives tileNum == 0.
struct HiddenSplit {
  uint32_t tileCols;
  uint32_t tileNum;
  uint32_t tailCols;
  uint32_t alignElems;
};

// ---- host functions ----------------------------------------------------------------------------
uint32_t dtype_bytes(DType d);
uint64_t align_up(uint64_t x, uint64_t a);
// Bytes of the ReduceMax/ReduceSum work buffer over `count` floats: ceil(2 * repeats / 8) * 8 floats,
// repeats = ceil(count / 64) (A2: a (value, index) pair per repeat; device twin ReduceMaxWorkFloats).
uint64_t reduce_max_work_bytes(uint64_t count);
// ceil(a / b) for a >= 0, b >= 1.
int64_t ceil_div(int64_t a, int64_t b);
// rows >= 0; maxCores >= 1. blockDim = max(1, min(maxCores, rows)).
RowSplit split_rows(int64_t rows, uint32_t maxCores);
// First row and row count of block `b` under `s`.
void block_rows(const RowSplit& s, uint32_t b, int64_t* first, int64_t* count);
// Largest tile (multiple of alignElems, at most align_up(hidden, alignElems) and at most maxCols)
// such that tileCols * bytesPerCol + fixedBytes <= budget. Throws std::invalid_argument when not even
// one aligned group of columns fits.
HiddenSplit split_hidden(int64_t hidden, uint64_t bytesPerCol, uint64_t fixedBytes, uint32_t alignElems,
                         uint64_t budget, uint32_t maxCols);
// UB bytes a tiling may plan with: ubBytes - ubReservedBytes.
uint64_t ub_budget(const ChipInfo& chip);

}  // namespace amo_ascend
