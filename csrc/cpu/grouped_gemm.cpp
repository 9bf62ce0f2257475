// grouped_gemm / grouped_gemm_dw on the CPU: a blocked, packed, multi-threaded AVX-512 kernel.
//
//   grouped_gemm(x [M,K], w [E,K,N] | [E,N,K] (trans_b), group_sizes [E]) -> [M,N]
//   grouped_gemm_dw(a [M,P], b [M,Q], group_sizes [E]) -> [E,P,Q],  out[e] = a_e^T b_e
//
// Both are lists of independent small GEMMs C = A.B with A(r,k) = A[r*rs + k*ks] and
// B(k,c) = B[k*ks + c*ns] (strides cover x, x^T, W and W^T without copies). The problem is cut
// into work items (group, M-tile, N-tile) that threads take from one atomic counter, so a single
// huge group and hundreds of tiny ones both keep every core busy. Inside an item (GotoBLAS
// style): the K loop is cut into KC blocks; each block of B is packed into NR=64-column
// micro-panels (bf16: VNNI pairs, two consecutive k of one column in one 32-bit word, the layout
// vdpbf16ps consumes; fp32/fp16: fp32 rows), and an MR x 64 register-blocked micro-kernel
// (6 x 4 zmm accumulators) runs over every (row block, panel), accumulating in fp32 in a
// per-thread C tile that is rounded once into the output dtype at the end.
//
// Each thread claims its next item one step ahead and prefetches (into L2) the operands of the
// next K block while it computes; large outputs come from amo::empty_large (common/alloc.h):
// reused, already faulted-in, huge-page blocks instead of fresh pages on every call. The bf16 micro-kernel rounds the last K block
// straight into the output.
//
// Files (one reason to change each):
//   grouped_gemm_pack.h      blocking, workspace, operand packing and AMX staging, result-tile stores
//   grouped_gemm_kernel_impl.h  the tile kernels: micro-kernels, AMX tiles, the K loop, prefetch
//                            (compiled per ISA; grouped_gemm_kernel.cpp picks one at run time)
//   grouped_gemm.cpp         this file: the work split over groups and threads, the entry points
//
// dtypes: bf16 -> AMX tiles (tdpbf16ps) where the CPU has AMX-BF16 and the OS grants the tile
// state (AMO_GG_AMX=0 switches it off), else _mm512_dpbf16_ps (AVX512_BF16), fp32 accumulation; fp32 -> FMA; fp16 ->
// converted to fp32 while packing (A and B), then the fp32 kernel; fp64 (oracle use only) ->
// at::mm per group. The tile kernels are compiled per instruction set and chosen at run time
// (cpu/cpu_capability.cpp; a -march=native build has one copy): AMX, AVX512_BF16, AVX-512 (bf16 and
// fp16 converted to fp32 while packing, the fp32 zmm micro-kernel) or AVX2 + FMA (the same on ymm
// registers); a build for a CPU without those runs the scalar fallback micro-kernel (correct, slow).
#include "cpu/grouped_gemm_kernel.h"

#include "common/alloc.h"
#include "common/grouped_gemm_checks.h"
#include "common/op_registry.h"
#include "common/registry.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace amo {
namespace grouped_gemm_cpu {

// Work split knobs (for tuning only): rows per item (AMO_GG_MC) and columns per item of the AMX
// forward (AMO_GG_NC, read per call).
inline int64_t mc_rows() { static const int64_t v = env_or("AMO_GG_MC", MC, MR, MC, MR); return v; }
inline int64_t nc_amx() { return env_or("AMO_GG_NC", NC_MAX, NR, NC_MAX, NR); }

// ------------------------------------------------------------------------------------------
// Work items and the threaded driver
struct Item {
  int64_t e, r0, m, c0, n;  // group, first row (within the group's A/out), rows, first col, cols
};

// Split `rows` into tiles of at most MC rows of nearly equal size (multiples of MR).
inline void split_rows(int64_t rows, std::vector<std::pair<int64_t, int64_t>>& out) {
  out.clear();
  if (rows <= 0) return;
  const int64_t nt = ceil_div(rows, mc_rows());
  const int64_t step = round_up(ceil_div(rows, nt), MR);
  for (int64_t r = 0; r < rows; r += step) out.emplace_back(r, std::min(step, rows - r));
}

template <typename Body>
void run_items(const std::vector<Item>& items, Body body) {
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t nth = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    Workspace ws;
    // each thread claims its next item one step ahead, so that it can prefetch its operands
    int64_t cur = next.fetch_add(1, std::memory_order_relaxed);
    while (cur < n_items) {
      const int64_t nxt = next.fetch_add(1, std::memory_order_relaxed);
      body(items[cur], nxt < n_items ? &items[nxt] : nullptr, ws);
      cur = nxt;
    }
  });
}

