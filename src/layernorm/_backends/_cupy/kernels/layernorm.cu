// LayerNorm / RMSNorm CUDA kernels for the CuPy backend.
//
// Compiled with NVRTC by ../launch.py (compile_kernels: its own NVRTC call, then
// cupy.RawModule loads the binary), one template instantiation per name expression,
// with --fmad=false so that every rounding step is exactly the one written here (no FMA
// contraction that could differ between two kernels inlining the same expression), and
// --ftz=false: subnormals are IEEE, as on the CPU backend. (RawModule compiling from
// source would append -ftz=true, and a row whose squared deviations are subnormal
// would get var = 0, rstd = inf with eps = 0.) The LNK_* constants come from launch.py.
//
// Every array is seen as a 3-D (outer, n, inner) view with element strides
// (s0, s1, s2); row r is x[r / inner, :, r % inner]. All index math is 64-bit.
//
// The arithmetic of one row is a function of (n, T) alone
// -----------------------------------------------------------------------
// The host picks a configuration (G, MAXC) from n and sizeof(T) only. The row is cut
// into tiles of TILE = G * MAXC * VEC elements (VEC = 16 / sizeof(T), one 16-byte
// vector). Virtual lane l (0 <= l < G) owns, in tile t, the vectors c * G + l for
// c < MAXC, i.e. elements t * TILE + (c * G + l) * VEC + k, k < VEC. Each lane
// accumulates its elements in the order (t, c, k), each tile's float partial closed
// into a double running state (see Running: long rows do not drift); the G lane states
// are then merged in a complete binary tree that pairs neighbours ((0,1), (2,3), ...,
// then (01, 23), ...). The row kernels run one virtual lane per thread and do the tree
// with warp shuffles (and shared memory across warps); the strided "cols" kernels (used when
// the normalized axis is not contiguous, e.g. channels-first) run several virtual
// lanes per thread and do the same tree with a register stack. Vector (16-byte) or
// scalar loads change how values are fetched, never which lane owns them. So a row
// gives the same bits alone, inside any batch, at any position, under any layout and
// any grid size.
//
// LayerNorm statistics: values are shifted by K = x[row, 0]. Per lane and tile the
// shifted two-pass mean and M2 of the lane's (at most MAXC * VEC) values are computed
// and merged into the lane's running state with Chan's formula; lanes merge the same
// way. The output is y = ((x - K) - mean_shift) * rstd * w + b, so a constant row gives
// exactly 0 (exactly b) and a large common offset costs no accuracy.
//
// Fused residual add (add_fwd_rows)
// ---------------------------------
// A pre-norm transformer block's h = x + r, y = norm(h) in one kernel: each element of h
// is the IEEE sum of x and r widened to the accumulation type, rounded once to h's type
// (which may differ from x's within one accumulation type, e.g. a float32 stream under
// bfloat16 activations), and the row kernel then runs fwd_rows' own device code
// (forward_rows) on those values, with the configuration of h's type: y (x's type) is
// bit for bit fwd_rows of the stored h, rounded to x's type. h and y may be x or r
// themselves (in place); see forward_rows for the order of loads and stores.
//
// Quantized output (quant_fwd_rows, quant_add_fwd_rows) and grad_residual
// ------------------------------------------------------------------------
// The same row code writes y as 8-bit codes with a per-row scale (see "quantized
// output" below), and the backward kernels add the gradient of the residual stream to
// grad_x before its rounding: neither is a separate pass over memory.

// Constants shared with the host come from launch.py as -D defines (one definition, in
// Python): a copy here could drift from the grid and buffer sizes the host computes.
#if !defined(LNK_GRAD_ROW_BLOCK) || !defined(LNK_COL_ROWS) || !defined(LNK_COL_MAX_RY) || \
    !defined(LNK_SUM_FAN) || !defined(LNK_MAX_G) || !defined(LNK_THREADS_PER_SM) || \
    !defined(LNK_BWD_THREADS_PER_SM)
#error "compile through layernorm._backends._cupy.launch, which defines the LNK_* constants"
#endif

#include <cuda_fp16.h>
#include <cuda_bf16.h>


namespace lnk {

typedef long long i64;
typedef unsigned long long u64;

constexpr unsigned FULL_MASK = 0xffffffffu;

// ----------------------------------------------------------------- element types

__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

// can_overflow: whether a finite row of T can leave its accumulation dtype's range in its
// sums of squares (float16's largest value squared, 4.3e9, cannot reach float32's 3.4e38
// in any row that fits in memory, and its smallest, 2^-24, has a normal square), i.e.
// whether the forward kernels need the rescaled slow path.
template <typename T> struct Elem;
template <> struct Elem<__half> {
  static constexpr bool can_overflow = false;
  static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr bool can_overflow = true;
  static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Elem<float> {
  static constexpr bool can_overflow = true;
  static __device__ __forceinline__ float from(float v) { return v; }
};
template <> struct Elem<double> {
  static constexpr bool can_overflow = true;
  static __device__ __forceinline__ double from(double v) { return v; }
};

template <typename T> struct VecWidth {
  static constexpr int value = 16 / sizeof(T);
};

// V elements of T: one 16-byte vector by default. The fused kernels load x and r in
// packs of h's vector width (V = VecWidth<H>), so a pack of x or r is 8 or 32 bytes when
// its element size differs from h's.
template <typename T, int V = VecWidth<T>::value>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) Pack {
  T v[V];
};

// --------------------------------------------------------------- addressing

// a / d for 0 <= a < 2^52 and d >= 1, given inv = 1.0 / d from the host. The double
// estimate is off by at most one, which one comparison fixes. (A 64-bit integer
// division is a subroutine call on the GPU, whose register saves show up as spills.)
__device__ __forceinline__ i64 div_fast(i64 a, i64 d, double inv) {
  i64 q = (i64)((double)a * inv);
  const i64 r = a - q * d;
  if (r < 0) {
    q -= 1;
  } else if (r >= d) {
    q += 1;
  }
  return q;
}

// Offset (in elements) of the first element of row r; inv_inner = 1.0 / inner.
__device__ __forceinline__ i64 row_offset(i64 r, i64 inner, double inv_inner, i64 s0,
                                          i64 s2) {
  if (inner == 1) return r * s0;
  const i64 o = div_fast(r, inner, inv_inner);
  return o * s0 + (r - o * inner) * s2;
}

// Elements off .. off + V - 1 after `base` (element stride s1), of which only the
// first `rem - off` exist; one vector access (16 bytes, or the pack's size) when allowed
// and fully inside the row.
template <typename T, int V>
__device__ __forceinline__ void load_pack(const T* base, i64 s1, int off, i64 rem, bool vec,
                                          Pack<T, V>& p) {
  if (vec && off + V <= rem) {
    p = *reinterpret_cast<const Pack<T, V>*>(base + off);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      p.v[k] = (off + k < rem) ? base[(i64)(off + k) * s1] : Elem<T>::from(0);
    }
  }
}

// Hides a pack's value from the optimizer (an empty asm that "changes" its registers):
// values derived from it before this point cannot be reused after it, so they are
// recomputed from the pack (a conversion and a subtraction) instead of being kept in
// registers across the row reduction. Keeping them raised the 16-bit kernels to 109-122
// registers; the arithmetic, and so the bits, are unchanged.
template <typename T>
__device__ __forceinline__ void opaque(Pack<T>& p) {
#ifdef __CUDA_ARCH__
  static_assert(sizeof(Pack<T>) == 16, "a pack is one 16-byte vector");
  unsigned* words = reinterpret_cast<unsigned*>(&p);
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(words[i]));
#endif
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* base, i64 s1, int off, i64 rem, bool vec,
                                           const Pack<T, V>& p) {
  if (vec && off + V <= rem) {
    *reinterpret_cast<Pack<T, V>*>(base + off) = p;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (off + k < rem) base[(i64)(off + k) * s1] = p.v[k];
    }
  }
}

// 1 / sqrt(v) for v >= 0. Float: division and square root as compiled (inline with
// --prec-div=false --prec-sqrt=false, within 2 ulp, like the rsqrt torch uses). Double:
// the library's rsqrt and 1 / sqrt both call a slow-path subroutine whose register saves
// spill on sm_80, so it is computed inline: v = m * 4^k with m in [1, 4), a float
// estimate of 1 / sqrt(m) refined by three Newton steps in double (error ~1 ulp), then
// scaled by 2^-k exactly.
__device__ __forceinline__ float inv_sqrt(float v) { return 1.0f / sqrtf(v); }
__device__ __forceinline__ double inv_sqrt(double v) {
  if (v != v) return v;                                         // NaN
  if (v == 0.0) return __longlong_as_double(0x7ff0000000000000LL);  // +inf
  if (v > 1.7976931348623157e308) return 0.0;                   // +inf
  long long bits = __double_as_longlong(v);
  int e = (int)((bits >> 52) & 0x7ff);
  int extra = 0;
  if (e == 0) {  // subnormal: scale by 2^64 first
    v = v * 18446744073709551616.0;
    bits = __double_as_longlong(v);
    e = (int)((bits >> 52) & 0x7ff);
    extra = 32;
  }
  const int k = (e - 1023) >> 1;  // floor((e - 1023) / 2)
  const double m = __longlong_as_double((bits & 0x800fffffffffffffLL) |
                                        ((long long)(e - 2 * k) << 52));
  double y = (double)rsqrtf((float)m);
  const double half_m = 0.5 * m;
  y = y * (1.5 - half_m * y * y);
  y = y * (1.5 - half_m * y * y);
  y = y * (1.5 - half_m * y * y);
  return y * __longlong_as_double((long long)(1023 - k + extra) << 52);
}

