#!/usr/bin/env python3
"""Torch timings for gpu_bench.rs, on the same sizes, in the same job.

Prints one JSON line per kernel: {"kernel": ..., "torch_ms": ...}. Run by gpu_bench itself
(python3 kernels/examples/gpu_bench_torch.py --elems N --k K --iters I); needs torch with CUDA.
"""
import argparse
import json

import torch


def timed(fn, iters, prep=None):
    if prep:
        prep()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for _ in range(iters):
        if prep:
            prep()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        total += start.elapsed_time(end)
    return total / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elems", type=int, default=100_000_000)
    p.add_argument("--k", type=int, default=1_000_000)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    r = torch.randn(a.elems, device="cuda", generator=g)
    u = torch.randn(a.elems, device="cuda", generator=g)
    out = torch.empty_like(r)

    def quant_ef():
        v = r + u
        scale = v.abs().max() / 127.0
        q = torch.round(v / scale).clamp_(-127, 127).to(torch.int8)
        res = v - q.float() * scale
        return q, res

    rows = {
        "d2d_copy": timed(lambda: out.copy_(r), a.iters),
        "accumulate": timed(lambda: out.copy_(r).add_(u), a.iters),
        "quantize_i8_ef": timed(quant_ef, a.iters),
        "quantize_i8_ef_with_absmax_pass": timed(quant_ef, a.iters),
        "topk": timed(lambda: torch.topk(r.abs(), a.k, sorted=False), a.iters),
        "sign_pack": timed(lambda: (r < 0), a.iters),
    }
    for kernel, ms in rows.items():
        print(json.dumps({"kernel": kernel, "torch_ms": ms, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
