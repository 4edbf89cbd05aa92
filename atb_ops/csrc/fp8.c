/* FP8 E4M3 block kernels of ascend_fa.fp8 (DeepSeek's 128 x 128 block weights).

   * afa_fp8_dequantize: codes x block scale_inv -> bf16 / fp16 in one pass (the
     eager path takes six);
   * afa_fp8_quantize: per block scale_inv = max(amax(|W|) / 448, tiny) and the
     codes (W / scale_inv).to(float8_e4m3fn) in one pass over each block (the
     eager path takes five torch passes and torch's scalar fp8 cast, about 7 ns
     per element on CPU);
   * afa_fp8_e4m3: the fp32 -> E4M3 conversion alone (tests sweep it against
     torch's cast).

   Every result equals the eager torch path bit for bit; the tests compare them. */
#include "afa_internal.h"

/* -- FP8 E4M3 block dequantize ---------------------------------------------------
   out[i, j] = to_dtype(fl32(value(codes[i, j]) * scale[i / br, j / bc])), the eager
   ``(codes.float() * scale_inv).to(dtype)``. The E4M3 value is exact in fp32 (lut,
   or on AVX2 the code's bits moved into fp16, which is value / 2^8, widened and
   scaled by 2^8: exact, a power of two); the product is the one fp32 rounding; the
   narrowing rounds to nearest even as torch's casts do (bf16: the integer form of
   c10's round_to_nearest_even, fp16: vcvtps2ph with RN). Returns -1, or 2 * k for
   the first NaN code at flat index k (row-major; stops there), or 2 * k + 1 for the
   first fp16 result that is not finite, or -3 when fp16 output needs F16C. */
static int64_t fp8_scalar(const uint8_t *codes, int64_t r, int64_t n,
                          const float *scale, int64_t br, int64_t bc, const float *lut,
                          uint16_t *out, int kind) {
    if (kind != 0) return -3;
    int64_t nbc = (n + bc - 1) / bc;
    for (int64_t i = 0; i < r; i++) {
        const float *srow = scale + (i / br) * nbc;
        const uint8_t *c = codes + i * n;
        uint16_t *o = out + i * n;
        for (int64_t j = 0; j < n; j++) {
            if ((c[j] & 0x7f) == 0x7f) return 2 * (i * n + j);
            o[j] = bf16_rne(lut[c[j]] * srow[j / bc]);
        }
    }
    return -1;
}

#ifdef HAVE_X86
static inline AFA_AVX2 __m256 e4m3x8(__m128i bytes8) {
    /* sign-extend, << 7: bit 15 sign, bit 14 sign again (cleared), 13..7 the code's
       exponent and mantissa -> fp16 of value / 2^8 */
    __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes8), 7);
    h = _mm_and_si128(h, _mm_set1_epi16((short)0xBFFF));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

/* bf16 bits of y, round to nearest even (y never NaN here: NaN codes are refused
   first and the scales are finite), on 8 lanes. */
static inline AFA_AVX2 __m256i bf16_rne8(__m256 y) {
    __m256i w = _mm256_castps_si256(y);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
    w = _mm256_add_epi32(w, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_srli_epi32(w, 16);
}

/* 16 codes at a time to bf16 (the common case): c[j..end) in a block with scale
   sc. value / 2^8 (the fp16 bit move, exact) times sc * 2^8 (exact while finite,
   checked by the caller) is the exact real value * sc, rounded once: the same fp32
   product as value * sc. Returns where it stopped: at end's last 16-multiple or
   before the first group holding a NaN code (the 8-lane loop then names it). */
static AFA_AVX2 int64_t bf16x16(const uint8_t *c, uint16_t *o, int64_t j, int64_t end,
                                float sc256) {
    const __m128i low7 = _mm_set1_epi8(0x7f), keep = _mm_set1_epi16((short)0xBFFF);
    const __m256 s = _mm256_set1_ps(sc256);
    for (; j + 16 <= end; j += 16) {
        __m128i b = _mm_loadu_si128((const __m128i *)(c + j));
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(b, low7), low7))) break;
        __m128i hl = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), keep);
        __m128i hh = _mm_and_si128(
            _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_srli_si128(b, 8)), 7), keep);
        __m256i lo = bf16_rne8(_mm256_mul_ps(_mm256_cvtph_ps(hl), s));
        __m256i hi = bf16_rne8(_mm256_mul_ps(_mm256_cvtph_ps(hh), s));
        /* packus works per 128-bit lane: lo0-3 hi0-3 | lo4-7 hi4-7 -> in order */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256((__m256i *)(o + j), packed);
    }
    return j;
}