// Whether a row's rstd from the fast arithmetic is the row's: positive, finite and at
// most 2^59 (double: 2^500). A larger one means var + eps below 2^-118 (2^-1000), where
// the squares of the deviations are subnormal or vanish (only an eps that small lets a
// row get there), off by up to 2^-149 (2^-1074) each: such a row is rescaled (below).
__device__ __forceinline__ bool usable_rstd(float r) {
  return r > 0.0f && r <= 576460752303423488.0f;  // 2^59
}
__device__ __forceinline__ bool usable_rstd(double r) { return r > 0.0 && r <= 0x1p500; }

template <typename A>
__device__ __forceinline__ A param_or(const A* p, i64 i, A dflt) {
  return p == nullptr ? dflt : __ldg(p + i);
}

// ------------------------------------------------------------- reduction states

// num / den for a count den >= 1, with no subroutine call (whose register saves spill):
// float division is compiled with --prec-div=false (inline, within 2 ulp); in double,
// a float estimate of 1 / den refined by three Newton steps (within 1 ulp). Only the
// Chan merge weights and chunk means use it, so results stay deterministic and the same
// in every kernel.
__device__ __forceinline__ float ratio(float num, u64 den) { return num / (float)den; }
__device__ __forceinline__ double ratio(double num, u64 den) {
  const double d = (double)den;
  double r = (double)(1.0f / (float)den);
  r = r * (2.0 - d * r);
  r = r * (2.0 - d * r);
  r = r * (2.0 - d * r);
  return num * r;
}

template <typename A> struct Mom {
  A mean;
  A m2;
  u64 n;
};

// Chan et al.'s pairwise merge; an empty side returns the other side unchanged.
template <typename A>
__device__ __forceinline__ Mom<A> chan(const Mom<A>& a, const Mom<A>& b) {
  if (b.n == 0) return a;
  if (a.n == 0) return b;
  Mom<A> r;
  r.n = a.n + b.n;
  const A fb = ratio(A(b.n), r.n);
  const A delta = b.mean - a.mean;
  r.mean = a.mean + delta * fb;
  r.m2 = (a.m2 + b.m2) + (delta * delta) * (A(a.n) * fb);
  return r;
}

template <typename A> struct MomOp {
  typedef Mom<A> S;
  static __device__ __forceinline__ S identity() {
    S s;
    s.mean = A(0);
    s.m2 = A(0);
    s.n = 0;
    return s;
  }
  static __device__ __forceinline__ S merge(const S& a, const S& b) { return chan(a, b); }
  static __device__ __forceinline__ S shfl_xor(const S& s, int off) {
    S o;
    o.mean = __shfl_xor_sync(FULL_MASK, s.mean, off);
    o.m2 = __shfl_xor_sync(FULL_MASK, s.m2, off);
    o.n = __shfl_xor_sync(FULL_MASK, s.n, off);
    return o;
  }
};

template <typename A> struct SumOp {
  typedef A S;
  static __device__ __forceinline__ S identity() { return A(0); }
  static __device__ __forceinline__ S merge(const S& a, const S& b) { return a + b; }
  static __device__ __forceinline__ S shfl_xor(const S& s, int off) {
    return __shfl_xor_sync(FULL_MASK, s, off);
  }
};

template <bool C, typename X, typename Y> struct Select {
  typedef X type;
};
template <typename X, typename Y> struct Select<false, X, Y> {
  typedef Y type;
};

template <typename A> struct Two {
  A a;
  A b;
};

template <typename A> struct Sum2Op {
  typedef Two<A> S;
  static __device__ __forceinline__ S identity() {
    S s;
    s.a = A(0);
    s.b = A(0);
    return s;
  }
  static __device__ __forceinline__ S merge(const S& x, const S& y) {
    S s;
    s.a = x.a + y.a;
    s.b = x.b + y.b;
    return s;
  }
  static __device__ __forceinline__ S shfl_xor(const S& s, int off) {
    S o;
    o.a = __shfl_xor_sync(FULL_MASK, s.a, off);
    o.b = __shfl_xor_sync(FULL_MASK, s.b, off);
    return o;
  }
};

// Tree over the G lanes of a group (G <= 32: aligned lanes of one warp; G > 32: the
// whole block, G == blockDim.x). Ascending offsets pair neighbours first; the lower
// lane's state is always the left operand, so both partners compute the same value
// and every lane ends with the row's result.
template <typename Op, int G>
__device__ __forceinline__ typename Op::S group_reduce(typename Op::S s) {
  typedef typename Op::S S;
  const int lane = threadIdx.x & 31;
  constexpr int WG = G < 32 ? G : 32;
#pragma unroll
  for (int off = 1; off < WG; off <<= 1) {
    const S o = Op::shfl_xor(s, off);
    s = (lane & off) ? Op::merge(o, s) : Op::merge(s, o);
  }
  if constexpr (G > 32) {
    constexpr int W = G / 32;
    __shared__ S partial[W];
    if (lane == 0) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    s = partial[lane & (W - 1)];  // every aligned group of W lanes builds the same tree
#pragma unroll
    for (int off = 1; off < W; off <<= 1) {
      const S o = Op::shfl_xor(s, off);
      s = (lane & off) ? Op::merge(o, s) : Op::merge(s, o);
    }
    __syncthreads();  // partial[] is reused by the next row
  }
  return s;
}

// Whether p holds in any thread of the group, and a barrier over the group, in code that
// every thread of the warp (G <= 32) or of the block (G > 32: the block is one group, and
// p is the same in all its threads) reaches. The barrier orders the group's global memory
// accesses: writes before it are seen by reads after it.
template <int G>
__device__ __forceinline__ bool group_any(bool p) {
  if constexpr (G > 32) {
    return p;
  } else {
    return __any_sync(FULL_MASK, p) != 0;
  }
}

template <int G>
__device__ __forceinline__ void group_sync() {
  if constexpr (G > 32) {
    __syncthreads();
  } else {
    __syncwarp(FULL_MASK);
  }
}

// The same neighbour-pairing tree over `count` states produced one after another
// (state(l) for l = 0 .. count - 1; count a power of two <= 2^MAX_LOG), with a stack of
// register slots: slot lvl holds the finished subtree of 2^lvl states waiting for its
// right neighbour.
constexpr int MAX_LOG = 6;

// The largest tree a cols kernel builds has G / RY lanes (G up to LNK_MAX_G, RY up to
// LNK_COL_MAX_RY threads per row) or blockDim.y <= LNK_COL_MAX_RY states; a larger
// configuration (1024 threads) would write past the stack, so it must not compile.
static_assert(LNK_MAX_G / LNK_COL_MAX_RY <= (1 << MAX_LOG), "cols lane tree exceeds MAX_LOG");
static_assert(LNK_COL_MAX_RY <= (1 << MAX_LOG), "cols thread tree exceeds MAX_LOG");
static_assert(LNK_COL_ROWS == 32, "cols kernels map threadIdx.x to 32 rows (one warp)");

template <typename Op, typename F>
__device__ __forceinline__ typename Op::S sequential_tree(int count, F state) {
  typedef typename Op::S S;
  S stack[MAX_LOG];
  S result = Op::identity();
#pragma unroll 1
  for (int l = 0; l < count; ++l) {
    S s = state(l);
    bool placed = false;
#pragma unroll
    for (int lvl = 0; lvl < MAX_LOG; ++lvl) {
      if (!placed) {
        if ((l >> lvl) & 1) {
          s = Op::merge(stack[lvl], s);
        } else {
          stack[lvl] = s;
          placed = true;
        }
      }
    }
    if (l == count - 1) result = s;
  }
  return result;
}

// --------------------------------------------------------- per-lane accumulation

