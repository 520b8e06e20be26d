/* mfgserve's native kernels: plain C over raw arrays, loaded with ctypes (common/native.py).
 *
 * No Python or torch headers: the library builds in a fraction of a second with the system C
 * compiler, and ctypes releases the GIL for the length of each call, so sampler threads run
 * these concurrently. Every function validates its ids before it writes anything and returns
 * a negative status instead of touching memory out of bounds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
#define MFG_PREFETCH_L2(p) __builtin_prefetch((p), 0, 1)
#define MFG_CTZ64(x) __builtin_ctzll(x)
#else
#define MFG_PREFETCH(p) ((void)0)
#define MFG_PREFETCH_L2(p) ((void)0)
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

/* numpy's PCG64 (PCG XSL-RR 128/64: the 128-bit LCG steps, then the output mixes the new
 * state's halves) and its Generator.random(): (next >> 11) * 2^-53. The state is numpy's
 * bit_generator.state["state"] as {state_hi, state_lo, inc_hi, inc_lo}. */
#define MFG_PCG_MUL_HI 2549297995355413924ULL
#define MFG_PCG_MUL_LO 4865540595714422341ULL
typedef struct {
    uint64_t hi, lo, inc_hi, inc_lo;
} mfg_pcg64;

#if defined(__SIZEOF_INT128__)
static inline double mfg_pcg_double(mfg_pcg64 *g)
{
    typedef unsigned __int128 u128;
    const u128 mul = ((u128)MFG_PCG_MUL_HI << 64) | MFG_PCG_MUL_LO;
    u128 s = (((u128)g->hi << 64) | g->lo) * mul + (((u128)g->inc_hi << 64) | g->inc_lo);
    g->hi = (uint64_t)(s >> 64);
    g->lo = (uint64_t)s;
#else
static inline uint64_t mfg_mulhi64(uint64_t a, uint64_t b)
{
    const uint64_t a0 = a & 0xffffffffu, a1 = a >> 32, b0 = b & 0xffffffffu, b1 = b >> 32;
    const uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    const uint64_t mid = (p00 >> 32) + (p01 & 0xffffffffu) + (p10 & 0xffffffffu);
    return p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}
static inline double mfg_pcg_double(mfg_pcg64 *g)
{
    uint64_t hi = mfg_mulhi64(g->lo, MFG_PCG_MUL_LO) + g->hi * MFG_PCG_MUL_LO
                  + g->lo * MFG_PCG_MUL_HI;
    uint64_t lo = g->lo * MFG_PCG_MUL_LO;
    const uint64_t lo2 = lo + g->inc_lo;
    hi += g->inc_hi + (lo2 < lo);
    g->hi = hi;
    g->lo = lo2;
#endif
    const uint64_t x = g->hi ^ g->lo;
    const unsigned rot = (unsigned)(g->hi >> 58);
    const uint64_t out = (x >> rot) | (x << ((64 - rot) & 63));
    return (double)(out >> 11) * (1.0 / 9007199254740992.0);
}

/* Rows of at most MFG_RANK_W (or 2 * MFG_RANK_W) picks are sorted by rank: pick i's slot is
 * the count of picks below it. The counts of all picks are accumulated at once, one pick m
 * against every lane i per step, over a row padded to a fixed width with INT32_MAX (above
 * every pick, so the pads never count), so the inner loop is a fixed run of compares the
 * compiler makes vector ones. Without a repeat the ranks are 0..k-1 and sum to k(k-1)/2;
 * equal picks share a rank, so the sum falls short and the row is redone by Floyd, which
 * overwrites it (the slots a repeat left unwritten included). Longer rows are sorted by
 * insertion. Every way gives the same sorted row. */
#define MFG_RANK_W 16
#if defined(__SSE2__)
/* SSE2 (every x86-64): 4 lanes a vector; the compilers tried leave the plain loop scalar. */
#define MFG_RANK_COUNT(W)                                                                  \
    do {                                                                                   \
        __m128i vv[(W) / 4], rr[(W) / 4];                                                  \
        for (int32_t q = 0; q < (W) / 4; q++) {                                            \
            vv[q] = _mm_loadu_si128((const __m128i *)(v + 4 * q));                         \
            rr[q] = _mm_setzero_si128();                                                   \
        }                                                                                  \
        for (int32_t m = 0; m < k32; m++) {                                                \
            const __m128i x = _mm_set1_epi32(v[m]);                                        \
            for (int32_t q = 0; q < (W) / 4; q++)                                          \
                rr[q] = _mm_sub_epi32(rr[q], _mm_cmpgt_epi32(vv[q], x));                   \
        }                                                                                  \
        for (int32_t q = 0; q < (W) / 4; q++)                                              \
            _mm_storeu_si128((__m128i *)(rank + 4 * q), rr[q]);                            \
    } while (0)
#else
#define MFG_RANK_COUNT(W)                                                                  \
    do {                                                                                   \
        for (int32_t i = 0; i < (W); i++)                                                  \
            rank[i] = 0;                                                                   \
        for (int32_t m = 0; m < k32; m++) {                                                \
            const int32_t x = v[m];                                                        \
            for (int32_t i = 0; i < (W); i++)                                              \
                rank[i] += x < v[i];                                                       \
        }                                                                                  \
    } while (0)
#endif
#define MFG_RANK_SORT(W)                                                                   \
    do {                                                                                   \
        int32_t v[W], rank[W];                                                             \
        for (int32_t i = 0; i < (W); i++)                                                  \
            v[i] = i < k32 ? (int32_t)(mfg_pcg_double(&g) * d) : INT32_MAX;               \
        MFG_RANK_COUNT(W);                                                                 \
        int64_t sum = 0;                                                                   \
        for (int32_t i = 0; i < k32; i++) {                                                \
            p[rank[i]] = v[i];                                                             \
            sum += rank[i];                                                                \
        }                                                                                  \
        repeat = sum != (int64_t)k32 * (k32 - 1) / 2;                                      \
    } while (0)

/* The seeded sampler's picks (sampler_server/seeded_sampler.py's choose_positions(): the same
 * values from the same numpy draws, made here instead of in numpy arrays).
 *
 * deg[0..n) are the rows' degrees (each > k and < 2^31 - 1), k >= 1. Draws n * k doubles
 * from the PCG64 state pcg (row-major: row i's k draws in turn), picks[i*k + j] = (int32)(u
 * * deg[i]) with each row sorted ascending. The rows holding two equal picks are then drawn
 * again by Floyd's algorithm from the next k * nr doubles, step-major (step s of every such
 * row in row order, then step s + 1): with j = deg - k + s, t = (int32)(u * (j + 1)), or j
 * when t was chosen at an earlier step; written unsorted, in step order. pcg is left at the
 * state after the last draw. redo has room for n (the rows drawn again, in order).
 * Returns the number of rows drawn again, or MFG_BAD_ID (nothing written) if k < 1 or a
 * degree is out of range, or MFG_NO_MEMORY (nothing written) if its work array cannot be
 * allocated. */
int64_t mfg_draw_picks(uint64_t *pcg, const int64_t *deg, int64_t n, int64_t k,
                       int32_t *picks, int64_t *redo)
{
    if (k < 1)
        return MFG_BAD_ID;
    for (int64_t i = 0; i < n; i++)
        if (deg[i] <= k || deg[i] >= 2147483647)
            return MFG_BAD_ID;
    int32_t *tb = n > 0 ? (int32_t *)malloc((size_t)(n * k) * sizeof(int32_t)) : NULL;
    if (n > 0 && tb == NULL) /* Floyd's draws (below): room for every row */
        return MFG_NO_MEMORY;
    mfg_pcg64 g = {pcg[0], pcg[1], pcg[2], pcg[3]};
    int64_t nr = 0;
    const int32_t k32 = (int32_t)k;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)deg[i];
        int32_t *p = picks + i * k;
        int repeat = 0;
        if (k <= MFG_RANK_W) {
            MFG_RANK_SORT(MFG_RANK_W);
        } else if (k <= 2 * MFG_RANK_W) {
            MFG_RANK_SORT(2 * MFG_RANK_W);
        } else {
            for (int64_t j = 0; j < k; j++) { /* insertion sort as the values arrive */
                const int32_t x = (int32_t)(mfg_pcg_double(&g) * d);
                int64_t m = j;
                while (m > 0 && p[m - 1] > x) {
                    p[m] = p[m - 1];
                    m--;
                }
                p[m] = x;
            }
            for (int64_t j = 1; j < k; j++)
                repeat |= p[j] == p[j - 1];
        }
        redo[nr] = i;
        nr += repeat;
    }
    /* Floyd. numpy draws its (k, nr) uniforms step-major (step s of every row, then step
     * s + 1). They are made in that order into tb, already scaled to t; then each row runs
     * its k steps at once. With SSE2 and k <= MFG_RANK_W a row's chosen values sit in four
     * vectors (-1: not chosen yet; every pick is >= 0): "t chosen before?" is four compares,
     * and two rows go side by side so that their steps' latency chains overlap. On a
     * products-shaped batch (85 % of the big rows redone) this is 23 % faster than the
     * step-major pass over the rows it replaced (session 40), with the same picks. */
    for (int64_t s = 0; s < k; s++)
        for (int64_t q = 0; q < nr; q++)
            tb[s * nr + q] =
                (int32_t)(mfg_pcg_double(&g) * (double)(deg[redo[q]] - k + s + 1));
    int64_t q0 = 0; /* the rows before q0 are done two at a time (SSE2), the rest below */
