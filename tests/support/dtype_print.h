// How gtest prints a DType parameter: by name ("bfloat16"), not as
// "4-byte object <02-00 00-00>" (in test output and in the ctest names
// gtest_discover_tests makes from --gtest_list_tests). Found by ADL: it is in
// DType's namespace. Include it in tests with DType parameters.
#pragma once

#include <ostream>

#include "dos/wire/dtype.h"

namespace dos {

inline void PrintTo(DType t, std::ostream* os) { *os << DTypeName(t); }

}  // namespace dos