// Shifted two-pass moments of the CNT values get(k, v) (get returns false for the
// positions past the end of the row, which are skipped). between() runs between the two
// passes: the row kernels hide their packs there (opaque), so the second pass converts
// the values again instead of holding all CNT of them in registers.
template <typename A, typename F, typename B>
__device__ __forceinline__ Mom<A> chunk_moments(int CNT, F get, B between) {
  A s = A(0);
  u64 cnt = 0;
#pragma unroll
  for (int k = 0; k < CNT; ++k) {
    A v;
    if (get(k, v)) {
      s = s + v;
      cnt += 1;
    }
  }
  Mom<A> m;
  m.n = cnt;
  m.mean = A(0);
  m.m2 = A(0);
  if (cnt == 0) return m;
  m.mean = ratio(s, cnt);
  between();
  A q = A(0);
#pragma unroll
  for (int k = 0; k < CNT; ++k) {
    A v;
    if (get(k, v)) {
      const A c = v - m.mean;
      q = q + c * c;
    }
  }
  m.m2 = q;
  return m;
}

// A lane's running sums over the tiles of a long row. With float accumulation, a running
// float sum of thousands of like terms (a row of 2^20 elements gives each of 512 lanes
// 2048 of them) gathers a rounding error proportional to their count when every addition
// rounds the same way (RMSNorm of a constant row of 2^22 elements was off by 1.4e-5): so
// each tile's terms are summed in float from zero (a few dozen at most) and that partial
// is closed into a double total, one double addition per tile and lane, in the fixed
// tile order (the bits still depend on the row alone). The total is narrowed back to A
// once, before the lanes' tree. A row of one tile gets exactly the bits of a plain float
// sum (0.0 + p and the narrowing are exact). Double accumulation keeps its one running
// sum (open() continues the total), as before, and so does CLOSE = false: the row
// kernels of the smaller configurations, whose rows always fit one tile (row_config),
// where closing would change no bit and only cost registers.
template <typename A, bool CLOSE = true> struct Running {
  A total;
  __device__ __forceinline__ Running() : total(A(0)) {}
  __device__ __forceinline__ A open() const { return total; }
  __device__ __forceinline__ void close(A part) { total = part; }
  __device__ __forceinline__ A value() const { return total; }
};
template <> struct Running<float, true> {
  double total;
  __device__ __forceinline__ Running() : total(0.0) {}
  __device__ __forceinline__ float open() const { return 0.0f; }
  __device__ __forceinline__ void close(float part) { total = total + (double)part; }
  __device__ __forceinline__ float value() const { return (float)total; }
};

// The same for LayerNorm's moments: each tile's chunk moments (float, from zero) are
// merged with Chan's formula into a double running state, narrowed once at the end. (The
// running mean and M2 kept in float drifted the same way: every tile's merge rounds.) For
// double accumulation (or CLOSE = false) this is the running merge in A, as before; one
// tile gives the chunk's bits either way.
template <typename A, bool CLOSE = true> struct RunningMoments {
  typedef typename Select<CLOSE, double, A>::type W;
  Mom<W> total;
  __device__ __forceinline__ RunningMoments() { total = MomOp<W>::identity(); }
  // chan(total, part); for a double state from float parts, with a float weight part.n / n
  // (within 2 ulp): it spares the double division's registers, and its error scales each
  // merge's own terms, not growing with the number of tiles.
  __device__ __forceinline__ void close(const Mom<A>& part) {
    if constexpr (sizeof(W) == sizeof(A)) {
      total = chan(total, part);
    } else if (part.n != 0) {
      if (total.n == 0) {
        total.mean = (W)part.mean;
        total.m2 = (W)part.m2;
        total.n = part.n;
      } else {
        const u64 n = total.n + part.n;
        const W fb = (W)ratio(A(part.n), n);
        const W delta = (W)part.mean - total.mean;
        total.mean = total.mean + delta * fb;
        total.m2 = (total.m2 + (W)part.m2) + (delta * delta) * (W(total.n) * fb);
        total.n = n;
      }
    }
  }
  __device__ __forceinline__ Mom<A> value() const {
    Mom<A> m;
    m.mean = (A)total.mean;
    m.m2 = (A)total.m2;
    m.n = total.n;
    return m;
  }
};

// The lane state of a forward kernel: RMSNorm's sum of squares or LayerNorm's moments.
template <typename A, bool RMS, bool CLOSE = true> struct LaneState {
  typedef typename Select<RMS, Running<A, CLOSE>, RunningMoments<A, CLOSE>>::type type;
};

// ====================================================================== quantized output
//
// quant_fwd_rows and quant_add_fwd_rows write y as 8-bit codes (the contract's
// "Quantized output"), float32 accumulation only. y32, the output in the accumulation
// precision before any rounding, is what fwd_rows<float> computes for the row widened to
// float32 (h widened, with a residual): the kernels run forward_rows with float packs
// (TP = float) and float's configuration, whatever the element type, so the codes are bit
// for bit the quantization of the unfused forward of the widened input, as composed.
// Per row:
//  * dynamic scale (inv_rows null): amax = the largest |y32| of the row, found as the
//    largest bit pattern with the sign cleared (for non-negative floats the integer order
//    is the float order, and NaN patterns lie above infinity's: a NaN makes amax NaN, as
//    max does); scale = amax / qmax (1 for an all-zero row) and inv = 1 / scale, both
//    IEEE divisions (__fdiv_rn, whatever --prec-div says), stored to scale_out[row];
//  * static scale: inv = inv_rows[row] (1 / scale, from the host);
//  * each code is code8(y32 * inv): int8: NaN -> 0, saturate to [-128, 127], round half to
//    even by adding and subtracting 1.5 * 2^23 (exact with --fmad=false); float8:
//    saturate to +-qmax (NaN kept), then round the float32 bits half to even to the
//    format (subnormals in units of the smallest one), NaN -> 0x7f (e4m3fn) / 0x7e (e5m2)
//    with its sign. Integer operations and IEEE steps only: the same codes as the CPU
//    backend's (_numba/_simd.py) for the same y32.
// fmt is 0 (int8), 1 (float8_e4m3fn) or 2 (float8_e5m2), a run-time argument (one kernel
// for the three formats).

constexpr int FMT_INT8 = 0;
constexpr int FMT_E4M3 = 1;

template <typename A> struct QuantOut {
  unsigned char* q;      // codes; row r at q + r * qs0 (unit stride), null: not quantized
  const A* inv_rows;     // static: 1 / scale per row; null: dynamic
  A* scale_out;          // dynamic: the row's scale
  i64 qs0;
  int fmt;
};

__device__ __forceinline__ unsigned f32_bits(float v) { return __float_as_uint(v); }

// The running amax as bits: max of the sign-cleared patterns.
__device__ __forceinline__ unsigned absmax_bits(unsigned top, float v) {
  const unsigned m = f32_bits(v) & 0x7fffffffu;
  return m > top ? m : top;
}

__device__ __forceinline__ float quant_qmax(int fmt) {
  return fmt == FMT_INT8 ? 127.0f : (fmt == FMT_E4M3 ? 448.0f : 57344.0f);
}

// 1 / scale of a dynamic row from its amax bits (scale stored by the caller).
__device__ __forceinline__ float quant_scale(unsigned top, int fmt) {
  const float amax = __uint_as_float(top);
  return amax == 0.0f ? 1.0f : __fdiv_rn(amax, quant_qmax(fmt));
}

__device__ __forceinline__ float round_half_even(float v) {
  const float R = 12582912.0f;  // 1.5 * 2^23: exact for |v| < 2^22
  return (v + R) - R;
}

__device__ __forceinline__ unsigned char code8(float v, int fmt) {
  if (fmt == FMT_INT8) {
    v = v != v ? 0.0f : v;
    v = v < -128.0f ? -128.0f : v;
    v = v > 127.0f ? 127.0f : v;
    return (unsigned char)(signed char)(int)round_half_even(v);
  }
  const bool e4 = fmt == FMT_E4M3;
  const float qmax = e4 ? 448.0f : 57344.0f;
  v = v < -qmax ? -qmax : v;  // comparisons are false for NaN: it passes
  v = v > qmax ? qmax : v;
  const unsigned bits = f32_bits(v);
  const unsigned sign = (bits >> 24) & 0x80u;
  const unsigned mag = bits & 0x7fffffffu;
  const int drop = e4 ? 20 : 21;  // float32 mantissa bits dropped
  const unsigned odd = (mag >> drop) & 1u;
  const unsigned up = mag + ((1u << (drop - 1)) - 1u) + odd;
  const unsigned normal = (up >> drop) - (e4 ? (120u << 3) : (112u << 2));
  float small = __uint_as_float(mag) * (e4 ? 512.0f : 65536.0f);  // exact
  small = small < 16.0f ? small : 16.0f;
  const unsigned sub = (unsigned)(int)round_half_even(small);
  unsigned code = mag < (e4 ? 0x3C800000u : 0x38800000u) ? sub : normal;
  code = mag > 0x7f800000u ? (e4 ? 0x7fu : 0x7eu) : code;
  return (unsigned char)(sign | code);
}

// Max of unsigned bit patterns over a group (exact: any tree gives the same value).
struct MaxBitsOp {
  typedef unsigned S;
  static __device__ __forceinline__ S identity() { return 0u; }
  static __device__ __forceinline__ S merge(const S& a, const S& b) { return a > b ? a : b; }
  static __device__ __forceinline__ S shfl_xor(const S& s, int off) {
    return __shfl_xor_sync(FULL_MASK, s, off);
  }
};

