// The command line shared by the emulator rule drivers: `driver CASE` runs the named case of the
// driver's table through `launch`. A name not in the table prints "unknown case"; a case the
// emulator refuses prints "EmuError: <message>" (what the Python tests match). The driver prints
// its own verdict only when the case ran.
#pragma once

#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "emu/kernel_operator_emu.h"

namespace emu_driver {

using Cases = std::map<std::string, std::function<void()>>;
enum Outcome { kRan, kRefused, kBadUsage };

// For a driver that dispatches on the name itself: `dispatch(name)` runs the case, or returns false
// for a name it does not know.
template <class Dispatch>
Outcome run_case_by_name(int argc, char** argv, Dispatch dispatch) {
  if (argc != 2) return kBadUsage;
  try {
    if (!dispatch(std::string(argv[1]))) {
      std::printf("unknown case\n");
      return kBadUsage;
    }
  } catch (const ascend_emu::EmuError& e) {
    std::printf("EmuError: %s\n", e.what());
    return kRefused;
  }
  return kRan;
}

template <class Launch>
Outcome run_named_case(int argc, char** argv, const Cases& cases, Launch launch) {
  return run_case_by_name(argc, argv, [&](const std::string& name) {
    const auto it = cases.find(name);
    if (it == cases.end()) return false;
    launch(it->second);
    return true;
  });
}

// The Cube memories of an Atlas A2 AI core: L1 512 KiB, L0A / L0B 64 KiB, L0C 128 KiB.
inline ascend_emu::CubeMem a2_cube_mem() { return {512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024}; }

// the process exit code of an outcome the driver does not report itself
inline int exit_code(Outcome o) { return o == kBadUsage ? 2 : 0; }

}  // namespace emu_driver