// Runs `items` with the tile kernel of dtype `dt` (fp32, fp16 or bf16); `make_args(item, tag)`
// gives an item's TileArgs for element type decltype(tag). The next item's args go along for
// the prefetch.
template <typename MakeArgs>
void run_typed(at::ScalarType dt, const std::vector<Item>& items, MakeArgs make_args) {
  auto body = [&](auto tag) {
    using T = decltype(tag);
    run_items(items, [&](const Item& it, const Item* nx, Workspace& ws) {
      const TileArgs t = make_args(it, tag);
      if (nx) {
        const TileArgs tn = make_args(*nx, tag);
        run_tile<T>(t, &tn, ws);
      } else {
        run_tile<T>(t, nullptr, ws);
      }
    });
  };
  if (dt == at::kFloat) body(float{});
  else if (dt == at::kHalf) body(c10::Half{});
  else body(c10::BFloat16{});
}

// group_sizes as host values (the kernel runs on the host; the op's check, common/grouped_gemm_checks.h, has
// already bounded every entry and the sum).
std::vector<int64_t> host_sizes(const at::Tensor& group_sizes) {
  at::Tensor gs = group_sizes.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(gs.data_ptr<int64_t>(), gs.data_ptr<int64_t>() + gs.numel());
}

// Smallest mean rows per non-empty group for the per-group mm path of bf16 (see mm_path).
constexpr int64_t kMmMinRows = 128;

inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool v = __builtin_cpu_supports("avx512bf16");
  return v;
#else
  return false;
#endif
}

// Run every group as one ATen mm (see grouped_gemm_cpu)? By default only where it was measured to
// win over the tile kernel (2026-12-02, AMD EPYC with AVX512_BF16, no AMX, 2 threads, one process,
// AMO_GG_MM=1 vs 0 alternated; docs/benchmarks.md "fifth session"): bf16, AMX not used, the CPU has
// AVX512_BF16 (oneDNN's bf16 GEMM), and only for the transposed-weight forward (dX) and dW with
// groups of >= kMmMinRows rows on average, where mm was 0.87-1.12x the tile kernel's time. The
// plain forward (W [E,K,N]) always takes the tile kernel (mm: 0.95-1.46x its time, below 1 in 2 of 27 rounds), and so do
// groups of 64 rows (mm: 1.2-1.5x its time). `plain`: the forward with W in [E,K,N] (trans_b=False).
//
// With AMX (2026-12-02, Intel Xeon with AMX-BF16, 2 threads, AMO_GG_MM=1 vs 0 alternated in one
// process; docs/benchmarks.md "sixth session"): oneDNN's AMX mm took 0.66-0.88x the AMX tile
// kernel's time on groups of 256 rows (forward and dX, balanced and Zipf) and 1.42-1.57x on
// groups of 64 rows, so the forward and dX take per-group mm there from kMmMinRows rows on; dW
// was not measured that way and keeps the AMX tile kernel. `dw`: the weight-gradient call.
inline bool mm_path(at::ScalarType dt, const std::vector<int64_t>& gs, bool plain, bool dw = false) {
  if (dt == at::kDouble) return true;
  const int64_t mm_env = env_or("AMO_GG_MM", -1, -1, 1, 1);  // read per call
  if (mm_env >= 0) return mm_env == 1;
  if (dt != at::kBFloat16) return false;
  int64_t busy = 0, total = 0;
  for (int64_t g : gs) { busy += g > 0; total += g; }
  const bool big = busy > 0 && total >= kMmMinRows * busy;
  if (amx_wanted(dt)) return big && !dw;
  if (plain) return false;
  return cpu_has_avx512_bf16() && big;
}