// ====================================== forward, rows whose squares overflow or underflow
//
// A finite row with a spread near 1e19 (float32 accumulation; float64: 1e154) has a sum
// of squares beyond the largest float: the kernels' arithmetic ends with rstd = 0 (or
// NaN, when a partial sum or a Chan delta overflows first). With eps = 0 (or as small),
// a row with a spread below about 1e-19 (float64: 1e-154) has squares that are subnormal
// or vanish: rstd ends huge or infinite. Normalization is scale invariant, so such a row
// is normalized as if scaled by a power of two first, as on the CPU backend
// (_numba/rescale.py). The forward kernels check each row's rstd (usable_rstd: one
// comparison; rows that pass keep their bits) and every thread of a failing row
// calls rescaled_row, which is a scalar loop over the whole row (a rare path: each of
// the row's threads computes the same statistics, in the same order, so no collective
// is needed and the result depends on the row alone) and
//  * returns false, writing nothing, if the row holds a NaN or an infinity: the fast
//    path's result stands (LayerNorm NaN, RMSNorm x * 0);
//  * else scales the row by s = 2^-e with max|x| * s (LayerNorm: max|x - x[0]| * s) in
//    [0.5, 1) (exact: only exponents change; eps becomes eps * s^2, and a scaling up is
//    capped so that this stays below 2^1000; a row of zeros, or for LayerNorm a
//    constant one, is not scaled), computes two-pass statistics of the scaled
//    row in double (LayerNorm: of the differences from the row's first element, so a
//    constant row has exactly zero deviations, as on the fast path), writes the elements
//    i = part, part + parts, ... of y through the same affine step and rounding as the
//    fast path, lets part 0 store the unscaled row's statistics (mean / s, rstd * s),
//    and returns true.
// y may have another element type than the row (TY: the fused kernels normalize h and
// store y in x's type), rounded once from A as on the fast path.
// __noinline__ keeps its registers out of the fast path's budget.

// 2^k for -1074 <= k <= 1023 (a subnormal below -1022), exactly.
__device__ __forceinline__ double pow2(int k) {
  return k >= -1022 ? __longlong_as_double((long long)(k + 1023) << 52)
                    : __longlong_as_double(1LL << (k + 1074));
}

// Quantized (QUANT, float accumulation): every thread of the row computes the row's y32
// amax itself (dynamic scale: another scalar pass, no collective) and its elements'
// codes (qz; yr unused).
template <typename T, typename A, bool RMS, typename TY, bool QUANT = false>
__device__ __noinline__ bool rescaled_row(const T* xr, i64 xs1, TY* yr, i64 ys1, i64 n, A eps,
                                          const A* w, const A* b, A* mean_out, A* rstd_out,
                                          i64 row, int part, int parts,
                                          QuantOut<A> qz = QuantOut<A>()) {
  // The largest |x| (LayerNorm: |x - x[0]|): in full where that is finite (a difference
  // of subnormals is exact, their halves are not), else measured on halves.
  const double first_full = RMS ? 0.0 : (double)to_acc(xr[0]);
  const double half_first = first_full * 0.5;
  double half_max = 0.0, full_max = 0.0;
  for (i64 i = 0; i < n; ++i) {
    const double v = (double)to_acc(xr[i * xs1]);
    if (!(fabs(v) <= 1.7976931348623157e308)) return false;  // NaN or infinity
    const double a = fabs(v * 0.5 - half_first);
    half_max = a > half_max ? a : half_max;
    const double f = fabs(v - first_full);  // infinity if the difference overflows
    full_max = f > full_max ? f : full_max;
  }
  // s = 2^-e. Nothing to scale (zeros; LayerNorm: a constant row, whose rstd is
  // 1 / sqrt(eps)): unscaled, since a scaling down could only make eps underflow.
  int e = 0;
  if (full_max > 1.7976931348623157e308) {
    frexp(half_max, &e);  // half_max = m * 2^e, m in [0.5, 1): the largest is m * 2^(e + 1)
    e += 1;               // 1025
  } else if (full_max > 0.0) {
    frexp(full_max, &e);  // -1073..1024
  }
  if (e < 0) {  // a tiny row, scaled up: eps * s^2 must stay finite
    int most = 1000;
    if ((double)eps > 0.0) {
      int eps_exponent;
      frexp((double)eps, &eps_exponent);
      const int by_eps = (1000 - eps_exponent) / 2;  // eps * 2^(2 by_eps) < 2^1000
      most = by_eps < most ? by_eps : most;
    }
    e = -e > most ? -most : e;
  }
  const double s = pow2(-e);
  const double first = RMS ? 0.0 : (double)to_acc(xr[0]) * s;
  double mean = 0.0;  // LayerNorm: of the differences from the first element
  if constexpr (!RMS) {
    double total = 0.0;
    for (i64 i = 0; i < n; ++i) total = total + ((double)to_acc(xr[i * xs1]) * s - first);
    mean = ratio(total, (u64)n);
  }
  double m2 = 0.0;
  for (i64 i = 0; i < n; ++i) {
    const double d = ((double)to_acc(xr[i * xs1]) * s - first) - mean;
    m2 = m2 + d * d;
  }
  const double rstd = inv_sqrt(ratio(m2, (u64)n) + (double)eps * s * s);
  auto value = [&](i64 i) -> A {
    const double d = ((double)to_acc(xr[i * xs1]) * s - first) - mean;
    A v = A(d * rstd);
    v = v * param_or(w, i, A(1));
    if constexpr (!RMS) v = v + param_or(b, i, A(0));
    return v;
  };
  if constexpr (QUANT) {
    static_assert(sizeof(A) == 4, "quantized output: float accumulation only");
    A inv;
    if (qz.inv_rows == nullptr) {
      unsigned top = 0u;
      for (i64 i = 0; i < n; ++i) top = absmax_bits(top, value(i));
      const A scale = quant_scale(top, qz.fmt);
      if (part == 0) qz.scale_out[row] = scale;
      inv = __fdiv_rn(1.0f, scale);
    } else {
      inv = qz.inv_rows[row];
    }
    unsigned char* qr = qz.q + row * qz.qs0;
    for (i64 i = part; i < n; i += parts) qr[i] = code8(value(i) * inv, qz.fmt);
  } else {
    for (i64 i = part; i < n; i += parts) yr[i * ys1] = Elem<TY>::from(value(i));
  }
  if (part == 0) {
    // mean / s as two power-of-two steps (2^e alone overflows at e >= 1024), exact
    // unless the result is subnormal, like one division.
    if constexpr (!RMS) mean_out[row] = A((first + mean) * pow2(e / 2) * pow2(e - e / 2));
    rstd_out[row] = A(rstd * s);
  }
  return true;
}

// ================================================================== forward, rows
//
// Occupancy: a row kernel of B threads asks ptxas for LNK_THREADS_PER_SM / B resident
// blocks per SM, i.e. at most 65536 / LNK_THREADS_PER_SM registers per thread. Without
// it the 16-bit LayerNorm kernels took 109-122 registers, one 512-thread block per SM
// (25% occupancy), too few loads in flight to cover DRAM latency.
// The backward holds twice the data (dy and x) and asks for LNK_BWD_THREADS_PER_SM
// (one vector per thread fits the forward's budget), except with four vectors per thread
// of 16- or 64-bit data, which spill (150-270 bytes) below about 110 registers: those
// keep one 512-thread block (or four of 128) per SM.
template <int G, int PER_SM> struct RowLaunch {
  static constexpr int threads = G > 32 ? G : 128;
  static constexpr int min_blocks = PER_SM / threads > 0 ? PER_SM / threads : 1;
};
// A warp per row with four vectors of 16- or 64-bit data spills a little (30-60 bytes)
// at 64 registers on sm_90: 768 threads (80 registers) there. (sm_80's ptxas leaves
// 16-60 bytes of spill in some forward kernels at either budget, within SPILL_LIMIT of
// the compile tests.)
template <typename T, int G, int MAXC> struct FwdPerSm {
  static constexpr int value =
      sizeof(T) != 4 && G <= 32 && MAXC > 2 ? 768 : LNK_THREADS_PER_SM;
};
template <typename T, int MAXC> struct BwdPerSm {
  static constexpr int value = MAXC == 1                    ? LNK_THREADS_PER_SM
                               : sizeof(T) != 4 && MAXC > 2 ? 512
                                                            : LNK_BWD_THREADS_PER_SM;
};
static_assert(LNK_MAX_G <= 1024, "a row group is at most one block");
//
// inv_n = A(1) / A(n) comes from the host (an IEEE division), which keeps a division
// slow-path call, and its register saves, out of the kernels.

