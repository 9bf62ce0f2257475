// Helpers shared by the AscendC kernels of this package (device code).
//
// The same sources compile with bisheng against CANN's kernel_operator.h and with g++ against the
// emulation layer (csrc/ascend/emu) when ASCEND_MOE_OPS_EMU is defined; that include switch is the
// only difference between the two builds.
#pragma once

#ifdef ASCEND_MOE_OPS_EMU
#include "emu/kernel_operator_emu.h"
#else
#include "kernel_operator.h"
#endif

#include "tiling/tiling_common.h"

namespace amo_ascend {
namespace kernels {

// Own type trait: device code does not rely on the C++ standard library.
template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

// Integer helpers of the kernels' index math (64-bit: row * hidden products never overflow).
__aicore__ inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__aicore__ inline int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__aicore__ inline uint32_t Up16(int64_t x) { return static_cast<uint32_t>((x + 15) / 16 * 16); }  // 16 x 16 fractals
__aicore__ inline uint32_t Up8(int64_t x) { return static_cast<uint32_t>((x + 7) / 8 * 8); }      // 8 fp32 = 32 bytes

// Work buffer of ReduceMax / ReduceSum over `count` floats. A2 rule (API reference, ReduceMax without
// index): the first round writes a (value, index) pair per 256-byte repeat, so ceil(2 * repeats / 8) * 8
// floats (tiling twin: reduce_max_work_bytes).
__aicore__ inline uint32_t ReduceMaxWorkFloats(int64_t count) { return Up8(2 * CeilDiv(count, 64)); }

// Tiling structs are passed as a GM pointer (the host copies the POD struct to device memory) and
// read word by word through the scalar unit. A2 rule (data cache, docs/ascend.md): scalar GM reads go
// through the core's data cache, and the host uploads a new tiling per step, possibly at an address
// an earlier launch read, so every 64-byte line of the struct is cleaned and invalidated before it is
// read (no public statement says lines do not survive a launch).
template <typename Tiling>
__aicore__ inline void CopyTiling(Tiling* dst, GM_ADDR src) {
  static_assert(sizeof(Tiling) % sizeof(uint32_t) == 0, "tiling structs are whole 32-bit words");
  constexpr uint32_t n = sizeof(Tiling) / sizeof(uint32_t);
  constexpr uint32_t wordsPerLine = 64 / sizeof(uint32_t);
  AscendC::GlobalTensor<uint32_t> s;
  s.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(src), n);
  for (uint32_t i = 0; i < n; i += wordsPerLine)  // one word in every line (a line holds 16 words)
    AscendC::DataCacheCleanAndInvalid<uint32_t, AscendC::CacheLine::SINGLE_CACHE_LINE, AscendC::DcciDst::CACHELINE_OUT>(s[i]);
  AscendC::DataCacheCleanAndInvalid<uint32_t, AscendC::CacheLine::SINGLE_CACHE_LINE, AscendC::DcciDst::CACHELINE_OUT>(s[n - 1]);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (uint32_t i = 0; i < n; ++i) d[i] = s.GetValue(i);
}

// Device twin of amo_ascend::block_rows (tiling_common.cpp): rows [first, first + count) of block b.
__aicore__ inline void BlockRows(const RowSplit& s, uint32_t b, int64_t* first, int64_t* count) {
  if (b < s.formerNum) {
    *first = static_cast<int64_t>(b) * s.formerRows;
    *count = s.formerRows;
  } else {
    *first = static_cast<int64_t>(s.formerNum) * s.formerRows + static_cast<int64_t>(b - s.formerNum) * s.tailRows;
    *count = s.tailRows;
  }
}

// GM -> UB of `cols` elements: DataCopy when the byte size is whole 32-byte blocks, else DataCopyPad
// (ragged tail of a row whose size is not a multiple of 32 bytes; the UB side stays 32-byte aligned).
template <typename T>
__aicore__ inline void CopyRowIn(const AscendC::LocalTensor<T>& dst, const AscendC::GlobalTensor<T>& src, uint32_t cols) {
  const uint32_t bytes = cols * static_cast<uint32_t>(sizeof(T));
  if (bytes % kBlockBytes == 0) {
    AscendC::DataCopy(dst, src, cols);
  } else {
    AscendC::DataCopyExtParams p{1, bytes, 0, 0, 0};
    AscendC::DataCopyPadExtParams<T> pad{false, 0, 0, 0};
    AscendC::DataCopyPad(dst, src, p, pad);
  }
}

// UB -> GM of `cols` elements, same rule.
template <typename T>
__aicore__ inline void CopyRowOut(const AscendC::GlobalTensor<T>& dst, const AscendC::LocalTensor<T>& src, uint32_t cols) {
  const uint32_t bytes = cols * static_cast<uint32_t>(sizeof(T));
  if (bytes % kBlockBytes == 0) {
    AscendC::DataCopy(dst, src, cols);
  } else {
    AscendC::DataCopyExtParams p{1, bytes, 0, 0, 0};
    AscendC::DataCopyPad(dst, src, p);
  }
}

// Zero `cols` elements of a 16- or 32-bit tensor through an integer view (bit pattern 0 is +0.0 in
// every float type, and integer Duplicate exists for every element width we use).
template <typename T>
__aicore__ inline void ZeroFill(const AscendC::LocalTensor<T>& t, uint32_t cols) {
  if constexpr (sizeof(T) == 2) {
    AscendC::Duplicate(t.template ReinterpretCast<int16_t>(), static_cast<int16_t>(0), static_cast<int32_t>(cols));
  } else {
    AscendC::Duplicate(t.template ReinterpretCast<int32_t>(), static_cast<int32_t>(0), static_cast<int32_t>(cols));
  }
}

__aicore__ inline uint32_t TileCols(const HiddenSplit& h, uint32_t j) {
  return j + 1 == h.tileNum ? h.tailCols : h.tileCols;
}

// Cube side: zero an L1 (POS = A1/B1) or L0A/L0B (POS = A2/B2) buffer of `elems` elements with
// InitConstValue. A2 rule: blockNum counts 32-byte blocks on L1 but 512-byte fractals on L0A/L0B, so
// `elems` must fill whole blocks of the position's unit. The L1 fill runs on PIPE_MTE2, the L0 fill
// on PIPE_MTE1. K padding must be zero: the Cube sums whole 16-wide K fractals.
template <AscendC::TPosition POS, typename T>
__aicore__ inline void ZeroCubeBuffer(const AscendC::LocalTensor<T>& t, uint32_t elems) {
  constexpr bool l0 = POS == AscendC::TPosition::A2 || POS == AscendC::TPosition::B2;
  constexpr uint32_t unit = l0 ? 512 : 32;
  AscendC::InitConstValueParams<T> z;
  z.repeatTimes = 1;
  z.blockNum = static_cast<uint16_t>(elems * sizeof(T) / unit);
  z.dstGap = 0;
  z.initValue = T(0);
  AscendC::InitConstValue(t, z);
}

// Mmad's m for a tile of `rows` rows. A2 rule: m == 1 switches the Cube to GEMV, which reads L0A as
// one ND row instead of the zZ fractals the kernels load, and A2 cannot turn it off. So m is promoted
// to 16: the extra rows of the fractal only produce L0C rows that Fixpipe (mSize = rows) never stores.
__aicore__ inline uint16_t MmadM(int64_t rows) { return static_cast<uint16_t>(rows == 1 ? 16 : rows); }

// Scalar read of GM that the host, an earlier kernel or another core wrote. A2 rule: scalar GM
// accesses go through the core's data cache (64-byte lines) and the A2 build does not invalidate it
// for them, so the line is cleaned and invalidated first (the next access reloads it from GM).
template <typename T>
__aicore__ inline T ReadGmFresh(const AscendC::GlobalTensor<T>& g, uint64_t i) {
  AscendC::DataCacheCleanAndInvalid<T, AscendC::CacheLine::SINGLE_CACHE_LINE, AscendC::DcciDst::CACHELINE_OUT>(g[i]);
  return g.GetValue(i);
}

// Store element 0 of a UB tensor to dst[0] with a 4-byte (sizeof(T)) DMA instead of a scalar
// SetValue: DMA bypasses the data cache, so cores writing neighbouring elements of one 64-byte line
// do not overwrite each other. The caller orders the UB value before the copy (V -> MTE3).
template <typename T>
__aicore__ inline void StoreElement(const AscendC::GlobalTensor<T>& dst, const AscendC::LocalTensor<T>& src) {
  AscendC::DataCopyExtParams p{1, static_cast<uint32_t>(sizeof(T)), 0, 0, 0};
  AscendC::DataCopyPad(dst, src, p);
}

// Cube side: ND (GM) -> NZ (L1) copy of nRows x nCols at src with row stride srcD; column blocks
// c0Stride rows apart in L1.
template <typename T>
__aicore__ inline void Nd2Nz(const AscendC::LocalTensor<T>& dst, const AscendC::GlobalTensor<T>& src, int64_t nRows,
                             int64_t nCols, int64_t srcD, uint32_t c0Stride) {
  AscendC::Nd2NzParams p;
  p.ndNum = 1;
  p.nValue = static_cast<uint16_t>(nRows);
  p.dValue = static_cast<uint16_t>(nCols);
  p.srcNdMatrixStride = 0;
  p.srcDValue = static_cast<uint16_t>(srcD);
  p.dstNzC0Stride = static_cast<uint16_t>(c0Stride);
  p.dstNzNStride = 1;
  p.dstNzMatrixStride = 0;
  AscendC::DataCopy(dst, src, p);
}

}  // namespace kernels
}  // namespace amo_ascend
