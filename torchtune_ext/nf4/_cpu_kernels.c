/* CPU kernels for frozen weights as stored (x86-64: AVX-512 or AVX2): NF4 decoding, and products of a few tokens
 * with an NF4 or 16-bit weight that never write a dense copy of it. Built and loaded by _cpu_kernels.py (its
 * docstring says why and how); the Python side checks every shape and layout before calling in.
 *
 * Every weight value is the one torchao computes: NF4 ``table[code] * block_scale`` in fp32, rounded to the NF4
 * tensor's dtype (round_mode). Decoding writes it exactly (then converted to the output's dtype, rounding to nearest
 * even, as torch's ``.to``); products multiply it by the fp32 activation and sum in fp32, so only their summation
 * order differs from torch.mm's.
 */
#include <immintrin.h>
#include <stdint.h>

enum { KEEP_FP32 = 0, ROUND_BF16 = 1, ROUND_FP16 = 2 };
/* The table lookups (permutes) read only the low 4 bits of each 32-bit index (AVX2's: 3, and bit 3 picks the half),
 * so a code byte widened to 32 bits is the index of its low nibble as it is. */
/* tokens multiplied per pass over a row of W (their accumulators stay in registers) */
#define TOKENS_PER_PASS 4

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value = {(uint32_t)bits << 16};
    return value.f;
}

/* 1: AVX-512F, 2: AVX2 + FMA + F16C, 0: neither (the caller uses torch). */
int tte_cpu_level(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c")) return 1;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 2;
    return 0;
}

/* ---------------------------------------------------------------- AVX-512 */

__attribute__((target("avx512f,f16c"))) static inline __m512 round512(__m512 v, int round_mode) {
    if (round_mode == ROUND_BF16) { /* round to nearest even; NaN to 0xFFFF, as torch's vectorized conversion */
        __m512i u = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
        return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
    if (round_mode == ROUND_FP16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

/* Tokens [0, m) (m <= TOKENS_PER_PASS) times one row of W: codes (k/2 bytes), scales (k/bs), x (m, k) deinterleaved in
 * groups of 32 (16 even, then 16 odd positions). Each block's 16 weight values are computed once (the table times the
 * scale, rounded), then looked up per code. */
__attribute__((target("avx512f,f16c"), always_inline)) static inline void nf4_row512(const float *x, int64_t m, int64_t k,
                                                               const uint8_t *codes, const float *scales,
                                                               const float *levels, int64_t bs, int round_mode,
                                                               float *y, int64_t y_stride) {
    const __m512 table = _mm512_loadu_ps(levels);
    __m512 acc[2 * TOKENS_PER_PASS];
    for (int64_t t = 0; t < 2 * m; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t start = 0; start < k; start += bs) {
        __m512 block = round512(_mm512_mul_ps(table, _mm512_set1_ps(scales[start / bs])), round_mode);
        for (int64_t i = start; i < start + bs; i += 32) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i / 2)));
            __m512 even = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), block); /* high nibble first */
            __m512 odd = _mm512_permutexvar_ps(bytes, block);
            for (int64_t t = 0; t < m; ++t) {
                acc[2 * t] = _mm512_fmadd_ps(even, _mm512_loadu_ps(x + t * k + i), acc[2 * t]);
                acc[2 * t + 1] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x + t * k + i + 16), acc[2 * t + 1]);
            }
        }
    }
    for (int64_t t = 0; t < m; ++t) y[t * y_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * t], acc[2 * t + 1]));
}

__attribute__((target("avx512f,f16c"))) static float dense16_dot512(const float *x, int64_t k, const uint16_t *w,
                                                               int is_fp16) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m256i half = _mm256_loadu_si256((const __m256i *)(w + i));
        __m512 values = is_fp16 ? _mm512_cvtph_ps(half)
                                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
        acc = _mm512_fmadd_ps(values, _mm512_loadu_ps(x + i), acc);
    }
    float sum = _mm512_reduce_add_ps(acc);
    for (; i < k; ++i) {
        sum += (is_fp16 ? _cvtsh_ss(w[i]) : bf16_to_float(w[i])) * x[i];
    }
    return sum;
}

/* One block's 16 values, rounded to the weight's dtype, then to the output's (exact where it is no narrower). */
__attribute__((target("avx512f,f16c"))) static inline __m512 block_values512(__m512 table, float scale, int round_mode,
                                                                             int out_mode) {
    return round512(round512(_mm512_mul_ps(table, _mm512_set1_ps(scale)), round_mode), out_mode);
}