// One group of G threads per row (G <= 32: 128 / G rows per block; G > 32: one row
// per block of G threads). The row stays in registers when it fits in one tile.
//
// The body is shared by fwd_rows (the row normalized is x: TX = TR = TH, ADD false) and
// add_fwd_rows (ADD: the row normalized is h = x + r, each element the IEEE sum of the
// widened x and r rounded once to TH as it is loaded, and h is stored beside y). Both
// then run the same instructions on the packs of the row: y is bit for bit fwd_rows<TH>
// of the stored h (the lanes own vectors of h's width, VecWidth<TH>), rounded to TX.
// add_fwd_rows takes rows of unit stride (inner == 1, s1 == 1), and h and y may each be
// x or r themselves: a lane stores only elements it owns, after it has read them, and
// only in the output pass, which follows the row reduction; the one element another
// lane reads (element 0, for the shift K) is read before that lane's part of the
// reduction. The rescaled path, which reads the whole row, has its own order (below).
//
// TP is the type the packs hold and the configuration's: TH, except in the quantized
// kernels (QUANT: y32 goes to 8-bit codes through qz, y unused), where it is float, so
// that y32 is fwd_rows<float>'s of the widened row (h); a pack of x, r or h then has
// float's vector width. The dynamic scale needs the row's amax before any code: a pass
// over the row (reloading tiles past the first) and a group reduction, which every
// thread reaches (rows finished by the rescaled path included: no `continue` there).
template <typename TX, typename TR, typename TH, typename TP, typename A, int G, int MAXC,
          bool RMS, bool ADD, bool QUANT>
__device__ __forceinline__ void forward_rows(
    const TX* x, const TR* res, TH* h, TX* y, const A* w, const A* b, A eps, A inv_n,
    A* mean_out, A* rstd_out, i64 rows, i64 n, i64 inner, double inv_inner, i64 xs0,
    i64 xs1, i64 xs2, i64 rs0, i64 hs0, i64 ys0, i64 ys1, i64 ys2, int vec_ok,
    QuantOut<A> qz = QuantOut<A>()) {
  constexpr int V = VecWidth<TP>::value;
  constexpr i64 TILE = (i64)G * MAXC * V;
  constexpr int GPB = G > 32 ? 1 : 128 / G;  // groups (rows) per block
  const int lane = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x % G);
  const int group = G > 32 ? 0 : (int)(threadIdx.x / G);
  const bool vec = vec_ok != 0;
  const i64 tiles = (n + TILE - 1) / TILE;

  for (i64 base = (i64)blockIdx.x * GPB; base < rows; base += (i64)gridDim.x * GPB) {
    const i64 row = base + group;
    const bool active = row < rows;
    const TX* xr = x + (active ? row_offset(row, inner, inv_inner, xs0, xs2) : 0);
    TX* yr = QUANT ? nullptr : y + (active ? row_offset(row, inner, inv_inner, ys0, ys2) : 0);
    // The fused kernel's r and h rows, recomputed where used from the row and the kernel
    // parameters (which ptxas rematerializes instead of holding two more pointers in
    // registers across the row reduction).
    const i64 arow = active ? row : 0;
    auto rrow = [&]() -> const TR* { return res + arow * rs0; };
    auto hrow = [&]() -> TH* { return h + arow * hs0; };
    Pack<TP> p[MAXC];
    // The stored h of this lane's vectors of a tile (from row element `first` on) into p.
    auto load_h = [&](i64 first, i64 rem) {
#pragma unroll
      for (int c = 0; c < MAXC; ++c) {
        if constexpr (sizeof(TP) == sizeof(TH)) {
          load_pack(hrow() + first, (i64)1, c * G * V, rem, vec, p[c]);
        } else {
          Pack<TH, V> ph;
          load_pack(hrow() + first, (i64)1, c * G * V, rem, vec, ph);
#pragma unroll
          for (int k = 0; k < V; ++k) p[c].v[k] = to_acc(ph.v[k]);
        }
      }
    };
    // Pack c of p, in h's type, at row element `first` + c * G * V of h.
    auto store_h = [&](i64 first, i64 rem, int c) {
      if constexpr (sizeof(TP) == sizeof(TH)) {
        store_pack(hrow() + first, (i64)1, c * G * V, rem, vec, p[c]);
      } else {
        Pack<TH, V> ph;
#pragma unroll
        for (int k = 0; k < V; ++k) ph.v[k] = Elem<TH>::from(p[c].v[k]);  // exact
        store_pack(hrow() + first, (i64)1, c * G * V, rem, vec, ph);
      }
    };
    // This lane's vectors of a tile into p: x, or x + r.
    auto load = [&](i64 first, i64 rem) {
      const TX* xt = xr + first * xs1;
      if constexpr (ADD) {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          Pack<TX, V> px;
          Pack<TR, V> pr;
          load_pack(xt, xs1, c * G * V, rem, vec, px);
          load_pack(rrow() + first, (i64)1, c * G * V, rem, vec, pr);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const TH hv = Elem<TH>::from(to_acc(px.v[k]) + to_acc(pr.v[k]));
            if constexpr (sizeof(TP) == sizeof(TH)) {
              p[c].v[k] = hv;
            } else {
              p[c].v[k] = to_acc(hv);
            }
          }
        }
      } else if constexpr (sizeof(TP) == sizeof(TX)) {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) load_pack(xt, xs1, c * G * V, rem, vec, p[c]);
      } else {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          Pack<TX, V> px;
          load_pack(xt, xs1, c * G * V, rem, vec, px);
#pragma unroll
          for (int k = 0; k < V; ++k) p[c].v[k] = to_acc(px.v[k]);
        }
      }
    };
    // h[0] (the shift K): from x and r in the fused kernel, whose row h is not stored yet.
    auto first_value = [&]() -> A {
      if constexpr (ADD) {
        return to_acc(Elem<TH>::from(to_acc(xr[0]) + to_acc(rrow()[0])));
      } else {
        return to_acc(xr[0]);
      }
    };
    const A K = (RMS || !active) ? A(0) : first_value();

    typedef typename Select<RMS, SumOp<A>, MomOp<A>>::type Op;
    // The lane's running state over the tiles (see Running): only the largest
    // configuration's rows span several tiles.
    constexpr bool CLOSE = G == LNK_MAX_G;
    typename LaneState<A, RMS, CLOSE>::type run;
    // Lane-relative view of tile t: element off (0 <= off < TILE, off = c * G * V + k)
    // of this lane is row element t * TILE + lane * V + off; `rem` counts the row
    // elements from the lane's first one on.
    if (active) {
      for (i64 t = 0; t < tiles; ++t) {
        const i64 first = t * TILE + (i64)lane * V;
        const i64 rem = n - first;
        load(first, rem);
        if constexpr (RMS) {
          A tile_sq = run.open();
#pragma unroll
          for (int c = 0; c < MAXC; ++c) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              if (c * G * V + k < rem) {
                const A v = to_acc(p[c].v[k]);
                tile_sq = tile_sq + v * v;
              }
            }
          }
          run.close(tile_sq);
        } else {
          run.close(chunk_moments<A>(MAXC * V, [&](int idx, A& v) -> bool {
            const int c = idx / V;
            const int k = idx % V;
            v = to_acc(p[c].v[k]) - K;
            return c * G * V + k < rem;
          }, [&] {
#pragma unroll
            for (int c = 0; c < MAXC; ++c) opaque(p[c]);
          }));
        }
      }
    }
    typename Op::S st = group_reduce<Op, G>(run.value());

    A shift_mean;
    A rstd;
    if constexpr (RMS) {
      shift_mean = A(0);
      rstd = inv_sqrt(st * inv_n + eps);
    } else {
      shift_mean = st.mean;
      rstd = inv_sqrt(st.m2 * inv_n + eps);
    }
    bool reload = false;  // fwd_rows: the packs are loaded again in the output pass
    bool from_h = false;  // add_fwd_rows: the output pass reads the stored h, not x + r
    bool done = false;    // QUANT: the rescaled path finished the row
    if constexpr (Elem<TP>::can_overflow) {
      const bool rescale = active && !usable_rstd(rstd);  // squares overflow or underflow
      if constexpr (ADD) {
        // rescaled_row reads the whole row while other lanes store y, which may be x or r:
        // so h is stored first (each lane its own elements, read just before), the group
        // waits, and the row is read back from h (never y). If it declines, the output
        // pass reads h too: x or r may be h by then.
        if (group_any<G>(rescale)) {
          if (rescale) {
            for (i64 t = 0; t < tiles; ++t) {
              const i64 first = t * TILE + (i64)lane * V;
              const i64 rem = n - first;
              if (tiles > 1) load(first, rem);
#pragma unroll
              for (int c = 0; c < MAXC; ++c) {
                if (c * G * V < rem) store_h(first, rem, c);
              }
            }
          }
          group_sync<G>();
          if (rescale) {
            if (rescaled_row<TH, A, RMS, TX, QUANT>(hrow(), (i64)1, yr, ys1, n, eps, w, b,
                                                    mean_out, rstd_out, row, lane, G, qz)) {
              if constexpr (QUANT) {
                done = true;
              } else {
                continue;
              }
            } else {
              from_h = true;
              // Tile 0 reloaded here, whatever the number of tiles, rather than in the
              // output pass: then no pack is live across the call (whose saved registers
              // would spill).
              load_h((i64)lane * V, n - (i64)lane * V);
            }
          }
        }
      } else if (rescale) {
        if (rescaled_row<TX, A, RMS, TX, QUANT>(xr, xs1, yr, ys1, n, eps, w, b, mean_out,
                                                rstd_out, row, lane, G, qz)) {
          if constexpr (QUANT) {
            done = true;
          } else {
            continue;
          }
        } else {
          reload = true;  // the packs are not kept across the call: load them again
        }
      }
    }
    const bool live = active && !done;
    // This lane's packs of tile t (row element `first` on), for a pass after the
    // reduction: kept in registers (one tile), else loaded again.
    auto refetch = [&](i64 first, i64 rem) {
      if (ADD && from_h && tiles > 1) {
        load_h(first, rem);
      } else if (tiles > 1 || reload) {
        load(first, rem);
      } else {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) opaque(p[c]);
      }
    };
    // y32 of element k of pack c of a tile (e: its offset from the lane's first element).
    auto y32 = [&](int c, int k, int e, const A* wt, const A* bt) -> A {
      A v;
      if constexpr (RMS) {
        v = to_acc(p[c].v[k]) * rstd;
      } else {
        v = ((to_acc(p[c].v[k]) - K) - shift_mean) * rstd;
      }
      v = v * param_or(wt, e, A(1));
      if constexpr (!RMS) v = v + param_or(bt, e, A(0));
      return v;
    };
    A inv = A(0);
    if constexpr (QUANT) {
      if (qz.inv_rows == nullptr) {
        unsigned top = 0u;
        if (live) {
          for (i64 t = 0; t < tiles; ++t) {
            const i64 first = t * TILE + (i64)lane * V;
            const i64 rem = n - first;
            const A* wt = w == nullptr ? nullptr : w + first;
            const A* bt = b == nullptr ? nullptr : b + first;
            refetch(first, rem);
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
#pragma unroll
              for (int k = 0; k < V; ++k) {
                const int e = c * G * V + k;
                if (e < rem) top = absmax_bits(top, y32(c, k, e, wt, bt));
              }
            }
          }
        }
        top = group_reduce<MaxBitsOp, G>(top);
        const A scale = quant_scale(top, qz.fmt);
        if (live && lane == 0) qz.scale_out[row] = scale;
        inv = __fdiv_rn(1.0f, scale);
      } else if (live) {
        inv = qz.inv_rows[row];
      }
    }
    if (live) {
      if (lane == 0) {
        if constexpr (!RMS) mean_out[row] = K + shift_mean;
        rstd_out[row] = rstd;
      }
      for (i64 t = 0; t < tiles; ++t) {
        const i64 first = t * TILE + (i64)lane * V;
        const i64 rem = n - first;
        const A* wt = w == nullptr ? nullptr : w + first;
        const A* bt = b == nullptr ? nullptr : b + first;
        refetch(first, rem);
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          const int off = c * G * V;
          if (off < rem) {
            if constexpr (QUANT) {
              Pack<unsigned char, V> o;
#pragma unroll
              for (int k = 0; k < V; ++k) {
                const int e = off + k < rem ? off + k : off;  // stays inside w and b
                o.v[k] = code8(y32(c, k, e, wt, bt) * inv, qz.fmt);
              }
              store_pack(qz.q + arow * qz.qs0 + first, (i64)1, off, rem, vec, o);
            } else {
              Pack<TX, V> o;
#pragma unroll
              for (int k = 0; k < V; ++k) {
                const int e = off + k < rem ? off + k : off;  // stays inside w and b
                o.v[k] = Elem<TX>::from(y32(c, k, e, wt, bt));
              }
              store_pack(yr + first * ys1, ys1, off, rem, vec, o);
            }
            if constexpr (ADD) store_h(first, rem, c);
          }
        }
      }
    }
  }
}