// Runs body(e) for every non-empty group e: by default the groups are split over the threads, each
// thread claiming the next largest group and running its mm on one thread (ATen's mm inside a
// parallel region stays on the calling thread); AMO_GG_MM_PAR=0 runs one group at a time with every
// thread inside its mm. Split: 1.02-1.6x faster on the layer, balanced, Zipf and fine-grained shapes
// (2026-12-02, AMD EPYC with AVX512_BF16, 2 threads; docs/benchmarks.md).
template <typename Body>
void for_groups(const std::vector<int64_t>& gs, Body body) {
  const int64_t E = static_cast<int64_t>(gs.size());
  std::vector<int64_t> order;
  for (int64_t e = 0; e < E; ++e)
    if (gs[e]) order.push_back(e);
  const int64_t nth = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(order.size()));
  const int64_t par = env_or("AMO_GG_MM_PAR", 1, 0, 1, 1);
  if (!par || nth < 2 || at::in_parallel_region()) {
    for (int64_t e : order) body(e);
    return;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gs[a] > gs[b]; });
  std::atomic<int64_t> next{0};
  // the pool's threads do not inherit the caller's dispatch state (below autograd inside this
  // kernel): carry it over, so that each mm dispatches exactly as on the calling thread
  const at::ThreadLocalState tls;
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard guard(tls);
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(order.size()); i = next.fetch_add(1))
      body(order[i]);
  });
}

at::Tensor grouped_gemm_cpu(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& group_sizes,
                            bool trans_b) {
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), E = w.size(0);
  const int64_t N = trans_b ? w.size(1) : w.size(2);
  const std::vector<int64_t> gs = host_sizes(group_sizes);
  at::Tensor out = amo::empty_large({M, N}, x.options());
  int64_t total = 0;
  for (int64_t g : gs) total += g;
  if (total < M) out.narrow(0, total, M - total).zero_();
  if (total == 0 || N == 0) return out;

  // Plain per-group matmuls (ATen's mm: oneDNN / BLAS) for the fp64 oracle dtype, and for the bf16
  // dX (trans_b), and with AMX the plain forward too, of groups that are not small (mm_path has
  // the measurements).
  // AMO_GG_MM=0 keeps the tile kernels, =1 forces mm for fp32/fp16/bf16 too (A/B timing).
  if (mm_path(x.scalar_type(), gs, /*plain=*/!trans_b)) {
    std::vector<int64_t> offs(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) offs[e + 1] = offs[e] + gs[e];
    for_groups(gs, [&](int64_t e) {
      at::Tensor we = trans_b ? w[e].t() : w[e];
      at::Tensor oe = out.narrow(0, offs[e], gs[e]);
      at::mm_out(oe, x.narrow(0, offs[e], gs[e]), we);
    });
    return out;
  }
  TORCH_INTERNAL_ASSERT(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                        x.scalar_type() == at::kBFloat16);  // fp64 took the mm path above

  const bool amx = amx_wanted(x.scalar_type()) && K % 32 == 0;  // x rows in whole 16-pair steps
  // items ordered (group, N-tile, M-tile): threads that work at the same time share the B tile.
  // AMX: wider N-tiles, so that each x row block is fetched fewer times per group
  const int64_t nc = amx ? nc_amx() : NC;
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> rows;
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    split_rows(gs[e], rows);
    for (int64_t c0 = 0; c0 < N; c0 += nc)
      for (auto& rm : rows) items.push_back({e, off + rm.first, rm.second, c0, std::min(nc, N - c0)});
    off += gs[e];
  }
  const int64_t wsE = trans_b ? N * K : K * N;
  const void* xv = x.data_ptr();
  const void* wv = w.data_ptr();
  void* ov = out.data_ptr();
  run_typed(x.scalar_type(), items, [&](const Item& it, auto tag) {
    using T = decltype(tag);
    const T* we = static_cast<const T*>(wv) + it.e * wsE;
    // B(k, c): trans_b=False w[e][k][c]; trans_b=True w[e][c][k]
    Operand B = trans_b ? Operand{we + it.c0 * K, 1, K} : Operand{we + it.c0, N, 1};
    return TileArgs{it.m, it.n, K, Operand{static_cast<const T*>(xv) + it.r0 * K, K, 1}, B,
                    static_cast<T*>(ov) + it.r0 * N + it.c0, N, amx};
  });
  return out;
}