#if defined(__SSE2__)
    if (k <= MFG_RANK_W) { /* two rows at a time: their steps' latency chains interleave */
        const __m128i i0 = _mm_setr_epi32(0, 1, 2, 3), i1 = _mm_setr_epi32(4, 5, 6, 7),
                      i2 = _mm_setr_epi32(8, 9, 10, 11), i3 = _mm_setr_epi32(12, 13, 14, 15);
#define MFG_FLOYD_STEP(c0, c1, c2, c3, t, j, p)                                            \
        do {                                                                               \
            const __m128i tv_ = _mm_set1_epi32(t);                                         \
            const __m128i eq_ = _mm_or_si128(                                              \
                _mm_or_si128(_mm_cmpeq_epi32(c0, tv_), _mm_cmpeq_epi32(c1, tv_)),           \
                _mm_or_si128(_mm_cmpeq_epi32(c2, tv_), _mm_cmpeq_epi32(c3, tv_)));          \
            const int32_t v_ = _mm_movemask_epi8(eq_) ? (j) : (t);                         \
            (p)[s] = v_;                                                                   \
            const __m128i vv_ = _mm_set1_epi32(v_);                                        \
            c0 = _mm_or_si128(_mm_andnot_si128(m0, c0), _mm_and_si128(m0, vv_));           \
            c1 = _mm_or_si128(_mm_andnot_si128(m1, c1), _mm_and_si128(m1, vv_));           \
            c2 = _mm_or_si128(_mm_andnot_si128(m2, c2), _mm_and_si128(m2, vv_));           \
            c3 = _mm_or_si128(_mm_andnot_si128(m3, c3), _mm_and_si128(m3, vv_));           \
        } while (0)
        for (; q0 + 1 < nr; q0 += 2) {
            int32_t *pa = picks + redo[q0] * k, *pb = picks + redo[q0 + 1] * k;
            const int32_t ja = (int32_t)(deg[redo[q0]] - k);
            const int32_t jb = (int32_t)(deg[redo[q0 + 1]] - k);
            __m128i a0 = _mm_set1_epi32(-1), a1 = a0, a2 = a0, a3 = a0;
            __m128i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int32_t s = 0; s < k32; s++) {
                const __m128i sv = _mm_set1_epi32(s);
                const __m128i m0 = _mm_cmpeq_epi32(i0, sv), m1 = _mm_cmpeq_epi32(i1, sv),
                              m2 = _mm_cmpeq_epi32(i2, sv), m3 = _mm_cmpeq_epi32(i3, sv);
                const int32_t ta = tb[s * nr + q0], tbb = tb[s * nr + q0 + 1];
                MFG_FLOYD_STEP(a0, a1, a2, a3, ta, ja + s, pa);
                MFG_FLOYD_STEP(b0, b1, b2, b3, tbb, jb + s, pb);
            }
        }
