"""Native CPU kernels of the paged cache write (and the FP8 block dequantize),
compiled on first use.

The eager cache write quantizes in four fp32 passes and scatters in a fifth; per
element that costs about ten times a copy of the int8 output. These kernels do the
whole write of one token in one pass over its row: widen (fp16/bf16 -> fp32,
exact), divide by the head's scale, round half to even, saturate to int8, and copy
the row's 32-byte fractal runs (NZ) or the whole row (ND) to the slot. Float caches
take the same scatter without the arithmetic.

The codes are those of :func:`~ascend_fa.atb_ops.quant.quantize_per_head` bit for
bit (the tests compare every fp16 and bf16 value under several scales):

* the quotient is a true IEEE fp32 division (``divps`` / ``/``), never a product
  with a reciprocal, so it is ``fl(x / s)`` exactly as torch forms it;
* the quotient is clamped to ``[INT8_MIN, INT8_MAX]`` *before* rounding: the bounds
  are integers and rounding is monotonic, so ``round(clamp(q)) ==
  clamp(round(q))``; +-inf quotients land on the bounds;
* rounding is half to even: on AVX2 machines ``cvtps2dq`` under the default MXCSR
  (round to nearest even, checked per call; the two saturating packs clamp the
  bottom) or ``roundps`` with ``_MM_FROUND_TO_NEAREST_INT`` where MXCSR rounds
  otherwise, the ``ROUND_MAGIC`` add on the scalar path (all exact for
  ``|q| <= 128``);
* fp16 is widened by ``vcvtph2ps`` (F16C) or bit arithmetic with the subnormals
  converted from their integer mantissa (exact; no reliance on denormal fp32
  arithmetic, which a flush-to-zero mode would change); bf16 is its bits << 16.

On AVX2 machines the codes go straight into the cache (an ND row at its slot; with
``D % 32 == 0`` each 32 codes are one whole NZ fractal row) and the loop
prefetches the rows ahead; the division stays a true ``divps``. On an AMD EPYC
(Zen 1) core a product with the reciprocal plus a per-vector check for quotients
next to a half-integer (the lanes where the product's code could differ)
measured no faster than the division: the check costs the vector operations the
division saved.

The FP8 E4M3 block dequantize (:meth:`NativeKernels.fp8_dequantize`) likewise
replaces six eager passes by one: decode the code exactly, one fp32 product with the
block's ``scale_inv``, round to bf16 / fp16 to nearest even, and report the first
NaN code or fp16 overflow the eager path would refuse.

The library is plain C with no torch headers: it compiles in well under a second
with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``), is cached
on disk under a name derived from the source, compiler and machine, and is loaded
with :mod:`ctypes`. The AVX2 + F16C path is chosen at run time from the CPU's
feature bits, so the cached file also runs on an older x86 CPU (scalar path). No
compiler, a failed compile or ``ASCEND_FA_NATIVE=0`` leaves the eager torch path in
use; :func:`native_status` says which path runs and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import settings
from .constants import INT8_MAX, INT8_MIN, ROUND_MAGIC
from .native_attention import ATTENTION_SOURCE
from .native_fp8 import FP8_SOURCE
from .native_linear import LINEAR_SOURCE

__all__ = [
    "NATIVE_ENV",
    "NATIVE_CACHE_ENV",
    "MAX_ROW_BYTES",
    "NativeStatus",
    "build_library",
    "native_disabled",
    "native_enabled",
    "native_status",
    "native_kernels",
    "NativeKernels",
]

#: Environment switch: ``0`` keeps the eager torch path (the kernels are not built).
NATIVE_ENV = "ASCEND_FA_NATIVE"
#: Directory for the compiled library (default: ``$XDG_CACHE_HOME/ascend_fa`` or
#: ``~/.cache/ascend_fa``; then ``<tmp>/ascend_fa-<uid>``). Only a directory of the
#: current user that group and others cannot write is used (the library runs as the
#: caller).
NATIVE_CACHE_ENV = "ASCEND_FA_NATIVE_CACHE"
#: Widest token row (bytes of int8 codes) the kernel stages on its stack.
MAX_ROW_BYTES = 65536

#: Input dtype codes of ``afa_quant_write``.
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

_SOURCE = r"""
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Every float operation below must round to fp32 on its own (no x87 excess
   precision): a build where it would not fails here, and the eager path runs. */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "native kernels need FLT_EVAL_METHOD == 0 (fp32 arithmetic in fp32)"
#endif

#define ROW_MAX @ROW_MAX@
#define ROUND_MAGIC @ROUND_MAGIC@f
#define CODE_MIN @CODE_MIN@.0f
#define CODE_MAX @CODE_MAX@.0f

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

static inline int64_t slot_at(const void *slots, int wide, int64_t t) {
    return wide ? ((const int64_t *)slots)[t] : ((const int32_t *)slots)[t];
}

