/* Helpers shared by the kernel sources (static inline: each translation unit
   gets its own copy, nothing here is exported). The exported functions are
   declared in afa_native.h. */
#ifndef AFA_INTERNAL_H
#define AFA_INTERNAL_H

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "afa_native.h"

/* Every float operation must round to fp32 on its own (no x87 excess precision):
   a build where it would not fails here, and the eager path runs. */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "native kernels need FLT_EVAL_METHOD == 0 (fp32 arithmetic in fp32)"
#endif

/* The constants come from ascend_fa/atb_ops (constants.py, native.py) as -D
   flags, so C and Python cannot disagree. */
#if !defined(AFA_ROW_MAX) || !defined(AFA_ROUND_MAGIC) || !defined(AFA_CODE_MIN) || \
    !defined(AFA_CODE_MAX)
#error "build through ascend_fa.atb_ops.native (it passes -DAFA_ROW_MAX=...)"
#endif

/* Widest token row (bytes of int8 codes) the cache write stages on its stack. */
#define ROW_MAX AFA_ROW_MAX
/* 1.5 * 2^23: fl32(ROUND_MAGIC + q) - ROUND_MAGIC is round_half_even(q) for
   |q| < 2^22 (see constants.py). */
#define ROUND_MAGIC AFA_ROUND_MAGIC
/* The int8 code range, as fp32 bounds. */
#define CODE_MIN AFA_CODE_MIN
#define CODE_MAX AFA_CODE_MAX

/* Inlined into every caller (a helper whose arguments select a path: each caller
   gets the branch-free copy for its constants). */
#define AFA_ALWAYS_INLINE __attribute__((always_inline))

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
/* Functions compiled for AVX2 (+ F16C, or + FMA) whatever the build's -march:
   they only run after afa_simd() found the CPU features (see cache_write.c). */
#define AFA_AVX2 __attribute__((target("avx2,f16c")))
#define AFA_AVX2_FMA __attribute__((target("avx2,fma")))
#endif

/* fp16 bits -> fp32, exact. Subnormals (e == 0) come from their integer mantissa
   times 2^-24 (an exact product with a normal fp32 result), so no denormal fp32
   value is ever formed. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) {
        float sub = (float)m * 0x1p-24f;
        memcpy(&bits, &sub, 4);
    } else if (e == 31) {
        bits = 0x7f800000u | (m << 13);
    } else {
        bits = ((e + 112u) << 23) | (m << 13);
    }
    bits |= sign;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Element i of src (dtype 0 fp16, 1 bf16, 2 fp32) widened to fp32, exact. */
static inline float load1(const void *src, int dtype, int64_t i) {
    if (dtype == 0) return f16_to_f32(((const uint16_t *)src)[i]);
    if (dtype == 1) return bf16_to_f32(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}

/* fp32 -> bf16 bits, round to nearest even (the integer form of c10's
   round_to_nearest_even); NaN -> 0x7fc0 as c10 gives. */
static inline uint16_t bf16_rne(float y) {
    uint32_t b;
    memcpy(&b, &y, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* Whether this thread's float environment is the default one the kernels'
   exactness arguments need (x86: MXCSR round to nearest, no FTZ / DAZ). */
static inline int default_fenv(void) {
#ifdef HAVE_X86
    return (_mm_getcsr() & ~0x3fu) == 0x1f80u;
#else
    return 1;
#endif
}

#ifdef HAVE_X86
/* Elements i..i+7 of src widened to fp32 (fp16 by vcvtph2ps, bf16 by its bits
   << 16, fp32 loaded), exact. */
static inline AFA_AVX2 __m256 load8(const void *src, int dtype, int64_t i) {
    const __m128i *p = (const __m128i *)((const uint16_t *)src + i);
    if (dtype == 0) return _mm256_cvtph_ps(_mm_loadu_si128(p));
    if (dtype == 1) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    return _mm256_loadu_ps((const float *)src + i);
}
#endif

#endif /* AFA_INTERNAL_H */
