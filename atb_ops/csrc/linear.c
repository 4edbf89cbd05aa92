/* Static W8A8 activation quantizer and dequantize epilogue of
   ascend_fa.atb_ops.linear.

   A decode step's linears quantize a few tokens: static_codes (five torch passes)
   and static_dequant (four) cost about 50 us each in dispatch alone, more than
   their arithmetic. These kernels do each in one pass, with the same IEEE
   operations in the same order, so the results are the eager path's bit for bit
   (the tests compare them):
   * afa_static_codes: fl(x * s) (or the true quotient fl(x / s)), then
     fl(. + offset), clamped to [-128, 127] (the bounds are integers, so clamping
     before rounding gives the same integer), rounded half to even by the magic
     add (exact for |q| <= 128), a NaN quotient giving code 0;
   * afa_static_dequant: fl32(acc + quant_bias) (the sum of two int32 is exact in
     fp64, one rounding to fp32, as torch's fp64 add then .float()), or fl32(acc)
     without a bias, times deq_scale (one fp32 rounding), narrowed to bf16 by
     round to nearest even (NaN -> 0x7fc0, as c10 does) or kept fp32.

   Both run only under the default floating-point environment (MXCSR round to
   nearest, no flush-to-zero): otherwise they return -1 and the caller runs the
   eager path, which then rounds as the environment says. */
#include "afa_internal.h"

static inline int8_t static_code1(float x, float s, float o, int div) {
    float q = div ? x / s : x * s;
    q = q + o;
    if (q != q) return 0;
    q = q < CODE_MIN ? CODE_MIN : q;
    q = q > CODE_MAX ? CODE_MAX : q;
    return (int8_t)(int32_t)((q + ROUND_MAGIC) - ROUND_MAGIC);
}

#ifdef HAVE_X86
/* 8 codes: the same operations as static_code1 lane by lane (a NaN lane: 0) */
static inline AFA_AVX2 __m256i static_codes8(__m256 x, __m256 s, __m256 o, int div) {
    __m256 q = _mm256_add_ps(div ? _mm256_div_ps(x, s) : _mm256_mul_ps(x, s), o);
    __m256 ok = _mm256_cmp_ps(q, q, _CMP_ORD_Q);
    q = _mm256_max_ps(q, _mm256_set1_ps(CODE_MIN));
    q = _mm256_min_ps(q, _mm256_set1_ps(CODE_MAX));
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvttps_epi32(_mm256_and_ps(q, ok));
}

static AFA_AVX2 void static_codes_avx2(const void *x, int dtype, int64_t count, float s,
                                       float o, int div, int8_t *out) {
    __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(o);
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i a = static_codes8(load8(x, dtype, i), sv, ov, div);
        __m256i b = static_codes8(load8(x, dtype, i + 8), sv, ov, div);
        __m256i c = static_codes8(load8(x, dtype, i + 16), sv, ov, div);
        __m256i d = static_codes8(load8(x, dtype, i + 24), sv, ov, div);
        /* int32 -> int8 (values already in range): packs work per 128-bit lane,
           the permute restores the order */
        __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
        __m256i abcd = _mm256_packs_epi16(ab, cd);
        __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        abcd = _mm256_permutevar8x32_epi32(abcd, order);
        _mm256_storeu_si256((__m256i *)(out + i), abcd);
    }
    for (; i < count; i++) out[i] = static_code1(load1(x, dtype, i), s, o, div);
}
#endif

static void static_codes_plain(const void *x, int dtype, int64_t count, float s,
                               float o, int div, int8_t *out) {
    for (int64_t i = 0; i < count; i++)
        out[i] = static_code1(load1(x, dtype, i), s, o, div);
}

/* x [count] (dtype 0 fp16, 1 bf16, 2 fp32) -> codes; -1: not the default fenv */
int afa_static_codes(const void *x, int dtype, int64_t count, float s, float o, int div,
                     int8_t *out) {
    if (!default_fenv()) return -1;
#ifdef HAVE_X86
    if (afa_simd()) {
        static_codes_avx2(x, dtype, count, s, o, div, out);
        return 0;
    }
#endif
    static_codes_plain(x, dtype, count, s, o, div, out);
    return 0;
}

static inline float dequant1(int32_t a, const int32_t *qb, int64_t j,
                             const float *deq) {
    float y = qb ? (float)((double)a + (double)qb[j]) : (float)a;
    return y * deq[j];
}

/* The epilogue's loop, inlined into both instances below (the AVX2 one lets the
   compiler vectorize it; the operations, and so the results, are the same). */
static inline AFA_ALWAYS_INLINE void dequant_rows(const int32_t *acc, int64_t m,
                                                  int64_t n, const int32_t *qb,
                                                  const float *deq, int bf16,
                                                  void *out) {
    for (int64_t i = 0; i < m; i++) {
        const int32_t *row = acc + i * n;
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + i * n;
            for (int64_t j = 0; j < n; j++)
                dst[j] = bf16_rne(dequant1(row[j], qb, j, deq));
        } else {
            float *dst = (float *)out + i * n;
            for (int64_t j = 0; j < n; j++) dst[j] = dequant1(row[j], qb, j, deq);
        }
    }
}

#ifdef HAVE_X86
static AFA_AVX2 void static_dequant_avx2(const int32_t *acc, int64_t m, int64_t n,
                                         const int32_t *qb, const float *deq, int bf16,
                                         void *out) {
    dequant_rows(acc, m, n, qb, deq, bf16, out);
}
#endif

static void static_dequant_plain(const int32_t *acc, int64_t m, int64_t n,
                                 const int32_t *qb, const float *deq, int bf16,
                                 void *out) {
    dequant_rows(acc, m, n, qb, deq, bf16, out);
}

/* acc int32 [m, n], qb int32 [n] or NULL, deq fp32 [n] -> out [m, n] bf16 (bf16
   = 1) or fp32; -1: not the default fenv */
int afa_static_dequant(const int32_t *acc, int64_t m, int64_t n, const int32_t *qb,
                       const float *deq, int bf16, void *out) {
    if (!default_fenv()) return -1;
#ifdef HAVE_X86
    if (afa_simd()) {
        static_dequant_avx2(acc, m, n, qb, deq, bf16, out);
        return 0;
    }
#endif
    static_dequant_plain(acc, m, n, qb, deq, bf16, out);
    return 0;
}