static inline float load1(const void *src, int dtype, int64_t i) {
    if (dtype == 0) return f16_to_f32(((const uint16_t *)src)[i]);
    if (dtype == 1) return bf16_to_f32(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}

/* One code: true division, clamp to the (integer) bounds, then round half to even
   by the magic add (fp32 values in [2^23, 2^24) are integers). */
static inline int8_t code1(float x, float s) {
    float q = x / s;
    q = q < CODE_MIN ? CODE_MIN : q;
    q = q > CODE_MAX ? CODE_MAX : q;
    float r = (q + ROUND_MAGIC) - ROUND_MAGIC;
    return (int8_t)(int32_t)r;
}

static void quant_scalar(const void *src, int dtype, int64_t n, float s,
                         int8_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = code1(load1(src, dtype, i), s);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1

__attribute__((target("avx2,f16c")))
static inline __m256 load8(const void *src, int dtype, int64_t i) {
    const __m128i *p = (const __m128i *)((const uint16_t *)src + i);
    if (dtype == 0) return _mm256_cvtph_ps(_mm_loadu_si128(p));
    if (dtype == 1) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    return _mm256_loadu_ps((const float *)src + i);
}

__attribute__((target("avx2,f16c")))
static inline __m256i codes8(__m256 x, __m256 s) {
    __m256 q = _mm256_div_ps(x, s);
    /* max/min return the bound for a NaN quotient (no defined code either way) */
    q = _mm256_max_ps(q, _mm256_set1_ps(CODE_MIN));
    q = _mm256_min_ps(q, _mm256_set1_ps(CODE_MAX));
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvttps_epi32(q);
}

/* The same codes in three vector operations instead of five, for a thread whose
   MXCSR rounds to nearest even (checked per call, see rounds_to_nearest):
   * min(CODE_MAX, q) caps the top; its operand order returns q for a NaN q;
   * cvtps2dq rounds half to even under that MXCSR, and every quotient it cannot
     represent (NaN, -inf, below -2^31) becomes INT32_MIN;
   * the two saturating packs of the caller then cap the bottom at CODE_MIN.
   So a quotient below -128 (or -inf) packs to -128 as clamp-then-round gives,
   and NaN packs to -128 as codes8 gives (max returns the bound there); in between
   rounding commutes with the integer clamp bounds. The true division stays. */
__attribute__((target("avx2,f16c")))
static inline __m256i codes8_rn(__m256 x, __m256 s) {
    __m256 q = _mm256_div_ps(x, s);
    q = _mm256_min_ps(_mm256_set1_ps(CODE_MAX), q);
    return _mm256_cvtps_epi32(q);
}

/* x * r with r = RN(1 / s), then codes8_rn's cap and conversion: the division
   replaced by a product (half the vector work on this loop). A product can round
   to a different code than the quotient (x / s next to a half-integer), so this
   only runs for a scale and 16-bit input dtype whose every one of the 65536 input
   patterns product_exact found to give codes8_rn's code (lane by lane the same
   instructions on the same value: equal on every input of that dtype). */
__attribute__((target("avx2,f16c")))
static inline __m256i codes8_mul(__m256 x, __m256 r) {
    __m256 q = _mm256_mul_ps(x, r);
    q = _mm256_min_ps(_mm256_set1_ps(CODE_MAX), q);
    return _mm256_cvtps_epi32(q);
}

/* The 32 codes of src[i:i + 32] in order (mode 0: codes8, 1: codes8_rn, 2:
   codes8_mul with s the reciprocal): four 8-lane conversions and the saturating
   packs, which work per 128-bit lane; the permute puts the 8 dwords back in order. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256i codes32(const void *src, int dtype, int64_t i, __m256 s,
                              int mode) {
    __m256i a, b, c, d;
    if (mode == 2) {
        a = codes8_mul(load8(src, dtype, i), s);
        b = codes8_mul(load8(src, dtype, i + 8), s);
        c = codes8_mul(load8(src, dtype, i + 16), s);
        d = codes8_mul(load8(src, dtype, i + 24), s);
    } else if (mode == 1) {
        a = codes8_rn(load8(src, dtype, i), s);
        b = codes8_rn(load8(src, dtype, i + 8), s);
        c = codes8_rn(load8(src, dtype, i + 16), s);
        d = codes8_rn(load8(src, dtype, i + 24), s);
    } else {
        a = codes8(load8(src, dtype, i), s);
        b = codes8(load8(src, dtype, i + 8), s);
        c = codes8(load8(src, dtype, i + 16), s);
        d = codes8(load8(src, dtype, i + 24), s);
    }
    __m256i ab = _mm256_packs_epi32(a, b);
    __m256i cd = _mm256_packs_epi32(c, d);
    __m256i abcd = _mm256_packs_epi16(ab, cd);
    return _mm256_permutevar8x32_epi32(
        abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Elements ahead of the current position that the loop prefetches: the rows of
   one call are contiguous in memory, so this fetches the next rows' lines while
   the division of the current ones runs (the hardware prefetcher alone left the
   loop waiting on memory; 4 KiB ahead measured best). */
#define PREFETCH_AHEAD 2048

/* The codes of src[0:n] under one scale: the 32 codes of element i go to
   out + (i / 32) * ostride (ostride 32: contiguous; the NZ fractal-row stride:
   straight into the cache). A tail (n % 32) needs ostride == 32; it takes the
   scalar division. mode 0: codes8, 1: codes8_rn, 2: codes8_mul. */
__attribute__((target("avx2,f16c"), always_inline))
static inline void quant_avx2_impl(const void *src, int dtype, int64_t n,
                                   float scale, int8_t *out, int64_t ostride,
                                   int mode) {
    __m256 s = _mm256_set1_ps(mode == 2 ? 1.0f / scale : scale);
    int64_t es = dtype == 2 ? 4 : 2, i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm_prefetch((const char *)src + (i + PREFETCH_AHEAD) * es, _MM_HINT_T0);
        if (es == 4)
            _mm_prefetch((const char *)src + (i + PREFETCH_AHEAD) * es + 64,
                         _MM_HINT_T0);
        _mm256_storeu_si256((__m256i *)(out + (i / 32) * ostride),
                            codes32(src, dtype, i, s, mode));
    }
    if (i < n) quant_scalar((const char *)src + i * es, dtype, n - i, scale,
                            out + i);
}

/* One instance per input dtype and path, so the loop has no branch (mode 2 is
   only ever chosen for the 16-bit dtypes). */
__attribute__((target("avx2,f16c")))
static void quant_avx2(const void *src, int dtype, int64_t n, float scale,
                       int8_t *out, int64_t ostride, int mode) {
    if (mode == 2) {
        if (dtype == 0) quant_avx2_impl(src, 0, n, scale, out, ostride, 2);
        else quant_avx2_impl(src, 1, n, scale, out, ostride, 2);
    } else if (mode == 1) {
        if (dtype == 0) quant_avx2_impl(src, 0, n, scale, out, ostride, 1);
        else if (dtype == 1) quant_avx2_impl(src, 1, n, scale, out, ostride, 1);
        else quant_avx2_impl(src, 2, n, scale, out, ostride, 1);
    } else {
        if (dtype == 0) quant_avx2_impl(src, 0, n, scale, out, ostride, 0);
        else if (dtype == 1) quant_avx2_impl(src, 1, n, scale, out, ostride, 0);
        else quant_avx2_impl(src, 2, n, scale, out, ostride, 0);
    }
}

/* Every token of a write in one loop (D % 32 == 0, every head on the same path):
   the 32 codes of chunk j of a token's row go to base + j * ostride (ND: the
   row at its slot, ostride 32; NZ: fractal row j, ostride bs * 32). fac holds
   each head's scale (modes 0, 1) or its reciprocal (mode 2), so the per-head
   constant is formed once per call, not once per token and head. */
__attribute__((target("avx2,f16c"), always_inline))
static inline void rows_avx2_impl(const void *src, int dtype, int64_t T, int64_t H,
                                  int64_t D, const float *fac, const void *slots,
                                  int wide, int8_t *cache, int64_t bs, int64_t run,
                                  int mode) {
    int64_t w = H * D, es = dtype == 2 ? 4 : 2, n1 = w / 32;
    int64_t ostride = run == 0 ? 32 : bs * 32;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slot_at(slots, wide, t);
        if (slot < 0) continue;
        const char *x = (const char *)src + t * w * es;
        int8_t *base;
        if (run == 0) {
            base = cache + slot * w;
        } else {
            int64_t blk = slot / bs;
            base = cache + (blk * n1 * bs + (slot - blk * bs)) * 32;
        }
        for (int64_t h = 0; h < H; h++) {
            __m256 f = _mm256_set1_ps(fac[h]);
            const char *xh = x + h * D * es;
            int8_t *oh = base + (h * D / 32) * ostride;
            for (int64_t i = 0; i < D; i += 32) {
                _mm_prefetch(xh + (i + PREFETCH_AHEAD) * es, _MM_HINT_T0);
                if (es == 4)
                    _mm_prefetch(xh + (i + PREFETCH_AHEAD) * es + 64, _MM_HINT_T0);
                _mm256_storeu_si256((__m256i *)(oh + (i / 32) * ostride),
                                    codes32(xh, dtype, i, f, mode));
            }
        }
    }
}