__attribute__((target("avx512f,f16c"))) static void nf4_decode_blocks512(const uint8_t *codes, const float *scales,
                                                                         const float *levels, int64_t count,
                                                                         int64_t bs, int round_mode, int out_mode,
                                                                         void *out) {
    const __m512 table = _mm512_loadu_ps(levels);
    /* positions 0-15 and 16-31 of 32 codes: (high, low) nibbles of bytes 0-7, then of bytes 8-15 */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t b = 0; b < count; ++b) {
        __m512 block = block_values512(table, scales[b], round_mode, out_mode);
        for (int64_t i = b * bs; i < (b + 1) * bs; i += 32) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i / 2)));
            __m512i high = _mm512_srli_epi32(bytes, 4), low = bytes;
            __m512 v0 = _mm512_permutexvar_ps(_mm512_permutex2var_epi32(high, first, low), block);
            __m512 v1 = _mm512_permutexvar_ps(_mm512_permutex2var_epi32(high, second, low), block);
            if (out_mode == KEEP_FP32) {
                _mm512_storeu_ps((float *)out + i, v0);
                _mm512_storeu_ps((float *)out + i + 16, v1);
            } else if (out_mode == ROUND_BF16) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v0), 16)));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i + 16),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v1), 16)));
            } else {
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i + 16),
                                    _mm512_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT));
            }
        }
    }
}

/* ---------------------------------------------------------------- AVX2 */

__attribute__((target("avx2,fma,f16c"))) static inline __m256 round256(__m256 v, int round_mode) {
    if (round_mode == ROUND_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
        u = _mm256_or_si256(u, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
    if (round_mode == ROUND_FP16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

/* table[index] for 8 indices in 0..15: two 8-entry permutes, bit 3 picks (moved to the sign bit for blendv). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 lookup256(__m256i index, __m256 low, __m256 high) {
    __m256 pick_high = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index), _mm256_permutevar8x32_ps(high, index), pick_high);
}

__attribute__((target("avx2,fma,f16c"))) static void nf4_decode_blocks256(const uint8_t *codes, const float *scales,
                                                                          const float *levels, int64_t count,
                                                                          int64_t bs, int round_mode, int out_mode,
                                                                          void *out) {
    const __m256 table_low = _mm256_loadu_ps(levels), table_high = _mm256_loadu_ps(levels + 8);
    for (int64_t b = 0; b < count; ++b) {
        __m256 scale = _mm256_set1_ps(scales[b]);
        __m256 low = round256(round256(_mm256_mul_ps(table_low, scale), round_mode), out_mode);
        __m256 high = round256(round256(_mm256_mul_ps(table_high, scale), round_mode), out_mode);
        for (int64_t i = b * bs; i < (b + 1) * bs; i += 16) {
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i / 2)));
            __m256i high_nibbles = _mm256_srli_epi32(bytes, 4), low_nibbles = bytes;
            /* (h0 l0 h1 l1 | h4 l4 h5 l5) and (h2 l2 h3 l3 | h6 l6 h7 l7), then their halves in order */
            __m256i a = _mm256_unpacklo_epi32(high_nibbles, low_nibbles);
            __m256i c = _mm256_unpackhi_epi32(high_nibbles, low_nibbles);
            __m256 v0 = lookup256(_mm256_permute2x128_si256(a, c, 0x20), low, high);
            __m256 v1 = lookup256(_mm256_permute2x128_si256(a, c, 0x31), low, high);
            if (out_mode == KEEP_FP32) {
                _mm256_storeu_ps((float *)out + i, v0);
                _mm256_storeu_ps((float *)out + i + 8, v1);
            } else if (out_mode == ROUND_BF16) {
                __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(v0), 16),
                                                     _mm256_srli_epi32(_mm256_castps_si256(v1), 16));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm256_permute4x64_epi64(packed, 0xD8));
            } else {
                _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT));
                _mm_storeu_si128((__m128i *)((uint16_t *)out + i + 8), _mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT));
            }
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static inline __m256 hsum_lanes256(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    return _mm256_castps128_ps256(_mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1)));
}

/* nf4_row512 with 8 lanes: bytes 0-7 of a group of 32 pair with its even/odd positions 0-7, bytes 8-15 with 8-15. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void nf4_row256(const float *x, int64_t m, int64_t k,
                                                                const uint8_t *codes, const float *scales,
                                                                const float *levels, int64_t bs, int round_mode,
                                                                float *y, int64_t y_stride) {
    const __m256 table_low = _mm256_loadu_ps(levels), table_high = _mm256_loadu_ps(levels + 8);
    __m256 acc[2 * TOKENS_PER_PASS];
    for (int64_t t = 0; t < 2 * m; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t start = 0; start < k; start += bs) {
        __m256 scale = _mm256_set1_ps(scales[start / bs]);
        __m256 low = round256(_mm256_mul_ps(table_low, scale), round_mode);
        __m256 high = round256(_mm256_mul_ps(table_high, scale), round_mode);
        for (int64_t i = start; i < start + bs; i += 16) {
            int64_t group = i & ~(int64_t)31, half = (i - group) / 2;
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i / 2)));
            __m256 even = lookup256(_mm256_srli_epi32(bytes, 4), low, high);
            __m256 odd = lookup256(bytes, low, high);
            for (int64_t t = 0; t < m; ++t) {
                const float *xs = x + t * k + group + half;
                acc[2 * t] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xs), acc[2 * t]);
                acc[2 * t + 1] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xs + 16), acc[2 * t + 1]);
            }
        }
    }
    for (int64_t t = 0; t < m; ++t)
        y[t * y_stride] = _mm256_cvtss_f32(hsum_lanes256(_mm256_add_ps(acc[2 * t], acc[2 * t + 1])));
}

__attribute__((target("avx2,fma,f16c"))) static float dense16_dot256(const float *x, int64_t k, const uint16_t *w,
                                                                     int is_fp16) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m128i half = _mm_loadu_si128((const __m128i *)(w + i));
        __m256 values = is_fp16 ? _mm256_cvtph_ps(half)
                                : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        acc = _mm256_fmadd_ps(values, _mm256_loadu_ps(x + i), acc);
    }
    float sum = _mm256_cvtss_f32(hsum_lanes256(acc));
    for (; i < k; ++i) {
        sum += (is_fp16 ? _cvtsh_ss(w[i]) : bf16_to_float(w[i])) * x[i];
    }
    return sum;
}

/* ---------------------------------------------------------------- entry points */

