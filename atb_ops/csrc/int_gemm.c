/* The exact integer product of the W8A8 linears for a few rows (a decode step):
   out[i, j] = sum_k x[i, k] * w[j, k] in int32, for output columns j in [n0, n1).

   Every product of two int8 values is at most 2^14 in magnitude and K <= 65535
   (the linears' limit), so every partial sum stays below 2^30: int32 never
   overflows and any order of the additions gives the same integer, the one the
   device's int32 accumulator holds. Without int8 dot-product instructions
   (VNNI / AMX) oneDNN's int8 GEMM is a slow fallback and the fp32 chunks convert
   the whole int8 weight to fp32 on every call; this kernel reads the int8 weight
   once, as it is stored:
   * AVX2: 16 weights of a row widened to int16 (vpmovsxbw), multiplied by the
     widened activations and summed in pairs into int32 (vpmaddwd: each pair sum
     is at most 2^15, exact), accumulated in int32 lanes, up to four activation
     rows per weight load; the lanes are summed at the end of the row;
   * the portable path is the plain triple loop in int32.
   The caller splits [0, n) into column ranges over its threads (the call holds
   no lock and writes only its own columns). */
#include "afa_internal.h"

static void int_gemm_plain(const int8_t *x, int64_t m, const int8_t *w, int64_t k,
                           int64_t n, int64_t n0, int64_t n1, int32_t *out) {
    for (int64_t j = n0; j < n1; j++) {
        const int8_t *wr = w + j * k;
        for (int64_t i = 0; i < m; i++) {
            const int8_t *xr = x + i * k;
            int32_t acc = 0;
            for (int64_t c = 0; c < k; c++) acc += (int32_t)xr[c] * (int32_t)wr[c];
            out[i * n + j] = acc;
        }
    }
}

#ifdef HAVE_X86
static inline AFA_AVX2 int32_t hsum8(__m256i v) {
    __m128i s =
        _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* rows i0 .. i0 + r - 1 (r <= 4) of x, widened to int16 in x16 [m, kp], times
   weight rows [n0, n1) */
static inline AFA_AVX2 AFA_ALWAYS_INLINE void
rows_avx2(const int16_t *x16, int64_t kp, const int8_t *x, int64_t i0, int r,
          const int8_t *w, int64_t k, int64_t n, int64_t n0, int64_t n1, int32_t *out) {
    int64_t kv = k & ~(int64_t)15;
    for (int64_t j = n0; j < n1; j++) {
        const int8_t *wr = w + j * k;
        __m256i acc[4];
        for (int t = 0; t < r; t++) acc[t] = _mm256_setzero_si256();
        for (int64_t c = 0; c < kv; c += 16) {
            __m256i wv =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + c)));
            for (int t = 0; t < r; t++) {
                __m256i xv =
                    _mm256_loadu_si256((const __m256i *)(x16 + (i0 + t) * kp + c));
                acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(wv, xv));
            }
        }
        for (int t = 0; t < r; t++) {
            int32_t s = hsum8(acc[t]);
            const int8_t *xr = x + (i0 + t) * k;
            for (int64_t c = kv; c < k; c++) s += (int32_t)xr[c] * (int32_t)wr[c];
            out[(i0 + t) * n + j] = s;
        }
    }
}

static AFA_AVX2 void int_gemm_avx2(const int8_t *x, int64_t m, const int8_t *w,
                                   int64_t k, int64_t n, int64_t n0, int64_t n1,
                                   int16_t *x16, int32_t *out) {
    int64_t kp = k & ~(int64_t)15;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < kp; c++) x16[i * kp + c] = x[i * k + c];
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) rows_avx2(x16, kp, x, i, 4, w, k, n, n0, n1, out);
    if (m - i == 3) rows_avx2(x16, kp, x, i, 3, w, k, n, n0, n1, out);
    else if (m - i == 2) rows_avx2(x16, kp, x, i, 2, w, k, n, n0, n1, out);
    else if (m - i == 1) rows_avx2(x16, kp, x, i, 1, w, k, n, n0, n1, out);
}
#endif

int afa_int_gemm(const int8_t *x, int64_t m, const int8_t *w, int64_t k, int64_t n,
                 int64_t n0, int64_t n1, int32_t *out) {
    if (m < 0 || k < 0 || n0 < 0 || n1 > n || n0 > n1) return -1;
#ifdef HAVE_X86
    if (afa_simd() && k >= 16) {
        int64_t kp = k & ~(int64_t)15;
        int16_t *x16 = (int16_t *)malloc((size_t)(m * kp) * sizeof(int16_t) + 32);
        if (x16 == NULL) return -2;
        int_gemm_avx2(x, m, w, k, n, n0, n1, x16, out);
        free(x16);
        return 0;
    }
#endif
    int_gemm_plain(x, m, w, k, n, n0, n1, out);
    return 0;
}
