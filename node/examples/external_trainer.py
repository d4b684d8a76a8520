#!/usr/bin/env python3
"""An external trainer for a Kindred node: the node does distillation, routing and merging; this
process does the training.

Start a node with the external trainer and the model this script trains (the built-in MLP's
architecture, 784-64-10):

    kindred run --trainer external --model mlp --api 127.0.0.1:7070 ...

then, on the same host:

    python3 external_trainer.py --api 127.0.0.1:7070 --rounds 10

Each round this script trains a numpy MLP for a few SGD steps on MNIST, POSTs the parameter change
as safetensors to /v1/update, waits for the merged update of that round from /v1/merged, and
applies it. A PyTorch job does exactly the same with its own model: read the layer names and
shapes from /v1/spec, send one float32 tensor per layer.

Needs numpy and safetensors (pip install numpy safetensors).
"""

import argparse
import gzip
import json
import os
import sys
import time
import urllib.error
import urllib.request

import numpy as np
from safetensors.numpy import load, save


def http(api, path, data=None, timeout=30):
    req = urllib.request.Request(f"http://{api}{path}", data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def load_mnist(folder):
    with gzip.open(os.path.join(folder, "t10k-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784) / 255.0
    with gzip.open(os.path.join(folder, "t10k-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    return images.astype(np.float32), labels.astype(np.int64)


def init_params(spec, rng):
    params = {}
    for layer in spec["layers"]:
        shape = tuple(layer["shape"])
        fan_in = shape[1] if len(shape) > 1 else params[layer["name"].replace("bias", "weight")].shape[1]
        bound = 1.0 / np.sqrt(fan_in)
        params[layer["name"]] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return params


def sgd(params, x, y, steps, batch, lr, rng):
    """Plain minibatch SGD on a 784-h-10 ReLU MLP; returns the mean loss."""
    w1, b1, w2, b2 = (params[k] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    total = 0.0
    for _ in range(steps):
        idx = rng.integers(0, len(x), size=batch)
        xb, yb = x[idx], y[idx]
        h = np.maximum(xb @ w1.T + b1, 0.0)
        logits = h @ w2.T + b2
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        total += float(-np.log(p[np.arange(batch), yb] + 1e-12).mean())
        g = p
        g[np.arange(batch), yb] -= 1.0
        g /= batch
        gw2, gb2 = g.T @ h, g.sum(axis=0)
        gh = (g @ w2) * (h > 0)
        gw1, gb1 = gh.T @ xb, gh.sum(axis=0)
        w1 -= lr * gw1
        b1 -= lr * gb1
        w2 -= lr * gw2
        b2 -= lr * gb2
    return total / max(steps, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", default="127.0.0.1:7070", help="the node's API address")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data", default=os.environ.get("KINDRED_DATA", "../shared/data/mnist"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each merged update")
    args = ap.parse_args()

    _, body, _ = http(args.api, "/v1/spec")
    spec = json.loads(body)
    names = [layer["name"] for layer in spec["layers"]]
    if names != ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]:
        sys.exit(f"this example trains the built-in MLP; the node's model has layers {names}")
    rng = np.random.default_rng(args.seed)
    x, y = load_mnist(args.data)
    params = init_params(spec, rng)
    last_round = None

    for r in range(args.rounds):
        before = {k: v.copy() for k, v in params.items()}
        loss = sgd(params, x, y, args.steps, args.batch, args.lr, rng)
        update = {k: (params[k] - before[k]).astype(np.float32) for k in names}
        params = before  # the merged update replaces our own
        status, _, _ = http(args.api, f"/v1/update?samples={args.steps * args.batch}&loss={loss}", save(update))
        if status != 202:
            sys.exit(f"the node refused the update: HTTP {status}")
        deadline = time.time() + args.timeout
        while True:
            after = "" if last_round is None else f"?after={last_round}"
            status, body, headers = http(args.api, f"/v1/merged{after}")
            if status == 200:
                break
            if time.time() > deadline:
                sys.exit("no merged update arrived in time")
            time.sleep(0.2)
        last_round = int(headers.get("x-kindred-round", "0"))
        merged = load(body)
        for k in names:
            params[k] += merged[k]
        norm = float(np.sqrt(sum(float((merged[k] ** 2).sum()) for k in names)))
        print(f"round {last_round}: loss {loss:.4f}, merged update norm {norm:.4f}", flush=True)
    print(json.dumps({"rounds": args.rounds, "last_round": last_round}))


if __name__ == "__main__":
    main()