static AFA_AVX2 int64_t fp8_avx2(const uint8_t *codes, int64_t r, int64_t n,
                                 const float *scale, int64_t br, int64_t bc,
                                 const float *lut, uint16_t *out, int kind) {
    int64_t nbc = (n + bc - 1) / bc;
    const __m128i low7 = _mm_set1_epi8(0x7f);
    for (int64_t i = 0; i < r; i++) {
        const float *srow = scale + (i / br) * nbc;
        const uint8_t *c = codes + i * n;
        uint16_t *o = out + i * n;
        for (int64_t j0 = 0; j0 < n; j0 += bc) {
            int64_t end = j0 + bc < n ? j0 + bc : n;
            float sc = srow[j0 / bc];
            __m256 s = _mm256_set1_ps(sc);
            int64_t j = j0;
            if (kind == 0 && sc * 256.0f <= FLT_MAX)
                j = bf16x16(c, o, j, end, sc * 256.0f);
            for (; j + 8 <= end; j += 8) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(c + j));
                int nan =
                    _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(b, low7), low7)) &
                    0xff;
                if (nan) return 2 * (i * n + j + __builtin_ctz(nan));
                __m256 y = _mm256_mul_ps(e4m3x8(b), s);
                __m128i packed;
                if (kind == 0) {
                    __m256i w = _mm256_castps_si256(y);
                    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(w, 16),
                                                   _mm256_set1_epi32(1));
                    w = _mm256_add_epi32(
                        w, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
                    w = _mm256_srli_epi32(w, 16);
                    packed = _mm_packus_epi32(_mm256_castsi256_si128(w),
                                              _mm256_extracti128_si256(w, 1));
                } else {
                    packed = _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT);
                    __m128i ex = _mm_and_si128(packed, _mm_set1_epi16(0x7c00));
                    int inf =
                        _mm_movemask_epi8(_mm_cmpeq_epi16(ex, _mm_set1_epi16(0x7c00)));
                    if (inf) return 2 * (i * n + j + __builtin_ctz(inf) / 2) + 1;
                }
                _mm_storeu_si128((__m128i *)(o + j), packed);
            }
            for (; j < end; j++) {
                if ((c[j] & 0x7f) == 0x7f) return 2 * (i * n + j);
                float y = lut[c[j]] * sc;
                if (kind == 0) {
                    o[j] = bf16_rne(y);
                } else {
                    o[j] = _cvtss_sh(y, _MM_FROUND_TO_NEAREST_INT);
                    if ((o[j] & 0x7c00) == 0x7c00) return 2 * (i * n + j) + 1;
                }
            }
        }
    }
    return -1;
}
#endif

int64_t afa_fp8_dequantize(const uint8_t *codes, int64_t r, int64_t n,
                           const float *scale, int64_t br, int64_t bc, const float *lut,
                           uint16_t *out, int kind) {
#ifdef HAVE_X86
    if (afa_simd()) return fp8_avx2(codes, r, n, scale, br, bc, lut, out, kind);
#endif
    return fp8_scalar(codes, r, n, scale, br, bc, lut, out, kind);
}

