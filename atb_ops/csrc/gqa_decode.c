/* Fused GQA decode over an int8 paged cache, of ascend_fa.atb_ops.attention.

   afa_gqa_decode is one decode step of paged_attention for a range of sequences,
   straight from the cache's int8 codes: for each sequence, block by block (looked
   up through the block table, ND rows or NZ fractal runs), it widens 8 K rows of a
   KV head at a time to fp32 and forms its g query heads' scores, takes each head's
   softmax, then accumulates P V over the V rows in register tiles. The eager path
   instead copies every sequence's whole context into fp32 matrices first (four
   bytes written and read again per code) and runs two batched GEMMs of g rows
   each; here each code is read once, as a byte.

   Numerics, against the eager path (same operands: the fp32 query operand and
   score factor of _gqa_operands):
   * scores: the fp32 dot product of the query operand with the widened codes (FMA
     accumulation, lanes then a fixed tree), times the head's factor. Where the
     query operand holds integers (FAQuant) every partial sum is an integer below
     2^24, so the scores are exact and equal the eager path's bit for bit;
     otherwise they differ from the BLAS order by fp32 rounding only;
   * softmax: exp(s - max) by a degree-6 polynomial after a Cody-Waite reduction
     (about 1 ulp; inputs below -87.33 give 0, where the eager exp gives a
     denormal below 1.2e-38), sum, times the sum's reciprocal;
   * P V: fp32 FMA accumulation in token order (the eager GEMM's order differs).

   So FAQuant scores are bit-equal and every output differs from the eager path
   by fp32 rounding only (the tests hold both to the float64 reference's budget). */
#include "afa_internal.h"

#define EXP_LO -87.33654f

/* the largest of s[0..n), or NaN where one is NaN (the softmax then gives NaN,
   as torch's does) */
static inline float row_max(const float *s, int64_t n) {
    float m = s[0];
    for (int64_t l = 0; l < n; l++) {
        if (s[l] != s[l]) return s[l];
        m = s[l] > m ? s[l] : m;
    }
    return m;
}

/* exp(x) for x <= 0 (the softmax's shifted scores): n = round(x / ln 2), r = x -
   n ln 2 in two steps (Cody-Waite), exp(r) by Cephes' degree-6 polynomial, times
   2^n from the exponent bits. Below EXP_LO (2^n would be denormal) it is 0. */
static inline float exp_scalar(float x) {
    if (!(x >= EXP_LO)) return x != x ? x : 0.0f;
    float n = x * 1.44269504088896341f;
    n = (n + ROUND_MAGIC) - ROUND_MAGIC;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float y = 1.9875691500E-4f;
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * (r * r) + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return y * two_n;
}

/* codes at ``src`` (d of them, one head's row) -> fp32 ``dst``; an NZ row is
   d / 32 runs of 32 codes, ``run_step`` bytes apart (0: ND, one run). */
static inline void widen_scalar(const int8_t *src, int64_t d, int64_t run_step,
                                float *dst) {
    for (int64_t i = 0; i < d; i++) {
        const int8_t *p = run_step ? src + (i / 32) * run_step + i % 32 : src + i;
        dst[i] = (float)*p;
    }
}

#ifdef HAVE_X86
static inline AFA_AVX2_FMA __m256 exp8(__m256 x) {
    __m256 lo = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    /* NaN in -> NaN out (max() dropped it); below EXP_LO -> 0 */
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    y = _mm256_andnot_ps(lo, y);
    return _mm256_blendv_ps(y, x, nan);
}

static inline AFA_AVX2_FMA __m256 codes_f8(const int8_t *p) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* d % 8 == 0 (and d % 32 == 0 for NZ, whose 32-code runs hold whole vectors) */
static AFA_AVX2_FMA void widen8(const int8_t *src, int64_t d, int64_t run_step,
                                float *dst) {
    for (int64_t i = 0; i < d; i += 8) {
        const int8_t *p = run_step ? src + (i / 32) * run_step + i % 32 : src + i;
        _mm256_storeu_ps(dst + i, codes_f8(p));
    }
}

