// Micro-kernels of the CPU kernel (skip_attn_cpu.cpp): S = Q K^T and O += P V on fp32 tiles.
//
// B operands are fp32: the cpu-packed page of an fp32 cache read in place (K dim-major:
// 16 positions per row of a panel; V token-major: one row per position), or the fp32
// gather buffers every other cache type and layout is converted into.
#pragma once

#include "sa_simd.h"

namespace sa {

constexpr int TILE_K = 64;  // checked against _common.TILE_K at load (sa_layout)
constexpr int PANEL = 16;   // KV positions per Q.K^T column panel
constexpr int MR = 6;       // rows per micro-kernel: 6 x 16 fp32 = 12 ymm (or 6 zmm) accumulators of 16

// C[r][0:16] = sum_d A[r][d] * B[d][0:16] for r < R: one 16-position column panel of Q.K^T.
// A: fp32 rows (lda), B: D rows of 16 KV positions (ldb between dims; the dim-major K of the
// cpu-packed page read in place, or the gather buffer).
template <int R>
inline void qk_panel(const float* A, int lda, const float* B, int64_t ldb, int D, float* C, int ldc) {
  V16 c[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c[r] = zero16();
  for (int d = 0; d < D; ++d) {
    const V16 b = load16(B + d * ldb);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c[r] = fmadd(set16(A[r * lda + d]), b, c[r]);
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store16(C + r * ldc, c[r]);
}

// O[r][col:col+8W] += sum_t P[r][t] * V[t][col:col+8W] for r < R, t < ntok; V rows by pointer
// (token-major V read in place through the block table, or the gather buffer).
// W even: W / 2 V16 per row (one zmm each in the AVX-512 build); W = 1: one V8.
template <int R, int W>
inline void pv_panel(const float* P, int ldp, const float* const* vrows, int ntok, int col, float* O, int ldo) {
  if constexpr (W % 2 == 0) {
    constexpr int W16 = W / 2;
    V16 acc[R][W16];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 8
      for (int w = 0; w < W16; ++w) acc[r][w] = load16(O + r * ldo + col + 16 * w);
    for (int t = 0; t < ntok; ++t) {
      const float* v = vrows[t] + col;
      V16 b[W16];
      #pragma GCC unroll 8
      for (int w = 0; w < W16; ++w) b[w] = load16(v + 16 * w);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const V16 a = set16(P[r * ldp + t]);
        #pragma GCC unroll 8
        for (int w = 0; w < W16; ++w) acc[r][w] = fmadd(a, b[w], acc[r][w]);
      }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 8
      for (int w = 0; w < W16; ++w) store16(O + r * ldo + col + 16 * w, acc[r][w]);
  } else {
    static_assert(W == 1, "pv_panel: W is 1 or even");
    V8 acc[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = load8(O + r * ldo + col);
    for (int t = 0; t < ntok; ++t) {
      const V8 b = load8(vrows[t] + col);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = fmadd(set1(P[r * ldp + t]), b, acc[r]);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store8(O + r * ldo + col, acc[r]);
  }
}

// Few rows per tile (decode): one row at a time over the whole 64-position tile, so each K
// row (dim-major: 64 positions) and each V row (D dims) is read as one contiguous run, the
// first row streaming it from memory and the others finding it in L1.
// C[0:64] = sum_d A[d] * B_p[d][0:16] over the 4 panels p.
__attribute__((noinline)) static void qk_wide(const float* A, const float* const* kp, int64_t ldb, int D, float* C) {
  V16 acc[4];
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = zero16();
  for (int d = 0; d < D; ++d) {
    const V16 a = set16(A[d]);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = fmadd(a, load16(kp[p] + d * ldb), acc[p]);
  }
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) store16(C + PANEL * p, acc[p]);
}

// O[col:col+8W] += sum_t P[t] * V[t][col:col+8W] for one row.
template <int W>
inline void pv_wide_w(const float* P, const float* const* vrows, int ntok, int col, float* O) {
  if constexpr (W % 2 == 0) {
    constexpr int W16 = W / 2;
    V16 acc[W16];
#pragma GCC unroll 8
    for (int w = 0; w < W16; ++w) acc[w] = load16(O + col + 16 * w);
    for (int t = 0; t < ntok; ++t) {
      const V16 a = set16(P[t]);
      const float* v = vrows[t] + col;
#pragma GCC unroll 8
      for (int w = 0; w < W16; ++w) acc[w] = fmadd(a, load16(v + 16 * w), acc[w]);
    }
#pragma GCC unroll 8
    for (int w = 0; w < W16; ++w) store16(O + col + 16 * w, acc[w]);
  } else {
    static_assert(W == 1, "pv_wide_w: W is 1 or even");
    V8 acc = load8(O + col);
    for (int t = 0; t < ntok; ++t) acc = fmadd(set1(P[t]), load8(vrows[t] + col), acc);
    store8(O + col, acc);
  }
}

__attribute__((noinline)) static void pv_wide(const float* P, const float* const* vrows, int ntok, int D, float* O) {
  int col = 0;
  for (; col + 64 <= D; col += 64) pv_wide_w<8>(P, vrows, ntok, col, O);
  for (; col + 16 <= D; col += 16) pv_wide_w<2>(P, vrows, ntok, col, O);
  if (col < D) pv_wide_w<1>(P, vrows, ntok, col, O);
}

// Not inlined: one copy serves every run_item variant (a quarter of the code, and of the
// compile time, of inlining them), and a call per 6 x 16 block costs nothing.
__attribute__((noinline)) static void qk_rows(int R, const float* A, int lda, const float* B, int64_t ldb, int D, float* C, int ldc) {
  switch (R) {
    case 1: qk_panel<1>(A, lda, B, ldb, D, C, ldc); break;
    case 2: qk_panel<2>(A, lda, B, ldb, D, C, ldc); break;
    case 3: qk_panel<3>(A, lda, B, ldb, D, C, ldc); break;
    case 4: qk_panel<4>(A, lda, B, ldb, D, C, ldc); break;
    case 5: qk_panel<5>(A, lda, B, ldb, D, C, ldc); break;
    default: qk_panel<6>(A, lda, B, ldb, D, C, ldc); break;
  }
}

template <int W>
__attribute__((noinline)) static void pv_rows_w(int R, const float* P, int ldp, const float* const* vrows, int ntok, int col, float* O, int ldo) {
  switch (R) {
    case 1: pv_panel<1, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 2: pv_panel<2, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 3: pv_panel<3, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 4: pv_panel<4, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 5: pv_panel<5, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    default: pv_panel<6, W>(P, ldp, vrows, ntok, col, O, ldo); break;
  }
}

}  // namespace sa
