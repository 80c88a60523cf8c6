#include "dos/wire/dtype.h"

namespace dos {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "invalid";
}

bool IsValidDType(uint32_t raw) { return raw >= 1 && raw <= 3; }

}  // namespace dos