#undef MFG_FLOYD_STEP
    }
#endif
    for (int64_t q = q0; q < nr; q++) {
        int32_t *p = picks + redo[q] * k;
        const int32_t j0 = (int32_t)(deg[redo[q]] - k);
        for (int64_t s = 0; s < k; s++) {
            const int32_t t = tb[s * nr + q];
            int hit = 0;
            for (int64_t m = 0; m < s; m++)
                hit |= p[m] == t;
            p[s] = hit ? (int32_t)(j0 + s) : t;
        }
    }
    free(tb);
    pcg[0] = g.hi;
    pcg[1] = g.lo;
    return nr;
}

/* The sampled sources of every row, in row order (see seeded_sampler.py's sample_runs()).
 *
 * Row i's candidates are indices[start[i] .. start[i] + deg[i]). A row with deg > fanout
 * (fanout > 0) reads its fanout positions from the next row of picks (nbig x fanout, in
 * order; each in [0, deg)); any other row takes all its candidates (fanout -1, or deg <=
 * fanout), in order, or none (fanout 0). indices are int32 (idx64 == 0) or int64, idx_len of
 * them. Writes the sources as int64 to src (room for the total).
 *
 * The memory of the row MFG_AHEAD rows on is fetched early, into L2: a row above the fanout
 * at each of its picked positions (a skewed graph's big rows span many lines, and the picks
 * land on different ones), any other row at its first and last candidate. Fetching only each
 * row's first line (until session 40) left the picks' misses to the loads themselves: this
 * pass is now 14-21 % faster on a batch's input hop, products and RMAT (docs/benchmarks.md,
 * "Issue 14, session 40").
 * Returns the number written, or MFG_BAD_ID (nothing written) if a run or pick is out of
 * range or the big rows do not number nbig. */