static inline AFA_AVX2_FMA float dot8(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static AFA_AVX2_FMA void softmax8(float *s, int64_t n) {
    float m = row_max(s, n);
    __m256 mv = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= n; l += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), mv));
        _mm256_storeu_ps(s + l, e);
        sum = _mm256_add_ps(sum, e);
    }
    float buf[8];
    _mm256_storeu_ps(buf, sum);
    float total = ((buf[0] + buf[1]) + (buf[2] + buf[3])) +
                  ((buf[4] + buf[5]) + (buf[6] + buf[7]));
    for (; l < n; l++) {
        s[l] = exp_scalar(s[l] - m);
        total += s[l];
    }
    __m256 inv = _mm256_set1_ps(1.0f / total);
    for (l = 0; l + 8 <= n; l += 8)
        _mm256_storeu_ps(s + l, _mm256_mul_ps(_mm256_loadu_ps(s + l), inv));
    for (; l < n; l++) s[l] = s[l] * (1.0f / total);
}

#endif

static void softmax_scalar(float *s, int64_t n) {
    float m = row_max(s, n);
    float total = 0.0f;
    for (int64_t l = 0; l < n; l++) {
        s[l] = exp_scalar(s[l] - m);
        total += s[l];
    }
    for (int64_t l = 0; l < n; l++) s[l] = s[l] * (1.0f / total);
}

static inline float dot_scalar(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

static inline void axpy_scalar(float a, const float *x, float *y, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] += a * x[i];
}

typedef struct {
    const int8_t *kc, *vc;
    int64_t kstride, vstride, nblocks, bs, hkv, d, nz;
    int64_t row_step;     /* bytes from a token's row to the next one's in a block */
    int64_t run_step;     /* NZ: bytes from a 32-code run to the next (BS * 32) */
    const int32_t *table; /* the sequence's block-table row */
} PagedCache;

/* offset of KV head ``kvh``'s first code in a token's row */
static inline int64_t head_off(const PagedCache *c, int64_t kvh) {
    return c->nz ? ((kvh * c->d) / 32) * c->run_step : kvh * c->d;
}

/* token ``t`` of block ``blk`` (checked by the caller), head ``kvh`` */
static inline const int8_t *row_at(const PagedCache *c, const int8_t *base,
                                   int64_t stride, int64_t blk, int64_t t,
                                   int64_t kvh) {
    return base + blk * stride + head_off(c, kvh) + t * c->row_step;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int check_blocks(const PagedCache *c, int64_t n) {
    for (int64_t l0 = 0; l0 < n; l0 += c->bs) {
        int64_t blk = c->table[l0 / c->bs];
        if (blk < 0 || blk >= c->nblocks) return -2;
    }
    return 0;
}

/* the scores s [H, n] of one sequence: q [H, D], coef [H] */
static void scores_scalar(const PagedCache *c, const float *q, const float *coef,
                          int64_t n, int64_t g, float *s, float *tmp) {
    int64_t d = c->d, step = c->nz ? c->run_step : 0;
    for (int64_t l = 0; l < n; l++) {
        int64_t blk = c->table[l / c->bs];
        for (int64_t kvh = 0; kvh < c->hkv; kvh++) {
            widen_scalar(row_at(c, c->kc, c->kstride, blk, l % c->bs, kvh), d, step,
                         tmp);
            for (int64_t j = kvh * g; j < (kvh + 1) * g; j++)
                s[j * n + l] = dot_scalar(q + j * d, tmp, d) * coef[j];
        }
    }
}

/* out [H, D] = P [H, n] . V, in token order */
static void pv_scalar(const PagedCache *c, const float *p, int64_t n, int64_t g,
                      float *tmp, float *out) {
    int64_t d = c->d, step = c->nz ? c->run_step : 0;
    memset(out, 0, (size_t)(c->hkv * g * d) * sizeof(float));
    for (int64_t l = 0; l < n; l++) {
        int64_t blk = c->table[l / c->bs];
        for (int64_t kvh = 0; kvh < c->hkv; kvh++) {
            widen_scalar(row_at(c, c->vc, c->vstride, blk, l % c->bs, kvh), d, step,
                         tmp);
            for (int64_t j = kvh * g; j < (kvh + 1) * g; j++)
                axpy_scalar(p[j * n + l], tmp, out + j * d, d);
        }
    }
}

#ifdef HAVE_X86
/* the sums of a[0..7]'s lanes, as one vector (lane r: the sum of a[r]) */
static inline AFA_AVX2_FMA __m256 sum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20),
                         _mm256_permute2f128_ps(t0, t2, 0x31));
}

