// Storage types for 16-bit floats. Plain bits only: the conversions live in vec.h, compiled per
// ISA variant.
#pragma once

#include <cstdint>

namespace pagedserve::cpu {

struct BFloat16 {
  uint16_t bits;
};

struct Half {
  uint16_t bits;
};

}  // namespace pagedserve::cpu
