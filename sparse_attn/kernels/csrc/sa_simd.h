// Element types, conversions and 8-float vectors of the CPU kernel (skip_attn_cpu.cpp).
//
// -DSA_AVX2 (with -mavx2 -mfma -mf16c): AVX2 intrinsics; -DSA_AVX512 (with SA_AVX2 and
// -mavx512f) adds 512-bit V16 for the matrix micro-kernels.  Otherwise GCC/Clang vector
// extensions, lowered to whatever SIMD the target has (two NEON or SSE registers per V8);
// no auto-vectoriser needed, so the portable build also compiles quickly.  Both builds
// compute exp and tanh with the same algorithms and constants.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(SA_AVX512) && !defined(SA_AVX2)
#error "SA_AVX512 builds on SA_AVX2 (the element loads, exp and tanh stay 8 wide)"
#endif
#if defined(SA_AVX2)
#include <immintrin.h>
#endif

namespace sa {

struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };
struct e4m3_t { uint8_t x; };  // float8_e4m3fn: bias 7, no infinities, S.1111.111 = NaN
struct e5m2_t { uint8_t x; };  // float8_e5m2: the top byte of an IEEE half

// ------------------------------------------------------------------ scalar conversions
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t h) { return bits_f32(uint32_t(h.x) << 16); }
inline float to_f32(f16_t h) {
  uint32_t sign = uint32_t(h.x & 0x8000) << 16, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ff;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e) return bits_f32(sign | ((e + 112) << 23) | (m << 13));
  return bits_f32(sign | f32_bits(float(m) * 5.9604644775390625e-8f));  // subnormal: m * 2^-24, exact
}
inline float to_f32(e5m2_t b) { return to_f32(f16_t{uint16_t(b.x << 8)}); }
inline float to_f32(e4m3_t b) {
  const uint32_t e = (b.x >> 3) & 0xf, m = b.x & 7;
  const float sign = (b.x & 0x80) ? -1.0f : 1.0f;
  if (e == 0xf && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * float(m) * 0.001953125f;                      // m * 2^-9
  return sign * bits_f32(((e + 120) << 23) | (m << 20));                  // (1 + m/8) 2^(e-7)
}
// Round to nearest even, as torch's .to(bfloat16 / float16) does.
inline void from_f32(float f, float* out) { *out = f; }
inline void from_f32(float f, bf16_t* out) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out->x = uint16_t((u >> 16) | 0x40);
    return;
  }
  out->x = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void from_f32(float f, f16_t* out) {
  const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    out->x = uint16_t(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  } else if (ax >= 0x477ff000u) {  // rounds to >= 65520: infinity
    out->x = uint16_t(sign | 0x7c00u);
  } else if (ax < 0x38800000u) {  // below 2^-14: an fp16 subnormal (or 0), in units of 2^-24
    out->x = uint16_t(sign | uint32_t(std::nearbyint(bits_f32(ax) * 16777216.0f)));
  } else {
    out->x = uint16_t(sign | ((ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23)) >> 13));
  }
}

// NaN policy (kernels/_common.py, "NaN and infinities"): maxima propagate NaN (vmax, hmax,
// nmax: NaN if either operand is), exp8 / exp_scalar return NaN for NaN and +inf for +inf,
// in both builds.
//
// exp(x) for x <= 88; x < -87 (and -inf) gives 0, x > 89 (and +inf) +inf, NaN NaN: 2^n p(r), n = round(x / ln 2), r = x - n ln 2
// in [-ln2/2, ln2/2] (ln 2 in two parts so n ln 2 is exact), p = Taylor polynomial of degree 6
// (truncation <= r^7/7! = 1.2e-7 relative).  Measured against float64 over [-87, 8]: < 2 ulp
// (tests/sparse_attn/test_kernels_cpu.py::test_exp_approximation_accuracy); the float64
// reference tolerance of the outputs is 1e-5 relative, 40x that.  Degree 6, not 5: one
// FMA more (the exp pass is ~10 % of a dense prefill) buys 1 ulp instead of 20.
constexpr float kExpLo = -87.0f, kExpHi = 89.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP6 = 1.0f / 720, kP5 = 1.0f / 120, kP4 = 1.0f / 24, kP3 = 1.0f / 6;

// The maximum of a and b, NaN if either is NaN (std::max keeps a when b is NaN).
inline float nmax(float a, float b) { return (a != a || a > b) ? a : b; }

inline float exp_scalar(float x) {
  if (!(x >= kExpLo)) return x != x ? x : 0.0f;
  x = std::fmin(x, kExpHi);  // exp(89) overflows to +inf: the exponent field saturates
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float p = std::fma(kP6, r, kP5);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  return p * bits_f32(uint32_t(int32_t(n) + 127) << 23);
}

