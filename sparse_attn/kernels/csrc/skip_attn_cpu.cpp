// Skip-softmax (BLASST) paged attention on CPU: the rule of sparse_attn/kernels/_common.py,
// compiled.  Plain C++17 + OpenMP with a C ABI (called through ctypes by cpu_impl.py), no
// torch headers: the build takes seconds instead of the ~1 min that <torch/extension.h>
// costs, and needs neither ninja nor the Python headers.  OpenMP pragmas bind to the
// libgomp torch already loaded (same SONAME), so torch.set_num_threads governs them.
//
// Build variants: -DSA_AVX2 (with -mavx2 -mfma -mf16c) uses AVX2 intrinsics; without it the
// same code runs on an 8-float struct the compiler vectorises as it can (SSE2, NEON).
//
// Work decomposition (one "item" per thread at a time, dynamic schedule):
//   item = (sequence, query tile of <= TILE_Q rows, KV head, a run of that KV head's query
//   heads).  The rows of the item are (head-in-run, row) ordered, so one K/V tile read
//   serves every query head of the GQA group (the packing), and each head's rows are one
//   contiguous block: a head whose tile is skipped simply leaves its block out of exp and
//   P.V, and the V tile is not read at all when every head of the item skips it.
//   The item walks its KV tiles in order with the rule's dense running max (restarted from
//   tile 0's maxima at every split boundary) and one online-softmax accumulator: splits are
//   an evaluation order in the rule, so a single pass over all tiles gives the same result.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(SA_AVX2)
#include <immintrin.h>
#endif
#if defined(SA_PROFILE)
#include <x86intrin.h>
#endif

namespace {

// -DSA_PROFILE (benchmarks/profile_cpu_kernel.py): cycles per phase of run_item, per thread,
// read back with sa_profile().  Without it the macros are empty.
enum Phase { P_Q, P_KPREP, P_QK, P_MASK_MAX, P_RULE, P_EXP, P_VPREP, P_PV, P_OUT, P_COUNT };
#if defined(SA_PROFILE)
thread_local uint64_t g_prof[P_COUNT];
std::atomic<uint64_t> g_prof_total[P_COUNT];
#define PROF_START uint64_t prof_t = __rdtsc();
#define PROF(phase)                     \
  do {                                  \
    uint64_t prof_n = __rdtsc();        \
    g_prof[phase] += prof_n - prof_t;   \
    prof_t = prof_n;                    \
  } while (0)
#else
#define PROF_START
#define PROF(phase) \
  do {              \
  } while (0)
#endif

constexpr int kAbiVersion = 1;
constexpr int TILE_Q = 64;  // must equal _common.TILE_Q
constexpr int TILE_K = 64;  // must equal _common.TILE_K
constexpr int PANEL = 16;   // KV positions per Q.K^T micro-kernel column panel
constexpr int MR = 6;       // rows per micro-kernel: 6 x 16 fp32 = 12 ymm accumulators of 16
// Rows per item: 4 heads x 64 rows x D 64-128 keeps Q, S and O (3 x M x D fp32, <= 384 KiB)
// inside the 1 MiB L2 of the machine this was tuned on; larger GQA groups get several items.
constexpr int ITEM_ROWS = 256;
// Items with fewer rows than this use the one-row kernels (qk_wide / pv_wide).
#ifndef WIDE_ROWS
#define WIDE_ROWS 6
#endif
// Lazy rescale: the exp reference of a row only moves when a tile's max exceeds it by more
// than this many nats (exp(8) cannot overflow fp32); exact, the reference cancels in O / l.
constexpr float RESCALE_SLACK = 8.0f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };

// ------------------------------------------------------------------ scalar conversions
inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t h) {
  uint32_t u = uint32_t(h.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(f16_t h) {
  uint32_t sign = uint32_t(h.x & 0x8000) << 16, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ff, u;
  if (e == 0x1f) {
    u = sign | 0x7f800000u | (m << 13);
  } else if (e) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else if (m) {  // subnormal: m * 2^-24, exact in fp32
    float f = float(m) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, as torch's .to(bfloat16/float16) does.
inline void from_f32(float f, float* out) { *out = f; }
inline void from_f32(float f, bf16_t* out) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out->x = uint16_t((u >> 16) | 0x40);
    return;
  }
  out->x = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void from_f32(float f, f16_t* out) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    out->x = uint16_t(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  } else if (ax >= 0x477ff000u) {  // rounds to >= 65520: infinity
    out->x = uint16_t(sign | 0x7c00u);
  } else if (ax < 0x38800000u) {  // below 2^-14: an fp16 subnormal (or 0), in units of 2^-24
    float v;
    std::memcpy(&v, &ax, 4);
    out->x = uint16_t(sign | uint32_t(std::nearbyint(v * 16777216.0f)));
  } else {
    out->x = uint16_t(sign | ((ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23)) >> 13));
  }
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
inline void store8(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 set1(float x) { return {_mm256_set1_ps(x)}; }
inline V8 zero8() { return {_mm256_setzero_ps()}; }
inline V8 fmadd(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 add(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 sub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 mul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 vmax(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline float hsum(V8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(V8 a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// exp(x) for x <= 88; x < -87 (and -inf) gives 0.  2^n * p(r), n = round(x / ln 2),
// r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two for an exact product), p the Taylor
// polynomial of degree 6: truncation <= r^7/7! = 1.2e-7 relative, about 1 ulp.  Measured
// against float64 exp over [-87, 8]: see tests/sparse_attn/test_kernels_cpu.py.
inline V8 exp8(V8 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  __m256 under = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);  // also -inf (NaN: not below, stays NaN)
  __m256 xc = _mm256_max_ps(x.v, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return {_mm256_andnot_ps(under, y)};
}
#else
// Portable build: GCC/Clang vector extensions, lowered to whatever SIMD the target has (two
// NEON or SSE registers per V8); no auto-vectoriser needed, so it also compiles quickly.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
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
inline V8 vmax(V8 a, V8 b) { return {a.v > b.v ? a.v : b.v}; }
inline float hsum(V8 a) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += a.v[i];
  return s;
}
inline float hmax(V8 a) {
  float s = a.v[0];
  for (int i = 1; i < 8; ++i) s = a.v[i] > s ? a.v[i] : s;
  return s;
}
// Same algorithm as the AVX2 exp8: round to nearest with the 1.5 * 2^23 shifter (exact for
// |x / ln 2| < 2^22), the same split ln 2 and polynomial.
inline V8 exp8(V8 x) {
  const f32x8 lo = set1(-87.0f).v, shifter = set1(12582912.0f).v;
  i32x8 under = x.v < lo;  // also -inf
  f32x8 xc = x.v < lo ? lo : x.v;
  f32x8 n = (xc * 1.44269504088896341f + shifter) - shifter;
  f32x8 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x8 p = set1(1.0f / 720).v;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i32x8 e = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  f32x8 y = p * scale;
  i32x8 yi;
  std::memcpy(&yi, &y, sizeof(yi));
  yi &= ~under;
  std::memcpy(&y, &yi, sizeof(y));
  return {y};
}
#endif

// ------------------------------------------------------------------ micro-kernels
// C[r][0:16] = sum_d A[r][d] * B[d][0:16] for r < R: one 16-position column panel of Q.K^T.
// A: fp32 rows (lda), B: D rows of 16 KV positions (ldb between dims; the dim-major K of the
// cpu-packed page read in place, or the gather buffer).
template <int R, typename BT>
inline void qk_panel(const float* A, int lda, const BT* B, int64_t ldb, int D, float* C, int ldc) {
  V8 c0[R], c1[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = zero8();
  for (int d = 0; d < D; ++d) {
    const BT* b = B + d * ldb;
    V8 b0 = load8(b), b1 = load8(b + 8);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      V8 a = set1(A[r * lda + d]);
      c0[r] = fmadd(a, b0, c0[r]);
      c1[r] = fmadd(a, b1, c1[r]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    store8(C + r * ldc, c0[r]);
    store8(C + r * ldc + 8, c1[r]);
  }
}

// O[r][col:col+8W] += sum_t P[r][t] * V[t][col:col+8W] for r < R, t < ntok; V rows by pointer
// (token-major V read in place through the block table, or the gather buffer).
template <int R, int W, typename BT>
inline void pv_panel(const float* P, int ldp, const BT* const* vrows, int ntok, int col, float* O, int ldo) {
  V8 acc[R][W];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) acc[r][w] = load8(O + r * ldo + col + 8 * w);
  for (int t = 0; t < ntok; ++t) {
    const BT* v = vrows[t] + col;
    V8 b[W];
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) b[w] = load8(v + 8 * w);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      V8 a = set1(P[r * ldp + t]);
      #pragma GCC unroll 8
      for (int w = 0; w < W; ++w) acc[r][w] = fmadd(a, b[w], acc[r][w]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) store8(O + r * ldo + col + 8 * w, acc[r][w]);
}

// Few rows per tile (decode): one row at a time over the whole 64-position tile, so each K
// row (dim-major: 64 positions) and each V row (D dims) is read as one contiguous run, the
// first row streaming it from memory and the others finding it in L1.
// C[0:64] = sum_d A[d] * B_p[d][0:16] over the 4 panels p.
template <typename BT>
__attribute__((noinline)) void qk_wide(const float* A, const BT* const* kp, int64_t ldb, int D, float* C) {
  V8 acc[8];
#pragma GCC unroll 8
  for (int w = 0; w < 8; ++w) acc[w] = zero8();
  for (int d = 0; d < D; ++d) {
    const V8 a = set1(A[d]);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const BT* b = kp[p] + d * ldb;
      acc[2 * p] = fmadd(a, load8(b), acc[2 * p]);
      acc[2 * p + 1] = fmadd(a, load8(b + 8), acc[2 * p + 1]);
    }
  }
#pragma GCC unroll 8
  for (int w = 0; w < 8; ++w) store8(C + 8 * w, acc[w]);
}

// O[col:col+8W] += sum_t P[t] * V[t][col:col+8W] for one row.
template <int W, typename BT>
inline void pv_wide_w(const float* P, const BT* const* vrows, int ntok, int col, float* O) {
  V8 acc[W];
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) acc[w] = load8(O + col + 8 * w);
  for (int t = 0; t < ntok; ++t) {
    const V8 a = set1(P[t]);
    const BT* v = vrows[t] + col;
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) acc[w] = fmadd(a, load8(v + 8 * w), acc[w]);
  }
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) store8(O + col + 8 * w, acc[w]);
}

template <typename BT>
__attribute__((noinline)) void pv_wide(const float* P, const BT* const* vrows, int ntok, int D, float* O) {
  int col = 0;
  for (; col + 64 <= D; col += 64) pv_wide_w<8>(P, vrows, ntok, col, O);
  for (; col + 16 <= D; col += 16) pv_wide_w<2>(P, vrows, ntok, col, O);
  if (col < D) pv_wide_w<1>(P, vrows, ntok, col, O);
}

// Not inlined: one copy per element type serves every run_item variant (a quarter of the
// code, and of the compile time, of inlining them), and a call per 6 x 16 block costs nothing.
template <typename BT>
__attribute__((noinline)) void qk_rows(int R, const float* A, int lda, const BT* B, int64_t ldb, int D, float* C, int ldc) {
  switch (R) {
    case 1: qk_panel<1>(A, lda, B, ldb, D, C, ldc); break;
    case 2: qk_panel<2>(A, lda, B, ldb, D, C, ldc); break;
    case 3: qk_panel<3>(A, lda, B, ldb, D, C, ldc); break;
    case 4: qk_panel<4>(A, lda, B, ldb, D, C, ldc); break;
    case 5: qk_panel<5>(A, lda, B, ldb, D, C, ldc); break;
    default: qk_panel<6>(A, lda, B, ldb, D, C, ldc); break;
  }
}

template <int W, typename BT>
__attribute__((noinline)) void pv_rows_w(int R, const float* P, int ldp, const BT* const* vrows, int ntok, int col, float* O, int ldo) {
  switch (R) {
    case 1: pv_panel<1, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 2: pv_panel<2, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 3: pv_panel<3, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 4: pv_panel<4, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    case 5: pv_panel<5, W>(P, ldp, vrows, ntok, col, O, ldo); break;
    default: pv_panel<6, W>(P, ldp, vrows, ntok, col, O, ldo); break;
  }
}

// ------------------------------------------------------------------ call description
}  // namespace

extern "C" {
// Mirrored field by field by cpu_impl._Call (ctypes).  Strides are in elements.
struct SaCall {
  int32_t abi;
  int32_t dtype;  // 0 fp32, 1 bf16, 2 fp16 (query, caches and out share it)
  int32_t num_seqs, num_q_heads, num_kv_heads, head_dim, page_size;
  int32_t causal, split_tiles, num_threads, num_counts, bt_is64;
  float scale;
  const void* q;
  int64_t q_st, q_sh, q_sd;
  void* out;
  int64_t o_st, o_sh, o_sd;
  const void* k;
  int64_t k_sb, k_st, k_sh, k_sd;
  const void* v;
  int64_t v_sb, v_st, v_sh, v_sd;
  const void* bt;
  int64_t bt_s0, bt_s1;
  const int64_t* seq_info;   // [3, num_seqs]: kv lengths, first query row, query lengths
  const float* lam;          // [num_seqs] serving lambdas, or null (dense)
  const float* count_lam;    // [num_counts, num_seqs] candidate lambdas, or null
  int64_t* skipped;          // [num_counts, num_q_heads], added to
  int64_t* visited;          // [1], added to
};
}

namespace {

struct Item {
  int32_t seq, qtile, kvh, h0, nh;
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, s, o, rowmax, mref, l, mdense, seed, kbuf, vbuf;
  void reserve(int M, int D) {
    auto grow = [](std::vector<float>& b, size_t n) { if (b.size() < n) b.resize(n); };
    grow(q, size_t(M) * D);
    grow(s, size_t(M) * TILE_K);
    grow(o, size_t(M) * D);
    grow(rowmax, M); grow(mref, M); grow(l, M); grow(mdense, M); grow(seed, M);
    grow(kbuf, size_t(TILE_K) * D);
    grow(vbuf, size_t(TILE_K) * D);
  }
};

struct Counts {
  std::vector<int64_t> skipped;
  int64_t visited = 0;
};

inline int64_t block_at(const SaCall& c, int s, int64_t col) {
  if (c.bt_is64) return static_cast<const int64_t*>(c.bt)[s * c.bt_s0 + col * c.bt_s1];
  return static_cast<const int32_t*>(c.bt)[s * c.bt_s0 + col * c.bt_s1];
}

// Where positions pos0 .. pos0+n-1 of sequence s live: block id and offset in the page of
// each, walking the block table with one division per tile instead of one per position.
struct TileSlots {
  int64_t blk[TILE_K];
  int32_t off[TILE_K];
  void fill(const SaCall& c, int s, int64_t pos0, int n) {
    int64_t col = pos0 / c.page_size;
    int32_t o = int32_t(pos0 - col * c.page_size);
    int64_t b = block_at(c, s, col);
    for (int j = 0; j < n; ++j) {
      blk[j] = b;
      off[j] = o;
      if (++o == c.page_size && j + 1 < n) {
        o = 0;
        b = block_at(c, s, ++col);
      }
    }
  }
};

// One item.  T: element type of query / caches / out.  KD / VD: K / V read in place (the
// micro-kernels then load T) or gathered into fp32 buffers first.
template <typename T, bool KD, bool VD>
void run_item(const SaCall& c, const Item& it, Scratch& sc, Counts& cnt, bool test) {
  using KT = typename std::conditional<KD, T, float>::type;
  using VT = typename std::conditional<VD, T, float>::type;
  const int D = c.head_dim, g = c.num_q_heads / c.num_kv_heads, S = c.num_seqs;
  const int s = it.seq, kvh = it.kvh;
  const int64_t kv = c.seq_info[s], qs = c.seq_info[S + s], ql = c.seq_info[2 * S + s];
  const int r0 = it.qtile * TILE_Q;
  const int nr = int(std::min<int64_t>(TILE_Q, ql - r0));
  const int nh = it.nh, M = nh * nr;
  // Row i of the query tile sees KV positions <= lim0 + i (causal) or <= kv - 1.
  const int64_t lim0 = c.causal ? kv - ql + r0 : kv - 1;
  const int64_t lim_last = c.causal ? lim0 + nr - 1 : kv - 1;
  const int last_tile = int(lim_last / TILE_K);
  float* Q = sc.q.data();
  float* Sb = sc.s.data();
  float* O = sc.o.data();
  float *rowmax = sc.rowmax.data(), *mref = sc.mref.data(), *l = sc.l.data();
  float *mdense = sc.mdense.data(), *seed = sc.seed.data();

  PROF_START
  const T* q = static_cast<const T*>(c.q);
  for (int hh = 0; hh < nh; ++hh) {
    const int64_t head = int64_t(kvh) * g + it.h0 + hh;
    for (int i = 0; i < nr; ++i) {
      const T* src = q + (qs + r0 + i) * c.q_st + head * c.q_sh;
      float* dst = Q + size_t(hh * nr + i) * D;
      for (int d = 0; d < D; ++d) dst[d] = to_f32(src[d * c.q_sd]) * c.scale;
    }
  }
  std::fill(O, O + size_t(M) * D, 0.0f);
  std::fill(l, l + M, 0.0f);
  std::fill(mref, mref + M, NEG_INF);

  const float lam_s = c.lam ? c.lam[s] : 0.0f;
  const bool count_here = c.num_counts > 0;
  const T* kc = static_cast<const T*>(c.k);
  const T* vc = static_cast<const T*>(c.v);
  const T* kh = kc + int64_t(kvh) * c.k_sh;  // this KV head's K and V
  const T* vh = vc + int64_t(kvh) * c.v_sh;
  const KT* kpanel[TILE_K / PANEL];
  int64_t ldk;
  const VT* vrows[TILE_K];
  bool keep[ITEM_ROWS];
  TileSlots ts;
  PROF(P_Q);

  for (int t = 0; t <= last_tile; ++t) {
    const int64_t pos0 = int64_t(t) * TILE_K;
    const int ntok = int(std::min<int64_t>(TILE_K, kv - pos0));
    const int npanel = (ntok + PANEL - 1) / PANEL;
    ts.fill(c, s, pos0, ntok);
    // ---- K: panels of 16 positions, each inside one page
    if (KD) {
      ldk = c.k_sd;
      for (int p = 0; p < npanel; ++p)
        kpanel[p] = reinterpret_cast<const KT*>(kh + ts.blk[p * PANEL] * c.k_sb + ts.off[p * PANEL] * c.k_st);
    } else {
      float* kb = sc.kbuf.data();
      ldk = TILE_K;
      for (int j = 0; j < ntok; ++j) {
        const T* src = kh + ts.blk[j] * c.k_sb + ts.off[j] * c.k_st;
        for (int d = 0; d < D; ++d) kb[d * TILE_K + j] = to_f32(src[d * c.k_sd]);
      }
      for (int d = 0; d < D; ++d)
        for (int j = ntok; j < npanel * PANEL; ++j) kb[d * TILE_K + j] = 0.0f;
      for (int p = 0; p < npanel; ++p) kpanel[p] = reinterpret_cast<const KT*>(kb + p * PANEL);
    }
    PROF(P_KPREP);
    // ---- S = (scale Q) K^T, [M, 64]; panels past the sequence end are -inf
    const bool wide = M < WIDE_ROWS;
    if (wide && npanel == TILE_K / PANEL) {
      for (int r = 0; r < M; ++r) qk_wide<KT>(Q + size_t(r) * D, kpanel, ldk, D, Sb + size_t(r) * TILE_K);
    } else for (int rb = 0; rb < M; rb += MR) {
      const int R = std::min(MR, M - rb);
      for (int p = 0; p < npanel; ++p)
        qk_rows<KT>(R, Q + size_t(rb) * D, D, kpanel[p], ldk, D, Sb + size_t(rb) * TILE_K + p * PANEL, TILE_K);
      if (npanel * PANEL < TILE_K)
        for (int r = rb; r < rb + R; ++r) std::fill(Sb + size_t(r) * TILE_K + npanel * PANEL, Sb + size_t(r + 1) * TILE_K, NEG_INF);
    }
    PROF(P_QK);
    // ---- mask positions a row does not see (causal diagonal, sequence end)
    if (pos0 + TILE_K - 1 > lim0) {
      for (int i = 0; i < nr; ++i) {
        const int64_t lim = c.causal ? lim0 + i : kv - 1;
        const int vis = int(std::max<int64_t>(0, std::min<int64_t>(TILE_K, lim - pos0 + 1)));
        if (vis == TILE_K) continue;
        for (int hh = 0; hh < nh; ++hh) {
          float* row = Sb + size_t(hh * nr + i) * TILE_K;
          std::fill(row + vis, row + TILE_K, NEG_INF);
        }
      }
    }
    // ---- per-row tile maxima
    for (int r = 0; r < M; ++r) {
      const float* row = Sb + size_t(r) * TILE_K;
      V8 m = vmax(vmax(load8(row), load8(row + 8)), vmax(load8(row + 16), load8(row + 24)));
      m = vmax(m, vmax(vmax(load8(row + 32), load8(row + 40)), vmax(load8(row + 48), load8(row + 56))));
      rowmax[r] = hmax(m);
    }
    PROF(P_MASK_MAX);
    // ---- the skip rule (per head: every valid row of the query tile votes)
    for (int hh = 0; hh < nh; ++hh) keep[hh] = true;
    if (test) {
      if (t == 0) {
        std::copy(rowmax, rowmax + M, seed);
        std::copy(rowmax, rowmax + M, mdense);
      } else {
        if (t % c.split_tiles == 0) std::copy(seed, seed + M, mdense);  // a later split opens
        for (int hh = 0; hh < nh; ++hh) {
          float diff = NEG_INF;
          for (int r = hh * nr; r < (hh + 1) * nr; ++r) diff = std::max(diff, rowmax[r] - mdense[r]);
          // max over rows of exp(.) = exp of the max: exp is monotonic.
          const float ratio = std::exp(diff);
          if (count_here) {
            int64_t* sk = cnt.skipped.data() + int64_t(kvh) * g + it.h0 + hh;
            for (int j = 0; j < c.num_counts; ++j)
              if (ratio < c.count_lam[int64_t(j) * S + s]) sk[int64_t(j) * c.num_q_heads] += 1;
          }
          keep[hh] = !(ratio < lam_s);
        }
        for (int r = 0; r < M; ++r) mdense[r] = std::max(mdense[r], rowmax[r]);
      }
      if (count_here && kvh == 0 && it.h0 == 0) cnt.visited += 1;
    }
    PROF(P_RULE);
    // ---- exp and row sums of the kept heads' rows
    bool any = false;
    for (int hh = 0; hh < nh; ++hh) {
      if (!keep[hh]) continue;
      any = true;
      for (int r = hh * nr; r < (hh + 1) * nr; ++r) {
        if (rowmax[r] > mref[r] + RESCALE_SLACK) {
          const float alpha = std::exp(mref[r] - rowmax[r]);  // 0 on the first tile
          mref[r] = rowmax[r];
          l[r] *= alpha;
          float* o = O + size_t(r) * D;
          for (int d = 0; d < D; ++d) o[d] *= alpha;
        }
        float* row = Sb + size_t(r) * TILE_K;
        const V8 m = set1(mref[r]);
        V8 sum = zero8();
        for (int j = 0; j < TILE_K; j += 8) {
          V8 p = exp8(sub(load8(row + j), m));
          store8(row + j, p);
          sum = add(sum, p);
        }
        l[r] += hsum(sum);
      }
    }
    PROF(P_EXP);
    if (!any) continue;  // no head keeps the tile: V is not read
    // ---- V rows (token-major)
    if (VD) {
      for (int j = 0; j < ntok; ++j) vrows[j] = reinterpret_cast<const VT*>(vh + ts.blk[j] * c.v_sb + ts.off[j] * c.v_st);
    } else {
      float* vb = sc.vbuf.data();
      for (int j = 0; j < ntok; ++j) {
        const T* src = vh + ts.blk[j] * c.v_sb + ts.off[j] * c.v_st;
        for (int d = 0; d < D; ++d) vb[j * D + d] = to_f32(src[d * c.v_sd]);
        vrows[j] = reinterpret_cast<const VT*>(vb + j * D);
      }
    }
    PROF(P_VPREP);
    // ---- O += P V for the kept heads' rows
    for (int hh = 0; hh < nh; ++hh) {
      if (!keep[hh]) continue;
      if (wide) {
        for (int r = hh * nr; r < (hh + 1) * nr; ++r)
          pv_wide<VT>(Sb + size_t(r) * TILE_K, vrows, ntok, D, O + size_t(r) * D);
        continue;
      }
      for (int rb = hh * nr; rb < (hh + 1) * nr; rb += MR) {
        const int R = std::min(MR, (hh + 1) * nr - rb);
        const float* P = Sb + size_t(rb) * TILE_K;
        float* o = O + size_t(rb) * D;
        int col = 0;
        for (; col + 16 <= D; col += 16) pv_rows_w<2, VT>(R, P, TILE_K, vrows, ntok, col, o, D);
        if (col < D) pv_rows_w<1, VT>(R, P, TILE_K, vrows, ntok, col, o, D);
      }
    }
    PROF(P_PV);
  }
  // ---- out = O / l in the query dtype
  T* out = static_cast<T*>(c.out);
  for (int hh = 0; hh < nh; ++hh) {
    const int64_t head = int64_t(kvh) * g + it.h0 + hh;
    for (int i = 0; i < nr; ++i) {
      const int r = hh * nr + i;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      const float* o = O + size_t(r) * D;
      T* dst = out + (qs + r0 + i) * c.o_st + head * c.o_sh;
      for (int d = 0; d < D; ++d) from_f32(o[d] * inv, dst + d * c.o_sd);
    }
  }
  PROF(P_OUT);
}

template <typename T>
int run(const SaCall& c) {
  const int S = c.num_seqs, g = c.num_q_heads / c.num_kv_heads;
  std::vector<Item> items;
  for (int s = 0; s < S; ++s) {
    const int64_t kv = c.seq_info[s], ql = c.seq_info[2 * S + s];
    if (ql <= 0) continue;
    const int nq = int((ql + TILE_Q - 1) / TILE_Q);
    for (int qt = 0; qt < nq; ++qt) {
      const int nr = int(std::min<int64_t>(TILE_Q, ql - int64_t(qt) * TILE_Q));
      const int hp = std::max(1, std::min(g, ITEM_ROWS / nr));
      const int64_t lim_last = c.causal ? kv - ql + int64_t(qt) * TILE_Q + nr - 1 : kv - 1;
      for (int kvh = 0; kvh < c.num_kv_heads; ++kvh)
        for (int h0 = 0; h0 < g; h0 += hp) {
          const int nh = std::min(hp, g - h0);
          items.push_back({s, qt, kvh, h0, nh, (lim_last / TILE_K + 1) * nh * nr});
        }
    }
  }
  if (items.empty()) return 0;
  // Longest first, then handed out one at a time: causal prefills make items very unequal.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  bool test = c.num_counts > 0;
  if (c.lam)
    for (int s = 0; s < S && !test; ++s) test = c.lam[s] > 0.0f;
  // K is read in place when it is dim-major (the cpu-packed page) and each 16-position panel
  // lies inside one page; V in place when it is token-major.  Otherwise gathered to fp32.
  const bool kdirect = c.k_st == 1 && c.page_size % PANEL == 0;
  const bool vdirect = c.v_sd == 1;
  int max_rows = 0;
  for (const Item& it : items) max_rows = std::max(max_rows, it.nh * TILE_Q);
  const int nthreads = std::max(1, std::min<int>(c.num_threads, int(items.size())));
  const int nitems = int(items.size());
  std::atomic<int> next(0);
  std::atomic<int> status(0);
  const size_t ncount = size_t(c.num_counts) * c.num_q_heads;

  auto body = [&](Counts& cnt) {
    try {
      thread_local Scratch sc;
      sc.reserve(max_rows, c.head_dim);
      cnt.skipped.assign(ncount, 0);
      for (int i = next.fetch_add(1); i < nitems; i = next.fetch_add(1)) {
        const Item& it = items[i];
        if (kdirect && vdirect) run_item<T, true, true>(c, it, sc, cnt, test);
        else if (kdirect) run_item<T, true, false>(c, it, sc, cnt, test);
        else if (vdirect) run_item<T, false, true>(c, it, sc, cnt, test);
        else run_item<T, false, false>(c, it, sc, cnt, test);
      }
    } catch (const std::bad_alloc&) {
      status.store(3);
    }
#if defined(SA_PROFILE)
    for (int i = 0; i < P_COUNT; ++i) {
      g_prof_total[i] += g_prof[i];
      g_prof[i] = 0;
    }
#endif
  };
  std::vector<Counts> counts(nthreads);
  if (nthreads == 1) {
    body(counts[0]);
  } else {
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
      body(counts[omp_get_thread_num()]);
#else
      body(counts[0]);
#endif
    }
  }
  if (status.load()) return status.load();
  for (const Counts& cnt : counts) {
    for (size_t i = 0; i < cnt.skipped.size(); ++i) c.skipped[i] += cnt.skipped[i];
    if (c.visited) *c.visited += cnt.visited;
  }
  return 0;
}

}  // namespace

extern "C" {

int sa_abi_version() { return kAbiVersion; }

const char* sa_isa() {
#if defined(SA_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// 0: ok; 1: this build's ISA is not available on the running CPU; 2: bad call (ABI
// mismatch, unsupported dtype or head size); 3: out of memory.
int sa_forward(const SaCall* c) {
  if (!c || c->abi != kAbiVersion || c->head_dim % 8 || c->num_kv_heads <= 0 || c->split_tiles <= 0) return 2;
#if defined(SA_AVX2)
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return 1;
#endif
  try {
    switch (c->dtype) {
      case 0: return run<float>(*c);
      case 1: return run<bf16_t>(*c);
      case 2: return run<f16_t>(*c);
      default: return 2;
    }
  } catch (const std::bad_alloc&) {
    return 3;
  }
}

// Cycles per phase (Phase order) summed over threads since the last reset; 0 without SA_PROFILE.
void sa_profile(uint64_t* out, int reset) {
  for (int i = 0; i < P_COUNT; ++i) {
#if defined(SA_PROFILE)
    out[i] = reset ? g_prof_total[i].exchange(0) : g_prof_total[i].load();
#else
    (void)reset;
    out[i] = 0;
#endif
  }
}

// The vector exp of the kernel on n floats (n % 8 == 0), for the accuracy test.
void sa_exp(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) store8(y + i, exp8(load8(x + i)));
}

}  // extern "C"