#define MFG_FETCH_ROW(T, a)                                                                \
    do {                                                                                   \
        const T *r_ = ix + start[a];                                                       \
        if (fanout > 0 && deg[a] > fanout) {                                               \
            const int32_t *q_ = picks + ba * fanout;                                       \
            for (int64_t j_ = 0; j_ < fanout; j_++)                                        \
                MFG_PREFETCH_L2(r_ + q_[j_]);                                              \
            ba++;                                                                          \
        } else if (fanout != 0 && deg[a] > 0) {                                            \
            MFG_PREFETCH_L2(r_);                                                           \
            MFG_PREFETCH_L2(r_ + deg[a] - 1);                                              \
        }                                                                                  \
    } while (0)
#define MFG_GATHER_ROWS(T)                                                                 \
    do {                                                                                   \
        const T *ix = (const T *)indices;                                                  \
        int64_t o = 0, b = 0, ba = 0; /* ba: big rows before the row fetched ahead */      \
        for (int64_t a = 0; a < n && a < MFG_AHEAD; a++)                                   \
            MFG_FETCH_ROW(T, a);                                                           \
        for (int64_t i = 0; i < n; i++) {                                                  \
            if (i + MFG_AHEAD < n)                                                         \
                MFG_FETCH_ROW(T, i + MFG_AHEAD);                                           \
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

/* A typed CSC's runs of one relation: each row's in-edge segment [indptr[v], indptr[v + 1])
 * has its edges' relation ids (etype, int16) in ascending order, so relation r's edges are
 * one run in it. start[i] and deg[i] are that run's first position and length for row
 * rows[i] (deg 0, start where the run would be, when the row has none): two binary searches
 * per row in one C pass, with the rows ahead's indptr and then their segments fetched ahead
 * (the numpy form, sampler_server/partition_store.py's relation_runs, takes ~10 passes over
 * all rows per search; docs/benchmarks.md, "Issue 14, session 41").
 * Returns 0, or MFG_BAD_ID (nothing written) if a row is outside [0, nrows) or a segment
 * outside etype's n_etype entries. */
int64_t mfg_relation_runs(const int64_t *indptr, int64_t nrows, const int16_t *etype,
                          int64_t n_etype, const int64_t *rows, int64_t n, int64_t r,
                          int64_t *start, int64_t *deg)
{
    for (int64_t i = 0; i < n; i++) {
        if ((uint64_t)rows[i] >= (uint64_t)nrows)
            return MFG_BAD_ID;
        const int64_t lo = indptr[rows[i]], hi = indptr[rows[i] + 1];
        if (lo < 0 || lo > hi || hi > n_etype)
            return MFG_BAD_ID;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i + 2 * MFG_AHEAD < n)
            MFG_PREFETCH(indptr + rows[i + 2 * MFG_AHEAD]);
        if (i + MFG_AHEAD < n)
            MFG_PREFETCH(etype + indptr[rows[i + MFG_AHEAD]]);
        const int64_t hi = indptr[rows[i] + 1];
        int64_t a = indptr[rows[i]], b = hi;
        while (a < b) { /* first position with etype >= r */
            const int64_t m = a + ((b - a) >> 1);
            if (etype[m] < r)
                a = m + 1;
            else
                b = m;
        }
        const int64_t s = a;
        b = hi;
        while (a < b) { /* first position with etype > r */
            const int64_t m = a + ((b - a) >> 1);
            if (etype[m] <= r)
                a = m + 1;
            else
                b = m;
        }
        start[i] = s;
        deg[i] = a - s;
    }
    return 0;
}

/* Feature rows into a reply: out's row i = base's row ids[i], row_bytes each (a partition's
 * feature matrix, num_rows rows, into a trainer's shared-memory slot; see
 * sampler_server/partition_store.py's gather()). The next rows' memory is fetched ahead.
 * With stream != 0 (large replies) the rows are written with non-temporal stores where SSE2,
 * 16-byte rows and a 16-byte aligned out allow: a reply larger than the cache is read next
 * by another process, so loading each destination line before overwriting it only costs
 * bandwidth (a products-sized gather, two at once: 13-17 ms a batch against 17-22 for
 * memcpy; docs/benchmarks.md, session 27). Otherwise memcpy per row.
 * The rows ahead are fetched into L2 only (prefetcht2), 8 rows ahead: a 400-byte row is 7
 * lines, and 4 rows' lines fetched into L1 (prefetcht0, until session 33) overran its few
 * fill buffers; the L2 form with 8 rows ahead is 12-18 % faster, one gather or two at once,
 * products and RMAT rows (docs/benchmarks.md, "Issue 14, session 33").
 * Returns n, or MFG_BAD_ID (nothing written) if an id is outside [0, num_rows). */
#define MFG_COPY_AHEAD 8
int64_t mfg_copy_rows(const char *base, int64_t row_bytes, int64_t num_rows, const int64_t *ids,
                      int64_t n, char *out, int32_t stream)
{
    if (row_bytes < 0)
        return MFG_BAD_ID;
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)num_rows)
            return MFG_BAD_ID;
