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

template <class Launch>
Outcome run_named_case(int argc, char** argv, const Cases& cases, Launch launch) {
  if (argc != 2) return kBadUsage;
  const auto it = cases.find(argv[1]);
  if (it == cases.end()) {
    std::printf("unknown case\n");
    return kBadUsage;
  }
  try {
    launch(it->second);
  } catch (const ascend_emu::EmuError& e) {
    std::printf("EmuError: %s\n", e.what());
    return kRefused;
  }
  return kRan;
}

// the process exit code of an outcome the driver does not report itself
inline int exit_code(Outcome o) { return o == kBadUsage ? 2 : 0; }

}  // namespace emu_driver
