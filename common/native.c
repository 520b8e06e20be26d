/* mfgserve's native kernels: plain C over raw arrays, loaded with ctypes (common/native.py).
 *
 * No Python or torch headers: the library builds in a fraction of a second with the system C
 * compiler, and ctypes releases the GIL for the length of each call, so sampler threads run
 * these concurrently. Every function validates its ids before it writes anything and returns
 * a negative status instead of touching memory out of bounds.
 */
#include <stdint.h>

#define MFG_BAD_ID (-1)

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
