/* The native CPU kernels of ascend_fa.atb_ops: every exported function, declared
   once. ascend_fa/atb_ops/native.py reads these declarations to type its ctypes
   bindings (and tests/test_native_build.py checks them with a C parser), so this
   file stays in a simple form: includes, the AFA_API macro, and one prototype per
   function with scalar types int / int64_t / float / void and pointers.

   dtype codes: 0 fp16, 1 bf16, 2 fp32. Shapes in brackets are row-major and
   contiguous; a "slot" array is int32 (wide = 0) or int64 (wide = 1). */
#ifndef AFA_NATIVE_H
#define AFA_NATIVE_H

#include <stdint.h>

/* Exported from the shared library (built with -fvisibility=hidden: nothing else
   is). */
#define AFA_API __attribute__((visibility("default")))

/* -- paged cache write (cache_write.c) ------------------------------------------ */

/* src [T, H, D] (dtype), scale [H] fp32 -> int8 codes of every token with
   slot >= 0 written to cache: run == 0 ND rows of H * D codes at slot * H * D;
   run == 32 NZ, fractal row j of the token at ((blk * n1 + j) * bs + r) * 32.
   Returns 0, or -1 when H * D exceeds AFA_ROW_MAX (nothing written). */
AFA_API int afa_quant_write(const void *src, int dtype, int64_t T, int64_t H, int64_t D,
                            const float *scale, const void *slots, int wide,
                            int8_t *cache, int64_t bs, int64_t run);

/* src [T, row_bytes] copied unchanged to the slots (a float cache of the input's
   dtype), ND (run == 0) or NZ fractal runs of run bytes. Returns 0. */
AFA_API int afa_copy_write(const void *src, int64_t T, int64_t row_bytes,
                           const void *slots, int wide, uint8_t *cache, int64_t bs,
                           int64_t run);

/* The smallest slot that slots[0:n] lists twice (negative slots skipped; every
   slot < num_slots), -1 when none, -2 when this does not decide (the caller
   sorts), -3 when out of memory. */
AFA_API int64_t afa_repeated_slot(const void *slots, int wide, int64_t n,
                                  int64_t num_slots, int64_t bs, int64_t max_bits);

/* The quantizer alone, for tests: src [n] (dtype) -> out [n] int8 under scale s. */
AFA_API void afa_quantize(const void *src, int dtype, int64_t n, float s, int8_t *out);

/* 1 when the AVX2 + F16C path is in use (chosen from the CPU's feature bits). */
AFA_API int afa_simd(void);

/* 1: the AVX2 path when the CPU has it (the default), 0: the portable scalar path. */
AFA_API void afa_set_simd(int on);

/* 1: the AVX2 quantizer rounds by roundps + cvttps2dq whatever the MXCSR, 0: by
   cvtps2dq where the MXCSR allows (the default). */
AFA_API void afa_set_explicit_round(int on);

/* 0: the AVX2 quantizer always divides, 1: it multiplies by the reciprocal for
   the scales product_exact verified (the default). */
AFA_API void afa_set_product(int on);

/* Whether the product path runs for scale s and 16-bit dtype (0, 1) on this
   thread: -1 without AVX2 or for another dtype, else 0 / 1. */
AFA_API int afa_product_exact(float s, int dtype);

/* -- FP8 E4M3 blocks (fp8.c) ------------------------------------------------------ */

/* out [r, n] (kind 0 bf16, 1 fp16) = codes [r, n] x scale [ceil(r/br), ceil(n/bc)]
   fp32; lut [256] the fp32 value of each code. Returns -1, 2 * k for the first NaN
   code at flat index k, 2 * k + 1 for the first fp16 result that is not finite,
   or -3 when fp16 output needs F16C (nothing written). */
AFA_API int64_t afa_fp8_dequantize(const uint8_t *codes, int64_t r, int64_t n,
                                   const float *scale, int64_t br, int64_t bc,
                                   const float *lut, uint16_t *out, int kind);

/* src [r, n] (dtype) -> scale [ceil(r/br), ceil(n/bc)] fp32 and codes [r, n]
   float8_e4m3fn. Returns -1, the flat index of the first block holding inf or
   NaN, or -2 outside the default float environment (nothing written). */
AFA_API int64_t afa_fp8_quantize(const void *src, int dtype, int64_t r, int64_t n,
                                 int64_t br, int64_t bc, float *scale, uint8_t *codes);

/* The fp32 -> E4M3 conversion alone, for tests: x [n] -> out [n]. Returns -1, or
   -2 outside the default float environment (nothing written). */
AFA_API int64_t afa_fp8_e4m3(const float *x, int64_t n, uint8_t *out);

/* -- GQA decode over an int8 paged cache (gqa_decode.c) ---------------------------- */

/* Sequences [b0, b1) of a decode step: q [B, H, D] fp32, coef [H] fp32 -> out
   [B, H, D] fp32 (before the V scale); caches int8, block i at i * stride (ND:
   [bs, hkv * D] rows, nz = 0; NZ: hkv * D / 32 runs of [bs, 32], nz = 1); table
   int32 [B, tcols]; lens int32 [B]. Returns 0, -1 for a length outside
   [1, tcols * bs], -2 for a block id outside [0, nblocks), -3 out of memory. */
AFA_API int afa_gqa_decode(const float *q, const float *coef, const int8_t *kc,
                           int64_t kstride, const int8_t *vc, int64_t vstride,
                           int64_t nblocks, int64_t bs, const int32_t *table,
                           int64_t tcols, const int32_t *lens, int64_t hkv, int64_t h,
                           int64_t d, int nz, int64_t b0, int64_t b1, float *out);

/* -- static W8A8 linears (linear.c) ------------------------------------------------ */

/* x [count] (dtype) -> int8 codes of fl(x * s) (div = 0) or fl(x / s) (div = 1)
   plus o. Returns 0, or -1 outside the default float environment. */
AFA_API int afa_static_codes(const void *x, int dtype, int64_t count, float s, float o,
                             int div, int8_t *out);

/* acc int32 [m, n], qb int32 [n] or NULL, deq fp32 [n] -> out [m, n] bf16 (bf16 =
   1) or fp32. Returns 0, or -1 outside the default float environment. */
AFA_API int afa_static_dequant(const int32_t *acc, int64_t m, int64_t n,
                               const int32_t *qb, const float *deq, int bf16,
                               void *out);

/* -- exact integer product of the linears (int_gemm.c) ----------------------------- */

/* out [m, n] int32 = x [m, k] int8 times w [n, k] int8 transposed, columns [n0, n1)
   only (each thread of the caller takes a range). Returns 0, -1 for a bad range,
   -2 when out of memory (nothing written). */
AFA_API int afa_int_gemm(const int8_t *x, int64_t m, const int8_t *w, int64_t k,
                         int64_t n, int64_t n0, int64_t n1, int32_t *out);

#endif /* AFA_NATIVE_H */
