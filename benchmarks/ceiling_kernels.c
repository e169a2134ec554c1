/* Hand-written AVX-512 LayerNorm forward kernels for benchmarks/ceiling.py.
 *
 * The per-element arithmetic of layernorm's row kernels (shift K = x[0]; per lane, chunk
 * trees of the centred values and of their squares; the lanes summed and the moments,
 * rstd taken in float64; y = fma(((x - K) - mean) * rstd, w, b)), without the checks of
 * rare rows (cancellation redo, rescaling) and without any Python around it: how fast
 * this machine runs that arithmetic when written by hand, next to a memcpy of the same
 * bytes. Rows of 64 and 128 go 16 at a time (statistics of 16 rows folded together,
 * w and b kept in registers: the library's short-row path); rows of a multiple of 128
 * from 256 on are software pipelined (the next row's statistics interleaved with this
 * row's output: the library's row path).
 *
 * usage: ceiling_kernels N ROWS X_OFFSET Y_OFFSET
 * prints: the rows run, the median microseconds of the kernel and of memcpy (interleaved
 * rounds), and the kernel's largest error against a float64 reference.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef __AVX512F__
#error "needs AVX-512 (compile with -march=native on an AVX-512 machine)"
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Lane sums of one row of 64, 128 or a multiple of 128 elements: chunks of 8 vectors
 * (a row of 64: one chunk of 4, its absent leaves left out, as the library's). */
static inline void lane_sums(const float *xr, int n, __m512 k, __m512 *a, __m512 *q) {
    __m512 sa = _mm512_setzero_ps(), sq = _mm512_setzero_ps();
    if (n == 64) {
        __m512 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm512_sub_ps(_mm512_loadu_ps(xr + 16 * j), k);
        *a = _mm512_add_ps(sa, _mm512_add_ps(_mm512_add_ps(v[0], v[1]),
                                             _mm512_add_ps(v[2], v[3])));
        *q = _mm512_add_ps(sq, _mm512_add_ps(
            _mm512_fmadd_ps(v[0], v[0], _mm512_mul_ps(v[1], v[1])),
            _mm512_fmadd_ps(v[2], v[2], _mm512_mul_ps(v[3], v[3]))));
        return;
    }
    for (int i = 0; i < n; i += 128) {
        __m512 v[8];
        for (int j = 0; j < 8; j++) v[j] = _mm512_sub_ps(_mm512_loadu_ps(xr + i + 16 * j), k);
        __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]),
                                               _mm512_add_ps(v[2], v[3])),
                                 _mm512_add_ps(_mm512_add_ps(v[4], v[5]),
                                               _mm512_add_ps(v[6], v[7])));
        __m512 t = _mm512_add_ps(
            _mm512_add_ps(_mm512_fmadd_ps(v[0], v[0], _mm512_mul_ps(v[1], v[1])),
                          _mm512_fmadd_ps(v[2], v[2], _mm512_mul_ps(v[3], v[3]))),
            _mm512_add_ps(_mm512_fmadd_ps(v[4], v[4], _mm512_mul_ps(v[5], v[5])),
                          _mm512_fmadd_ps(v[6], v[6], _mm512_mul_ps(v[7], v[7]))));
        sa = _mm512_add_ps(sa, s);
        sq = _mm512_add_ps(sq, t);
    }
    *a = sa;
    *q = sq;
}

/* Lanes j + j + 8 in float32, the rest of the tree in float64. */
static inline double tree(__m512 v) {
    __m512 h = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    return _mm512_reduce_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(h)));
}

static inline void finish(double s, double ss, int n, float eps, float *mean, float *rstd) {
    double mu = s * (1.0 / n);
    double m2 = fma(s, -mu, ss);
    *mean = (float)mu;
    *rstd = (float)(1.0 / sqrt(m2 * (1.0 / n) + eps));
}

static inline void out_vec(const float *xr, float *yr, int i, __m512 k, __m512 m, __m512 r,
                           __m512 w, __m512 b) {
    __m512 v = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + i), k), m);
    _mm512_storeu_ps(yr + i, _mm512_fmadd_ps(_mm512_mul_ps(v, r), w, b));
}

/* The trees of 8 rows' float64 lane vectors (lanes j + 4, j + 2, j + 1 of each row, as
 * in tree()) folded into one vector, row i in lane i. */
