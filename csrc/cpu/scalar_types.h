// Storage types for 16-bit floats and the float8 e5m2 KV cache. Plain bits only: the conversions
// live in vec.h, compiled per ISA variant.
#pragma once

#include <cstdint>

namespace pagedserve::cpu {

struct BFloat16 {
  uint16_t bits;
};

struct Half {
  uint16_t bits;
};

// float8 e5m2 (1 sign, 5 exponent, 2 mantissa bits): the top byte of a float16.
struct Float8E5M2 {
  uint8_t bits;
};

}  // namespace pagedserve::cpu
