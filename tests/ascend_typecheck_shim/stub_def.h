// Type-check shim (tests/ascend_typecheck.sh): the few compiler built-ins of the AscendC device
// compiler that the public AscendC headers expect in their CPU-debug build (ASCENDC_CPU_DEBUG=1),
// written here so that g++ -fsyntax-only can parse the headers and the kernels. Declarations only:
// nothing here is an implementation, and the shapes are the minimum the headers need to parse.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cassert>
#include <iostream>
#include <tuple>
#include <type_traits>
#include <vector>

#define ASCENDC_HOST_AICORE

// address-space and function qualifiers of the device compiler
#define __aicore__
#define __gm__
#define __ubuf__
#define __cbuf__
#define __ca__
#define __cb__
#define __cc__
#define __fbuf__
#define __ssbuf__
#define __host__
#define __global__
#define __simd_callee__
#define __simd_vf__
#define __simt_callee__
#define __simt_vf__
#define __host_aicore__
#define __BLOCK_LOCAL__
#define __WORKGROUP_LOCAL__
#define __disable_kernel_type_autoinfer__
#define __inout_pipe__(x)
#define __in_pipe__(x)
#define __out_pipe__(x)
#define __sync_alias__
#define __sync_noalias__
#define __sync_in__
#define __sync_out__
#define __check_sync_alias__

// pipes and events of the instruction set
enum pipe_t : uint8_t { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_MTE4, PIPE_MTE5,
                        PIPE_V2, PIPE_FIX, VIRTUAL_PIPE_MTE2_L1A, VIRTUAL_PIPE_MTE2_L1B, PIPE_NUM };
enum event_t : uint8_t { EVENT_ID0 = 0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };
enum pad_t : uint8_t { PAD_NONE = 0, PAD_MODE1, PAD_MODE2, PAD_MODE3, PAD_MODE4, PAD_MODE5, PAD_MODE6, PAD_MODE7, PAD_MODE8 };
enum atomic_type_t : uint8_t { ATOMIC_NONE = 0, ATOMIC_F32, ATOMIC_F16, ATOMIC_S16, ATOMIC_S32, ATOMIC_S8, ATOMIC_BF16 };
enum atomic_op_t : uint8_t { ATOMIC_SUM = 0, ATOMIC_MAX, ATOMIC_MIN };

// 16-bit and narrow float storage types of the device compiler
struct half {
  uint16_t bits = 0;
  half() = default;
  template <typename U, typename = std::enable_if_t<std::is_arithmetic_v<U>>> half(U) {}
  operator float() const { return 0.0f; }
  float ToFloat() const { return 0.0f; }
};
struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  template <typename U, typename = std::enable_if_t<std::is_arithmetic_v<U>>> bfloat16_t(U) {}
  operator float() const { return 0.0f; }
  float ToFloat() const { return 0.0f; }
};
struct fp8_e5m2_t { uint8_t b; };
struct fp8_e4m3fn_t { uint8_t b; };
struct fp8_e8m0_t { uint8_t b; };
struct fp4x2_e2m1_t { uint8_t b; };
struct fp4x2_e1m2_t { uint8_t b; };
struct hifloat8_t { uint8_t b; };

// enums the device compiler predefines
enum class QuantMode_t : uint64_t { NoQuant = 0, F322F16, F322BF16, DEQF16, DEQS16, VDEQF16, VDEQS16, REQ4, REQ8, VREQ4,
  VREQ8, QF162B8_PRE, QF162S16_PRE, QF162S4_PRE, QF322B8_PRE, QF322BF16_PRE, QF322F16_PRE, QF322F32_PRE, QF322FP8_PRE,
  QF322HIF8_PRE, QF322HIF8_PRE_HYBRID, QS322BF16_PRE, VQF162B8_PRE, VQF162S16_PRE, VQF162S4_PRE, VQF322B8_PRE,
  VQF322BF16_PRE, VQF322F16_PRE, VQF322F32_PRE, VQF322FP8_PRE, VQF322HIF8_PRE, VQF322HIF8_PRE_HYBRID, VQS322BF16_PRE };
enum class cache_line_t : uint8_t { SINGLE_CACHE_LINE = 0, ENTIRE_DATA_CACHE };
enum class dcci_dst_t : uint8_t { CACHELINE_ALL = 0, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };
enum class Order_t : uint8_t { VALUE_INDEX = 0, INDEX_VALUE, ONLY_VALUE, ONLY_INDEX };

enum mem_dsb_t : uint8_t { DSB_ALL = 0 };
enum mem_t : uint8_t { MEM_NONE = 0 };
enum addr_cal_mode_t : uint8_t { ADDR_CAL_MODE_0 = 0 };
extern int64_t g_taskRation;
enum inc_t : uint8_t { inc = 0 };  // address update mode of the 2-D load intrinsics
namespace AscendC {
extern bool g_isVdeq;
constexpr int AIC_TYPE = 1, AIV_TYPE = 2;
}  // namespace AscendC

// vector register types (declared only)
struct vector_bool {};
struct vector_address {};
struct vector_align {};

// core identity registers
extern int64_t block_idx;
extern int64_t block_num;
extern int64_t sub_block_idx;
