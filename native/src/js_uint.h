// A non-negative integer argument from JavaScript: a number that is a safe
// integer (up to 2^53 - 1) or a bigint that fits in 64 bits. Throws a
// TypeError or RangeError naming the argument. The one check every binding
// uses for addresses, lengths and counts.
#pragma once
#include <napi.h>

#include <cstdint>
#include <string>

namespace forkling {

inline uint64_t ToU64(Napi::Env env, const Napi::Value& v, const std::string& name) {
  if (v.IsBigInt()) {
    bool lossless = false;
    uint64_t x = v.As<Napi::BigInt>().Uint64Value(&lossless);
    if (!lossless) throw Napi::RangeError::New(env, name + " does not fit in 64 bits");
    return x;
  }
  if (v.IsNumber()) {
    double d = v.As<Napi::Number>().DoubleValue();
    if (!(d >= 0) || d > 9007199254740991.0 || d != static_cast<double>(static_cast<uint64_t>(d)))
      throw Napi::RangeError::New(env, name + " must be a non-negative integer (at most 2^53 - 1 as a number)");
    return static_cast<uint64_t>(d);
  }
  throw Napi::TypeError::New(env, name + " must be a number or a bigint");
}

}  // namespace forkling
