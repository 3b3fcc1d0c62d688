/* The loop both small-row matmul kernels share (`small_linear.c`, `small_linear_bf16.c`): OpenMP splits
 * the N output columns over torch's threads, and each column takes the rows of x in passes of up to
 * ROWS, with the pass's row count a compile-time constant at every call of `column` (so its loops
 * over rows unroll). Expects x, w, b, y, M, N, K in scope and `column(x, w, b, y, N, K, m0, n, MT)`. */
#define ROWS 8 /* rows of x per pass over a weight row */

#define FOR_EACH_COLUMN_AND_ROW_PASS()                                       \
    _Pragma("omp parallel for schedule(static)")                             \
    for (int64_t n = 0; n < N; n++) {                                        \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {                           \
            switch (M - m0 < ROWS ? M - m0 : ROWS) {                         \
            case 1: column(x, w, b, y, N, K, m0, n, 1); break;               \
            case 2: column(x, w, b, y, N, K, m0, n, 2); break;               \
            case 3: column(x, w, b, y, N, K, m0, n, 3); break;               \
            case 4: column(x, w, b, y, N, K, m0, n, 4); break;               \
            case 5: column(x, w, b, y, N, K, m0, n, 5); break;               \
            case 6: column(x, w, b, y, N, K, m0, n, 6); break;               \
            case 7: column(x, w, b, y, N, K, m0, n, 7); break;               \
            default: column(x, w, b, y, N, K, m0, n, 8); break;              \
            }                                                                \
        }                                                                    \
    }
