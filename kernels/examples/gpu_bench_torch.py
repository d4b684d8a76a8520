#!/usr/bin/env python3
"""Torch timings for gpu_bench.rs, on the same tensors, in the same job.

Prints one JSON line per kernel: {"kernel": ..., "torch_ms": ...}, the median of --iters runs
timed by CUDA events after a warm-up. Run by gpu_bench itself (python3
kernels/examples/gpu_bench_torch.py --data DIR --elems N --k K --iters I), which writes the
residual and update it times as DIR/r.f32 and DIR/u.f32 (raw little-endian f32); without --data
the tensors are drawn here. Needs torch with CUDA.
"""
import argparse
import json
import os
import statistics

import torch


def timed(fn, iters, prep=None):
    if prep:
        prep()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        if prep:
            prep()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elems", type=int, default=100_000_000)
    p.add_argument("--k", type=int, default=1_000_000)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--data", help="directory holding r.f32 and u.f32 from gpu_bench")
    a = p.parse_args()
    if a.data:
        def load(name):
            t = torch.from_file(os.path.join(a.data, name), size=a.elems, dtype=torch.float32)
            return t.to("cuda")
        r, u = load("r.f32"), load("u.f32")
    else:
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