/* y (m, n) = x (m, k) @ W.T with W an NF4 weight (n, k): codes (n, k/2), scales (n, k/bs) in fp32, levels (16).
 * x is deinterleaved: each group of 32 values holds the 16 even positions, then the 16 odd ones.
 * k and bs are multiples of 32, k of bs. Each row of W is read once per TOKENS_PER_PASS tokens. */
/* nf4_row512 / nf4_row256 inlined with m a constant: the accumulators of 1-4 tokens stay in registers. */
#define NF4_ROWS(ISA, TARGET)                                                                                     \
    __attribute__((target(TARGET))) static void nf4_rows_##ISA(const float *x, int64_t m, int64_t k,              \
                                                              const uint8_t *codes, const float *scales,         \
                                                              const float *levels, int64_t bs, int round_mode,   \
                                                              float *y, int64_t n) {                             \
        switch (m) {                                                                                              \
            case 1: nf4_row##ISA(x, 1, k, codes, scales, levels, bs, round_mode, y, n); break;                    \
            case 2: nf4_row##ISA(x, 2, k, codes, scales, levels, bs, round_mode, y, n); break;                    \
            case 3: nf4_row##ISA(x, 3, k, codes, scales, levels, bs, round_mode, y, n); break;                    \
            default: nf4_row##ISA(x, 4, k, codes, scales, levels, bs, round_mode, y, n); break;                   \
        }                                                                                                         \
    }
NF4_ROWS(512, "avx512f,f16c")
NF4_ROWS(256, "avx2,fma,f16c")

void tte_nf4_gemv(int level, const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scales,
                  const float *levels, int64_t n, int64_t bs, int round_mode, float *y, int threads) {
    int64_t blocks = k / bs;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < n; ++row) {
        for (int64_t first = 0; first < m; first += TOKENS_PER_PASS) {
            int64_t tokens = m - first < TOKENS_PER_PASS ? m - first : TOKENS_PER_PASS;
            (level == 1 ? nf4_rows_512 : nf4_rows_256)(x + first * k, tokens, k, codes + row * (k / 2),
                                                       scales + row * blocks, levels, bs, round_mode,
                                                       y + first * n + row, n);
        }
    }
}

/* out (rows, cols) = the NF4 weight's values: row r's codes at codes + r * codes_stride (bytes), its block scales
 * (fp32) at scales + r * scales_stride, its output at out + r * out_stride elements of out_mode's dtype. cols is a
 * multiple of 32 and of bs. */
void tte_nf4_decode(int level, const uint8_t *codes, int64_t codes_stride, const float *scales, int64_t scales_stride,
                    const float *levels, int64_t rows, int64_t cols, int64_t bs, int round_mode, int out_mode,
                    void *out, int64_t out_stride, int threads) {
    int64_t per_row = cols / bs, chunk = per_row < 64 ? per_row : 64, chunks = (per_row + chunk - 1) / chunk;
    int64_t item = out_mode == KEEP_FP32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t task = 0; task < rows * chunks; ++task) {
        int64_t row = task / chunks, first = (task % chunks) * chunk;
        int64_t count = per_row - first < chunk ? per_row - first : chunk;
        const uint8_t *c = codes + row * codes_stride + first * bs / 2;
        const float *s = scales + row * scales_stride + first;
        char *o = (char *)out + (row * out_stride + first * bs) * item;
        if (level == 1)
            nf4_decode_blocks512(c, s, levels, count, bs, round_mode, out_mode, o);
        else
            nf4_decode_blocks256(c, s, levels, count, bs, round_mode, out_mode, o);
    }
}

/* y (m, n) = x (m, k) @ W.T with W (n, k) in bfloat16 (is_fp16 0) or float16 (1), row-major. */
void tte_dense16_gemv(int level, const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int is_fp16,
                      float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < n; ++row) {
        for (int64_t token = 0; token < m; ++token) {
            const float *xs = x + token * k;
            y[token * n + row] = level == 1 ? dense16_dot512(xs, k, w + row * k, is_fp16)
                                            : dense16_dot256(xs, k, w + row * k, is_fp16);
        }
    }
}
