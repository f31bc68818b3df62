// Skip-softmax (BLASST) paged attention on CPU: the rule of sparse_attn/kernels/_common.py,
// compiled.  Plain C++17 + OpenMP with a C ABI (called through ctypes by cpu_impl.py), no
// torch headers: the build takes seconds instead of the ~1 min that <torch/extension.h>
// costs, and needs neither ninja nor the Python headers.  OpenMP pragmas bind to the
// libgomp torch already loaded (same SONAME; vLLM's CPU worker even LD_PRELOADs it), so
// the kernel runs on the threads torch and vLLM configured.
//
// Work decomposition (one "item" per thread at a time, dynamic schedule, longest first):
//   item = (sequence, query tile of <= TILE_Q rows, KV head, a run of that KV head's query
//   heads).  The rows of the item are (head-in-run, row) ordered, so one K/V tile read
//   serves every query head of the GQA group (the packing; vLLM's own vec kernel packs
//   only when 8 is a multiple of the group, so SmolLM2's group of 3 reads K/V once per
//   query head there).  Measured, 1 thread, 9/3/64 heads, CPU time: decode 4 x 8k 5.1 ms
//   packed vs 8.6 ms with one query head per item (memory-bound: 3x the K/V reads); prefill
//   2k 74.5 vs 74.9 ms (compute-bound).  Each head's rows are one contiguous block: a head whose tile is
//   skipped leaves its block out of exp and P.V, and the V tile is not read at all when
//   every head of the item skips it.  The item walks its KV tiles in order (tile-major
//   inner loop: Q, S and O of the item stay in L2 while K/V stream) with the rule's dense
//   running max (starting from the anchor's maxima, the seed, and restarted from them at
//   every later split) and one online-softmax accumulator: splits are an evaluation order
//   in the rule, so one pass over all tiles gives the same result.  A short query tile's item
//   (decode) over a long KV runs as several items, one per KV part (KV_PART_MIN_TILES below),
//   merged at the end, so a decode step has more items than sequences x KV heads.  The anchor is tile 0
//   without a window and the item's diagonal tile with one; a windowed item visits its
//   anchor first, so the seed is known before the tiles tested against it.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(SA_PROFILE)
#include <x86intrin.h>
#endif

#include "sa_kernels.h"
#if defined(SA_AMX) && !defined(SA_BF16DP)
#error "the amx build is the avx512bf16 build plus tiles: -DSA_AMX needs -DSA_BF16DP"
#endif
#if defined(SA_AMX)
#include "sa_amx.h"
#elif defined(SA_BF16DP)
#include "sa_bf16.h"
#endif

using namespace sa;

namespace {

constexpr int kAbiVersion = 7;
// SaCall.counters' slots (kernels.batch.COUNTER_SLOTS; checked at load through sa_layout).
constexpr int kSlotSkipped = 0, kSlotVisited = 1, kSlotLaunches = 2, kSlotDenseLaunches = 4, kSlotVTested = 5,
              kSlotVSkipped = 6;
// sa_forward's return codes (cpu_impl.forward turns each into an error).
constexpr int kOk = 0, kIsaMissing = 1, kBadCall = 2, kOutOfMemory = 3, kBadBlockId = 4, kBadBlockTable = 5;
constexpr int TILE_Q = 64;  // checked against _common.TILE_Q at load (sa_layout)
// Rows per item: 4 heads x 64 rows x D 64-128 keeps Q, S and O (3 x M x D fp32, <= 384 KiB)
// inside the 1 MiB L2 of the machine this was tuned on; larger GQA groups get several items.
constexpr int ITEM_ROWS = 256;
// Lazy rescale: the exp reference of a row only moves when a tile's max exceeds it by more
// than this many nats (exp(8) cannot overflow fp32); exact, the reference cancels in O / l.
constexpr float RESCALE_SLACK = 8.0f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();

// -DSA_PROFILE (benchmarks/profile_cpu_kernel.py): cycles per phase of run_item, per thread,
// read back with sa_profile().  Without it the macros are empty.
enum Phase { P_Q, P_KPREP, P_QK, P_MASK_MAX, P_RULE, P_EXP, P_VPREP, P_PV, P_OUT, P_COUNT };
#if defined(SA_PROFILE)
thread_local uint64_t g_prof[P_COUNT];
std::atomic<uint64_t> g_prof_total[P_COUNT];
#define PROF_START uint64_t prof_t = __rdtsc();
#define PROF(phase)                   \
  do {                                \
    uint64_t prof_n = __rdtsc();      \
    g_prof[phase] += prof_n - prof_t; \
    prof_t = prof_n;                  \
  } while (0)
#else
#define PROF_START
#define PROF(phase) \
  do {              \
  } while (0)
#endif

}  // namespace

extern "C" {
// Mirrored field by field by cpu_impl._Call (ctypes); the loader compares the two through
// sa_layout (size, field count, every offset) and refuses a library that differs.  Strides
// are in elements.
struct SaCall {
  int32_t abi;
  int32_t dtype;     // query / out: 0 fp32, 1 bf16, 2 fp16
  int32_t kv_dtype;  // caches: 0 fp32, 1 bf16, 2 fp16, 3 float8_e4m3fn, 4 float8_e5m2
  int32_t num_seqs, num_q_heads, num_kv_heads, head_dim, page_size;
  int32_t causal, window, split_tiles, num_threads, num_counts, bt_is64, sl_is64, qsl_is64;
  int32_t num_blocks;  // blocks of the caches: every block id a sequence uses must be in [0, num_blocks)
  int32_t bt_cols;     // columns of the block table: a sequence may use at most this many blocks
  float scale;     // softmax scale times the K dequantisation scale
  float soft_cap;  // 0: none
  float v_scale;   // V dequantisation scale (1 for unquantised caches)
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
  const void* seq_lens;     // [num_seqs] KV lengths (stride sl_s), int32 or int64
  const void* qsl;          // [num_seqs + 1] query offsets (stride qsl_s), int32 or int64
  int64_t sl_s, qsl_s;
  const float* lam;         // [num_seqs] serving lambdas, or null (dense)
  const float* count_lam;   // [num_counts, num_seqs] candidate lambdas, or null
  const float* sink_logits;  // [num_q_heads] learned sink logits, or null
  int64_t* skipped;         // [num_counts, num_q_heads], written (zeroed first)
  int64_t* visited;         // [num_q_heads], written (the count is the same for every head)
  // The serving phase counter (kernels.batch.COUNTER_SLOTS), added to, or null (ABI 7).  When set, the
  // launch counts under its own lambdas (count_lam = lam, num_counts = 1: skipped / visited may then be
  // null) and adds, where some sequence with query rows has lambda > 0: the tiles its heads skipped and
  // visited, the (item, tile) pairs tested and those no query head of the item kept, whose V was
  // therefore not read (an item packs the query heads of one KV head, so this is the V-tile fraction
  // skipped, the union over the group, which the per-head counts only bound from above), and one sparse
  // launch; else one dense launch.  What the Triton kernels add with atomics: no host op per launch.
  int64_t* counters;
};
}

