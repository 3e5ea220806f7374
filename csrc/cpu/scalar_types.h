// Storage types for 16-bit floats and the float8 KV caches (e5m2, e4m3). Plain bits only: the
// conversions live in vec.h, compiled per ISA variant.
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

// float8 e4m3 "fn" (1 sign, 4 exponent, 3 mantissa bits, bias 7; no infinities, 0x7f and 0xff
// are NaN; largest finite 448): torch.float8_e4m3fn, vLLM's "fp8" cache.
struct Float8E4M3 {
  uint8_t bits;
};

}  // namespace pagedserve::cpu
