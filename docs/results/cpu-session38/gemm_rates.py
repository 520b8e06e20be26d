"""GEMM times of the seed model's shapes at a float32 matmul precision, session 38.

python gemm_rates.py highest|medium   (2 torch threads; run with
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296
so that fresh output pages do not count). Prints ms per call (median of 20) for repeated
shapes, then the first-call and median times when the row count changes every call (as a
sampled block's does) and when it is bucketed to a multiple of 512.
"""
import sys
import time

import torch

torch.set_num_threads(2)
torch.set_float32_matmul_precision(sys.argv[1])


def bench(f, n=20):
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def rates(m: int, k: int, n: int) -> None:
    h, w, g, b = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n), torch.randn(n)
    o = torch.mm(h, w.t())
    r = {"h@W.t": bench(lambda: torch.mm(h, w.t())),
         "addmm": bench(lambda: torch.addmm(b, h, w.t())),
         "addmm_": bench(lambda: o.addmm_(h, w.t())),
         "h.t()@g": bench(lambda: h.t().mm(g)),
         "g@W": bench(lambda: g.mm(w))}
    print(sys.argv[1], (m, k, n), " ".join(f"{a} {v:.2f}" for a, v in r.items()))


for shape in [(25150, 100, 256), (4188, 256, 256), (1024, 256, 47)]:
    rates(*shape)

W = torch.randn(256, 100)


def shapes(ms):
    ts = []
    for m in ms:
        h = torch.randn(m, 100)
        t = time.perf_counter()
        torch.mm(h, W.t())
        ts.append((time.perf_counter() - t) * 1e3)
    return ts


ts = shapes([25000 + i * 7 for i in range(30)])
print(sys.argv[1], f"new shape every call: first {ts[0]:.2f}, median {sorted(ts)[15]:.2f} ms")
ts = shapes([25000] * 30)
print(sys.argv[1], f"one shape: first {ts[0]:.2f}, median {sorted(ts)[15]:.2f} ms")
ts = shapes([((25000 + i * 37 + 511) // 512) * 512 for i in range(30)])
print(sys.argv[1], f"bucketed to 512: median {sorted(ts)[15]:.2f} ms")