#if defined(__SSE2__)
    const int nt = stream && (row_bytes & 15) == 0 && ((uintptr_t)out & 15) == 0;
#else
    const int nt = 0;
    (void)stream;
#endif
    for (int64_t i = 0; i < n; i++) {
        if (i + MFG_COPY_AHEAD < n) {
            const char *next = base + ids[i + MFG_COPY_AHEAD] * row_bytes;
            for (int64_t q = 0; q < row_bytes; q += 64)
                MFG_PREFETCH_L2(next + q);
        }
        const char *src = base + ids[i] * row_bytes;
        char *dst = out + i * row_bytes;
#if defined(__SSE2__)
        if (nt) {
            for (int64_t q = 0; q < row_bytes; q += 16)
                _mm_stream_si128((__m128i *)(dst + q),
                                 _mm_loadu_si128((const __m128i *)(src + q)));
            continue;
        }
#endif
        memcpy(dst, src, (size_t)row_bytes);
    }
#if defined(__SSE2__)
    if (nt)
        _mm_sfence(); /* the streamed rows are visible before the reply that names them */
#endif
    return n;
}

/* A trainer's input feature matrix from its feature cache and a reply
 * (trainer_client/feature_cache.py's assemble): out's row i is the reply's next row where
 * present[i] != 0, else the cache's row slot[nodes[i]], row_bytes each, in one pass.
 * The cache rows ahead are fetched into L2 as in mfg_copy_rows.
 * Torch's index_select into a temporary and two index_copy_ calls into the output moved the
 * cached rows twice: in benchmarks.datapath's cache row (RMAT, 89,000 of a batch's 108,775
 * rows cached) the consumer's CPU for a batch's assembly fell from 27 ms (2 threads) to 16
 * (docs/benchmarks.md, "Issue 14, session 45"). Non-temporal stores, as in mfg_copy_rows,
 * were slower here: the assembled matrix is read next by the same process.
 * Returns n; or MFG_BAD_ID, before anything is written, if a node is outside
 * [0, num_nodes), a node left out of the reply has no cache row (slot outside
 * [0, cache_rows): trainer and servers disagree on what is cached), or the reply does not
 * hold exactly as many rows as are present. */