__attribute__((target("avx2,f16c")))
static void rows_avx2(const void *src, int dtype, int64_t T, int64_t H, int64_t D,
                      const float *fac, const void *slots, int wide, int8_t *cache,
                      int64_t bs, int64_t run, int mode) {
#define ROWS(dt, m) \
    rows_avx2_impl(src, dt, T, H, D, fac, slots, wide, cache, bs, run, m)
    if (mode == 2) {
        if (dtype == 0) ROWS(0, 2);
        else ROWS(1, 2);
    } else if (mode == 1) {
        if (dtype == 0) ROWS(0, 1);
        else if (dtype == 1) ROWS(1, 1);
        else ROWS(2, 1);
    } else {
        if (dtype == 0) ROWS(0, 0);
        else if (dtype == 1) ROWS(1, 0);
        else ROWS(2, 0);
    }
#undef ROWS
}

/* Whether codes8_mul gives codes8_rn's code for every one of the 65536 bit
   patterns of a 16-bit dtype (0 fp16, 1 bf16) under scale s: an exhaustive
   comparison of the two kernel paths, about 0.1 ms, under the caller's MXCSR
   (the default one, see product_mode). Random absmax / 127 scales pass about 995
   times in 1000 (a failing one has an input whose quotient lies within the
   product's rounding error of a half-integer); a scale that fails keeps the
   division. */
__attribute__((target("avx2,f16c")))
static int product_exact(float s, int dtype) {
    uint16_t pat[1024];
    int8_t by_div[1024], by_mul[1024];
    for (int32_t base = 0; base < 65536; base += 1024) {
        for (int32_t i = 0; i < 1024; i++) pat[i] = (uint16_t)(base + i);
        quant_avx2(pat, dtype, 1024, s, by_div, 32, 1);
        quant_avx2(pat, dtype, 1024, s, by_mul, 32, 2);
        if (memcmp(by_div, by_mul, 1024) != 0) return 0;
    }
    return 1;
}

/* Verdicts of product_exact by (scale bits, dtype), direct-mapped. An entry is
   one 64-bit word (scale bits << 32 | dtype << 8 | verdict << 1 | 1) read and
   written atomically, so concurrent callers see a whole entry or a miss. */
#define EXACT_SLOTS 4096
static uint64_t exact_cache[EXACT_SLOTS];

__attribute__((target("avx2,f16c")))
static int product_ok(float s, int dtype) {
    uint32_t bits;
    memcpy(&bits, &s, 4);
    uint64_t key = ((uint64_t)bits << 32) | ((uint64_t)dtype << 8) | 1u;
    uint32_t slot = ((bits * 2654435761u) >> 20 ^ (uint32_t)dtype) % EXACT_SLOTS;
    uint64_t e = __atomic_load_n(&exact_cache[slot], __ATOMIC_RELAXED);
    if ((e & ~(uint64_t)2) == key) return (int)((e >> 1) & 1);
    int ok = product_exact(s, dtype);
    __atomic_store_n(&exact_cache[slot], key | ((uint64_t)ok << 1), __ATOMIC_RELAXED);
    return ok;
}