// Every field of SaCall in declaration order, for sa_layout (a field added to the struct but
// not here changes sizeof or the offsets that follow, which the loader sees).
#define SA_CALL_FIELDS(X)                                                                                  \
  X(abi) X(dtype) X(kv_dtype) X(num_seqs) X(num_q_heads) X(num_kv_heads) X(head_dim) X(page_size) X(causal) \
  X(window) X(split_tiles) X(num_threads) X(num_counts) X(bt_is64) X(sl_is64) X(qsl_is64) X(num_blocks)     \
  X(bt_cols) X(scale) X(soft_cap) X(v_scale) X(q) X(q_st) X(q_sh) X(q_sd) X(out) X(o_st) X(o_sh) X(o_sd)    \
  X(k) X(k_sb) X(k_st) X(k_sh) X(k_sd) X(v) X(v_sb) X(v_st) X(v_sh) X(v_sd) X(bt) X(bt_s0) X(bt_s1)         \
  X(seq_lens) X(qsl) X(sl_s) X(qsl_s) X(lam) X(count_lam) X(sink_logits) X(skipped) X(visited) X(counters)

namespace {

// KV parts: an item of a short query tile (decode, speculative verification: at most KV_PART_MAX_ROWS
// query rows) without a window, whose KV spans more than one part, runs as one item per part of
// about part_tiles() tiles (part_range), the smallest multiple of the rule's split (a split restarts the running
// max from the seed, so the rule decides each part's tiles alone) of at least KV_PART_MIN_TILES; merge_parts()
// then combines their softmax states.  A decode step has few items (sequences x KV heads), so without
// parts threads beyond that count had nothing to do, as vLLM's CPU kernel avoids by splitting too.  The
// parts do not depend on the thread count, so neither do the outputs; a later part recomputes only the
// anchor tile's Q.K^T (its seed), 1 tile in 16-32 at the default split.
constexpr int KV_PART_MIN_TILES = 32, KV_PART_MAX_ROWS = 16;
inline int part_tiles(const SaCall& c) { return c.split_tiles * ((KV_PART_MIN_TILES + c.split_tiles - 1) / c.split_tiles); }

// Tiles [lo, hi) (from the item's first) of part p of an item's `tiles` KV tiles in nparts parts: whole splits,
// as even as they go (2049 positions: 16 + 17 tiles, not 32 + 1, whose second part would cost an item for a tile).
inline void part_range(const SaCall& c, int64_t tiles, int nparts, int p, int64_t& lo, int64_t& hi) {
  const int64_t st = c.split_tiles, nsplits = (tiles + st - 1) / st;
  lo = p * nsplits / nparts * st;
  hi = std::min(tiles, (p + 1) * nsplits / nparts * st);
}

// part / nparts: which of the item's KV parts this is (KV_PART_TILES tiles each, see run()); part > 0
// items write their unnormalised O, l and reference max to `partial` (parts x M x (D + 2) floats from
// `out0`) instead of the output, and merge_parts() combines them.
struct Item {
  int32_t seq, qtile, kvh, h0, nh, part, nparts;
  int64_t cost;
  int64_t out0;  // first float of this item's first part in the partial buffer (split items)
};

struct Scratch {
  std::vector<float> q, s, o, rowmax, mref, l, mdense, seed, kbuf, vbuf;
  // The pair products' bf16 operands (sa_bf16.h): raw query rows, the tile's K and V repacked, P rows.
  std::vector<uint16_t> qb, kpack, vpack, pb, zrow;
  void reserve(int M, int D) {
    auto grow = [](auto& b, size_t n) {
      if (b.size() < n) b.resize(n);
    };
#if defined(SA_BF16DP)
    grow(qb, size_t(M) * D);
    grow(kpack, size_t(TILE_K) * D);
    grow(vpack, size_t(TILE_K) * D);
    grow(pb, size_t(16) * TILE_K);
    grow(zrow, size_t(D));
#endif
    grow(q, size_t(M) * D);
    grow(s, size_t(M) * TILE_K);
    grow(o, size_t(M) * D);
    grow(rowmax, M);
    grow(mref, M);
    grow(l, M);
    grow(mdense, M);
    grow(seed, M);
    grow(kbuf, size_t(TILE_K) * D);
    grow(vbuf, size_t(TILE_K) * D);
  }
};

struct Counts {
  std::vector<int64_t> skipped;
  int64_t visited = 0;
  int64_t v_tested = 0, v_skipped = 0;  // for SaCall.counters
};

// The calling thread's scratch buffers, kept between calls (grown, never shrunk).
Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

inline int64_t block_at(const SaCall& c, int s, int64_t col) {
  if (c.bt_is64) return static_cast<const int64_t*>(c.bt)[s * c.bt_s0 + col * c.bt_s1];
  return static_cast<const int32_t*>(c.bt)[s * c.bt_s0 + col * c.bt_s1];
}

// Where positions pos0 .. pos0+n-1 of sequence s live: block id and offset in the page of
// each, walking the block table with one division per tile instead of one per position.
struct TileSlots {
  // A tile inside one page (vLLM's CPU page of 128 holds two whole tiles) is one block and a run of
  // offsets: no per-position entries (listing them, and V's row pointers from them, took 6 % and
  // 4-6 % of a bf16 decode tile, benchmarks/profile_cpu_kernel.py).  A tile across pages lists each
  // position's block and offset.
  int64_t blk[TILE_K];
  int32_t off[TILE_K];
  int64_t b0 = 0;
  int32_t o0 = 0;
  bool one_page = false;
  void fill(const SaCall& c, int s, int64_t pos0, int n) {
    int64_t col = pos0 / c.page_size;
    int32_t o = int32_t(pos0 - col * c.page_size);
    int64_t b = block_at(c, s, col);
    b0 = b;
    o0 = o;
    one_page = o + n <= c.page_size;
    if (one_page) return;
    for (int j = 0; j < n; ++j) {
      blk[j] = b;
      off[j] = o;
      if (++o == c.page_size && j + 1 < n) {
        o = 0;
        b = block_at(c, s, ++col);
      }
    }
  }
  int64_t block(int j) const { return one_page ? b0 : blk[j]; }
  int32_t offset(int j) const { return one_page ? o0 + j : off[j]; }
};

// Row i of an item sees KV positions [lo(i), hi(i)]: hi = lim0 + i (causal) or kv - 1; lo =
// hi - window + 1 (sliding window, causal only) or 0.
struct Rows {
  int64_t lim0, kv;
  int32_t window;
  bool causal;
  int64_t hi(int i) const { return causal ? lim0 + i : kv - 1; }
  int64_t lo(int i) const { return window > 0 ? std::max<int64_t>(0, hi(i) - window + 1) : 0; }
};

// Calls f(row, head, r) for each query row of an item: row (token index) and head (query head) address
// q and out, r is the row's place in the item's row order (head-in-run major: r = hh * nr + i), which
// the Q, O, m and l scratch rows follow.
template <typename F>
void for_item_rows(const SaCall& c, const Item& it, int64_t row0, int nr, F f) {
  const int g = c.num_q_heads / c.num_kv_heads;
  for (int hh = 0; hh < it.nh; ++hh) {
    const int64_t head = int64_t(it.kvh) * g + it.h0 + hh;
    for (int i = 0; i < nr; ++i) f(row0 + i, head, hh * nr + i);
  }
}

// Query rows -> scaled fp32 rows, and fp32 rows -> output rows, in the query's dtype (a
// runtime switch per item: templating run_item on it too doubled the compile time).
template <typename T>
void load_q_rows(const SaCall& c, const Item& it, int64_t row0, int nr, float* Q) {
  const T* q = static_cast<const T*>(c.q);
  const int D = c.head_dim;
  for_item_rows(c, it, row0, nr, [&](int64_t row, int64_t head, int r) {
    const T* src = q + row * c.q_st + head * c.q_sh;
    float* dst = Q + size_t(r) * D;
    if (c.q_sd == 1) {  // D % 8 == 0 (sa_forward): the same one rounding per element, 8 at a time
      const V8 scale = set1(c.scale);
      for (int d = 0; d < D; d += 8) store8(dst + d, mul(load8(src + d), scale));
    } else {
      for (int d = 0; d < D; ++d) dst[d] = to_f32(src[d * c.q_sd]) * c.scale;
    }
  });
}

template <typename T>
void store_out_rows(const SaCall& c, const Item& it, int64_t row0, int nr, const float* O, const float* l,
                    const float* mref) {
  T* out = static_cast<T*>(c.out);
  const int D = c.head_dim;
  for_item_rows(c, it, row0, nr, [&](int64_t row, int64_t head, int r) {
    const float denom = l[r] + (c.sink_logits ? std::exp(c.sink_logits[head] - mref[r]) : 0.0f);
    const float inv = (denom > 0.0f || denom != denom) ? c.v_scale / denom : 0.0f;  // NaN stays NaN
    const float* o = O + size_t(r) * D;
    T* dst = out + row * c.o_st + head * c.o_sh;
    for (int d = 0; d < D; ++d) from_f32(o[d] * inv, dst + d * c.o_sd);
  });
}

// out = v_scale O / (l + exp(sink - m)) in the query dtype.
void store_rows(const SaCall& c, const Item& it, int64_t row0, int nr, const float* O, const float* l, const float* mref) {
  switch (c.dtype) {
    case 1: store_out_rows<bf16_t>(c, it, row0, nr, O, l, mref); break;
    case 2: store_out_rows<f16_t>(c, it, row0, nr, O, l, mref); break;
    default: store_out_rows<float>(c, it, row0, nr, O, l, mref); break;
  }
}

#if defined(SA_BF16DP)
// The item's bf16 query rows as they are (the softmax scale is applied to S), in the row order of
// load_q_rows: Qb[(head-in-run, row)][d].
void load_q_bits(const SaCall& c, const Item& it, int64_t row0, int nr, uint16_t* Qb) {
  const bf16_t* q = static_cast<const bf16_t*>(c.q);
  const int D = c.head_dim;
  for_item_rows(c, it, row0, nr, [&](int64_t row, int64_t head, int r) {
    const bf16_t* src = q + row * c.q_st + head * c.q_sh;
    uint16_t* dst = Qb + size_t(r) * D;
    if (c.q_sd == 1) std::memcpy(dst, src, sizeof(uint16_t) * D);
    else
      for (int d = 0; d < D; ++d) dst[d] = src[d * c.q_sd].x;
  });
}

// kpack[kk][j][e] = K[2 kk + e][position j of the tile] (D / 2 rows of 64 pairs), positions past
// the tile's ntok zero.  kh: this KV head's cache.
void repack_k(const SaCall& c, const bf16_t* kh, const TileSlots& ts, int ntok, int npanel, int D, uint16_t* kpack) {
  if (c.k_st == 1 && c.page_size % PANEL == 0) {  // dim-major runs of 16 positions: 16 pairs a store
    if (npanel * PANEL < TILE_K)  // the panels past the sequence end: zeros (their scores are masked)
      for (int kk = 0; kk < D / 2; ++kk)
        std::fill(kpack + size_t(kk) * 2 * TILE_K + 2 * PANEL * npanel, kpack + size_t(kk + 1) * 2 * TILE_K, uint16_t(0));
    for (int p = 0; p < npanel; ++p) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(kh + ts.block(p * PANEL) * c.k_sb + ts.offset(p * PANEL));
      if (c.k_sd == PANEL) {  // pages of 16 positions: dims 2 kk and 2 kk + 1 are one 64-byte run
        for (int kk = 0; kk < D / 2; ++kk)
          _mm512_storeu_si512(kpack + size_t(kk) * 2 * TILE_K + 2 * PANEL * p, pair16_adjacent(src + 2 * kk * PANEL));
      } else {
        for (int kk = 0; kk < D / 2; ++kk)
          _mm512_storeu_si512(kpack + size_t(kk) * 2 * TILE_K + 2 * PANEL * p,
                              pair16(src + 2 * kk * c.k_sd, src + (2 * kk + 1) * c.k_sd));
      }
    }
  } else {
    std::fill(kpack, kpack + size_t(D) * TILE_K, uint16_t(0));
    for (int j = 0; j < ntok; ++j) {
      const bf16_t* src = kh + ts.block(j) * c.k_sb + ts.offset(j) * c.k_st;
      for (int d = 0; d < D; ++d) kpack[size_t(d / 2) * 2 * TILE_K + 2 * j + (d & 1)] = src[d * c.k_sd].x;
    }
  }
}