template <typename T, typename A, int G, int MAXC, bool RMS>
__global__ void __launch_bounds__(RowLaunch<G, FwdPerSm<T, G, MAXC>::value>::threads,
                                  RowLaunch<G, FwdPerSm<T, G, MAXC>::value>::min_blocks)
fwd_rows(const T* x, T* y, const A* w, const A* b, A eps, A inv_n, A* mean_out,
         A* rstd_out,
         i64 rows, i64 n, i64 inner, double inv_inner, i64 xs0, i64 xs1, i64 xs2,
         i64 ys0, i64 ys1, i64 ys2,
         int vec_ok) {
  forward_rows<T, T, T, T, A, G, MAXC, RMS, false, false>(
      x, nullptr, nullptr, y, w, b, eps, inv_n, mean_out, rstd_out, rows, n, inner,
      inv_inner, xs0, xs1, xs2, 0, 0, ys0, ys1, ys2, vec_ok);
}

// h = x + r (TR r, TH h) and y = the forward of h (TX y, x's type) for rows of unit
// stride; row r of an array a starts at a + r * as0. The configuration (G, MAXC) and the
// occupancy are those of fwd_rows<TH>, whose arithmetic this is.
template <typename TX, typename TR, typename TH, typename A, int G, int MAXC, bool RMS>
__global__ void __launch_bounds__(RowLaunch<G, FwdPerSm<TH, G, MAXC>::value>::threads,
                                  RowLaunch<G, FwdPerSm<TH, G, MAXC>::value>::min_blocks)
add_fwd_rows(const TX* x, const TR* r, TH* h, TX* y, const A* w, const A* b, A eps,
             A inv_n, A* mean_out, A* rstd_out, i64 rows, i64 n, i64 xs0, i64 rs0,
             i64 hs0, i64 ys0, int vec_ok) {
  forward_rows<TX, TR, TH, TH, A, G, MAXC, RMS, true, false>(
      x, r, h, y, w, b, eps, inv_n, mean_out, rstd_out, rows, n, 1, 1.0, xs0, 1, 0, rs0,
      hs0, ys0, 1, 0, vec_ok);
}

// y (of x, rows of unit stride) as 8-bit codes q (row r at q + r * qs0): see "quantized
// output" above. A = float; the configuration and the occupancy are fwd_rows<float>'s.
// inv_rows: 1 / scale per row (static scale), or null: each row's scale goes to
// scale_out.
template <typename TX, typename A, int G, int MAXC, bool RMS>
__global__ void __launch_bounds__(RowLaunch<G, FwdPerSm<A, G, MAXC>::value>::threads,
                                  RowLaunch<G, FwdPerSm<A, G, MAXC>::value>::min_blocks)
quant_fwd_rows(const TX* x, unsigned char* q, const A* w, const A* b, A eps, A inv_n,
               A* mean_out, A* rstd_out, const A* inv_rows, A* scale_out, i64 rows, i64 n,
               i64 xs0, i64 qs0, int fmt, int vec_ok) {
  const QuantOut<A> qz = {q, inv_rows, scale_out, qs0, fmt};
  forward_rows<TX, TX, TX, A, A, G, MAXC, RMS, false, true>(
      x, nullptr, nullptr, nullptr, w, b, eps, inv_n, mean_out, rstd_out, rows, n, 1, 1.0,
      xs0, 1, 0, 0, 0, 0, 1, 0, vec_ok, qz);
}

// h = x + r as add_fwd_rows computes it, then y of h as 8-bit codes (quant_fwd_rows of the
// stored h). h may be x or r itself; q shares memory with nothing.
template <typename TX, typename TR, typename TH, typename A, int G, int MAXC, bool RMS>
__global__ void __launch_bounds__(RowLaunch<G, FwdPerSm<A, G, MAXC>::value>::threads,
                                  RowLaunch<G, FwdPerSm<A, G, MAXC>::value>::min_blocks)
quant_add_fwd_rows(const TX* x, const TR* r, TH* h, unsigned char* q, const A* w,
                   const A* b, A eps, A inv_n, A* mean_out, A* rstd_out, const A* inv_rows,
                   A* scale_out, i64 rows, i64 n, i64 xs0, i64 rs0, i64 hs0, i64 qs0,
                   int fmt, int vec_ok) {
  const QuantOut<A> qz = {q, inv_rows, scale_out, qs0, fmt};
  forward_rows<TX, TR, TH, A, A, G, MAXC, RMS, true, true>(
      x, r, h, nullptr, w, b, eps, inv_n, mean_out, rstd_out, rows, n, 1, 1.0, xs0, 1, 0,
      rs0, hs0, 0, 1, 0, vec_ok, qz);
}

// ================================================================== forward, cols