int64_t mfg_assemble_rows(const char *cache, int64_t row_bytes, int64_t cache_rows,
                          const int32_t *slot, int64_t num_nodes, const int64_t *nodes,
                          const uint8_t *present, int64_t n, const char *received,
                          int64_t num_received, char *out)
{
    if (row_bytes < 0)
        return MFG_BAD_ID;
    int64_t have = 0;
    for (int64_t i = 0; i < n; i++) {
        if ((uint64_t)nodes[i] >= (uint64_t)num_nodes)
            return MFG_BAD_ID;
        if (present[i]) {
            have++;
        } else if (slot[nodes[i]] < 0 || (int64_t)slot[nodes[i]] >= cache_rows) {
            return MFG_BAD_ID;
        }
    }
    if (have != num_received)
        return MFG_BAD_ID;
    const char *next_received = received;
    for (int64_t i = 0; i < n; i++) {
        if (i + MFG_COPY_AHEAD < n && !present[i + MFG_COPY_AHEAD]) {
            const char *ahead = cache + (int64_t)slot[nodes[i + MFG_COPY_AHEAD]] * row_bytes;
            for (int64_t q = 0; q < row_bytes; q += 64)
                MFG_PREFETCH_L2(ahead + q);
        }
        const char *src;
        if (present[i]) {
            src = next_received;
            next_received += row_bytes;
        } else {
            src = cache + (int64_t)slot[nodes[i]] * row_bytes;
        }
        memcpy(out + i * row_bytes, src, (size_t)row_bytes);
    }
    return n;
}

/* The transpose of a block's CSC with its per-edge weights (common/mfg.py's
 * Block.mean_bags_t, the mean's backward bags): out_offsets[j]..out_offsets[j + 1] are
 * source j's out-edges, in CSC order (the order a stable sort by source gives), with
 * out_dst[p] the edge's destination and out_w[p] its weight w[e]. One counting pass, one
 * prefix sum and one scatter, against torch's stable argsort plus three gathers: in
 * benchmarks.step's RMAT step a step's two calls (the middle and last blocks) took 0.47-0.49
 * ms that way on 2 threads, 0.15-0.17 ms here (docs/benchmarks.md, "Issue 14, session 49").
 * indptr: num_dst + 1 entries rising from 0 to num_edges; indices: num_edges source
 * positions in [0, num_src); out_offsets: num_src + 1.
 * Returns num_edges; or MFG_BAD_ID, before anything past out_offsets is written, if indptr
 * does not rise from 0 to num_edges or a source is outside [0, num_src); MFG_NO_MEMORY if
 * the cursors cannot be allocated. */