static inline __m512d fold8(const __m512d r[8]) {
    const __m512i lo4 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i hi4 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i lo2 = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i hi2 = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
    const __m512i lo1 = _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i hi1 = _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1);
    __m512d p[4], u[2];
    for (int k = 0; k < 4; k++)
        p[k] = _mm512_add_pd(_mm512_permutex2var_pd(r[2 * k], lo4, r[2 * k + 1]),
                             _mm512_permutex2var_pd(r[2 * k], hi4, r[2 * k + 1]));
    for (int k = 0; k < 2; k++)
        u[k] = _mm512_add_pd(_mm512_permutex2var_pd(p[2 * k], lo2, p[2 * k + 1]),
                             _mm512_permutex2var_pd(p[2 * k], hi2, p[2 * k + 1]));
    return _mm512_add_pd(_mm512_permutex2var_pd(u[0], lo1, u[1]),
                         _mm512_permutex2var_pd(u[0], hi1, u[1]));
}

static inline __m512d first_level(__m512 v) {
    __m512 h = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    return _mm512_cvtps_pd(_mm512_castps512_ps256(h));
}

/* Rows of 64 or 128, 16 at a time: each row's lane sums, then the trees, moments and
 * rstd of 8 rows at once in a vector, then the rows' output passes with w and b in
 * registers. */
__attribute__((noinline)) static void ln_short(const float *x, float *y, const float *w,
                                               const float *b, int rows, int n, float eps) {
    __m512 wv[8], bv[8];
    for (int j = 0; j < n / 16; j++) {
        wv[j] = _mm512_loadu_ps(w + 16 * j);
        bv[j] = _mm512_loadu_ps(b + 16 * j);
    }
    const __m512d inv_n = _mm512_set1_pd(1.0 / n), e = _mm512_set1_pd(eps);
    for (int g = 0; g + 16 <= rows; g += 16) {
        float sh[16], mn[16], rs[16];
        __m512d sa[16], sq[16];
        for (int i = 0; i < 16; i++) {
            const float *xr = x + (size_t)(g + i) * n;
            __m512 a, q;
            sh[i] = xr[0];
            lane_sums(xr, n, _mm512_set1_ps(sh[i]), &a, &q);
            sa[i] = first_level(a);
            sq[i] = first_level(q);
        }
        for (int h = 0; h < 2; h++) {
            __m512d s = fold8(sa + 8 * h), ss = fold8(sq + 8 * h);
            __m512d mu = _mm512_mul_pd(s, inv_n);
            __m512d m2 = _mm512_fnmadd_pd(s, mu, ss);
            __m512d r = _mm512_div_pd(_mm512_set1_pd(1.0),
                                      _mm512_sqrt_pd(_mm512_fmadd_pd(m2, inv_n, e)));
            _mm256_storeu_ps(mn + 8 * h, _mm512_cvtpd_ps(mu));
            _mm256_storeu_ps(rs + 8 * h, _mm512_cvtpd_ps(r));
        }
        for (int i = 0; i < 16; i++) {
            const float *xr = x + (size_t)(g + i) * n;
            float *yr = y + (size_t)(g + i) * n;
            __m512 k = _mm512_set1_ps(sh[i]), m = _mm512_set1_ps(mn[i]),
                   r = _mm512_set1_ps(rs[i]);
            for (int j = 0; j < n / 16; j++) out_vec(xr, yr, 16 * j, k, m, r, wv[j], bv[j]);
        }
    }
}

/* Rows of a multiple of 128: row r + 1's statistics interleaved with row r's output. */
__attribute__((noinline)) static void ln_pipelined(const float *x, float *y, const float *w,
                                                   const float *b, int rows, int n,
                                                   float eps) {
    __m512 a, q;
    float k = x[0], mean, rstd;
    lane_sums(x, n, _mm512_set1_ps(k), &a, &q);
    finish(tree(a), tree(q), n, eps, &mean, &rstd);
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *yr = y + (size_t)r * n;
        const float *xn = x + (size_t)(r + 1 < rows ? r + 1 : r) * n;
        __m512 kv = _mm512_set1_ps(k), mv = _mm512_set1_ps(mean), rv = _mm512_set1_ps(rstd);
        __m512 kn = _mm512_set1_ps(xn[0]);
        __m512 sa = _mm512_setzero_ps(), sq = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 128) {
            __m512 v[8];
            for (int j = 0; j < 8; j++) v[j] = _mm512_sub_ps(_mm512_loadu_ps(xn + i + 16 * j), kn);
            sa = _mm512_add_ps(sa, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]),
                                                               _mm512_add_ps(v[2], v[3])),
                                                 _mm512_add_ps(_mm512_add_ps(v[4], v[5]),
                                                               _mm512_add_ps(v[6], v[7]))));
            sq = _mm512_add_ps(sq, _mm512_add_ps(
                _mm512_add_ps(_mm512_fmadd_ps(v[0], v[0], _mm512_mul_ps(v[1], v[1])),
                              _mm512_fmadd_ps(v[2], v[2], _mm512_mul_ps(v[3], v[3]))),
                _mm512_add_ps(_mm512_fmadd_ps(v[4], v[4], _mm512_mul_ps(v[5], v[5])),
                              _mm512_fmadd_ps(v[6], v[6], _mm512_mul_ps(v[7], v[7])))));
            for (int j = 0; j < 8; j++)
                out_vec(xr, yr, i + 16 * j, kv, mv, rv, _mm512_loadu_ps(w + i + 16 * j),
                        _mm512_loadu_ps(b + i + 16 * j));
        }
        k = xn[0];
        finish(tree(sa), tree(sq), n, eps, &mean, &rstd);
    }
}