/* -- FP8 E4M3 block quantize -----------------------------------------------------
   fp32 -> E4M3 code, round to nearest even, the rule of torch's float8_e4m3fn cast
   (c10/util/Float8_e4m3fn.h, fp8e4m3fn_from_fp32_value; the format has no inf):
   * NaN: the NaN code 0x7f (sign kept);
   * |x| > 464 (past the midpoint of 448, the largest code 0x7e, and 480), inf
     included: 0x7e, saturated as torch 2.13's CPU cast does (older torch gave
     the NaN code; the quantizer never gets there: |W / scale_inv| <= 448 up to
     one rounding of the quotient);
   * |x| < 2^-6 (below the smallest normal): |x| + 2^14 in fp32, whose ulp is the
     subnormal step 2^-9, so the one fp32 addition rounds to nearest even; the
     integer difference of the bits to 2^14's is the code;
   * otherwise the exponent is rebased from bias 127 to 7 and the 20 dropped
     mantissa bits are rounded half to even by an integer add (a carry into the
     exponent is the correct rounding up).
   The sign bit is copied. The addition needs round-to-nearest without
   denormals-are-zero: the kernels check MXCSR per call. */
#define E4M3_NAN_FROM 0x7f800001u    /* the first NaN pattern */
#define E4M3_SAT_ABOVE 0x43e80000u   /* 464.0f */
#define E4M3_NORMAL_FROM 0x3c800000u /* 2^-6 */
#define E4M3_DENORM_BASE 0x46800000u /* 2^14 */
#define E4M3_REBASE 0xc407ffffu      /* ((7 - 127) << 23) + 0x7ffff, mod 2^32 */

static inline uint8_t e4m3_rne(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t sign = b & 0x80000000u, a = b ^ sign;
    uint8_t code;
    if (a >= E4M3_NAN_FROM) {
        code = 0x7f;
    } else if (a > E4M3_SAT_ABOVE) {
        code = 0x7e;
    } else if (a < E4M3_NORMAL_FROM) {
        float f;
        memcpy(&f, &a, 4);
        f += 16384.0f;
        memcpy(&b, &f, 4);
        code = (uint8_t)(b - E4M3_DENORM_BASE);
    } else {
        code = (uint8_t)((a + E4M3_REBASE + ((a >> 20) & 1u)) >> 20);
    }
    return code | (uint8_t)(sign >> 24);
}

/* Bits of |x| compared as unsigned integers order like the values; at or above
   the inf pattern they are inf or NaN. dtype 0 fp16, 1 bf16, 2 fp32. */
static const uint32_t ABS_MASK[3] = {0x7fffu, 0x7fffu, 0x7fffffffu};
static const uint32_t INF_BITS[3] = {0x7c00u, 0x7f80u, 0x7f800000u};

static inline uint32_t abs_bits(const void *src, int dtype, int64_t i) {
    if (dtype == 2) return ((const uint32_t *)src)[i] & ABS_MASK[2];
    return ((const uint16_t *)src)[i] & ABS_MASK[0];
}

static inline float bits_value(uint32_t bits, int dtype) {
    if (dtype == 0) return f16_to_f32((uint16_t)bits);
    if (dtype == 1) return bf16_to_f32((uint16_t)bits);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint32_t amax_scalar(const void *src, int dtype, int64_t n, int64_t i0,
                            int64_t i1, int64_t j0, int64_t j1) {
    uint32_t m = 0;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) {
            uint32_t v = abs_bits(src, dtype, i * n + j);
            m = v > m ? v : m;
        }
    return m;
}

static void codes_scalar(const void *src, int dtype, int64_t n, int64_t i0, int64_t i1,
                         int64_t j0, int64_t j1, float s, uint8_t *out) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++)
            out[i * n + j] = e4m3_rne(load1(src, dtype, i * n + j) / s);
}