int64_t mfg_transpose_csc(const int64_t *indptr, int64_t num_dst, const int64_t *indices,
                          int64_t num_edges, int64_t num_src, const float *w,
                          int64_t *out_offsets, int64_t *out_dst, float *out_w)
{
    if (num_dst < 0 || num_src < 0 || num_edges < 0 || indptr[0] != 0
        || indptr[num_dst] != num_edges)
        return MFG_BAD_ID;
    for (int64_t d = 0; d < num_dst; d++)
        if (indptr[d + 1] < indptr[d])
            return MFG_BAD_ID;
    memset(out_offsets, 0, (size_t)(num_src + 1) * sizeof(int64_t));
    for (int64_t e = 0; e < num_edges; e++) {
        if ((uint64_t)indices[e] >= (uint64_t)num_src)
            return MFG_BAD_ID;
        out_offsets[indices[e] + 1]++;
    }
    for (int64_t j = 0; j < num_src; j++)
        out_offsets[j + 1] += out_offsets[j];
    int64_t *cursor = (int64_t *)malloc((size_t)(num_src > 0 ? num_src : 1) * sizeof(int64_t));
    if (cursor == NULL)
        return MFG_NO_MEMORY;
    memcpy(cursor, out_offsets, (size_t)num_src * sizeof(int64_t));
    for (int64_t d = 0; d < num_dst; d++) {
        for (int64_t e = indptr[d]; e < indptr[d + 1]; e++) {
            int64_t p = cursor[indices[e]]++;
            out_dst[p] = d;
            out_w[p] = w[e];
        }
    }
    free(cursor);
    return num_edges;
}

/* A CSC's weighted bags split by the part that owns each edge's source, for one
 * embedding_bag per part's feature matrix (trainer_client/model.py mean_and_self_rows over
 * several parts' rows read in place): one counting pass and one scatter, against a
 * comparison, a prefix sum, a nonzero and three gathers per part in torch.
 * offsets: num_bags + 1 entries rising from 0 to num_edges (bag b: edges offsets[b] ..
 * offsets[b + 1]); idx: each edge's source position in [0, num_src); part / local: each
 * source's part in [0, num_parts) and its row in that part's matrix; w: each edge's weight.
 * Writes part p's edges, in CSC order, to out_row / out_w[start[p] .. start[p + 1]) (their
 * rows and weights) and its bag offsets, relative to start[p], to out_off[p * (num_bags + 1)
 * .. + num_bags]; start has num_parts + 1 entries.
 * Returns num_edges; or MFG_BAD_ID, before anything past start is written, if offsets do not
 * rise from 0 to num_edges, a source is outside [0, num_src) or its part outside
 * [0, num_parts); MFG_NO_MEMORY if the cursors cannot be allocated. */
int64_t mfg_split_bags(const int64_t *offsets, int64_t num_bags, const int64_t *idx,
                       int64_t num_edges, const int64_t *part, const int64_t *local,
                       int64_t num_src, const float *w, int64_t num_parts, int64_t *start,
                       int64_t *out_row, float *out_w, int64_t *out_off)
{
    if (num_bags < 0 || num_src < 0 || num_edges < 0 || num_parts < 1 || offsets[0] != 0
        || offsets[num_bags] != num_edges)
        return MFG_BAD_ID;
    for (int64_t b = 0; b < num_bags; b++)
        if (offsets[b + 1] < offsets[b])
            return MFG_BAD_ID;
    for (int64_t s = 0; s < num_src; s++)
        if ((uint64_t)part[s] >= (uint64_t)num_parts)
            return MFG_BAD_ID;
    memset(start, 0, (size_t)(num_parts + 1) * sizeof(int64_t));
    for (int64_t e = 0; e < num_edges; e++) {
        if ((uint64_t)idx[e] >= (uint64_t)num_src)
            return MFG_BAD_ID;
        start[part[idx[e]] + 1]++;
    }
    for (int64_t p = 0; p < num_parts; p++)
        start[p + 1] += start[p];
    int64_t *cursor = (int64_t *)malloc((size_t)num_parts * sizeof(int64_t));
    if (cursor == NULL)
        return MFG_NO_MEMORY;
    memcpy(cursor, start, (size_t)num_parts * sizeof(int64_t));
    const int64_t stride = num_bags + 1;
    for (int64_t b = 0; b < num_bags; b++) {
        for (int64_t p = 0; p < num_parts; p++)
            out_off[p * stride + b] = cursor[p] - start[p];
        for (int64_t e = offsets[b]; e < offsets[b + 1]; e++) {
            const int64_t s = idx[e];
            const int64_t c = cursor[part[s]]++;
            out_row[c] = local[s];
            out_w[c] = w[e];
        }
    }
    for (int64_t p = 0; p < num_parts; p++)
        out_off[p * stride + num_bags] = cursor[p] - start[p];
    free(cursor);
    return num_edges;
}