static int compare(const void *p, const void *q) {
    double d = *(const double *)p - *(const double *)q;
    return (d > 0) - (d < 0);
}

/* COUNT floats at OFFSET (< 4096) bytes past a 4 KiB boundary, in *BASE (to free). */
static float *placed(size_t count, int offset, void **base) {
    size_t bytes = (count * sizeof(float) + 8191) / 4096 * 4096;  /* a multiple of 4 KiB */
    *base = aligned_alloc(4096, bytes);
    if (*base == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return (float *)((char *)*base + offset);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s N ROWS X_OFFSET Y_OFFSET\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]), rows = atoi(argv[2]);
    int short_rows = n == 64 || n == 128;
    if (!short_rows && (n < 256 || n % 128 != 0)) {
        fprintf(stderr, "N must be 64, 128 or a multiple of 128 from 256 on\n");
        return 2;
    }
    rows = short_rows ? rows / 16 * 16 : rows;
    int x_offset = atoi(argv[3]), y_offset = atoi(argv[4]);
    if (rows < 1 || x_offset < 0 || x_offset >= 4096 || y_offset < 0 || y_offset >= 4096) {
        fprintf(stderr, "ROWS must be at least 1 (16 for N of 64 or 128) and the offsets "
                        "0-4095\n");
        return 2;
    }
    size_t count = (size_t)rows * n;
    void *blocks[4];
    float *x = placed(count, x_offset, blocks), *y = placed(count, y_offset, blocks + 1);
    float *w = placed(n, 0, blocks + 2), *b = placed(n, 0, blocks + 3);
    srand(0);
    for (size_t i = 0; i < count; i++) x[i] = (float)rand() / RAND_MAX;
    for (int i = 0; i < n; i++) {
        w[i] = 1.0f + i * 1e-3f;
        b[i] = i * 1e-3f;
    }
    enum { ROUNDS = 41, REPS = 20 };
    double tk[ROUNDS], tc[ROUNDS];
    for (int k = 0; k < ROUNDS; k++) {
        double t0 = now();
        for (int j = 0; j < REPS; j++) {
            if (short_rows)
                ln_short(x, y, w, b, rows, n, 1e-5f);
            else
                ln_pipelined(x, y, w, b, rows, n, 1e-5f);
            __asm__ volatile("" ::"r"(y) : "memory");
        }
        double t1 = now();
        for (int j = 0; j < REPS; j++) {
            memcpy(y, x, count * sizeof(float));
            __asm__ volatile("" ::"r"(y) : "memory");
        }
        double t2 = now();
        tk[k] = (t1 - t0) / REPS;
        tc[k] = (t2 - t1) / REPS;
    }
    qsort(tk, ROUNDS, sizeof(double), compare);
    qsort(tc, ROUNDS, sizeof(double), compare);
    /* The kernel's output against a float64 two-pass reference (a kernel that is fast
     * because it is wrong would be no ceiling). */
    if (short_rows)
        ln_short(x, y, w, b, rows, n, 1e-5f);
    else
        ln_pipelined(x, y, w, b, rows, n, 1e-5f);
    double worst = 0.0;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        double mean = 0.0, var = 0.0;
        for (int i = 0; i < n; i++) mean += xr[i];
        mean /= n;
        for (int i = 0; i < n; i++) var += (xr[i] - mean) * (xr[i] - mean);
        double rstd = 1.0 / sqrt(var / n + 1e-5);
        for (int i = 0; i < n; i++) {
            double err = fabs(y[(size_t)r * n + i] - ((xr[i] - mean) * rstd * w[i] + b[i]));
            worst = err > worst ? err : worst;
        }
    }
    printf("%d %.3f %.3f %.3g\n", rows, tk[ROUNDS / 2] * 1e6, tc[ROUNDS / 2] * 1e6, worst);
    for (int i = 0; i < 4; i++) free(blocks[i]);
    return 0;
}
