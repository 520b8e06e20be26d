/* mfgserve's native kernels: plain C over raw arrays, loaded with ctypes (common/native.py).
 *
 * No Python or torch headers: the library builds in a fraction of a second with the system C
 * compiler, and ctypes releases the GIL for the length of each call, so sampler threads run
 * these concurrently. Every function validates its ids before it writes anything and returns
 * a negative status instead of touching memory out of bounds.
 */
#include <stdint.h>

#define MFG_BAD_ID (-1)

/* Rows ahead whose memory a loop over scattered rows asks for early: each row is a cache miss
 * (~150 ns on a VM), and a loop body of a few loads leaves the CPU too few misses in flight to
 * hide that; 8 measured best on 2-core x86 (4 and 16 less; docs/benchmarks.md, session 21). */
#define MFG_AHEAD 8
#if defined(__GNUC__) || defined(__clang__)
#define MFG_PREFETCH(p) __builtin_prefetch(p)
#else
#define MFG_PREFETCH(p) ((void)0)
#endif

/* Compact ids (see sampler_server/neighbor_sampler.py's relabel()).
 *
 * dst[0..nd) are unique ids, src[0..ns) any ids, all in [0, num_nodes). scratch has num_nodes
 * int32 slots, all -1 on entry; it is all -1 again on return. Writes the ids of src that are
 * not in dst, each once, in the order of their first appearance in src, to new_out (room for
 * ns), and the position of src[i] in [dst, new_out] to src_local[i].
 * Returns the number of new ids, or MFG_BAD_ID (nothing written) if an id is out of range. */
int64_t mfg_relabel(const int64_t *dst, int64_t nd, const int64_t *src, int64_t ns,
                    int64_t num_nodes, int32_t *scratch, int64_t *new_out, int64_t *src_local)
{
    for (int64_t i = 0; i < nd; i++)
        if ((uint64_t)dst[i] >= (uint64_t)num_nodes)
            return MFG_BAD_ID;
    for (int64_t i = 0; i < ns; i++)
        if ((uint64_t)src[i] >= (uint64_t)num_nodes)
            return MFG_BAD_ID;
    for (int64_t i = 0; i < nd; i++)
        scratch[dst[i]] = (int32_t)i;
    int64_t nn = 0;
    for (int64_t i = 0; i < ns; i++) {
        if (i + MFG_AHEAD < ns)
            MFG_PREFETCH(scratch + src[i + MFG_AHEAD]);
        int64_t v = src[i];
        int32_t p = scratch[v];
        if (p < 0) {
            p = (int32_t)(nd + nn);
            scratch[v] = p;
            new_out[nn++] = v;
        }
        src_local[i] = p;
    }
    for (int64_t i = 0; i < nd; i++)
        scratch[dst[i]] = -1;
    for (int64_t i = 0; i < nn; i++)
        scratch[new_out[i]] = -1;
    return nn;
}

/* Sorted draws with replacement (see sampler_server/seeded_sampler.py's choose_positions()).
 *
 * r[0..n*k) are uniform doubles in [0, 1) (row-major, k per row), deg[0..n) the rows' degrees
 * (each > k and < 2^31 - 1). Writes picks[r*k + j] = (int32)(r[r*k + j] * deg[r]), each row
 * sorted ascending (numpy's float64 multiply and truncating cast, so the same values), and
 * the indices of the rows holding two equal picks to redo (room for n), in order.
 * Returns the number of such rows. */
int64_t mfg_sorted_picks(const double *r, const int64_t *deg, int64_t n, int64_t k,
                         int32_t *picks, int64_t *redo)
{
    int64_t nr = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)deg[i];
        const double *u = r + i * k;
        int32_t *p = picks + i * k;
        int repeat = 0;
        for (int64_t j = 0; j < k; j++) { /* insertion sort as the values arrive */
            int32_t v = (int32_t)(u[j] * d);
            int64_t m = j;
            while (m > 0 && p[m - 1] > v) {
                p[m] = p[m - 1];
                m--;
            }
            if (m > 0 && p[m - 1] == v)
                repeat = 1;
            p[m] = v;
        }
        if (repeat)
            redo[nr++] = i;
    }
    return nr;
}

/* The sampled sources of every row, in row order (see seeded_sampler.py's sample_runs()).
 *
 * Row i's candidates are indices[start[i] .. start[i] + deg[i]). A row with deg > fanout
 * (fanout > 0) reads its fanout positions from the next row of picks (nbig x fanout, in
 * order; each in [0, deg)); any other row takes all its candidates (fanout -1, or deg <=
 * fanout), in order, or none (fanout 0). indices are int32 (idx64 == 0) or int64, idx_len of
 * them. Writes the sources as int64 to src (room for the total).
 * Returns the number written, or MFG_BAD_ID (nothing written) if a run or pick is out of
 * range or the big rows do not number nbig. */
