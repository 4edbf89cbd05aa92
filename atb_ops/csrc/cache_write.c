/* Paged KV cache write of ascend_fa.atb_ops.cache, and the quantizer it uses.

   The eager cache write quantizes in four fp32 passes and scatters in a fifth; per
   element that costs about ten times a copy of the int8 output. These kernels do
   the whole write of one token in one pass over its row: widen (fp16/bf16 -> fp32,
   exact), divide by the head's scale, round half to even, saturate to int8, and
   copy the row's 32-byte fractal runs (NZ) or the whole row (ND) to the slot.
   Float caches take the same scatter without the arithmetic.

   The codes are those of ascend_fa.atb_ops.quant.quantize_per_head bit for bit
   (the tests compare every fp16 and bf16 value under several scales):
   * the quotient is a true IEEE fp32 division (divps / "/"), never a product with
     a reciprocal unless that product was verified equal on every input of the
     dtype (product_exact), so it is fl(x / s) exactly as torch forms it;
   * the quotient is clamped to [CODE_MIN, CODE_MAX] before rounding: the bounds
     are integers and rounding is monotonic, so round(clamp(q)) == clamp(round(q));
     +-inf quotients land on the bounds;
   * rounding is half to even: on AVX2 machines cvtps2dq under the default MXCSR
     (round to nearest even, checked per call; the two saturating packs clamp the
     bottom) or roundps with _MM_FROUND_TO_NEAREST_INT where MXCSR rounds
     otherwise, the ROUND_MAGIC add on the scalar path (all exact for |q| <= 128);
   * fp16 is widened by vcvtph2ps (F16C) or bit arithmetic with the subnormals
     converted from their integer mantissa (exact; no reliance on denormal fp32
     arithmetic, which a flush-to-zero mode would change); bf16 is its bits << 16.

   On AVX2 machines the codes go straight into the cache (an ND row at its slot;
   with D % 32 == 0 each 32 codes are one whole NZ fractal row) and the loop
   prefetches the rows ahead. The AVX2 + F16C path is chosen at run time from the
   CPU's feature bits (afa_simd), so one library also runs on an older x86 CPU. */
#include "afa_internal.h"

static inline int64_t slot_at(const void *slots, int wide, int64_t t) {
    return wide ? ((const int64_t *)slots)[t] : ((const int32_t *)slots)[t];
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

static void quant_scalar(const void *src, int dtype, int64_t n, float s, int8_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = code1(load1(src, dtype, i), s);
}

#ifdef HAVE_X86
static inline AFA_AVX2 __m256i codes8(__m256 x, __m256 s) {
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
static inline AFA_AVX2 __m256i codes8_rn(__m256 x, __m256 s) {
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
static inline AFA_AVX2 __m256i codes8_mul(__m256 x, __m256 r) {
    __m256 q = _mm256_mul_ps(x, r);
    q = _mm256_min_ps(_mm256_set1_ps(CODE_MAX), q);
    return _mm256_cvtps_epi32(q);
}

/* The 32 codes of src[i:i + 32] in order (mode 0: codes8, 1: codes8_rn, 2:
   codes8_mul with s the reciprocal): four 8-lane conversions and the saturating
   packs, which work per 128-bit lane; the permute puts the 8 dwords back in order. */
static inline AFA_AVX2 AFA_ALWAYS_INLINE __m256i codes32(const void *src, int dtype,
                                                         int64_t i, __m256 s,
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
    return _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
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
static inline AFA_AVX2 AFA_ALWAYS_INLINE void
quant_avx2_impl(const void *src, int dtype, int64_t n, float scale, int8_t *out,
                int64_t ostride, int mode) {
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
    if (i < n) quant_scalar((const char *)src + i * es, dtype, n - i, scale, out + i);
}

/* One instance per input dtype and path, so the loop has no branch (mode 2 is
   only ever chosen for the 16-bit dtypes). */
static AFA_AVX2 void quant_avx2(const void *src, int dtype, int64_t n, float scale,
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
static inline AFA_AVX2 AFA_ALWAYS_INLINE void
rows_avx2_impl(const void *src, int dtype, int64_t T, int64_t H, int64_t D,
               const float *fac, const void *slots, int wide, int8_t *cache, int64_t bs,
               int64_t run, int mode) {
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

static AFA_AVX2 void rows_avx2(const void *src, int dtype, int64_t T, int64_t H,
                               int64_t D, const float *fac, const void *slots, int wide,
                               int8_t *cache, int64_t bs, int64_t run, int mode) {
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
static AFA_AVX2 int product_exact(float s, int dtype) {
    uint16_t pat[1024];
    int8_t by_div[1024], by_mul[1024];
    /* callers pass 0 or 1 (product_allowed); said so, the compiler sees that the
       buffer is never read as fp32 */
    dtype = dtype != 0;
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

static AFA_AVX2 int product_ok(float s, int dtype) {
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
static inline AFA_AVX2 int quant_mode(float s, int dtype, int rn, int product) {
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
