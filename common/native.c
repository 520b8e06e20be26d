/* mfgserve's native kernels: plain C over raw arrays, loaded with ctypes (common/native.py).
 *
 * No Python or torch headers: the library builds in a fraction of a second with the system C
 * compiler, and ctypes releases the GIL for the length of each call, so sampler threads run
 * these concurrently. Every function validates its ids before it writes anything and returns
 * a negative status instead of touching memory out of bounds.
 */
#include <stdint.h>
#include <stdlib.h>

#define MFG_BAD_ID (-1)
#define MFG_NO_MEMORY (-2)
/* mfg_relabel marks the sources in a bitmap over their id range (one bit an id, zeroed per
 * call) when that range has at most this many 64-bit words per source; a sparser range takes
 * the provisional-slot pass and a radix sort instead. */
#define MFG_BITMAP_WORDS_PER_ID 4

/* Rows ahead whose memory a loop over scattered rows asks for early: each row is a cache miss
 * (~150 ns on a VM), and a loop body of a few loads leaves the CPU too few misses in flight to
 * hide that; 8 measured best on 2-core x86 (4 and 16 less; docs/benchmarks.md, session 21). */
#define MFG_AHEAD 8
#if defined(__GNUC__) || defined(__clang__)
#define MFG_PREFETCH(p) __builtin_prefetch(p)
#define MFG_CTZ64(x) __builtin_ctzll(x)
#else
#define MFG_PREFETCH(p) ((void)0)
static int mfg_ctz64(uint64_t x) /* x != 0 */
{
    int n = 0;
    for (; !(x & 1); x >>= 1)
        n++;
    return n;
}
#define MFG_CTZ64(x) mfg_ctz64(x)
#endif

/* The sparse path's first pass: dst[i] gets slot i, and each id of src not in dst a
 * provisional slot nd + q in order of first appearance (q-th new id, written to new_out[q]);
 * src_local[i] = src[i]'s slot. Leaves the scratch -1 for dst and the provisional slot for
 * the new ids. The ids were checked by the caller. Returns the number of new ids. */
static int64_t relabel_pass(const int64_t *dst, int64_t nd, const int64_t *src, int64_t ns,
                            int32_t *scratch, int64_t *new_out, int64_t *src_local)
{
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
    return nn;
}

/* Ascending LSD radix sort of v[0..n), all in [0, bound): 11 bits a pass (2 passes up to
 * 4M ids), tmp has room for n. */
static void radix_sort(int64_t *v, int64_t n, int64_t bound, int64_t *tmp)
{
    enum { BITS = 11, BUCKETS = 1 << BITS };
    int64_t count[BUCKETS];
    int64_t *a = v, *b = tmp;
    for (int shift = 0; shift < 63 && (bound - 1) >> shift > 0; shift += BITS) {
        for (int d = 0; d < BUCKETS; d++)
            count[d] = 0;
        for (int64_t i = 0; i < n; i++)
            count[(a[i] >> shift) & (BUCKETS - 1)]++;
        int64_t sum = 0;
        for (int d = 0; d < BUCKETS; d++) {
            const int64_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++)
            b[count[(a[i] >> shift) & (BUCKETS - 1)]++] = a[i];
        int64_t *t = a;
        a = b;
        b = t;
    }
    if (a != v)
        for (int64_t i = 0; i < n; i++)
            v[i] = a[i];
}

/* The dense path (see mfg_relabel): bits has nw zeroed words for ids from w0 * 64 on. */
static int64_t relabel_bitmap(const int64_t *dst, int64_t nd, const int64_t *src, int64_t ns,
                              int32_t *scratch, int64_t *new_out, int64_t *src_local,
                              uint64_t *bits, int64_t w0, int64_t nw)
{
    for (int64_t i = 0; i < ns; i++) { /* the bitmap stays in cache: no scattered misses */
        const int64_t v = src[i];
        bits[(v >> 6) - w0] |= (uint64_t)1 << (v & 63);
    }
    for (int64_t i = 0; i < nd; i++)
        scratch[dst[i]] = (int32_t)i;
    int64_t nn = 0; /* the marked ids in ascending order: each new one takes the next slot */
    for (int64_t w = 0; w < nw; w++) {
        for (uint64_t b = bits[w]; b; b &= b - 1) {
            const int64_t v = ((w0 + w) << 6) + MFG_CTZ64(b);
            if (scratch[v] < 0) {
                scratch[v] = (int32_t)(nd + nn);
                new_out[nn++] = v;
            }
        }
    }
    for (int64_t i = 0; i < ns; i++) {
        if (i + MFG_AHEAD < ns)
            MFG_PREFETCH(scratch + src[i + MFG_AHEAD]);
        src_local[i] = scratch[src[i]];
    }
    for (int64_t i = 0; i < nd; i++)
        scratch[dst[i]] = -1;
    for (int64_t q = 0; q < nn; q++)
        scratch[new_out[q]] = -1;
    return nn;
}

