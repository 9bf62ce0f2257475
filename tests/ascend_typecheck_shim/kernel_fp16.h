// Type-check shim: empty stand-in for a CPU-debug header of the toolkit (not in the source tree).
#pragma once