// A block of 32 x RY threads (RY = min(G, 8)) normalizes 32 rows; threadIdx.x picks the
// row (adjacent rows are adjacent in memory for channels-first and Fortran-order inputs,
// so loads coalesce), threadIdx.y runs L = G / RY consecutive virtual lanes of that row.
// G and MAXC are run-time values here: only the order of operations must match the row
// kernels, not the unrolling.
template <typename T, typename A, bool RMS>
__global__ void __launch_bounds__(256)
fwd_cols(const T* x, T* y, const A* w, const A* b, A eps, A inv_n, A* mean_out,
         A* rstd_out,
         i64 rows, i64 n, i64 inner, double inv_inner, i64 xs0, i64 xs1, i64 xs2,
         i64 ys0, i64 ys1, i64 ys2,
         int G, int MAXC, i64 tiles) {
  constexpr int V = VecWidth<T>::value;
  const i64 TILE = (i64)G * MAXC * V;
  const int L = G / (int)blockDim.y;
  typedef typename Select<RMS, SumOp<A>, MomOp<A>>::type Op;
  typedef typename Op::S S;
  __shared__ S part[LNK_COL_MAX_RY][LNK_COL_ROWS];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;

  for (i64 base = (i64)blockIdx.x * LNK_COL_ROWS; base < rows;
       base += (i64)gridDim.x * LNK_COL_ROWS) {
    const i64 row = base + tx;
    const bool active = row < rows;
    const T* xr = x + (active ? row_offset(row, inner, inv_inner, xs0, xs2) : 0);
    T* yr = y + (active ? row_offset(row, inner, inv_inner, ys0, ys2) : 0);
    const A K = (RMS || !active) ? A(0) : to_acc(xr[0]);

    S st = Op::identity();
    if (active) {
      st = sequential_tree<Op>(L, [&](int j) -> S {
        const int l = ty * L + j;
        typename LaneState<A, RMS>::type run;  // as fwd_rows'
        for (i64 t = 0; t < tiles; ++t) {
          const i64 t0 = t * TILE;
          if constexpr (RMS) {
            A tile_sq = run.open();
#pragma unroll 1
            for (int c = 0; c < MAXC; ++c) {
#pragma unroll
              for (int k = 0; k < V; ++k) {
                const i64 e = t0 + (i64)(c * G + l) * V + k;
                if (e < n) {
                  const A v = to_acc(xr[e * xs1]);
                  tile_sq = tile_sq + v * v;
                }
              }
            }
            run.close(tile_sq);
          } else {
            run.close(chunk_moments<A>(MAXC * V, [&](int idx, A& v) -> bool {
              const int c = idx / V;
              const int k = idx % V;
              const i64 e = t0 + (i64)(c * G + l) * V + k;
              v = (e < n ? to_acc(xr[e * xs1]) : K) - K;
              return e < n;
            }, [] {}));
          }
        }
        return run.value();
      });
    }
    part[ty][tx] = st;
    __syncthreads();
    st = sequential_tree<Op>((int)blockDim.y, [&](int j) -> S { return part[j][tx]; });

    A shift_mean;
    A rstd;
    if constexpr (RMS) {
      shift_mean = A(0);
      rstd = inv_sqrt(st * inv_n + eps);
    } else {
      shift_mean = st.mean;
      rstd = inv_sqrt(st.m2 * inv_n + eps);
    }
    bool done = false;  // not `continue`: every thread must reach the __syncthreads below
    if constexpr (Elem<T>::can_overflow) {
      if (active && !usable_rstd(rstd)) {  // squares overflow or underflow, or NaN / inf
        done = rescaled_row<T, A, RMS>(xr, xs1, yr, ys1, n, eps, w, b, mean_out, rstd_out,
                                       row, ty, (int)blockDim.y);
      }
    }
    if (active && !done) {
      if (ty == 0) {
        if constexpr (!RMS) mean_out[row] = K + shift_mean;
        rstd_out[row] = rstd;
      }
      for (int j = 0; j < L; ++j) {
        const int l = ty * L + j;
        for (i64 t = 0; t < tiles; ++t) {
          const i64 t0 = t * TILE;
#pragma unroll 1
          for (int c = 0; c < MAXC; ++c) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const i64 e = t0 + (i64)(c * G + l) * V + k;
              if (e < n) {
                const A xv = to_acc(xr[e * xs1]);
                A v;
                if constexpr (RMS) {
                  v = xv * rstd;
                } else {
                  v = ((xv - K) - shift_mean) * rstd;
                }
                v = v * param_or(w, e, A(1));
                if constexpr (!RMS) v = v + param_or(b, e, A(0));
                yr[e * ys1] = Elem<T>::from(v);
              }
            }
          }
        }
      }
    }
    __syncthreads();  // part[] is reused by the next rows
  }
}

// ================================================================= backward, rows

// grad_x = ((g - mean(g)) - xhat * mean(g * xhat)) * rstd, g = dy * w,
// xhat = (x - mean) * rstd (RMSNorm: no mean(g) term, xhat = x * rstd).
// gres (null: none; strides es0, es1, es2, like x's) is the gradient reaching the
// normalized input from elsewhere (the residual stream): gx = grad_x + gres, added in the
// accumulation type before the one rounding to T (both backward kernels).
template <typename T, typename A, int G, int MAXC, bool RMS>
__global__ void __launch_bounds__(RowLaunch<G, BwdPerSm<T, MAXC>::value>::threads,
                                  RowLaunch<G, BwdPerSm<T, MAXC>::value>::min_blocks)
bwd_rows(const T* gy, const T* x, const A* mean, const A* rstd, const A* w, T* gx, A inv_n,
         i64 rows, i64 n, i64 inner, double inv_inner, i64 gs0, i64 gs1, i64 gs2,
         i64 xs0, i64 xs1, i64 xs2,
         i64 os0, i64 os1, i64 os2, const T* gres, i64 es0, i64 es1, i64 es2,
         int vec_ok) {
  constexpr int V = VecWidth<T>::value;
  constexpr i64 TILE = (i64)G * MAXC * V;
  constexpr int GPB = G > 32 ? 1 : 128 / G;
  const int lane = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x % G);
  const int group = G > 32 ? 0 : (int)(threadIdx.x / G);
  const bool vec = vec_ok != 0;
  const i64 tiles = (n + TILE - 1) / TILE;

  for (i64 base = (i64)blockIdx.x * GPB; base < rows; base += (i64)gridDim.x * GPB) {
    const i64 row = base + group;
    const bool active = row < rows;
    const T* gr = gy + (active ? row_offset(row, inner, inv_inner, gs0, gs2) : 0);
    const T* xr = x + (active ? row_offset(row, inner, inv_inner, xs0, xs2) : 0);
    T* orow = gx + (active ? row_offset(row, inner, inv_inner, os0, os2) : 0);
    const A mu = (RMS || !active) ? A(0) : mean[row];
    const A rs = active ? rstd[row] : A(0);
    Pack<T> pg[MAXC];
    Pack<T> px[MAXC];

    typedef Sum2Op<A> Op;
    // Sums of g and of g * xhat, per tile closed as in the forward (see Running).
    constexpr bool CLOSE = G == LNK_MAX_G;
    Running<A, CLOSE> run_g;
    Running<A, CLOSE> run_gx;
    if (active) {
      for (i64 t = 0; t < tiles; ++t) {
        const i64 first = t * TILE + (i64)lane * V;
        const i64 rem = n - first;
        const T* gt = gr + first * gs1;
        const T* xt = xr + first * xs1;
        const A* wt = w == nullptr ? nullptr : w + first;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          load_pack(gt, gs1, c * G * V, rem, vec, pg[c]);
          load_pack(xt, xs1, c * G * V, rem, vec, px[c]);
        }
        A part_g = run_g.open();
        A part_gx = run_gx.open();
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const int e = c * G * V + k;
            if (e < rem) {
              const A g = to_acc(pg[c].v[k]) * param_or(wt, e, A(1));
              const A xh = (to_acc(px[c].v[k]) - mu) * rs;
              part_g = part_g + g;
              part_gx = part_gx + g * xh;
            }
          }
        }
        run_g.close(part_g);
        run_gx.close(part_gx);
      }
    }
    typename Op::S st;
    st.a = run_g.value();
    st.b = run_gx.value();
    st = group_reduce<Op, G>(st);
    const A mean_g = st.a * inv_n;
    const A mean_gx = st.b * inv_n;
    if (active) {
      for (i64 t = 0; t < tiles; ++t) {
        const i64 first = t * TILE + (i64)lane * V;
        const i64 rem = n - first;
        const T* gt = gr + first * gs1;
        const T* xt = xr + first * xs1;
        T* ot = orow + first * os1;
        const A* wt = w == nullptr ? nullptr : w + first;
        if (tiles > 1) {
#pragma unroll
          for (int c = 0; c < MAXC; ++c) {
            load_pack(gt, gs1, c * G * V, rem, vec, pg[c]);
            load_pack(xt, xs1, c * G * V, rem, vec, px[c]);
          }
        } else {
#pragma unroll
          for (int c = 0; c < MAXC; ++c) {
            opaque(pg[c]);
            opaque(px[c]);
          }
        }
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          const int off = c * G * V;
          if (off < rem) {
            Pack<T> o;
            Pack<T> pe;
            if (gres != nullptr) {
              load_pack(gres + row_offset(row, inner, inv_inner, es0, es2) + first * es1, es1,
                        off, rem, vec, pe);
            }
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const int e = off + k < rem ? off + k : off;
              const A g = to_acc(pg[c].v[k]) * param_or(wt, e, A(1));
              const A xh = (to_acc(px[c].v[k]) - mu) * rs;
              A v;
              if constexpr (RMS) {
                v = (g - xh * mean_gx) * rs;
              } else {
                v = ((g - mean_g) - xh * mean_gx) * rs;
              }
              if (gres != nullptr) v = v + to_acc(pe.v[k]);
              o.v[k] = Elem<T>::from(v);
            }
            store_pack(ot, os1, off, rem, vec, o);
          }
        }
      }
    }
  }
}

