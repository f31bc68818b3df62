// bf16 pair products of the CPU kernel (skip_attn_cpu.cpp), built with -DSA_BF16DP (the `avx512bf16`
// and `amx` targets): a bf16 cache's items of 16 rows or more (prefill) compute S = Q K^T and O += P V
// on bf16 pairs instead of widening every element to fp32.  Each VDPBF16PS multiplies 16 lanes of
// two bf16 pairs and adds both products into fp32 lanes: twice the multiply-adds of a 512-bit FMA per
// instruction, and half the bytes loaded per multiply-add.  The operands are packed as the AMX tiles
// (sa_amx.h) take them, so the two share the packing, P's rounding, and the rows they serve:
//   S = Q K^T:  Qb = the item's bf16 query rows as they came, kpack = the tile's keys pairwise along d
//               (row kk holds (K[2kk][j], K[2kk+1][j]) for the tile's 64 positions j);
//   O += P V:   Pb = P rounded to bf16 (64 positions a row), vpack = V pairwise along positions
//               (row tt holds (V[2tt][d], V[2tt+1][d]) for every column d).
// Each product of two bf16 is exact in fp32; the pair's two products are added in the instruction's
// own order (and inputs below 2^-126 read as 0), so these rows are not bit-identical to the fp32
// micro-kernels' (the float64 tests hold them to the bf16 tolerance).  P in bf16 is what vLLM's AMX
// kernel (and GPU flash attention) does too: the row sums l stay fp32, from the unrounded P.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "sa_simd.h"

namespace sa {

// 16 pairs (a[i], b[i]) of bf16 bits as 16 32-bit lanes, a in the low half: one 64-byte VNNI row.
inline __m512i pair16(const uint16_t* a, const uint16_t* b) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// Pb[16 rows][0:64] = P rows (fp32, 64 apart) rounded to bf16, to nearest even (VCVTNE2PS2BF16, 32 a
// instruction; it flushes inputs below 2^-126 to 0, P terms that add nothing at fp32 either).
inline void round_p16(const float* P, uint16_t* Pb) {
  for (int r = 0; r < 16; ++r)
    for (int j = 0; j < 64; j += 32) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(P + r * 64 + j + 16), _mm512_loadu_ps(P + r * 64 + j));
      _mm512_storeu_si512(Pb + r * 64 + j, reinterpret_cast<const __m512i&>(b));
    }
}

// Two adjacent 16-element bf16 rows a = p[0:16], b = p[16:32] as one VNNI row (a[i], b[i]): one
// load and one permute (a K panel's dims 2kk and 2kk + 1 are adjacent in a page of 16 positions).
inline __m512i pair16_adjacent(const uint16_t* p) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(p));
}

// Rows a and b, 32 elements each, as two VNNI rows: lo = (a[i], b[i]) for i < 16, hi for 16 <= i < 32.
inline void pair32(const uint16_t* a, const uint16_t* b, __m512i& lo, __m512i& hi) {
  const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i ihi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                       55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  lo = _mm512_permutex2var_epi16(va, ilo, vb);
  hi = _mm512_permutex2var_epi16(va, ihi, vb);
}

// One bf16 pair (p[0], p[1]) broadcast to 16 lanes.
inline __m512bh pair_bcast(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return (__m512bh)_mm512_set1_epi32(int(bits));
}

// (The loops over rows and panels are unrolled, as the fp32 micro-kernels' are: at -O2 GCC would otherwise
// keep the accumulators in memory.)
// S[R rows][0:64] = scale * Qb[R rows] . K^T over D (D even).  Qb: bf16 rows, D apart; kpack: D / 2 rows of
// 64 pairs (256 bytes a row); S rows TILE_K (64) apart.  4 R accumulators of 16 positions.
template <int R>
inline void dp_qk_rows(const uint16_t* Qb, int D, const uint16_t* kpack, float scale, float* S) {
  __m512 c[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < 4; ++p) c[r][p] = _mm512_setzero_ps();
  for (int kk = 0; kk < D / 2; ++kk) {
    const uint16_t* kb = kpack + size_t(kk) * 128;
    __m512bh b[4];
#pragma GCC unroll 8
    for (int p = 0; p < 4; ++p) b[p] = (__m512bh)_mm512_loadu_si512(kb + 32 * p);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_bcast(Qb + size_t(r) * D + 2 * kk);
#pragma GCC unroll 8
      for (int p = 0; p < 4; ++p) c[r][p] = _mm512_dpbf16_ps(c[r][p], a, b[p]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < 4; ++p) _mm512_storeu_ps(S + size_t(r) * 64 + 16 * p, _mm512_mul_ps(c[r][p], sc));
}

// S[16 rows][0:64] = scale * Qb[16 rows] . K^T: amx_qk16 then its scaling pass, on pair products.
inline void dp_qk16(const uint16_t* Qb, int D, const uint16_t* kpack, float scale, float* S) {
  dp_qk_rows<6>(Qb, D, kpack, scale, S);
  dp_qk_rows<6>(Qb + 6 * size_t(D), D, kpack, scale, S + 6 * 64);
  dp_qk_rows<4>(Qb + 12 * size_t(D), D, kpack, scale, S + 12 * 64);
}

// O[R rows][n : n + 16 W] += Pb[R rows] . V[:, n : n + 16 W].  Pb rows 64 apart; vpack: 32 rows of D
// pairs (2 D bf16 a row); O rows D apart.
template <int R, int W>
inline void dp_pv_block(const uint16_t* Pb, const uint16_t* vpack, int D, int n, float* O) {
  __m512 c[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) c[r][w] = _mm512_loadu_ps(O + size_t(r) * D + n + 16 * w);
  for (int tt = 0; tt < 32; ++tt) {
    const uint16_t* vb = vpack + size_t(tt) * 2 * D + 2 * n;
    __m512bh b[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) b[w] = (__m512bh)_mm512_loadu_si512(vb + 32 * w);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_bcast(Pb + size_t(r) * 64 + 2 * tt);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) c[r][w] = _mm512_dpbf16_ps(c[r][w], a, b[w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(O + size_t(r) * D + n + 16 * w, c[r][w]);
}

// O[16 rows][0:D] += Pb[16 rows] . V (D % 16 == 0): amx_pv16 on pair products.
inline void dp_pv16(const uint16_t* Pb, const uint16_t* vpack, int D, float* O) {
  int n = 0;
  for (; n + 64 <= D; n += 64) {
    dp_pv_block<6, 4>(Pb, vpack, D, n, O);
    dp_pv_block<6, 4>(Pb + 6 * 64, vpack, D, n, O + 6 * size_t(D));
    dp_pv_block<4, 4>(Pb + 12 * 64, vpack, D, n, O + 12 * size_t(D));
  }
  for (; n < D; n += 16) {
    dp_pv_block<6, 1>(Pb, vpack, D, n, O);
    dp_pv_block<6, 1>(Pb + 6 * 64, vpack, D, n, O + 6 * size_t(D));
    dp_pv_block<4, 1>(Pb + 12 * 64, vpack, D, n, O + 12 * size_t(D));
  }
}

}  // namespace sa
