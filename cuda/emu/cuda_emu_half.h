// cuda_emu_half.h (part of cuda_emu.h): __half and __nv_bfloat16 with bit-exact
// conversions (round to nearest even).
#pragma once

#include "cuda_emu_builtins.h"

// ---- half and bfloat16 (bit-exact conversions, round to nearest even) ----------------
struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};

inline float __half2float(__half h) {
  const unsigned int sign = (h.x & 0x8000u) << 16;
  const unsigned int rest = (h.x & 0x7fffu) << 13;
  if ((h.x & 0x7c00u) == 0x7c00u) return __uint_as_float(sign | 0x7f800000u | rest);  // inf, nan
  // Exponent and mantissa moved into a float's places read as 2^-112 times the value
  // (subnormal halves become subnormal floats); multiplying by 2^112 is exact.
  return __uint_as_float(sign | __float_as_uint(__uint_as_float(rest) * 0x1p112f));
}

inline __half __float2half_rn(float f) {
  const unsigned int bits = __float_as_uint(f);
  const unsigned short sign = static_cast<unsigned short>((bits >> 16) & 0x8000u);
  const unsigned int abs = bits & 0x7fffffffu;
  __half h;
  if (abs >= 0x7f800000u) {  // inf or nan
    h.x = sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
    return h;
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    h.x = sign | 0x7c00u;
    return h;
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Scale to units of 2^-24 and round to nearest even in float arithmetic.
    const float scaled = std::ldexp(__uint_as_float(abs), 24);
    const float r = std::nearbyint(scaled);  // default rounding mode: to nearest even
    h.x = sign | static_cast<unsigned short>(r);
    return h;
  }
  const unsigned int exp = (abs >> 23) - 112u;
  unsigned int man = abs & 0x7fffffu;
  unsigned int out = (exp << 10) | (man >> 13);
  const unsigned int rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (out & 1u))) ++out;  // carry may bump exponent
  h.x = sign | static_cast<unsigned short>(out);
  return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 b) {
  return __uint_as_float(static_cast<unsigned int>(b.x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int bits = __float_as_uint(f);
  __nv_bfloat16 b;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // nan stays a (quiet) nan
    b.x = static_cast<unsigned short>((bits >> 16) | 0x40u);
    return b;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  b.x = static_cast<unsigned short>(bits >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
