// Internal entry points of the large-output block cache (common/alloc.h), for tests and for users
// who want the cached memory back: _C._large_blocks_stats() and _C._large_blocks_release().
#include "common/alloc.h"
#include "common/registry.h"

AMO_REGISTER(large_blocks) {
  m.def("_large_blocks_stats", [] {
    const amo::LargeBlocks::Stats s = amo::large_blocks().stats();
    pybind11::dict d;
    d["cached_bytes"] = s.cached_bytes;
    d["cached_blocks"] = s.cached_blocks;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["cap_bytes"] = s.cap_bytes;
    return d;
  }, "large-output block cache: cached bytes/blocks, hits, misses, cap (common/alloc.h)");
  m.def("_large_blocks_release", [] { amo::large_blocks().release(); },
        "unmap every cached large-output block (common/alloc.h)");
}