static int explicit_round = 0;
static int use_product = 1;

/* Whether codes8_rn may run: this thread's SSE rounding mode is round to nearest
   even (MXCSR.RC == 0, the default; codes8 names its rounding instead), and the
   tests have not asked for the codes8 path (afa_set_explicit_round). */
static inline int rounds_to_nearest(void) {
    return !explicit_round && (_mm_getcsr() & 0x6000u) == 0;
}

/* Whether codes8_mul may be considered: a 16-bit input dtype, the default MXCSR
   (round to nearest, no flush-to-zero or denormals-are-zero, exceptions masked;
   the status flags ignored) so that product_exact's verdicts, all taken under it,
   hold, and not switched off (afa_set_product). */
static inline int product_allowed(int dtype) {
    return use_product && !explicit_round && dtype != 2 &&
           (_mm_getcsr() & ~0x3fu) == 0x1f80u;
}

/* The path for one scale: 2 (product, verified), 1 (division, cvtps2dq) or 0. */
__attribute__((target("avx2,f16c")))
static inline int quant_mode(float s, int dtype, int rn, int product) {
    if (product && product_ok(s, dtype)) return 2;
    return rn;
}
#endif

static int simd = -1;

int afa_simd(void) {
#ifdef HAVE_X86
    if (simd < 0)
        simd = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    return simd;
#else
    return 0;
#endif
}

/* 1: AVX2 path when the CPU has it (the default), 0: the portable scalar path. */
void afa_set_simd(int on) {
    simd = -1;
    if (on) afa_simd();
    else simd = 0;
}

/* 1: the AVX2 path rounds by roundps + cvttps2dq whatever the MXCSR (what a
   thread with another rounding mode runs), 0: by cvtps2dq where MXCSR allows. */
void afa_set_explicit_round(int on) {
#ifdef HAVE_X86
    explicit_round = on != 0;
#else
    (void)on;
#endif
}

/* 0: the AVX2 path always divides, 1: it multiplies by the reciprocal for the
   scales product_exact verified (the default). */
void afa_set_product(int on) {
#ifdef HAVE_X86
    use_product = on != 0;
#else
    (void)on;
#endif
}

/* Whether the product path runs for scale s and 16-bit dtype (0 fp16, 1 bf16) on
   this thread: -1 without AVX2, else 0 / 1 (the verdict, checked and cached). */
int afa_product_exact(float s, int dtype) {
#ifdef HAVE_X86
    if (!afa_simd() || (dtype != 0 && dtype != 1)) return -1;
    return quant_mode(s, dtype, rounds_to_nearest(), product_allowed(dtype)) == 2;
#else
    (void)s;
    (void)dtype;
    return -1;
#endif
}

static void quant(const void *src, int dtype, int64_t n, float s, int8_t *out) {
#ifdef HAVE_X86
    if (afa_simd()) {
        int rn = rounds_to_nearest();
        quant_avx2(src, dtype, n, s, out, 32,
                   quant_mode(s, dtype, rn, product_allowed(dtype)));
        return;
    }
#endif
    quant_scalar(src, dtype, n, s, out);
}

/* Copy one token row of row_bytes to slot: ND (run == 0) the whole row at
   slot * row_bytes; NZ its row_bytes / run fractal rows of run bytes, row j of the
   token at ((blk * n1 + j) * bs + r) * run. */
static inline void put(uint8_t *cache, const uint8_t *row, int64_t slot,
                       int64_t row_bytes, int64_t bs, int64_t run) {
    if (run == 0) {
        memcpy(cache + slot * row_bytes, row, (size_t)row_bytes);
        return;
    }
    int64_t blk = slot / bs, r = slot - blk * bs, n1 = row_bytes / run;
    uint8_t *base = cache + (blk * n1 * bs + r) * run;
    int64_t stride = bs * run;
    /* fixed sizes let the compiler inline the 32- and 64-byte copies */
    if (run == 32) {
        for (int64_t j = 0; j < n1; j++) memcpy(base + j * stride, row + j * 32, 32);
    } else if (run == 64) {
        for (int64_t j = 0; j < n1; j++) memcpy(base + j * stride, row + j * 64, 64);
    } else {
        for (int64_t j = 0; j < n1; j++)
            memcpy(base + j * stride, row + j * run, (size_t)run);
    }
}

/* src [T, H, D] (dtype 0 fp16, 1 bf16, 2 fp32), scale [H] fp32 -> int8 codes of
   every token with slot >= 0 written to cache. On the AVX2 path the codes go
   straight to the cache: an ND row is contiguous at its slot, and with D % 32 == 0
   each 32 codes of an NZ row are one whole fractal row (C0 = 32 int8). Otherwise a
   token's row is staged and put() copies it. */