/* Compact ids (see sampler_server/neighbor_sampler.py's relabel()).
 *
 * dst[0..nd) are unique ids, src[0..ns) any ids, all in [0, num_nodes). scratch has num_nodes
 * int32 slots, all -1 on entry; it is all -1 again on return. Writes the ids of src that are
 * not in dst, each once, in ascending order, to new_out (room for ns), and the position of
 * src[i] in [dst, new_out] to src_local[i].
 * Returns the number of new ids; MFG_BAD_ID (nothing written) if an id is out of range;
 * MFG_NO_MEMORY (nothing written) if its work arrays cannot be allocated.
 *
 * Why ascending: the server gathers the last hop's ids' feature rows in this order, and rows
 * read front to back stream from memory far faster than in a random order (products-shaped
 * batch, 373k of 1M rows: gather 74 -> 50 ms; docs/benchmarks.md, session 22).
 * How, when the sources' id range has at most MFG_BITMAP_WORDS_PER_ID words of bits per
 * source (every hop but the first on a 1M-node graph): each source sets its bit in a bitmap of
 * the range, the set bits read in order give the new ids their slots in the scratch, and each
 * source then reads its slot there. The scattered scratch accesses are one read per source
 * plus the resets; the marking touches only the bitmap (125 KiB for 1M ids), which stays in
 * cache (last hop of a products-shaped batch, 663k sources: 10.6-11.0 ms -> 3.9-4.1 ms;
 * docs/benchmarks.md, session 26). Otherwise: relabel_pass, a radix sort of the new ids, and
 * each provisional slot in src_local mapped to its sorted one through a map of nn int32
 * slots. */
int64_t mfg_relabel(const int64_t *dst, int64_t nd, const int64_t *src, int64_t ns,
                    int64_t num_nodes, int32_t *scratch, int64_t *new_out, int64_t *src_local)
{
    for (int64_t i = 0; i < nd; i++)
        if ((uint64_t)dst[i] >= (uint64_t)num_nodes)
            return MFG_BAD_ID;
    int64_t lo = num_nodes, hi = -1;
    for (int64_t i = 0; i < ns; i++) {
        const int64_t v = src[i];
        if ((uint64_t)v >= (uint64_t)num_nodes)
            return MFG_BAD_ID;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    if (ns == 0)
        return 0;
    const int64_t w0 = lo >> 6, nw = (hi >> 6) - w0 + 1;
    if (nw <= MFG_BITMAP_WORDS_PER_ID * ns) {
        uint64_t *bits = calloc((size_t)nw, sizeof(uint64_t));
        if (bits == NULL)
            return MFG_NO_MEMORY;
        const int64_t nn = relabel_bitmap(dst, nd, src, ns, scratch, new_out, src_local,
                                          bits, w0, nw);
        free(bits);
        return nn;
    }
    int64_t *tmp = malloc((size_t)ns * sizeof(int64_t)); /* radix sort's; nn <= ns */
    int32_t *map = malloc((size_t)ns * sizeof(int32_t));
    if (tmp == NULL || map == NULL) {
        free(tmp);
        free(map);
        return MFG_NO_MEMORY;
    }
    const int64_t nn = relabel_pass(dst, nd, src, ns, scratch, new_out, src_local);
    radix_sort(new_out, nn, hi + 1, tmp);
    for (int64_t k = 0; k < nn; k++) {
        const int64_t v = new_out[k];
        map[scratch[v] - nd] = (int32_t)(nd + k);
        scratch[v] = -1;
    }
    for (int64_t i = 0; i < ns; i++) { /* branch-free: which slots are new is random */
        const int64_t q = src_local[i];
        const int64_t m = map[q >= nd ? q - nd : 0];
        src_local[i] = q >= nd ? m : q;
    }
    free(tmp);
    free(map);
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