// vpack[tt][d][e] = V[position 2 tt + e][d] (32 rows of D pairs), positions past ntok zero (P is
// 0 there, but 0 times a NaN in an unused slot would not be).  zrow: D zeros.
void repack_v(const SaCall& c, const bf16_t* vh, const TileSlots& ts, int ntok, int D, const uint16_t* zrow, uint16_t* vpack) {
  auto row = [&](int j) -> const uint16_t* {
    return j < ntok ? reinterpret_cast<const uint16_t*>(vh + ts.block(j) * c.v_sb + ts.offset(j) * c.v_st) : zrow;
  };
  for (int tt = 0; tt < TILE_K / 2; ++tt) {
    uint16_t* dst = vpack + size_t(tt) * 2 * D;
    if (c.v_sd == 1) {
      const uint16_t *a = row(2 * tt), *b = row(2 * tt + 1);
      int d = 0;
      for (; d + 32 <= D; d += 32) {  // two permutes for 32 pairs
        __m512i lo, hi;
        pair32(a + d, b + d, lo, hi);
        _mm512_storeu_si512(dst + 2 * d, lo);
        _mm512_storeu_si512(dst + 2 * d + 32, hi);
      }
      for (; d < D; d += 16) _mm512_storeu_si512(dst + 2 * d, pair16(a + d, b + d));
    } else {
      for (int e = 0; e < 2; ++e) {
        const int j = 2 * tt + e;
        for (int d = 0; d < D; ++d)
          dst[2 * d + e] = j < ntok ? (vh + ts.block(j) * c.v_sb + ts.offset(j) * c.v_st)[d * c.v_sd].x : uint16_t(0);
      }
    }
  }
}
#endif