#define MFG_GATHER_ROWS(T)                                                                 \
    do {                                                                                   \
        const T *ix = (const T *)indices;                                                  \
        int64_t o = 0, b = 0;                                                              \
        for (int64_t i = 0; i < n; i++) {                                                  \
            if (i + MFG_AHEAD < n)                                                         \
                MFG_PREFETCH(ix + start[i + MFG_AHEAD]);                                   \
            const T *row = ix + start[i];                                                  \
            if (fanout > 0 && deg[i] > fanout) {                                           \
                const int32_t *p = picks + b * fanout;                                     \
                for (int64_t j = 0; j < fanout; j++)                                       \
                    src[o + j] = (int64_t)row[p[j]];                                       \
                o += fanout;                                                               \
                b++;                                                                       \
            } else if (fanout != 0) {                                                      \
                for (int64_t j = 0; j < deg[i]; j++)                                       \
                    src[o + j] = (int64_t)row[j];                                          \
                o += deg[i];                                                               \
            }                                                                              \
        }                                                                                  \
        return o;                                                                          \
    } while (0)

int64_t mfg_gather_rows(const int64_t *start, const int64_t *deg, int64_t n, int64_t fanout,
                        const int32_t *picks, int64_t nbig, const void *indices,
                        int64_t idx_len, int32_t idx64, int64_t *src)
{
    if (fanout < -1)
        return MFG_BAD_ID;
    int64_t b = 0;
    for (int64_t i = 0; i < n; i++) {
        if (start[i] < 0 || deg[i] < 0 || deg[i] > idx_len - start[i])
            return MFG_BAD_ID;
        if (fanout > 0 && deg[i] > fanout) {
            if (b >= nbig)
                return MFG_BAD_ID;
            const int32_t *p = picks + b * fanout;
            for (int64_t j = 0; j < fanout; j++)
                if (p[j] < 0 || p[j] >= deg[i])
                    return MFG_BAD_ID;
            b++;
        }
    }
    if (b != nbig)
        return MFG_BAD_ID;
    if (idx64)
        MFG_GATHER_ROWS(int64_t);
    MFG_GATHER_ROWS(int32_t);
}

/* Floyd's draws for the rows that repeated (see seeded_sampler.py's _floyd(): the same
 * values). u[i * nr + q] (k x nr, row-major, uniform in [0, 1)) drives step i of row
 * redo[q], whose degree is deg[redo[q]] (> k, < 2^31 - 1): with j = deg - k + i, t =
 * (int32)(u * (j + 1)), or j when t was chosen at an earlier step; written to
 * picks[redo[q] * k + i]. redo's entries must be in [0, n). */
void mfg_floyd(const double *u, const int64_t *deg, const int64_t *redo, int64_t nr, int64_t k,
               int32_t *picks)
{
    for (int64_t q = 0; q < nr; q++) {
        const int64_t row = redo[q];
        int32_t *p = picks + row * k;
        const int32_t base = (int32_t)(deg[row] - k);
        for (int64_t i = 0; i < k; i++) {
            const int32_t j = base + (int32_t)i;
            int32_t t = (int32_t)(u[i * nr + q] * (double)(j + 1));
            for (int64_t m = 0; m < i; m++)
                if (p[m] == t) {
                    t = j;
                    break;
                }
            p[i] = t;
        }
    }
}

/* Each row's run in a CSC: start[i] = indptr[rows[i]], deg[i] = indptr[rows[i] + 1] -
 * start[i] (numpy's indptr[rows] and its difference, in one pass with the next rows' indptr
 * fetched ahead). rows must be in [0, nrows); indptr has nrows + 1 entries.
 * Returns 0, or MFG_BAD_ID (nothing written) if a row is out of range. */
int64_t mfg_row_runs(const int64_t *indptr, int64_t nrows, const int64_t *rows, int64_t n,
                     int64_t *start, int64_t *deg)
{
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)rows[i] >= (uint64_t)nrows)
            return MFG_BAD_ID;
    for (int64_t i = 0; i < n; i++) {
        if (i + MFG_AHEAD < n)
            MFG_PREFETCH(indptr + rows[i + MFG_AHEAD]);
        const int64_t s = indptr[rows[i]];
        start[i] = s;
        deg[i] = indptr[rows[i] + 1] - s;
    }
    return 0;
}