#ifdef HAVE_X86
/* e4m3_rne on 8 lanes (both roundings formed, the lane's case selected). */
static inline AFA_AVX2 __m256i e4m3_rne8(__m256 q) {
    __m256i b = _mm256_castps_si256(q);
    __m256i sign = _mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u));
    __m256i a = _mm256_xor_si256(b, sign);
    __m256 fd = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f));
    __m256i den = _mm256_sub_epi32(_mm256_castps_si256(fd),
                                   _mm256_set1_epi32((int)E4M3_DENORM_BASE));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    __m256i nor = _mm256_add_epi32(a, _mm256_set1_epi32((int)E4M3_REBASE));
    nor = _mm256_srli_epi32(_mm256_add_epi32(nor, odd), 20);
    nor = _mm256_and_si256(nor, _mm256_set1_epi32(0xff));
    /* a < 2^31: signed compares are exact */
    __m256i is_den = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)E4M3_NORMAL_FROM), a);
    __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)E4M3_NAN_FROM - 1));
    __m256i is_sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)E4M3_SAT_ABOVE));
    __m256i r = _mm256_blendv_epi8(nor, den, is_den);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7e), is_sat);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), is_nan);
    return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

/* amax of |bits| over rows i0..i1, columns j0..j1 (j1 - j0 a multiple of 16 for
   the 16-bit dtypes, of 8 for fp32). */
static AFA_AVX2 uint32_t amax_avx2(const void *src, int dtype, int64_t n, int64_t i0,
                                   int64_t i1, int64_t j0, int64_t j1) {
    __m256i m = _mm256_setzero_si256();
    if (dtype == 2) {
        const __m256i mask = _mm256_set1_epi32(0x7fffffff);
        for (int64_t i = i0; i < i1; i++) {
            const uint32_t *row = (const uint32_t *)src + i * n;
            for (int64_t j = j0; j < j1; j += 8) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(row + j));
                m = _mm256_max_epu32(m, _mm256_and_si256(v, mask));
            }
        }
        uint32_t lanes[8], best = 0;
        _mm256_storeu_si256((__m256i *)lanes, m);
        for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
        return best;
    }
    const __m256i mask = _mm256_set1_epi16(0x7fff);
    for (int64_t i = i0; i < i1; i++) {
        const uint16_t *row = (const uint16_t *)src + i * n;
        for (int64_t j = j0; j < j1; j += 16) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(row + j));
            m = _mm256_max_epu16(m, _mm256_and_si256(v, mask));
        }
    }
    uint16_t lanes[16], best = 0;
    _mm256_storeu_si256((__m256i *)lanes, m);
    for (int k = 0; k < 16; k++) best = lanes[k] > best ? lanes[k] : best;
    return best;
}

/* codes of rows i0..i1, columns j0..j1 (j1 - j0 a multiple of 32): the true
   division, e4m3_rne8, the packs (values 0..255 pass the unsigned saturation
   unchanged) and the permute that restores the order the per-lane packs mix. */
static AFA_AVX2 void codes_avx2(const void *src, int dtype, int64_t n, int64_t i0,
                                int64_t i1, int64_t j0, int64_t j1, float scale,
                                uint8_t *out) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = i0; i < i1; i++) {
        for (int64_t j = j0; j < j1; j += 32) {
            int64_t k = i * n + j;
            __m256i a = e4m3_rne8(_mm256_div_ps(load8(src, dtype, k), s));
            __m256i b = e4m3_rne8(_mm256_div_ps(load8(src, dtype, k + 8), s));
            __m256i c = e4m3_rne8(_mm256_div_ps(load8(src, dtype, k + 16), s));
            __m256i d = e4m3_rne8(_mm256_div_ps(load8(src, dtype, k + 24), s));
            __m256i ab = _mm256_packus_epi32(a, b);
            __m256i cd = _mm256_packus_epi32(c, d);
            __m256i abcd = _mm256_packus_epi16(ab, cd);
            _mm256_storeu_si256((__m256i *)(out + k),
                                _mm256_permutevar8x32_epi32(abcd, order));
        }
    }
}
#endif