int afa_quant_write(const void *src, int dtype, int64_t T, int64_t H, int64_t D,
                    const float *scale, const void *slots, int wide, int8_t *cache,
                    int64_t bs, int64_t run) {
    int8_t row[ROW_MAX];
    int64_t w = H * D, es = dtype == 2 ? 4 : 2;
    if (w > ROW_MAX) return -1;
#ifdef HAVE_X86
    if (afa_simd() && (run == 0 || (run == 32 && D % 32 == 0))) {
        /* the path of each head's scale, chosen once per call (up to 256 heads;
           more heads, a rare shape, keep the division) */
        int rn = rounds_to_nearest(), mode[256], same = H <= 256;
        float fac[256];
        int product = H <= 256 && product_allowed(dtype);
        for (int64_t h = 0; h < H && h < 256; h++) {
            mode[h] = quant_mode(scale[h], dtype, rn, product);
            fac[h] = mode[h] == 2 ? 1.0f / scale[h] : scale[h];
            same = same && mode[h] == mode[0];
        }
        if (same && D % 32 == 0) {
            rows_avx2(src, dtype, T, H, D, fac, slots, wide, cache, bs, run, mode[0]);
            return 0;
        }
        for (int64_t t = 0; t < T; t++) {
            int64_t s = slot_at(slots, wide, t);
            if (s < 0) continue;
            const char *x = (const char *)src + t * w * es;
            if (run == 0) {
                int8_t *dst = cache + s * w;
                for (int64_t h = 0; h < H; h++)
                    quant_avx2(x + h * D * es, dtype, D, scale[h], dst + h * D, 32,
                               H <= 256 ? mode[h] : rn);
            } else {
                /* fractal row j of the token at ((blk * n1 + j) * bs + r) * 32 */
                int64_t blk = s / bs, r = s - blk * bs, n1 = w / 32;
                int8_t *base = cache + (blk * n1 * bs + r) * 32;
                for (int64_t h = 0; h < H; h++)
                    quant_avx2(x + h * D * es, dtype, D, scale[h],
                               base + (h * D / 32) * bs * 32, bs * 32,
                               H <= 256 ? mode[h] : rn);
            }
        }
        return 0;
    }
#endif
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slot_at(slots, wide, t);
        if (s < 0) continue;
        const char *x = (const char *)src + t * w * es;
        for (int64_t h = 0; h < H; h++)
            quant(x + h * D * es, dtype, D, scale[h], row + h * D);
        put((uint8_t *)cache, (const uint8_t *)row, s, w, bs, run);
    }
    return 0;
}

/* The smallest slot that slots[0:n] lists twice (negative slots are padding and
   skipped; every slot is < num_slots, validated before), -1 when none, -2 when
   this does not decide (the caller sorts instead), -3 when out of memory.
   A prefill hands out whole blocks: when every group of bs consecutive valid
   entries is a run start, start + 1, ... with start a multiple of bs, two groups
   collide exactly when they share a block, so one bit per block decides (and
   the smallest repeated slot is the smallest shared block's first slot). Any
   other pattern takes one bit per slot when num_slots <= max_bits. */
int64_t afa_repeated_slot(const void *slots, int wide, int64_t n, int64_t num_slots,
                          int64_t bs, int64_t max_bits) {
    /* whole blocks: one bit per block, marked at each group's first slot; the
       position in the group is counted, so only a group's first slot takes a
       (slow, 64-bit) division */
    uint8_t *seen = calloc((size_t)((num_slots + bs - 1) / bs / 8 + 1), 1);
    if (seen == NULL) return -3;
    int64_t pos = 0, start = 0, found = -1;
    int runs = 1;
    for (int64_t t = 0; t < n; t++) {
        int64_t v = slot_at(slots, wide, t);
        if (v < 0) continue;
        if (pos == 0) {
            if (v % bs != 0) {
                runs = 0;
                break;
            }
            start = v;
            int64_t b = v / bs;
            uint8_t bit = (uint8_t)(1u << (b & 7));
            if (seen[b >> 3] & bit) {
                if (found < 0 || v < found) found = v;
            } else {
                seen[b >> 3] |= bit;
            }
        } else if (v != start + pos) {
            runs = 0;
            break;
        }
        if (++pos == bs) pos = 0;
    }
    free(seen);
    if (runs) return found;
    if (num_slots > max_bits) return -2;
    /* any other pattern: one bit per slot */
    seen = calloc((size_t)(num_slots / 8 + 1), 1);
    if (seen == NULL) return -3;
    found = -1;
    for (int64_t t = 0; t < n; t++) {
        int64_t v = slot_at(slots, wide, t);
        if (v < 0) continue;
        uint8_t bit = (uint8_t)(1u << (v & 7));
        if (seen[v >> 3] & bit) {
            if (found < 0 || v < found) found = v;
        } else {
            seen[v >> 3] |= bit;
        }
    }
    free(seen);
    return found;
}

/* src [T, row_bytes] copied unchanged (float cache of the input's dtype). */
int afa_copy_write(const void *src, int64_t T, int64_t row_bytes, const void *slots,
                   int wide, uint8_t *cache, int64_t bs, int64_t run) {
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slot_at(slots, wide, t);
        if (s < 0) continue;
        put(cache, (const uint8_t *)src + t * row_bytes, s, row_bytes, bs, run);
    }
    return 0;
}