// tanh(y): odd Taylor series up to y^13 for |y| < 0.4 (next term < 2e-9 relative), else
// 1 - 2 / (exp(2|y|) + 1) with the sign restored (|y| clamped to 9, where tanh is 1.0f).
constexpr float kTanhSmall = 0.4f;
constexpr float kT3 = -1.0f / 3, kT5 = 2.0f / 15, kT7 = -17.0f / 315, kT9 = 62.0f / 2835, kT11 = -1382.0f / 155925,
                kT13 = 21844.0f / 6081075;

inline float tanh_scalar(float y) {
  const float a = std::fabs(y);
  if (a < kTanhSmall) {
    const float y2 = y * y;
    float p = std::fma(kT13, y2, kT11);
    p = std::fma(p, y2, kT9);
    p = std::fma(p, y2, kT7);
    p = std::fma(p, y2, kT5);
    p = std::fma(p, y2, kT3);
    return std::fma(p * y2, y, y);
  }
  if (a != a) return y;
  const float t = 1.0f - 2.0f / (exp_scalar(2.0f * std::fmin(a, 9.0f)) + 1.0f);
  return std::copysign(t, y);
}

// ------------------------------------------------------------------ 8-float vectors
#if defined(SA_AVX2)
struct V8 { __m256 v; };
inline V8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline V8 load8(const bf16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline V8 load8(const f16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline V8 load8(const e5m2_t* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_slli_epi16(b, 8))};
}
// e4m3 bits placed as half bits (sign << 8, the rest << 7) read as 2^-8 times the value,
// exactly, subnormals included; S.1111.111 (NaN) is blended in.
inline V8 load8(const e4m3_t* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
  __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
  return {_mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan)};
}
inline void store8(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 set1(float x) { return {_mm256_set1_ps(x)}; }
inline V8 zero8() { return {_mm256_setzero_ps()}; }
inline V8 fmadd(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 add(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 sub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 mul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
// _mm256_max_ps returns b when either is NaN: blend a back where a is NaN.
inline V8 vmax(V8 a, V8 b) { return {_mm256_blendv_ps(_mm256_max_ps(a.v, b.v), a.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))}; }
inline float hsum(V8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(V8 a) {
  if (_mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))) return std::numeric_limits<float>::quiet_NaN();
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V8 exp8(V8 x) {
  const __m256 lo = _mm256_set1_ps(kExpLo);
  __m256 under = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);  // also -inf
  // max / min return their second operand for NaN: xc is finite, NaN is blended back below.
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, lo), _mm256_set1_ps(kExpHi));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP6), r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  return {_mm256_blendv_ps(y, x.v, _mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q))};
}
inline V8 tanh8(V8 y) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_andnot_ps(sign, y.v);
  __m256 y2 = _mm256_mul_ps(y.v, y.v);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kT13), y2, _mm256_set1_ps(kT11));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kT9));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kT7));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kT5));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kT3));
  __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, y2), y.v, y.v);
  __m256 e = exp8({_mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_min_ps(a, _mm256_set1_ps(9.0f)))}).v;
  __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  __m256 large = _mm256_or_ps(t, _mm256_and_ps(sign, y.v));
  __m256 is_small = _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ);
  __m256 nan = _mm256_cmp_ps(y.v, y.v, _CMP_UNORD_Q);
  return {_mm256_blendv_ps(_mm256_blendv_ps(large, small, is_small), y.v, nan)};
}
#else
typedef float f32x8 __attribute__((vector_size(32)));
struct V8 { f32x8 v; };
inline V8 load8(const float* p) {
  V8 a;
  std::memcpy(&a.v, p, sizeof(a.v));
  return a;
}
template <typename T>
inline V8 load8(const T* p) {
  V8 a;
  for (int i = 0; i < 8; ++i) a.v[i] = to_f32(p[i]);
  return a;
}
inline void store8(float* p, V8 a) { std::memcpy(p, &a.v, sizeof(a.v)); }
inline V8 set1(float x) { return {f32x8{x, x, x, x, x, x, x, x}}; }
inline V8 zero8() { return set1(0.0f); }
inline V8 fmadd(V8 a, V8 b, V8 c) { return {a.v * b.v + c.v}; }
inline V8 add(V8 a, V8 b) { return {a.v + b.v}; }
inline V8 sub(V8 a, V8 b) { return {a.v - b.v}; }
inline V8 mul(V8 a, V8 b) { return {a.v * b.v}; }
inline V8 vmax(V8 a, V8 b) { return {((a.v > b.v) | (a.v != a.v)) ? a.v : b.v}; }
inline float hsum(V8 a) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += a.v[i];
  return s;
}
inline float hmax(V8 a) {
  float s = a.v[0];
  for (int i = 1; i < 8; ++i) s = nmax(s, a.v[i]);
  return s;
}
typedef int32_t i32x8 __attribute__((vector_size(32)));
// exp_scalar on 8 lanes: rounding with the 1.5 * 2^23 shifter (exact for |x / ln 2| < 2^22).
inline V8 exp8(V8 x) {
  const f32x8 lo = set1(kExpLo).v, shifter = set1(12582912.0f).v;
  const f32x8 hi = set1(kExpHi).v;
  const i32x8 under = x.v < lo;  // also -inf
  const i32x8 nan = x.v != x.v;
  f32x8 xc = x.v < lo ? lo : x.v;
  xc = xc > hi ? hi : xc;       // +inf -> exp(89) = +inf
  xc = nan ? lo : xc;           // a finite input for the arithmetic; NaN is put back below
  const f32x8 n = (xc * kLog2e + shifter) - shifter;
  f32x8 r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  f32x8 p = set1(kP6).v * r + kP5;
  p = p * r + kP4;
  p = p * r + kP3;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i32x8 e = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 scale, y;
  std::memcpy(&scale, &e, sizeof(scale));
  y = p * scale;
  i32x8 yi;
  std::memcpy(&yi, &y, sizeof(yi));
  yi &= ~under;
  std::memcpy(&y, &yi, sizeof(y));
  return {nan ? x.v : y};
}
inline V8 tanh8(V8 y) {
  for (int i = 0; i < 8; ++i) y.v[i] = tanh_scalar(y.v[i]);
  return y;
}
#endif