/* scores of 8 consecutive tokens (widened rows in tmp [8, d]) for g heads */
static AFA_AVX2_FMA void scores_rows8(const float *q, const float *coef,
                                      const float *tmp, int64_t g, int64_t d, int64_t n,
                                      float *s) {
    for (int64_t j = 0; j < g; j++) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + j * d + i);
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(tmp + r * d + i), acc[r]);
        }
        __m256 sum = _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(coef[j]));
        _mm256_storeu_ps(s + j * n, sum);
    }
}

/* the next block's rows while this block's are worked on (ND rows are
   contiguous: 8 tokens' rows are one run of bytes) */
static inline void prefetch_rows(const int8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

/* block by block (each block's rows read front to back, all heads together) */
static AFA_AVX2_FMA void scores_vec(const PagedCache *c, const float *q,
                                    const float *coef, int64_t n, int64_t g, float *s,
                                    float *tmp) {
    int64_t d = c->d, step = c->nz ? c->run_step : 0;
    for (int64_t l0 = 0; l0 < n; l0 += c->bs) {
        int64_t blk = c->table[l0 / c->bs], rows = min64(c->bs, n - l0);
        const int8_t *next = l0 + c->bs < n && !c->nz
                                 ? c->kc + c->table[l0 / c->bs + 1] * c->kstride
                                 : NULL;
        int64_t t = 0;
        for (; t + 8 <= rows; t += 8) {
            if (next) prefetch_rows(next + t * c->row_step, 8 * c->row_step);
            for (int64_t kvh = 0; kvh < c->hkv; kvh++) {
                for (int r = 0; r < 8; r++)
                    widen8(row_at(c, c->kc, c->kstride, blk, t + r, kvh), d, step,
                           tmp + r * d);
                scores_rows8(q + kvh * g * d, coef + kvh * g, tmp, g, d, n,
                             s + kvh * g * n + l0 + t);
            }
        }
        for (; t < rows; t++) {
            for (int64_t kvh = 0; kvh < c->hkv; kvh++) {
                widen8(row_at(c, c->kc, c->kstride, blk, t, kvh), d, step, tmp);
                for (int64_t j = kvh * g; j < (kvh + 1) * g; j++)
                    s[j * n + l0 + t] = dot8(q + j * d, tmp, d) * coef[j];
            }
        }
    }
}

/* acc (8 vectors: heads p[0..3] x 16 columns) += P . V over ``rows`` tokens from
   ``col`` (the block's first token, at the tile's first column) */
static AFA_AVX2_FMA void pv_tile(const float *const *p, const int8_t *col,
                                 int64_t row_step, int64_t rows, __m256 *acc) {
    for (int64_t t = 0; t < rows; t++) {
        const int8_t *src = col + t * row_step;
        __m256 v0 = codes_f8(src), v1 = codes_f8(src + 8);
        for (int jj = 0; jj < 4; jj++) {
            __m256 pj = _mm256_broadcast_ss(p[jj] + t);
            acc[2 * jj] = _mm256_fmadd_ps(pj, v0, acc[2 * jj]);
            acc[2 * jj + 1] = _mm256_fmadd_ps(pj, v1, acc[2 * jj + 1]);
        }
    }
}

/* out [H, D] = P [H, n] . V, block by block: each output tile is carried in
   registers through a block's tokens and kept in ``out`` between blocks (an
   exact store and load: the sums run in token order). Heads go by 4; a missing
   head reads ``zero`` probabilities and writes to ``sink``. */
static AFA_AVX2_FMA void pv_vec(const PagedCache *c, const float *p, int64_t n,
                                int64_t g, const float *zero, float *sink, float *out) {
    int64_t d = c->d, step = c->nz ? c->run_step : 0;
    memset(out, 0, (size_t)(c->hkv * g * d) * sizeof(float));
    for (int64_t l0 = 0; l0 < n; l0 += c->bs) {
        int64_t blk = c->table[l0 / c->bs], rows = min64(c->bs, n - l0);
        if (l0 + c->bs < n && !c->nz)
            prefetch_rows(c->vc + c->table[l0 / c->bs + 1] * c->vstride,
                          rows * c->row_step);
        for (int64_t kvh = 0; kvh < c->hkv; kvh++) {
            const int8_t *base = row_at(c, c->vc, c->vstride, blk, 0, kvh);
            for (int64_t j0 = 0; j0 < g; j0 += 4) {
                const float *rows_p[4];
                float *dst[4];
                for (int jj = 0; jj < 4; jj++) {
                    int64_t j = kvh * g + j0 + jj;
                    int ok = j0 + jj < g;
                    rows_p[jj] = ok ? p + j * n + l0 : zero;
                    dst[jj] = ok ? out + j * d : sink;
                }
                for (int64_t i0 = 0; i0 < d; i0 += 16) {
                    const int8_t *col =
                        step ? base + (i0 / 32) * step + i0 % 32 : base + i0;
                    __m256 acc[8];
                    for (int jj = 0; jj < 4; jj++) {
                        acc[2 * jj] = _mm256_loadu_ps(dst[jj] + i0);
                        acc[2 * jj + 1] = _mm256_loadu_ps(dst[jj] + i0 + 8);
                    }
                    pv_tile(rows_p, col, c->row_step, rows, acc);
                    for (int jj = 0; jj < 4; jj++) {
                        _mm256_storeu_ps(dst[jj] + i0, acc[2 * jj]);
                        _mm256_storeu_ps(dst[jj] + i0 + 8, acc[2 * jj + 1]);
                    }
                }
            }
        }
    }
}
#endif

/* One sequence: out [H, D] (before the V scale) from q [H, D]. scratch: H * lmax
   scores, lmax zeros, 8 * D widened rows, then D sink floats. */
static int gqa_seq(const PagedCache *c, const float *q, const float *coef, int64_t n,
                   int64_t g, int64_t lmax, float *scratch, float *out, int vec) {
    int rc = check_blocks(c, n);
    if (rc) return rc;
    int64_t h = c->hkv * g;
    float *s = scratch, *zero = s + h * lmax, *tmp = zero + lmax;
    float *sink = tmp + 8 * c->d;
#ifdef HAVE_X86
    if (vec) {
        scores_vec(c, q, coef, n, g, s, tmp);
        for (int64_t j = 0; j < h; j++) softmax8(s + j * n, n);
        pv_vec(c, s, n, g, zero, sink, out);
        return 0;
    }
#else
    (void)sink;
#endif
    scores_scalar(c, q, coef, n, g, s, tmp);
    for (int64_t j = 0; j < h; j++) softmax_scalar(s + j * n, n);
    pv_scalar(c, s, n, g, tmp, out);
    return 0;
}

/* Sequences [b0, b1) of a decode step. q [B, H, D] fp32, coef [H] fp32, out [B,
   H, D] fp32 (before the V scale); caches int8, block ``i`` at ``i * stride``
   (ND: [BS, hkv * D] rows; NZ: hkv * D / 32 runs of [BS, 32]); table int32 [B,
   tcols]; lens int32 [B]. */
int afa_gqa_decode(const float *q, const float *coef, const int8_t *kc, int64_t kstride,
                   const int8_t *vc, int64_t vstride, int64_t nblocks, int64_t bs,
                   const int32_t *table, int64_t tcols, const int32_t *lens,
                   int64_t hkv, int64_t h, int64_t d, int nz, int64_t b0, int64_t b1,
                   float *out) {
    int64_t g = h / hkv, lmax = tcols * bs;
    int vec = 0;
#ifdef HAVE_X86
    vec = afa_simd() && __builtin_cpu_supports("fma") && d % 16 == 0;
#endif
    float *scratch = (float *)calloc((size_t)(h * lmax + lmax + 9 * d), sizeof(float));
    if (!scratch) return -3;
    int rc = 0;
    for (int64_t b = b0; b < b1 && rc == 0; b++) {
        int64_t n = lens[b];
        if (n < 1 || n > lmax) {
            rc = -1;
            break;
        }
        PagedCache c = {.kc = kc,
                        .vc = vc,
                        .kstride = kstride,
                        .vstride = vstride,
                        .nblocks = nblocks,
                        .bs = bs,
                        .hkv = hkv,
                        .d = d,
                        .nz = nz,
                        .row_step = nz ? 32 : hkv * d,
                        .run_step = bs * 32,
                        .table = table + b * tcols};
        rc =
            gqa_seq(&c, q + b * h * d, coef, n, g, lmax, scratch, out + b * h * d, vec);
    }
    free(scratch);
    return rc;
}