/* The quantizer alone, for tests: src [n] -> out [n] with one scale. */
void afa_quantize(const void *src, int dtype, int64_t n, float s, int8_t *out) {
    quant(src, dtype, n, s, out);
}
"""

#: Optimisation only; no flag that relaxes IEEE semantics (no -ffast-math), and no
#: contraction of a product and a sum into one FMA: the division, the products and
#: the rounding must be the exact IEEE operations the eager path performs.
_CFLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-fno-fast-math",
    "-ffp-contract=off",
    "-std=gnu99",
)


def _source() -> str:
    return (
        (_SOURCE + FP8_SOURCE + ATTENTION_SOURCE + LINEAR_SOURCE)
        .replace("@ROW_MAX@", str(MAX_ROW_BYTES))
        .replace("@ROUND_MAGIC@", repr(float(ROUND_MAGIC)))
        .replace("@CODE_MIN@", str(INT8_MIN))
        .replace("@CODE_MAX@", str(INT8_MAX))
    )


@dataclass(frozen=True)
class NativeStatus:
    """Which cache-write path runs on CPU and why.

    ``available``: the native library is loaded; ``compiler``: the C compiler used;
    ``compile_s``: seconds this process spent compiling it (0 when it was loaded
    from the disk cache, ``from_cache``); ``simd``: the AVX2 + F16C path is used;
    ``reason``: why the eager path runs when not available."""

    available: bool
    path: str | None = None
    compiler: str | None = None
    compile_s: float = 0.0
    from_cache: bool = False
    simd: bool = False
    reason: str = ""

    def describe(self) -> str:
        """One line for benchmark output."""
        if not self.available:
            return f"eager torch ({self.reason})"
        how = (
            "loaded from the disk cache"
            if self.from_cache
            else f"compiled in {self.compile_s:.2f} s"
        )
        isa = "AVX2+F16C" if self.simd else "scalar"
        return f"native C ({isa}, {self.compiler}, {how})"


def native_enabled() -> bool:
    """False when ``ASCEND_FA_NATIVE=0`` (read on every call, so a test or a
    benchmark can switch paths in-process)."""
    return bool(settings.get(NATIVE_ENV))


@contextlib.contextmanager
def native_disabled() -> Iterator[None]:
    """Run the block on the eager torch path (``ASCEND_FA_NATIVE=0``, restored
    on exit)."""
    before = os.environ.get(NATIVE_ENV)
    os.environ[NATIVE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NATIVE_ENV, None)
        else:
            os.environ[NATIVE_ENV] = before


def _find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def _cache_dir() -> Path:
    env = settings.get(NATIVE_CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(base) / "ascend_fa"


def _private_dir(directory: Path) -> str | None:
    """Make ``directory`` (mode 0700) and check that only this user can put a
    library there: a real directory (not a symlink), owned by the current user,
    not writable by group or others. Returns why not, or None. A library loaded
    with ``ctypes`` runs with the caller's rights, so a directory someone else can
    write (a shared temp dir, a planted symlink) is never used."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        return f"{directory}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory}: not a directory (a symlink is not followed)"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{directory}: owned by another user"
    if st.st_mode & 0o022:
        return f"{directory}: writable by group or others"
    return None