// Caches the micro-kernels read in place (widening 16-bit elements as they load them); fp8 is
// converted (and so read once) into the gather buffers.
template <typename KVT>
constexpr bool kInPlace = std::is_same<KVT, float>::value || std::is_same<KVT, bf16_t>::value ||
                          std::is_same<KVT, f16_t>::value;

// One item.  KVT: cache type.  KD / VD: the cache's K / V read in place (kInPlace types, in the
// layouts run() checks); every other cache type and layout is converted into the fp32 gather
// buffers.  Either way the micro-kernels see the same fp32 values, so the outputs are the same.
template <typename KVT, bool KD, bool VD>
void run_item(const SaCall& c, const int64_t* info, const Item& it, Scratch& sc, Counts& cnt, bool test,
              float* partial) {
  static_assert(!(KD || VD) || kInPlace<KVT>, "fp8 caches are not read in place");
  using KB = std::conditional_t<KD, KVT, float>;  // the element type the micro-kernels read K / V as
  using VB = std::conditional_t<VD, KVT, float>;
  const int D = c.head_dim, g = c.num_q_heads / c.num_kv_heads, S = c.num_seqs;
  const int s = it.seq, kvh = it.kvh;
  const int64_t kv = info[s], qs = info[S + s], ql = info[2 * S + s];
  const int r0 = it.qtile * TILE_Q;
  const int nr = int(std::min<int64_t>(TILE_Q, ql - r0));
  const int nh = it.nh, M = nh * nr;
  const Rows rows{c.causal ? kv - ql + r0 : kv - 1, kv, c.causal ? c.window : 0, c.causal != 0};
  // Visited tiles first .. last: from the first position the first row sees to the last
  // position the last row sees.  The anchor is never skipped and its maxima seed the running
  // max: tile first (= 0) without a window, the diagonal tile last with one.  A windowed item
  // visits its anchor first (order anchor, first, .., last - 1): the output is the same single
  // online softmax in any order, and the seed is then known before the tiles it is tested with.
  const int first_tile = int(rows.lo(0) / TILE_K), last_tile = int(rows.hi(nr - 1) / TILE_K);
  const int anchor_tile = rows.window > 0 ? last_tile : first_tile;
  const int64_t lo_last = rows.lo(nr - 1), hi_first = rows.hi(0);
  float* Q = sc.q.data();
  float* Sb = sc.s.data();
  float* O = sc.o.data();
  float *rowmax = sc.rowmax.data(), *mref = sc.mref.data(), *l = sc.l.data();
  float *mdense = sc.mdense.data(), *seed = sc.seed.data();

  // bf16 pair products (sa_bf16.h) for the first M16 rows of a gathered bf16 item of 16 rows or
  // more, on AMX tiles where the build has them and the OS granted them (sa_amx.h), else on
  // AVX512-BF16 dot products; the rest of its rows (M - M16 < 16) take the fp32 micro-kernels.
#if defined(SA_BF16DP)
  constexpr bool kPairType = std::is_same<KVT, bf16_t>::value && !KD && !VD;
  const bool pairs = kPairType && M >= 16 && D % 32 == 0;
#else
  constexpr bool pairs = false;
#endif
#if defined(SA_AMX)
  const bool amx = pairs && amx_permitted();
#else
  constexpr bool amx = false;
#endif
  const int M16 = pairs ? M / 16 * 16 : 0;

  PROF_START
  switch (c.dtype) {
    case 1: load_q_rows<bf16_t>(c, it, qs + r0, nr, Q); break;
    case 2: load_q_rows<f16_t>(c, it, qs + r0, nr, Q); break;
    default: load_q_rows<float>(c, it, qs + r0, nr, Q); break;
  }
#if defined(SA_BF16DP)
  if (pairs) load_q_bits(c, it, qs + r0, nr, sc.qb.data());
#endif
#if defined(SA_AMX)
  if (amx) amx_tile_config();
#endif
  std::fill(O, O + size_t(M) * D, 0.0f);
  std::fill(l, l + M, 0.0f);
  std::fill(mref, mref + M, NEG_INF);

  const float lam_s = c.lam ? c.lam[s] : 0.0f;
  const bool count_here = c.num_counts > 0;
  // Visited tiles are counted for a sequence some counted lambda can skip in (one > 0):
  // serving's achieved sparsity and calibration's counts share that denominator (_common).
  bool count_visited = false;
  for (int j = 0; j < c.num_counts; ++j) count_visited |= c.count_lam[int64_t(j) * S + s] > 0.0f;
  const bool count_v = test && c.counters && lam_s > 0.0f;
  const KVT* kh = static_cast<const KVT*>(c.k) + int64_t(kvh) * c.k_sh;  // this KV head's K and V
  const KVT* vh = static_cast<const KVT*>(c.v) + int64_t(kvh) * c.v_sh;
  const KB* kpanel[TILE_K / PANEL];
  int64_t ldk;
  const VB* vrows[TILE_K];
  bool keep[ITEM_ROWS];
  const float* prow[ITEM_ROWS];  // the kept heads' rows of P and O, for pv_tile
  float* orow[ITEM_ROWS];
  TileSlots ts;
  PROF(P_Q);

  // The order tiles are visited in: step first_tile visits the anchor, the later steps the other
  // tiles in KV order.
  auto tile_of = [&](int step) { return step == first_tile ? anchor_tile : (anchor_tile == first_tile ? step : step - 1); };
  int64_t pos0 = 0;
  int ntok = 0, npanel = 0;
  // Tile t's scores: S = (scale Q) K^T, soft-capped and masked, [M, 64], and each row's maximum
  // (rowmax).  next: the tile visited after t (decode prefetches its K), or -1.
  auto tile_scores = [&](int t, int next) {
    pos0 = int64_t(t) * TILE_K;
    ntok = int(std::min<int64_t>(TILE_K, kv - pos0));
    npanel = (ntok + PANEL - 1) / PANEL;
    ts.fill(c, s, pos0, ntok);
    // ---- K as 16-position panels of D rows
    if constexpr (KD) {  // dim-major, 16-aligned pages: in place
      ldk = c.k_sd;
      for (int p = 0; p < npanel; ++p) kpanel[p] = kh + ts.block(p * PANEL) * c.k_sb + ts.offset(p * PANEL) * c.k_st;
    } else {
#if defined(SA_BF16DP)
      if constexpr (kPairType)
        if (pairs) repack_k(c, kh, ts, ntok, npanel, D, sc.kpack.data());
#endif
      float* kb = sc.kbuf.data();
      ldk = TILE_K;
      if (M16 == M) {
        // every row on pair products: no fp32 copy of K
      } else if (c.k_st == 1 && c.page_size % PANEL == 0) {  // dim-major runs of 16 positions
        for (int p = 0; p < npanel; ++p) {
          const KVT* src = kh + ts.block(p * PANEL) * c.k_sb + ts.offset(p * PANEL);
          for (int d = 0; d < D; ++d) convert_run(src + d * c.k_sd, kb + d * TILE_K + p * PANEL, PANEL);
        }
      } else {
        for (int j = 0; j < ntok; ++j) {
          const KVT* src = kh + ts.block(j) * c.k_sb + ts.offset(j) * c.k_st;
          for (int d = 0; d < D; ++d) kb[d * TILE_K + j] = to_f32(src[d * c.k_sd]);
        }
        for (int d = 0; d < D; ++d)
          for (int j = ntok; j < npanel * PANEL; ++j) kb[d * TILE_K + j] = 0.0f;
      }
      for (int p = 0; p < npanel; ++p) kpanel[p] = kb + p * PANEL;
    }
    PROF(P_KPREP);
    // ---- S = (scale Q) K^T, [M, 64]; panels past the sequence end are -inf
    // Decode (fewer rows than a block, read in place): prefetch the next tile's K while this one's
    // streams (qk_tile says why).
    const KB* pf = nullptr;
    if constexpr (KD) {
      if (M < MR && npanel == TILE_K / PANEL && next >= 0) {
        const int64_t pn = int64_t(next) * TILE_K, col = pn / c.page_size;
        if (pn + TILE_K <= kv) pf = kh + block_at(c, s, col) * c.k_sb + (pn - col * c.page_size) * c.k_st;
      }
    }
#if defined(SA_AMX)
    if (amx) {
      for (int rb = 0; rb < M16; rb += 16) amx_qk16(sc.qb.data() + size_t(rb) * D, D, sc.kpack.data(), Sb + size_t(rb) * TILE_K);
      const __m512 scale16 = _mm512_set1_ps(c.scale);
      for (size_t i = 0; i < size_t(M16) * TILE_K; i += 16) _mm512_storeu_ps(Sb + i, _mm512_mul_ps(_mm512_loadu_ps(Sb + i), scale16));
    } else
#endif
#if defined(SA_BF16DP)
    if (pairs) {
      for (int rb = 0; rb < M16; rb += 16) dp_qk16(sc.qb.data() + size_t(rb) * D, D, sc.kpack.data(), c.scale, Sb + size_t(rb) * TILE_K);
    }
#endif
    if (M16 < M) qk_tile(M - M16, Q + size_t(M16) * D, D, kpanel, npanel, ldk, Sb + size_t(M16) * TILE_K, pf);
    if (npanel * PANEL < TILE_K)
      for (int r = 0; r < M; ++r) std::fill(Sb + size_t(r) * TILE_K + npanel * PANEL, Sb + size_t(r + 1) * TILE_K, NEG_INF);
    if (c.soft_cap > 0.0f) {  // logit = cap tanh(x / cap); masked positions are overwritten below
      const V8 inv = set1(1.0f / c.soft_cap), cap = set1(c.soft_cap);
      for (int r = 0; r < M; ++r)
        for (int j = 0; j < npanel * PANEL; j += 8) {
          float* x = Sb + size_t(r) * TILE_K + j;
          store8(x, mul(cap, tanh8(mul(load8(x), inv))));
        }
    }
    PROF(P_QK);
    // ---- mask positions a row does not see (causal diagonal, window start, sequence end)
    if (pos0 + TILE_K - 1 > hi_first || pos0 < lo_last) {
      for (int i = 0; i < nr; ++i) {
        const int vis_lo = int(std::max<int64_t>(0, std::min<int64_t>(TILE_K, rows.lo(i) - pos0)));
        const int vis_hi = std::max(vis_lo, int(std::max<int64_t>(0, std::min<int64_t>(TILE_K, rows.hi(i) - pos0 + 1))));
        if (vis_lo == 0 && vis_hi == TILE_K) continue;
        for (int hh = 0; hh < nh; ++hh) {
          float* row = Sb + size_t(hh * nr + i) * TILE_K;
          std::fill(row, row + vis_lo, NEG_INF);
          std::fill(row + vis_hi, row + TILE_K, NEG_INF);
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
  };

  // A part of a split item visits its own run of tiles (no window: step = tile); the anchor is in
  // part 0, so a later part computes only the anchor's scores, for the seed its first tile (a split
  // boundary, as every part boundary is) restarts the running max from.
  int step_lo = first_tile, step_hi = last_tile;
  if (it.nparts > 1) {
    int64_t lo, hi;
    part_range(c, last_tile - first_tile + 1, it.nparts, it.part, lo, hi);
    step_lo = first_tile + int(lo);
    step_hi = first_tile + int(hi) - 1;
  }
  if (step_lo != first_tile && test) {
    tile_scores(anchor_tile, -1);
    std::copy(rowmax, rowmax + M, seed);
  }
  for (int step = step_lo; step <= step_hi; ++step) {
    [[maybe_unused]] bool vpacked = false;  // this tile's V repacked for the pair products
    const int t = tile_of(step);
    tile_scores(t, step < step_hi ? tile_of(step + 1) : -1);
    // ---- the skip rule (per head: every valid row of the query tile votes)
    for (int hh = 0; hh < nh; ++hh) keep[hh] = true;
    if (test) {
      if (t == anchor_tile) {  // the anchor, visited first: never skipped, its maxima are the seed
        std::copy(rowmax, rowmax + M, seed);
        std::copy(rowmax, rowmax + M, mdense);
      } else {
        if (t % c.split_tiles == 0) std::copy(seed, seed + M, mdense);  // a split opens: restart
        for (int hh = 0; hh < nh; ++hh) {
          float diff = NEG_INF;  // max over voting rows of tile_max - m_before
          for (int r = hh * nr; r < (hh + 1) * nr; ++r) {
            if (rowmax[r] == NEG_INF) continue;  // the row sees nothing of this tile: no vote
            diff = nmax(diff, mdense[r] == NEG_INF ? POS_INF : rowmax[r] - mdense[r]);  // NaN propagates
          }
          // max over rows of exp(.) = exp of the max: exp is monotonic.
          const float ratio = std::exp(diff);
          if (count_here) {
            int64_t* sk = cnt.skipped.data() + int64_t(kvh) * g + it.h0 + hh;
            for (int j = 0; j < c.num_counts; ++j)
              if (ratio < c.count_lam[int64_t(j) * S + s]) sk[int64_t(j) * c.num_q_heads] += 1;
          }
          keep[hh] = !(ratio < lam_s);  // a NaN ratio keeps the tile
        }
        for (int r = 0; r < M; ++r) mdense[r] = nmax(mdense[r], rowmax[r]);
      }
      if (count_visited && kvh == 0 && it.h0 == 0) cnt.visited += 1;
    }
    PROF(P_RULE);
    // ---- exp and row sums of the kept heads' rows
    bool any = false;
    for (int hh = 0; hh < nh; ++hh) {
      if (!keep[hh]) continue;
      any = true;
      for (int r = hh * nr; r < (hh + 1) * nr; ++r) {
        float* row = Sb + size_t(r) * TILE_K;
        if (rowmax[r] == NEG_INF) {  // nothing visible (a window starting later): P = 0
          std::fill(row, row + TILE_K, 0.0f);
          continue;
        }
        if (rowmax[r] > mref[r] + RESCALE_SLACK) {
          const float alpha = std::exp(mref[r] - rowmax[r]);  // 0 on the row's first tile
          mref[r] = rowmax[r];
          l[r] *= alpha;
          float* o = O + size_t(r) * D;
          for (int d = 0; d < D; ++d) o[d] *= alpha;
        }
        l[r] += exp_sub_sum(row, TILE_K, mref[r]);
      }
    }
    PROF(P_EXP);
    if (count_v) {
      cnt.v_tested += 1;
      cnt.v_skipped += !any;
    }
    if (!any) continue;  // no head keeps the tile: V is not read
    // ---- the kept heads' rows: on pair products in runs of 16, the others listed for the fp32 P.V
    int nkept = 0;
    for (int hh = 0; hh < nh;) {
      if (!keep[hh]) {
        ++hh;
        continue;
      }
      int he = hh;  // kept heads hh .. he - 1: one contiguous run of rows
      while (he < nh && keep[he]) ++he;
      int r = hh * nr;
      if (pairs) r += (he - hh) * nr / 16 * 16;  // rows [hh nr, r) go on pair products
      for (int q = r; q < he * nr; ++q, ++nkept) {
        prow[nkept] = Sb + size_t(q) * TILE_K;
        orow[nkept] = O + size_t(q) * D;
      }
#if defined(SA_BF16DP)
      if (pairs && r > hh * nr) {
        if constexpr (kPairType)
          if (!vpacked) repack_v(c, vh, ts, ntok, D, sc.zrow.data(), sc.vpack.data());
        vpacked = true;
        for (int q = hh * nr; q < r; q += 16) {
          round_p16(Sb + size_t(q) * TILE_K, sc.pb.data());
#if defined(SA_AMX)
          if (amx) {
            amx_pv16(sc.pb.data(), sc.vpack.data(), D, O + size_t(q) * D);
            continue;
          }
#endif
          dp_pv16(sc.pb.data(), sc.vpack.data(), D, O + size_t(q) * D);
        }
      }
#endif
      hh = he;
    }
    PROF(P_PV);
    if (nkept == 0) continue;
    // ---- V rows (token-major)
    if constexpr (VD) {
      if (ts.one_page) {
        const VB* v0 = vh + ts.b0 * c.v_sb + ts.o0 * c.v_st;
        for (int j = 0; j < ntok; ++j) vrows[j] = v0 + j * c.v_st;
      } else {
        for (int j = 0; j < ntok; ++j) vrows[j] = vh + ts.block(j) * c.v_sb + ts.offset(j) * c.v_st;
      }
    } else {
      float* vb = sc.vbuf.data();
      for (int j = 0; j < ntok; ++j) {
        const KVT* src = vh + ts.block(j) * c.v_sb + ts.offset(j) * c.v_st;
        if (c.v_sd == 1) {
          convert_run(src, vb + j * D, D);
        } else {
          for (int d = 0; d < D; ++d) vb[j * D + d] = to_f32(src[d * c.v_sd]);
        }
        vrows[j] = vb + j * D;
      }
    }
    PROF(P_VPREP);
    // ---- O += P V for the listed rows
    pv_tile(nkept, prow, vrows, ntok, D, orow);
    PROF(P_PV);
  }
#if defined(SA_AMX)
  if (amx) _tile_release();
#endif
  if (it.nparts > 1) {  // a part: its unnormalised state, for merge_parts
    float* dst = partial + it.out0 + size_t(it.part) * M * (D + 2);
    std::copy(O, O + size_t(M) * D, dst);
    std::copy(l, l + M, dst + size_t(M) * D);
    std::copy(mref, mref + M, dst + size_t(M) * (D + 1));
  } else {
    store_rows(c, it, qs + r0, nr, O, l, mref);
  }
  PROF(P_OUT);
}

// A split item's parts (each O_p, l_p against its own reference max m_p) as one softmax: with m the
// largest m_p, O = sum_p exp(m_p - m) O_p and l likewise, summed in part order (so the result does not
// depend on which thread ran which part), then stored as an unsplit item's.  sc: O, l and mref.
void merge_parts(const SaCall& c, const int64_t* info, const Item& it, const float* partial, Scratch& sc) {
  const int D = c.head_dim, S = c.num_seqs;
  const int64_t qs = info[S + it.seq], ql = info[2 * S + it.seq];
  const int r0 = it.qtile * TILE_Q;
  const int nr = int(std::min<int64_t>(TILE_Q, ql - r0)), M = it.nh * nr;
  const size_t stride = size_t(M) * (D + 2);
  const float* base = partial + it.out0;
  float *O = sc.o.data(), *l = sc.l.data(), *mref = sc.mref.data();
  for (int r = 0; r < M; ++r) {
    float m = NEG_INF;
    for (int p = 0; p < it.nparts; ++p) m = std::max(m, base[p * stride + size_t(M) * (D + 1) + r]);
    float* o = O + size_t(r) * D;
    std::fill(o, o + D, 0.0f);
    l[r] = 0.0f;
    mref[r] = m;
    for (int p = 0; p < it.nparts; ++p) {
      const float* part = base + p * stride;
      const float mp = part[size_t(M) * (D + 1) + r];
      if (mp == NEG_INF) continue;  // the part kept nothing of this row: O_p = 0, l_p = 0
      const float w = std::exp(mp - m);
      l[r] += w * part[size_t(M) * D + r];
      const float* op = part + size_t(r) * D;
      for (int d = 0; d < D; ++d) o[d] += w * op[d];
    }
  }
  store_rows(c, it, qs + r0, nr, O, l, mref);
}

// SaCall.counters: one launch's counts under its lambdas (those of sequences with lambda > 0 and query
// rows), and one sparse launch, where there is such a sequence; else one dense launch.
void add_counters(const SaCall& c, const std::vector<int64_t>& info, int64_t skipped, int64_t visited, int64_t v_tested,
                  int64_t v_skipped) {
  if (!c.counters) return;
  const int S = c.num_seqs;
  bool sparse = false;
  for (int s = 0; s < S && !sparse; ++s) sparse = c.lam && c.lam[s] > 0.0f && info[2 * S + s] > 0;
  if (!sparse) {
    c.counters[kSlotDenseLaunches] += 1;
    return;
  }
  c.counters[kSlotSkipped] += skipped;
  c.counters[kSlotVisited] += visited;
  c.counters[kSlotVTested] += v_tested;
  c.counters[kSlotVSkipped] += v_skipped;
  c.counters[kSlotLaunches] += 1;
}

inline int64_t index_at(const void* p, int is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

template <typename KVT>
int run(const SaCall& c) {
  const int S = c.num_seqs, g = c.num_q_heads / c.num_kv_heads;
  // [3, S]: KV length, first query row, query length of each sequence (read from the host
  // tensors themselves: no Python-side copy per call).
  std::vector<int64_t> info(3 * size_t(S));
  for (int s = 0; s < S; ++s) {
    const int64_t a = index_at(c.qsl, c.qsl_is64, s * c.qsl_s), b = index_at(c.qsl, c.qsl_is64, (s + 1) * c.qsl_s);
    info[s] = index_at(c.seq_lens, c.sl_is64, s * c.sl_s);
    info[S + s] = a;
    info[2 * S + s] = b - a;
  }
  // Every block id a sequence uses (ceil(kv / page) of them) must lie in the caches and the
  // table: the walk dereferences them unchecked.  S * blocks reads, nothing next to the walk.
  for (int s = 0; s < S; ++s) {
    if (info[2 * S + s] <= 0) continue;  // no query row this step: nothing is read
    const int64_t kv = info[s], need = (kv + c.page_size - 1) / c.page_size;
    if (kv < 0 || need > c.bt_cols) return kBadBlockTable;
    for (int64_t col = 0; col < need; ++col) {
      const int64_t b = block_at(c, s, col);
      if (b < 0 || b >= c.num_blocks) return kBadBlockId;
    }
  }
  // The counts are written, not added to (ABI 5): callers pass uninitialised buffers, which
  // saves the two fills per layer and step that zeroed them on the Python side.
  if (c.skipped) std::fill(c.skipped, c.skipped + int64_t(c.num_counts) * c.num_q_heads, int64_t(0));
  if (c.visited) std::fill(c.visited, c.visited + c.num_q_heads, int64_t(0));
  std::vector<Item> items;
  const int ptiles = part_tiles(c);
  int64_t partial_size = 0;  // floats of the split items' part states
  for (int s = 0; s < S; ++s) {
    const int64_t kv = info[s], ql = info[2 * S + s];
    if (ql <= 0) continue;
    const int nq = int((ql + TILE_Q - 1) / TILE_Q);
    for (int qt = 0; qt < nq; ++qt) {
      const int nr = int(std::min<int64_t>(TILE_Q, ql - int64_t(qt) * TILE_Q));
      const int hp = std::max(1, std::min(g, ITEM_ROWS / nr));
      const Rows rows{c.causal ? kv - ql + int64_t(qt) * TILE_Q : kv - 1, kv, c.causal ? c.window : 0, c.causal != 0};
      const int64_t tiles = rows.hi(nr - 1) / TILE_K - rows.lo(0) / TILE_K + 1;
      const int nparts = nr <= KV_PART_MAX_ROWS && rows.window <= 0 ? int((tiles + ptiles - 1) / ptiles) : 1;
      for (int kvh = 0; kvh < c.num_kv_heads; ++kvh)
        for (int h0 = 0; h0 < g; h0 += hp) {
          const int nh = std::min(hp, g - h0);
          for (int p = 0; p < nparts; ++p) {
            int64_t lo = 0, hi = tiles;
            if (nparts > 1) part_range(c, tiles, nparts, p, lo, hi);
            items.push_back({s, qt, kvh, h0, nh, p, nparts, (hi - lo) * nh * nr, partial_size});
          }
          if (nparts > 1) partial_size += int64_t(nparts) * nh * nr * (c.head_dim + 2);
        }
    }
  }
  if (items.empty()) {
    add_counters(c, info, 0, 0, 0, 0);
    return kOk;
  }
  // Longest first, then handed out one at a time: causal prefills make items very unequal.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  bool test = c.num_counts > 0;
  if (c.lam)
    for (int s = 0; s < S && !test; ++s) test = c.lam[s] > 0.0f;
  // An fp32 / bf16 / fp16 cache can be read in place where K is dim-major (the cpu-packed page)
  // with pages holding whole 16-position panels, and where V is token-major.  bf16 decode read in
  // place (vLLM's vec pages, 1 thread, 9/3/64 heads, AVX-512, benchmarks/bench_cpu_native.py):
  // 4 x 8k 4.00 -> 2.38 ms, 4 x 2k 1.04 -> 0.66 ms; through the gather buffers each element was
  // widened, stored and read back, which made bf16 decode slower than fp32 decode although it
  // reads half the bytes.
  const bool kdirect = kInPlace<KVT> && c.k_st == 1 && c.page_size % PANEL == 0;
  const bool vdirect = kInPlace<KVT> && c.v_sd == 1;
  int max_rows = 0;
  for (const Item& it : items) max_rows = std::max(max_rows, it.nh * TILE_Q);
  const int nthreads = std::max(1, std::min<int>(c.num_threads, int(items.size())));
  const int nitems = int(items.size());
  // Uninitialised (no fill of a batch's worth of part states per layer): every part writes its whole slot.
  const std::unique_ptr<float[]> partial(partial_size ? new float[size_t(partial_size)] : nullptr);
  std::atomic<int> next(0);
  std::atomic<int> status(0);
  const size_t ncount = size_t(c.num_counts) * c.num_q_heads;

  auto body = [&](Counts& cnt) {
    try {
      Scratch& sc = thread_scratch();
      sc.reserve(max_rows, c.head_dim);
      cnt.skipped.assign(ncount, 0);
      for (int i = next.fetch_add(1); i < nitems; i = next.fetch_add(1)) {
        const Item& it = items[i];
        if constexpr (kInPlace<KVT>) {
          // A 16-bit cache is widened on every load: in place for decode-sized items (fewer rows
          // than a block: each K / V element is loaded once), through the buffers for larger ones,
          // whose row blocks would widen each element once per block, the extra ops taking FMA ports.
          const bool in_place = std::is_same<KVT, float>::value ||
                                it.nh * std::min<int64_t>(TILE_Q, info[2 * S + it.seq] - int64_t(it.qtile) * TILE_Q) < MR;
          const bool kd = kdirect && in_place, vd = vdirect && in_place;
          if (kd && vd) run_item<KVT, true, true>(c, info.data(), it, sc, cnt, test, partial.get());
          else if (kd) run_item<KVT, true, false>(c, info.data(), it, sc, cnt, test, partial.get());
          else if (vd) run_item<KVT, false, true>(c, info.data(), it, sc, cnt, test, partial.get());
          else run_item<KVT, false, false>(c, info.data(), it, sc, cnt, test, partial.get());
        } else {
          run_item<KVT, false, false>(c, info.data(), it, sc, cnt, test, partial.get());
        }
      }
    } catch (const std::bad_alloc&) {
      status.store(kOutOfMemory);
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
  if (status.load()) return status.load();  // kOutOfMemory
  if (partial_size) {  // the split items, each from its parts (part 0 carries the item)
    Scratch& sc = thread_scratch();
    sc.reserve(max_rows, c.head_dim);
    for (const Item& it : items)
      if (it.nparts > 1 && it.part == 0) merge_parts(c, info.data(), it, partial.get(), sc);
  }
  int64_t skipped = 0, visited = 0, v_tested = 0, v_skipped = 0;  // for counters: serving's one lambda
  for (const Counts& cnt : counts) {
    for (size_t i = 0; i < cnt.skipped.size(); ++i) {
      if (c.skipped) c.skipped[i] += cnt.skipped[i];
      if (i < size_t(c.num_q_heads)) skipped += cnt.skipped[i];
    }
    if (c.visited)
      for (int h = 0; h < c.num_q_heads; ++h) c.visited[h] += cnt.visited;
    visited += cnt.visited * c.num_q_heads;
    v_tested += cnt.v_tested;
    v_skipped += cnt.v_skipped;
  }
  add_counters(c, info, skipped, visited, v_tested, v_skipped);
  return kOk;
}


}  // namespace

extern "C" {

int sa_abi_version() { return kAbiVersion; }

const char* sa_isa() {
#if defined(SA_AMX)
  return "amx";
#elif defined(SA_BF16DP)
  return "avx512bf16";
#elif defined(SA_AVX512)
  return "avx512";
#elif defined(SA_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// 1 where this build computes with AMX tiles and the OS granted them (asked here, once), else 0.
int sa_tiles() {
#if defined(SA_AMX)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// kOk; kIsaMissing: this build's ISA is not available on the running CPU; kBadCall: ABI
// mismatch, unsupported dtype or head size, page size < 1; kOutOfMemory; kBadBlockId: a
// sequence uses a block id outside [0, num_blocks); kBadBlockTable: a sequence needs more
// blocks than the table has columns (or has a negative length).
int sa_forward(const SaCall* c) {
  if (!c || c->abi != kAbiVersion || c->head_dim % 8 || c->num_kv_heads <= 0 || c->split_tiles <= 0 ||
      c->num_q_heads % c->num_kv_heads || c->page_size < 1)
    return kBadCall;
#if defined(SA_AVX2)
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    return kIsaMissing;
#endif
#if defined(SA_AVX512)
  if (!__builtin_cpu_supports("avx512f")) return kIsaMissing;
#endif
#if defined(SA_BF16DP)
  // The tiles are used only where the OS grants them (amx_permitted), else the AVX512-BF16 code runs.
  if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512bf16")) return kIsaMissing;
#endif
  // An unquantised cache has the query's dtype; an fp8 one goes with any query dtype.
  if (c->dtype < 0 || c->dtype > 2 || (c->kv_dtype < 3 && c->kv_dtype != c->dtype) || c->kv_dtype > 4)
    return kBadCall;
  try {
    switch (c->kv_dtype) {
      case 0: return run<float>(*c);
      case 1: return run<bf16_t>(*c);
      case 2: return run<f16_t>(*c);
      case 3: return run<e4m3_t>(*c);
      default: return run<e5m2_t>(*c);
    }
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
}

// The contract with cpu_build.SaCall, _common and kernels.batch.COUNTER_SLOTS, checked by the loader:
// writes abi, sizeof(SaCall), the field count, TILE_Q, TILE_K, each field's offset (declaration
// order), then the counters' slots (skipped, visited, launches, dense launches, V tiles tested,
// V tiles unread) into out[0 .. cap) and returns how many values the full layout has.
int sa_layout(int64_t* out, int cap) {
  std::vector<int64_t> v{kAbiVersion, int64_t(sizeof(SaCall)), 0, TILE_Q, TILE_K};
#define SA_OFFSET(f) v.push_back(int64_t(offsetof(SaCall, f)));
  SA_CALL_FIELDS(SA_OFFSET)
#undef SA_OFFSET
  v[2] = int64_t(v.size()) - 5;
  for (int slot : {kSlotSkipped, kSlotVisited, kSlotLaunches, kSlotDenseLaunches, kSlotVTested, kSlotVSkipped})
    v.push_back(slot);
  for (int i = 0; i < cap && i < int(v.size()); ++i) out[i] = v[i];
  return int(v.size());
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

// The kernel's vector exp / tanh on n floats (n % 8 == 0), for the accuracy tests.
void sa_exp(const float* x, float* y, int64_t n) {  // the kernel's own exp pass (exp16 on AVX-512)
  std::copy(x, x + (n / 8) * 8, y);
  exp_sub_sum(y, int((n / 8) * 8), 0.0f);
}
void sa_tanh(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) store8(y + i, tanh8(load8(x + i)));
}

}  // extern "C"
