#!/usr/bin/env python3
"""Train the MNIST MLP through a Kindred node with the ``kindred`` package (numpy only).

Start a node with the external trainer and this model (the built-in MLP, 784-64-10):

    kindred run --trainer external --model mlp --api 127.0.0.1:7070 ...

then, on the same host (after ``pip install ./node/python``):

    python3 node/python/examples/train_mnist.py --api 127.0.0.1:7070 --rounds 10

Each round trains a few SGD steps on MNIST; ``Synchronizer.sync`` pushes the change to the node
and applies the round's merged update in place. A PyTorch job does the same with
``kindred.torch.TorchSync``.
"""

import argparse
import gzip
import json
import os
import sys

import numpy as np

from kindred import Client, KindredError, Synchronizer

LAYERS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def load_mnist(folder):
    with gzip.open(os.path.join(folder, "t10k-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784) / 255.0
    with gzip.open(os.path.join(folder, "t10k-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    return images.astype(np.float32), labels.astype(np.int64)


def init_params(spec, rng):
    params = {}
    for layer in spec.layers:
        fan_in = layer.shape[1] if len(layer.shape) > 1 else params[layer.name.replace("bias", "weight")].shape[1]
        bound = 1.0 / np.sqrt(fan_in)
        params[layer.name] = rng.uniform(-bound, bound, size=layer.shape).astype(np.float32)
    return params


def sgd(params, x, y, steps, batch, lr, rng):
    """Plain minibatch SGD on a 784-h-10 ReLU MLP, in place; returns the mean loss."""
    w1, b1, w2, b2 = (params[k] for k in LAYERS)
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
    ap.add_argument("--steps", type=int, default=20, help="SGD steps per round")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data", default=os.environ.get("KINDRED_DATA", "../shared/data/mnist"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each merged update")
    args = ap.parse_args()

    client = Client(args.api)
    try:
        spec = client.spec()
        if list(spec.names) != LAYERS:
            sys.exit(f"this example trains the built-in MLP; the node's model has layers {list(spec.names)}")
        rng = np.random.default_rng(args.seed)
        x, y = load_mnist(args.data)
        params = init_params(spec, rng)
        sync = Synchronizer(client, params, merge_timeout=args.timeout)
        for _ in range(args.rounds):
            loss = sgd(params, x, y, args.steps, args.batch, args.lr, rng)
            before = {k: v.copy() for k, v in params.items()}
            round_ = sync.sync(samples=args.steps * args.batch, loss=loss)
            moved = float(np.sqrt(sum(float(((params[k] - before[k]) ** 2).sum()) for k in LAYERS)))
            print(f"round {round_}: loss {loss:.4f}, merge moved the parameters by {moved:.4f}", flush=True)
    except KindredError as e:
        sys.exit(f"kindred: {e}")
    print(json.dumps({"rounds": args.rounds, "last_round": sync.last_round}))


if __name__ == "__main__":
    main()