/* One block: its amax bits (or the scalar fallback's), then its codes. */
static uint32_t block_amax(const void *src, int dtype, int64_t n, int64_t i0,
                           int64_t i1, int64_t j0, int64_t j1) {
#ifdef HAVE_X86
    int64_t lanes = dtype == 2 ? 8 : 16, jv = j0 + (j1 - j0) / lanes * lanes;
    if (afa_simd() && jv > j0) {
        uint32_t m = amax_avx2(src, dtype, n, i0, i1, j0, jv);
        uint32_t t = jv < j1 ? amax_scalar(src, dtype, n, i0, i1, jv, j1) : 0;
        return m > t ? m : t;
    }
#endif
    return amax_scalar(src, dtype, n, i0, i1, j0, j1);
}

static void block_codes(const void *src, int dtype, int64_t n, int64_t i0, int64_t i1,
                        int64_t j0, int64_t j1, float s, uint8_t *out) {
#ifdef HAVE_X86
    int64_t jv = j0 + (j1 - j0) / 32 * 32;
    if (afa_simd() && jv > j0) {
        codes_avx2(src, dtype, n, i0, i1, j0, jv, s, out);
        j0 = jv;
    }
#endif
    if (j0 < j1) codes_scalar(src, dtype, n, i0, i1, j0, j1, s, out);
}

/* src [r, n] (dtype 0 fp16, 1 bf16, 2 fp32, row-major) -> scale [ceil(r/br),
   ceil(n/bc)] fp32 and codes [r, n], block by block (a 128 x 128 block of bf16 is
   32 KiB: its codes are formed while the amax pass left it in cache). Per block:
   scale = max(fl32(amax / 448), FLT_MIN), codes = e4m3_rne(fl32(x / scale)), the
   eager rule. Returns -1, or the flat index bi * nbc + bj of the first block
   (row-major) holding inf or NaN (its scale and codes are not written), or -2
   when the float environment is not the default one (nothing written). */
int64_t afa_fp8_quantize(const void *src, int dtype, int64_t r, int64_t n, int64_t br,
                         int64_t bc, float *scale, uint8_t *codes) {
    if (!default_fenv()) return -2;
    int64_t nbr = (r + br - 1) / br, nbc = (n + bc - 1) / bc;
    for (int64_t bi = 0; bi < nbr; bi++) {
        int64_t i0 = bi * br, i1 = i0 + br < r ? i0 + br : r;
        for (int64_t bj = 0; bj < nbc; bj++) {
            int64_t j0 = bj * bc, j1 = j0 + bc < n ? j0 + bc : n;
            uint32_t m = block_amax(src, dtype, n, i0, i1, j0, j1);
            if (m >= INF_BITS[dtype]) return bi * nbc + bj;
            float s = bits_value(m, dtype) / 448.0f;
            s = s < FLT_MIN ? FLT_MIN : s;
            scale[bi * nbc + bj] = s;
            block_codes(src, dtype, n, i0, i1, j0, j1, s, codes);
        }
    }
    return -1;
}

/* The conversion alone, for tests: x [n] fp32 -> codes [n] (the AVX2 path for
   whole groups of 8 when it is in use). Returns -2 (nothing written) outside the
   default float environment. */
#ifdef HAVE_X86
static AFA_AVX2 int64_t e4m3_avx2(const float *x, int64_t n, uint8_t *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, e4m3_rne8(_mm256_loadu_ps(x + i)));
        for (int k = 0; k < 8; k++) out[i + k] = (uint8_t)lanes[k];
    }
    return i;
}
#endif

int64_t afa_fp8_e4m3(const float *x, int64_t n, uint8_t *out) {
    if (!default_fenv()) return -2;
    int64_t i = 0;
#ifdef HAVE_X86
    if (afa_simd()) i = e4m3_avx2(x, n, out);
#endif
    for (; i < n; i++) out[i] = e4m3_rne(x[i]);
    return -1;
}