/* Each source's owning part and its row there, from the parts' first global ids
 * (common/mfg.py SourceRows.owners, a multi-part set's rows read in place): part[i] is the p
 * with offsets[p] <= ids[i] < offsets[p + 1] and local[i] = ids[i] - offsets[p] + base[p]
 * (base NULL: 0; common/joined_rows.py gives each part's first row in one matrix that spans
 * them all), in one pass (a count of the bounds below each id for a few parts, a binary
 * search above 8), against one comparison pass per bound, a gather of the bounds and a
 * subtraction in torch. part may be NULL (not written).
 * offsets: num_parts + 1 entries rising from 0.
 * Returns n; or MFG_BAD_ID, before anything is written, if the offsets do not rise from 0
 * or an id is outside [0, offsets[num_parts]). */
int64_t mfg_owners(const int64_t *offsets, int64_t num_parts, const int64_t *base,
                   const int64_t *ids, int64_t n, int64_t *part, int64_t *local)
{
    if (num_parts < 1 || offsets[0] != 0)
        return MFG_BAD_ID;
    for (int64_t p = 0; p < num_parts; p++)
        if (offsets[p + 1] < offsets[p])
            return MFG_BAD_ID;
    const uint64_t total = (uint64_t)offsets[num_parts];
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= total)
            return MFG_BAD_ID;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        int64_t p = 0;
        if (num_parts <= 8) { /* a count of the bounds at or below id: no branch to mispredict */
            for (int64_t b = 1; b < num_parts; b++)
                p += id >= offsets[b];
        } else {
            int64_t hi = num_parts - 1;
            while (p < hi) { /* the last p with offsets[p] <= id */
                const int64_t mid = p + (hi - p + 1) / 2;
                if (offsets[mid] <= id)
                    p = mid;
                else
                    hi = mid - 1;
            }
        }
        if (part != NULL)
            part[i] = p;
        local[i] = id - offsets[p] + (base != NULL ? base[p] : 0);
    }
    return n;
}

/* Rows of several parts' matrices into one (common/mfg.py SourceRows.gather over a
 * multi-part set read in place): out's row i is row local[i] of part part[i]'s matrix, whose
 * first byte is bases[part[i]], row_bytes each, in one pass with the rows ahead fetched into
 * L2 as in mfg_copy_rows, against a nonzero, an index_select into a temporary and an
 * index_copy_ per part in torch. Plain stores: the rows are read next by this process.
 * num_rows: each part's rows.
 * Returns n; or MFG_BAD_ID, before anything is written, if a part is outside
 * [0, num_parts) or a row outside its part's [0, num_rows[p]). */
int64_t mfg_copy_part_rows(const int64_t *bases, const int64_t *num_rows, int64_t num_parts,
                           int64_t row_bytes, const int64_t *part, const int64_t *local,
                           int64_t n, char *out)
{
    if (row_bytes < 0 || num_parts < 1)
        return MFG_BAD_ID;
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)part[i] >= (uint64_t)num_parts
            || (uint64_t)local[i] >= (uint64_t)num_rows[part[i]])
            return MFG_BAD_ID;
    for (int64_t i = 0; i < n; i++) {
        if (i + MFG_COPY_AHEAD < n) {
            const int64_t j = i + MFG_COPY_AHEAD;
            const char *next = (const char *)(intptr_t)bases[part[j]] + local[j] * row_bytes;
            for (int64_t q = 0; q < row_bytes; q += 64)
                MFG_PREFETCH_L2(next + q);
        }
        const char *src = (const char *)(intptr_t)bases[part[i]] + local[i] * row_bytes;
        memcpy(out + i * row_bytes, src, (size_t)row_bytes);
    }
    return n;
}