// ------------------------------------------------------------------ 16-float vectors
// The matrix micro-kernels' unit (sa_kernels.h: 16 KV positions of a Q.K^T panel, 16 columns
// of P.V): one zmm register with -DSA_AVX512, two V8 otherwise.  Every lane runs the same
// FMA sequence in both, so the AVX-512 build's outputs are bit-identical to the AVX2 build's.
#if defined(SA_AVX512)
struct V16 { __m512 v; };
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
// 16 bf16 / fp16 as fp32, exactly (the values load8 gives, 16 at a time): the micro-kernels read
// a 16-bit cache in place with these, so no fp32 copy of a tile is written and read back.
inline V16 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#if defined(__AVX512BW__)
  const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                       7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  return {_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi256_si512(h)))};
#else
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
#endif
}
inline V16 load16(const f16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// exp8's arithmetic on 16 lanes, operation for operation (max / min return their second operand
// for NaN in both widths), so each lane is bit-identical to exp8's.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLo);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);  // also -inf
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP6), r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_maskz_mov_ps(_mm512_knot(under), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
#else
struct V16 { V8 lo, hi; };
template <typename T>
inline V16 load16(const T* p) { return {load8(p), load8(p + 8)}; }
inline void store16(float* p, V16 a) {
  store8(p, a.lo);
  store8(p + 8, a.hi);
}
inline V16 set16(float x) { return {set1(x), set1(x)}; }
inline V16 zero16() { return {zero8(), zero8()}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {fmadd(a.lo, b.lo, c.lo), fmadd(a.hi, b.hi, c.hi)}; }
#endif

// x[j] = exp(x[j] - m) for j < n (n a multiple of 8), returning their sum.  The sum is the same
// 8-lane accumulation, in the same order, in every build (the AVX-512 one splits each 16-lane
// exp into its two halves), so the row sums, and the outputs, do not depend on the build.
inline float exp_sub_sum(float* x, int n, float m) {
  V8 sum = zero8();
#if defined(SA_AVX512)
  const __m512 m16 = _mm512_set1_ps(m);
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), m16));
    _mm512_storeu_ps(x + j, p);
    sum = add(sum, V8{_mm512_castps512_ps256(p)});
    sum = add(sum, V8{_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))});  // AVX512F only
  }
#else
  int j = 0;
#endif
  const V8 m8 = set1(m);
  for (; j < n; j += 8) {
    const V8 p = exp8(sub(load8(x + j), m8));
    store8(x + j, p);
    sum = add(sum, p);
  }
  return hsum(sum);
}

// dst[0:n] = src[0:n] as fp32 (n a multiple of 8).
template <typename S>
inline void convert_run(const S* src, float* dst, int n) {
  for (int i = 0; i < n; i += 8) store8(dst + i, load8(src + i));
}

}  // namespace sa
