// Argument checks of the launch wrappers (bindings.cpp), done at the C++ boundary before any
// launch: the kernels trust their sizes, so a wrong stride or dimension would read or write past
// a buffer. A failed check throws std::invalid_argument, which pybind11 raises as ValueError with
// the message: "<module>.<function>: <argument>: expected <what>, got <value>".
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace spd_checks {

inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}

template <typename... Parts>
[[noreturn]] void fail(const char* fn, const Parts&... parts) {
  std::ostringstream os;
  os << fn << ": ";
  append(os, parts...);
  throw std::invalid_argument(os.str());
}

inline const char* dtype_name(long long code) {
  switch (code) {
    case 0: return "0 (float32)";
    case 1: return "1 (bfloat16)";
    case 2: return "2 (float16)";
    default: return "an unknown code";
  }
}

}  // namespace spd_checks

// SPD_CHECK(cond, parts...): throws naming the calling binding (SPD_FN, a const char* in scope)
// and the parts streamed together, when cond is false.
#define SPD_CHECK(cond, ...)                                 \
  do {                                                       \
    if (!(cond)) ::spd_checks::fail(SPD_FN, __VA_ARGS__);    \
  } while (0)

// An argument with a lower bound: "stride_h: expected >= 64 (D), got 32".
#define SPD_CHECK_GE(arg, bound, why) \
  SPD_CHECK((arg) >= (bound), #arg ": expected >= ", (bound), " (" why "), got ", (arg))

// A required buffer (the kernel dereferences it unconditionally).
#define SPD_CHECK_PTR(arg) SPD_CHECK((arg) != 0, #arg ": expected a buffer address, got null")

// A dtype code among those the kernel is compiled for (spd::DType).
#define SPD_CHECK_DTYPE(arg, lo, hi)                                                     \
  SPD_CHECK((arg) >= (lo) && (arg) <= (hi), #arg ": expected a dtype code in [", (lo), \
            ", ", (hi), "] (0 float32, 1 bfloat16, 2 float16), got ", (arg))
