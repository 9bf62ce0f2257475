// Type-check shim: empty stand-in (toolkit tiling types are not used by these kernels).
#pragma once