at::Tensor grouped_gemm_dw_cpu(const at::Tensor& a_, const at::Tensor& b_, const at::Tensor& group_sizes) {
  const at::Tensor a = a_.contiguous(), b = b_.contiguous();
  const int64_t M = a.size(0), P = a.size(1), Q = b.size(1);
  const std::vector<int64_t> gs = host_sizes(group_sizes);
  const int64_t E = static_cast<int64_t>(gs.size());
  at::Tensor out = amo::empty_large({E, P, Q}, a.options());
  if (out.numel() == 0) return out;
  // per-group mm as in the dX (fp64; bf16 without AMX when groups average >= kMmMinRows rows)
  if (mm_path(a.scalar_type(), gs, /*plain=*/false, /*dw=*/true)) {
    std::vector<int64_t> offs(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      offs[e + 1] = offs[e] + gs[e];
      if (!gs[e]) out[e].zero_();
    }
    for_groups(gs, [&](int64_t e) {
      at::Tensor oe = out[e];
      at::mm_out(oe, a.narrow(0, offs[e], gs[e]).t(), b.narrow(0, offs[e], gs[e]));
    });
    return out;
  }
  TORCH_INTERNAL_ASSERT(a.scalar_type() == at::kFloat || a.scalar_type() == at::kHalf ||
                        a.scalar_type() == at::kBFloat16);  // fp64 took the mm path above
  // items: (group, P-tile, Q-tile); the reduction runs over the group's rows (empty -> zeros)
  std::vector<Item> items;
  std::vector<int64_t> offs(E);
  std::vector<std::pair<int64_t, int64_t>> ptiles;
  split_rows(P, ptiles);
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    offs[e] = off;
    for (int64_t c0 = 0; c0 < Q; c0 += NC)
      for (auto& pm : ptiles) items.push_back({e, pm.first, pm.second, c0, std::min(NC, Q - c0)});
    off += gs[e];
  }
  const void* av = a.data_ptr();
  const void* bv = b.data_ptr();
  void* ov = out.data_ptr();
  const bool amx = amx_wanted(a.scalar_type());
  run_typed(a.scalar_type(), items, [&](const Item& it, auto tag) {
    using T = decltype(tag);
    const int64_t o = offs[it.e];
    Operand A{static_cast<const T*>(av) + o * P + it.r0, 1, P};  // A(r=p, k=row) = a[row][p]
    Operand B{static_cast<const T*>(bv) + o * Q + it.c0, Q, 1};  // B(k=row, c=q) = b[row][q]
    return TileArgs{it.m, it.n, gs[it.e], A, B, static_cast<T*>(ov) + it.e * P * Q + it.r0 * Q + it.c0, Q,
                    amx};
  });
  return out;
}

}  // namespace grouped_gemm_cpu
}  // namespace amo

// ---- dispatcher kernels: the op-boundary checks (common/grouped_gemm_checks.h), then the kernels ----
namespace {
at::Tensor grouped_gemm_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& group_sizes, bool trans_b) {
  amo::checks::grouped_gemm(x, w, group_sizes, trans_b);
  return amo::grouped_gemm_cpu::grouped_gemm_cpu(x, w, group_sizes, trans_b);
}

at::Tensor grouped_gemm_dw_op(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_sizes) {
  amo::checks::grouped_gemm_dw(a, b, group_sizes);
  return amo::grouped_gemm_cpu::grouped_gemm_dw_cpu(a, b, group_sizes);
}
}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(grouped_gemm, grouped_gemm_op)
AMO_CPU_KERNEL(grouped_gemm_dw, grouped_gemm_dw_op)
AMO_OP_CONTRACT(grouped_gemm)
AMO_OP_CONTRACT(grouped_gemm_dw)