def _own_file(path: Path) -> bool:
    """``path`` is a regular file (not a symlink) of the current user that
    group and others cannot write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and (not hasattr(os, "getuid") or st.st_uid == os.getuid())
        and not st.st_mode & 0o022
    )


def _cache_dirs() -> list[Path]:
    """Where the library may be cached: the user's cache directory, then a
    per-user directory in the temp dir (``ascend_fa-<uid>``, mode 0700)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [_cache_dir(), Path(tempfile.gettempdir()) / f"ascend_fa-{uid}"]


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def build_library(directory: str | os.PathLike[str], cc: str | None = None) -> Path:
    """Compile the kernels into ``directory`` (a fresh build, no cache lookup) and
    return the library's path. Raises ``RuntimeError`` with the compiler's message
    when there is no compiler or it fails. Used by :func:`native_kernels` and by the
    benchmark to measure the cold compile cost."""
    cc = cc or _find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"afa_cache_write_{os.getpid()}_{threading.get_ident()}.c"
    src.write_text(_source(), encoding="utf-8")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *_CFLAGS, "-o", tmp, str(src)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        src.unlink(missing_ok=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        first = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise RuntimeError(
            f"{cc} failed (exit {proc.returncode}): {first[0] if first else ''}"
        )
    return Path(tmp)


class NativeKernels:
    """The loaded library with typed wrappers (pointers come from tensors the
    caller has validated: contiguous, CPU, the dtypes named)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.afa_quant_write.argtypes = [
            ptr, c_int, i64, i64, i64, ptr, ptr, c_int, ptr, i64, i64
        ]  # fmt: skip
        lib.afa_quant_write.restype = c_int
        lib.afa_copy_write.argtypes = [ptr, i64, i64, ptr, c_int, ptr, i64, i64]
        lib.afa_copy_write.restype = c_int
        lib.afa_quantize.argtypes = [ptr, c_int, i64, ctypes.c_float, ptr]
        lib.afa_quantize.restype = None
        lib.afa_simd.restype = c_int
        lib.afa_fp8_dequantize.argtypes = [
            ptr, i64, i64, ptr, i64, i64, ptr, ptr, c_int
        ]  # fmt: skip
        lib.afa_fp8_dequantize.restype = i64
        lib.afa_fp8_quantize.argtypes = [ptr, c_int, i64, i64, i64, i64, ptr, ptr]
        lib.afa_fp8_quantize.restype = i64
        lib.afa_fp8_e4m3.argtypes = [ptr, i64, ptr]
        lib.afa_fp8_e4m3.restype = i64
        lib.afa_repeated_slot.argtypes = [ptr, c_int, i64, i64, i64, i64]
        lib.afa_repeated_slot.restype = i64
        lib.afa_gqa_decode.argtypes = [
            ptr, ptr, ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64,
            c_int, i64, i64, ptr,
        ]  # fmt: skip
        lib.afa_gqa_decode.restype = c_int
        f32 = ctypes.c_float
        lib.afa_static_codes.argtypes = [ptr, c_int, i64, f32, f32, c_int, ptr]
        lib.afa_static_codes.restype = c_int
        lib.afa_static_dequant.argtypes = [ptr, i64, i64, ptr, ptr, c_int, ptr]
        lib.afa_static_dequant.restype = c_int
        lib.afa_set_simd.argtypes = [c_int]
        lib.afa_set_simd.restype = None
        lib.afa_set_explicit_round.argtypes = [c_int]
        lib.afa_set_explicit_round.restype = None
        lib.afa_set_product.argtypes = [c_int]
        lib.afa_set_product.restype = None
        lib.afa_product_exact.argtypes = [ctypes.c_float, c_int]
        lib.afa_product_exact.restype = c_int
        self._lib = lib
        self.simd = bool(lib.afa_simd())

    def set_simd(self, enabled: bool) -> bool:
        """Use the AVX2 + F16C path when the CPU has it (``True``, the default) or
        the portable scalar path (``False``, what a CPU without AVX2 runs); returns
        whether the SIMD path is now in use."""
        self._lib.afa_set_simd(int(enabled))
        self.simd = bool(self._lib.afa_simd())
        return self.simd

    def set_explicit_rounding(self, enabled: bool) -> None:
        """Make the AVX2 quantizer round with an explicit round-to-nearest-even
        instruction (``True``: the path a thread whose MXCSR rounds otherwise
        takes) instead of the conversion under the default MXCSR (``False``, the
        default); both give the same codes, the tests run both."""
        self._lib.afa_set_explicit_round(int(enabled))

    def set_product(self, enabled: bool) -> None:
        """Let the AVX2 quantizer multiply by the reciprocal for scales whose
        product codes were verified equal on every 16-bit input (``True``, the
        default) or always divide (``False``); the tests run both."""
        self._lib.afa_set_product(int(enabled))

    def product_exact(self, scale: float, dtype: torch.dtype) -> bool | None:
        """Whether the quantizer runs the verified product path for ``scale`` and
        16-bit ``dtype`` on this thread (None: no AVX2 path or another dtype)."""
        code = _DTYPE_CODES.get(dtype, -1)
        rc = self._lib.afa_product_exact(scale, code if code in (0, 1) else -1)
        return None if rc < 0 else bool(rc)

    def quant_write(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        run_bytes: int,
    ) -> None:
        """Quantize ``x`` ``[T, H, D]`` (contiguous) by ``scale`` ``[H]`` fp32 into
        the int8 ``cache``; ``run_bytes`` 0 for ND, the fractal row bytes for NZ."""
        t, h, d = x.shape
        rc = self._lib.afa_quant_write(
            x.data_ptr(),
            _DTYPE_CODES[x.dtype],
            t,
            h,
            d,
            scale.data_ptr(),
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            cache.data_ptr(),
            block_size,
            run_bytes,
        )
        if rc != 0:
            raise ValueError(f"row of {h * d} codes exceeds {MAX_ROW_BYTES} bytes")

    def repeated_slot(
        self, slots: torch.Tensor, num_slots: int, block_size: int
    ) -> int | None | bool:
        """The smallest slot that contiguous int32/int64 ``slots`` ``[T]`` lists
        twice (negative slots skipped; every slot must be ``< num_slots``), None
        when none, or False when the kernel does not decide (a pattern other than
        whole blocks on a cache too large for one bit per slot; the caller sorts)."""
        n = slots.numel()
        # one bit per slot costs num_slots / 8 bytes zeroed: allowed while that
        # stays within a small multiple of the slots' own bytes
        rc = self._lib.afa_repeated_slot(
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            n,
            num_slots,
            block_size,
            max(1 << 16, 64 * n),
        )
        if rc >= 0:
            return int(rc)
        return None if rc == -1 else False

    def copy_write(
        self,
        x: torch.Tensor,
        slots: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        run_bytes: int,
    ) -> None:
        """Copy the rows of ``x`` ``[T, ...]`` (contiguous, the cache dtype)."""
        t = x.shape[0]
        self._lib.afa_copy_write(
            x.data_ptr(),
            t,
            x[0].numel() * x.element_size() if t else 0,
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            cache.data_ptr(),
            block_size,
            run_bytes,
        )

    def fp8_dequantize(
        self,
        codes: torch.Tensor,
        scale_inv: torch.Tensor,
        block: tuple[int, int],
        lut: torch.Tensor,
        out: torch.Tensor,
    ) -> tuple[str, int] | None:
        """``out [r, n]`` (bf16 or fp16, contiguous) = ``(codes.float() *
        scale_inv).to(out.dtype)`` for contiguous ``codes [r, n] float8_e4m3fn`` and
        fp32 ``scale_inv [ceil(r/BR), ceil(n/BC)]``; ``lut`` is the fp32 value of
        each of the 256 codes. Returns None, or ``("nan", k)`` for the first NaN
        code at flat index ``k`` / ``("overflow", k)`` for the first fp16 result
        that is not finite (``out`` is then partly written), or ``("unsupported",
        -1)`` (fp16 output without F16C: nothing written)."""
        r, n = codes.shape
        kind = 0 if out.dtype == torch.bfloat16 else 1
        rc = self._lib.afa_fp8_dequantize(
            codes.data_ptr(),
            r,
            n,
            scale_inv.data_ptr(),
            block[0],
            block[1],
            lut.data_ptr(),
            out.data_ptr(),
            kind,
        )
        if rc == -1:
            return None
        if rc == -3:
            return ("unsupported", -1)
        return ("overflow" if rc % 2 else "nan", rc // 2)

    def fp8_quantize(
        self,
        w: torch.Tensor,
        block: tuple[int, int],
        scale_inv: torch.Tensor,
        codes: torch.Tensor,
    ) -> int | None:
        """Block-quantize contiguous ``w [r, n]`` (fp16, bf16 or fp32) into
        contiguous ``codes [r, n] float8_e4m3fn`` and fp32 ``scale_inv
        [ceil(r/BR), ceil(n/BC)]``, equal to the eager rule bit for bit. Returns
        None, the flat index of the first block holding inf or NaN (row-major), or
        -1 when this thread's float environment is not the default one (MXCSR
        rounding or flush-to-zero changed: nothing written, the caller runs the
        eager path)."""
        r, n = w.shape
        rc = self._lib.afa_fp8_quantize(
            w.data_ptr(),
            _DTYPE_CODES[w.dtype],
            r,
            n,
            block[0],
            block[1],
            scale_inv.data_ptr(),
            codes.data_ptr(),
        )
        return None if rc == -1 else (-1 if rc == -2 else int(rc))

    def fp8_e4m3(self, x: torch.Tensor) -> torch.Tensor | None:
        """The kernels' fp32 -> float8_e4m3fn conversion of contiguous fp32 ``x``
        (exposed so tests can sweep it against torch's cast); None outside the
        default float environment."""
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        rc = self._lib.afa_fp8_e4m3(x.data_ptr(), x.numel(), out.data_ptr())
        return None if rc == -2 else out

    def gqa_decode(
        self,
        q: torch.Tensor,
        coef: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        num_kv_heads: int,
        nz: bool,
        out: torch.Tensor,
        seqs: tuple[int, int],
    ) -> int:
        """Decode sequences ``[b0, b1)`` of contiguous fp32 ``q`` ``[B, H, D]``
        against the int8 caches (each block contiguous, blocks ``stride(0)``
        apart) through contiguous int32 ``table`` ``[B, n]`` and ``lens`` ``[B]``,
        into contiguous fp32 ``out`` ``[B, H, D]`` (before the V scale); ``coef``
        ``[H]`` fp32 is the score factor.
        Returns 0 or the kernel's error code (see
        :mod:`~ascend_fa.atb_ops.native_attention`)."""
        _, h, d = q.shape
        bs = key_cache.shape[2] if nz else key_cache.shape[1]
        return int(
            self._lib.afa_gqa_decode(
                q.data_ptr(),
                coef.data_ptr(),
                key_cache.data_ptr(),
                key_cache.stride(0),
                value_cache.data_ptr(),
                value_cache.stride(0),
                min(key_cache.shape[0], value_cache.shape[0]),
                bs,
                table.data_ptr(),
                table.shape[1],
                lens.data_ptr(),
                num_kv_heads,
                h,
                d,
                int(nz),
                seqs[0],
                seqs[1],
                out.data_ptr(),
            )  # fmt: skip
        )

    def static_codes(
        self, x: torch.Tensor, scale: float, offset: float, div: bool
    ) -> torch.Tensor | None:
        """``static_codes`` of contiguous CPU ``x`` (fp16, bf16 or fp32) with fp32
        ``scale`` / ``offset``: int8 of ``x``'s shape, or None outside the default
        float environment (see :mod:`~ascend_fa.atb_ops.native_linear`)."""
        out = torch.empty(x.shape, dtype=torch.int8)
        rc = self._lib.afa_static_codes(
            x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), scale, offset,
            int(div), out.data_ptr(),
        )  # fmt: skip
        return None if rc != 0 else out

    def static_dequant(
        self,
        acc: torch.Tensor,
        quant_bias: torch.Tensor | None,
        deq: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """``static_dequant`` of contiguous int32 ``acc`` ``[M, N]`` with int32
        ``quant_bias`` ``[N]`` (or None) and fp32 ``deq`` ``[N]`` into bf16 or
        fp32; None outside the default float environment."""
        m, n = acc.shape
        out = torch.empty(m, n, dtype=out_dtype)
        rc = self._lib.afa_static_dequant(
            acc.data_ptr(), m, n,
            None if quant_bias is None else quant_bias.data_ptr(), deq.data_ptr(),
            int(out_dtype == torch.bfloat16), out.data_ptr(),
        )  # fmt: skip
        return None if rc != 0 else out

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """The kernel's quantizer alone: codes of contiguous ``x`` under one scale
        (what the write stores; exposed so tests can sweep every input value)."""
        out = torch.empty(x.shape, dtype=torch.int8)
        self._lib.afa_quantize(
            x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), scale, out.data_ptr()
        )
        return out


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _load() -> tuple[NativeKernels | None, NativeStatus]:
    if sys.platform not in ("linux", "darwin"):
        return None, NativeStatus(False, reason=f"no native kernels on {sys.platform}")
    cc = _find_compiler()
    if cc is None:
        return None, NativeStatus(False, reason="no C compiler ($CC, cc, gcc, clang)")
    ident = _compiler_id(cc)
    key = "\n".join([_source(), ident, " ".join(_CFLAGS), platform.machine()])
    name = f"afa_cache_write_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    reason = ""
    for directory in _cache_dirs():
        unsafe = _private_dir(directory)
        if unsafe is not None:
            reason = unsafe
            continue
        target = directory / name
        if target.is_file() and _own_file(target):
            try:
                kernels = NativeKernels(target)
            except OSError:
                pass  # damaged or foreign file: rebuild it below
            else:
                return kernels, NativeStatus(
                    True, str(target), ident, 0.0, True, kernels.simd
                )
        start = time.perf_counter()
        try:
            built = build_library(directory, cc)
        except (OSError, RuntimeError) as exc:
            reason = str(exc)
            continue
        elapsed = time.perf_counter() - start
        # atomic: another process building the same library concurrently either
        # sees the finished file or builds its own
        os.replace(built, target)
        kernels = NativeKernels(target)
        return kernels, NativeStatus(
            True, str(target), ident, elapsed, False, kernels.simd
        )
    return None, NativeStatus(False, compiler=ident, reason=reason)


def _loaded() -> tuple[NativeKernels | None, NativeStatus]:
    with _LOCK:
        if "status" not in _STATE:
            _STATE["kernels"], _STATE["status"] = _load()
        return _STATE["kernels"], _STATE["status"]  # type: ignore[return-value]


def native_kernels() -> NativeKernels | None:
    """The loaded kernels (built on the first call of the process), or None when
    disabled (``ASCEND_FA_NATIVE=0``) or unavailable."""
    if not native_enabled():
        return None
    return _loaded()[0]


def native_status() -> NativeStatus:
    """Which path the CPU cache write takes (loads the kernels if enabled)."""
    if not native_enabled():
        return NativeStatus(False, reason=f"{NATIVE_ENV}=0")
    return _loaded()[1]