// ================================================================= backward, cols

template <typename T, typename A, bool RMS>
__global__ void __launch_bounds__(256)
bwd_cols(const T* gy, const T* x, const A* mean, const A* rstd, const A* w, T* gx, A inv_n,
         i64 rows, i64 n, i64 inner, double inv_inner, i64 gs0, i64 gs1, i64 gs2,
         i64 xs0, i64 xs1, i64 xs2,
         i64 os0, i64 os1, i64 os2, const T* gres, i64 es0, i64 es1, i64 es2,
         int G, int MAXC, i64 tiles) {
  constexpr int V = VecWidth<T>::value;
  const i64 TILE = (i64)G * MAXC * V;
  const int L = G / (int)blockDim.y;
  typedef Sum2Op<A> Op;
  typedef typename Op::S S;
  __shared__ S part[LNK_COL_MAX_RY][LNK_COL_ROWS];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;

  for (i64 base = (i64)blockIdx.x * LNK_COL_ROWS; base < rows;
       base += (i64)gridDim.x * LNK_COL_ROWS) {
    const i64 row = base + tx;
    const bool active = row < rows;
    const T* gr = gy + (active ? row_offset(row, inner, inv_inner, gs0, gs2) : 0);
    const T* xr = x + (active ? row_offset(row, inner, inv_inner, xs0, xs2) : 0);
    T* orow = gx + (active ? row_offset(row, inner, inv_inner, os0, os2) : 0);
    const A mu = (RMS || !active) ? A(0) : mean[row];
    const A rs = active ? rstd[row] : A(0);

    S st = Op::identity();
    if (active) {
      st = sequential_tree<Op>(L, [&](int j) -> S {
        const int l = ty * L + j;
        Running<A> run_g;  // as bwd_rows'
        Running<A> run_gx;
        for (i64 t = 0; t < tiles; ++t) {
          const i64 t0 = t * TILE;
          A part_g = run_g.open();
          A part_gx = run_gx.open();
#pragma unroll 1
          for (int c = 0; c < MAXC; ++c) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const i64 e = t0 + (i64)(c * G + l) * V + k;
              if (e < n) {
                const A g = to_acc(gr[e * gs1]) * param_or(w, e, A(1));
                const A xh = (to_acc(xr[e * xs1]) - mu) * rs;
                part_g = part_g + g;
                part_gx = part_gx + g * xh;
              }
            }
          }
          run_g.close(part_g);
          run_gx.close(part_gx);
        }
        S ls;
        ls.a = run_g.value();
        ls.b = run_gx.value();
        return ls;
      });
    }
    part[ty][tx] = st;
    __syncthreads();
    st = sequential_tree<Op>((int)blockDim.y, [&](int j) -> S { return part[j][tx]; });
    const A mean_g = st.a * inv_n;
    const A mean_gx = st.b * inv_n;
    if (active) {
      for (int j = 0; j < L; ++j) {
        const int l = ty * L + j;
        for (i64 t = 0; t < tiles; ++t) {
          const i64 t0 = t * TILE;
#pragma unroll 1
          for (int c = 0; c < MAXC; ++c) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const i64 e = t0 + (i64)(c * G + l) * V + k;
              if (e < n) {
                const A g = to_acc(gr[e * gs1]) * param_or(w, e, A(1));
                const A xh = (to_acc(xr[e * xs1]) - mu) * rs;
                A v;
                if constexpr (RMS) {
                  v = (g - xh * mean_gx) * rs;
                } else {
                  v = ((g - mean_g) - xh * mean_gx) * rs;
                }
                if (gres != nullptr) {
                  v = v + to_acc(gres[row_offset(row, inner, inv_inner, es0, es2) + e * es1]);
                }
                orow[e * os1] = Elem<T>::from(v);
              }
            }
          }
        }
      }
    }
    __syncthreads();
  }
}

// ====================================================== parameter gradients

// part[(c * blocks + blk) * n + i] = sum over the rows r of row block blk (the
// LNK_GRAD_ROW_BLOCK rows from blk * LNK_GRAD_ROW_BLOCK on), in increasing r, of
// dy * xhat (c = 0) and dy (c = 1, LayerNorm only). The block size is fixed, so the
// partials never depend on the grid.
template <typename T, typename A, bool RMS>
__global__ void __launch_bounds__(256)
param_partials(const T* gy, const T* x, const A* mean, const A* rstd, A* part,
               i64 rows, i64 n, i64 inner, double inv_inner, i64 gs0, i64 gs1, i64 gs2,
               i64 xs0, i64 xs1, i64 xs2, i64 blocks, double inv_n) {
  constexpr i64 block_rows = LNK_GRAD_ROW_BLOCK;
  const i64 total = blocks * n;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (i64)gridDim.x * blockDim.x) {
    const i64 blk = div_fast(idx, n, inv_n);
    const i64 i = idx - blk * n;
    const i64 r0 = blk * block_rows;
    const i64 r1 = r0 + block_rows < rows ? r0 + block_rows : rows;
    i64 o = inner == 1 ? r0 : div_fast(r0, inner, inv_inner);
    i64 j = r0 - o * inner;
    A sw = A(0);
    A sb = A(0);
    for (i64 r = r0; r < r1; ++r) {
      const A dy = to_acc(gy[o * gs0 + i * gs1 + j * gs2]);
      const A xv = to_acc(x[o * xs0 + i * xs1 + j * xs2]);
      A xh;
      if constexpr (RMS) {
        xh = xv * rstd[r];
      } else {
        xh = (xv - mean[r]) * rstd[r];
      }
      sw = sw + dy * xh;
      sb = sb + dy;
      if (++j == inner) {
        j = 0;
        ++o;
      }
    }
    part[blk * n + i] = sw;
    if (!RMS) part[(blocks + blk) * n + i] = sb;
  }
}

// One level of the parameter-gradient tree. out[(c * out_blocks + j) * n + i] is the sum
// of the LNK_SUM_FAN partials in[(c * blocks + j * LNK_SUM_FAN + k) * n + i] (those with
// j * LNK_SUM_FAN + k < blocks) in a complete binary tree that pairs neighbours. The host
// repeats this level until one block is left, and LNK_SUM_FAN is a power of two, so the
// levels together are the complete binary tree over all row blocks (absent trailing
// leaves skipped): the bits depend on the number of rows only, never on the grid or the
// number of SMs. Each output is one thread's, and consecutive threads take consecutive
// columns, so loads coalesce; a level moves 1 / LNK_SUM_FAN of the previous one's data.
static_assert((LNK_SUM_FAN & (LNK_SUM_FAN - 1)) == 0 && LNK_SUM_FAN >= 2,
              "the tree levels must nest: LNK_SUM_FAN is a power of two");

template <typename A>
__global__ void __launch_bounds__(256)
sum_partials(const A* in, A* out, i64 count, i64 blocks, i64 n, i64 out_blocks,
             double inv_n, double inv_out_blocks) {
  const i64 total = count * out_blocks * n;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (i64)gridDim.x * blockDim.x) {
    const i64 cj = div_fast(idx, n, inv_n);
    const i64 i = idx - cj * n;
    const i64 c = div_fast(cj, out_blocks, inv_out_blocks);
    const i64 j = cj - c * out_blocks;
    const i64 first = j * LNK_SUM_FAN;
    const int cnt = (int)(blocks - first < LNK_SUM_FAN ? blocks - first : LNK_SUM_FAN);
    const A* p = in + (c * blocks + first) * n + i;
    A v[LNK_SUM_FAN];
#pragma unroll
    for (int k = 0; k < LNK_SUM_FAN; ++k) v[k] = k < cnt ? p[(i64)k * n] : A(0);
#pragma unroll
    for (int w = 1; w < LNK_SUM_FAN; w <<= 1) {
#pragma unroll
      for (int k = 0; k + w < LNK_SUM_FAN; k += 2 * w) {
        if (k + w < cnt) v[k] = v[k] + v[k + w];
      }
    }
    out[idx] = v[0];
  }
}

}  // namespace lnk
