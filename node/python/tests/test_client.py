"""The package against a scripted stand-in of the node's API (a real node runs in
`tests/tests/external_trainer.rs`): errors, retries, timeouts, and the sync arithmetic of the
numpy and (where torch is importable) torch paths."""

import json
import socket
import threading
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from kindred import (
    Client,
    MergeTimeout,
    NodeBusy,
    NodeUnavailable,
    RequestRejected,
    SpecMismatch,
    Synchronizer,
)

SPEC = {
    "model_id": "ab" * 32,
    "params": 10,
    "layers": [
        {"name": "w", "shape": [2, 4], "dtype": "f32"},
        {"name": "b", "shape": [2], "dtype": "f32"},
    ],
}


class FakeNode:
    """A scripted node API: `/v1/spec`, `/v1/update` (answers from `update_answers`, then 202),
    `/v1/merged` (the merged update once an update arrived)."""

    def __init__(self):
        self.updates = []
        self.update_answers = []  # (status, message) answered before accepting
        self.merged = None
        self.round = 0
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body=b"", headers=()):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/spec":
                    self.reply(200, json.dumps(SPEC).encode())
                elif self.path.startswith("/v1/merged"):
                    after = None
                    if "after=" in self.path:
                        after = int(self.path.split("after=")[1])
                    if node.merged is None or (after is not None and node.round <= after):
                        self.reply(204)
                    else:
                        self.reply(200, st_save(node.merged), [("x-kindred-round", str(node.round))])
                else:
                    self.reply(404, b"no such route")

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if node.update_answers:
                    status, message = node.update_answers.pop(0)
                    self.reply(status, message.encode())
                    return
                node.updates.append((self.path, st_load(body)))
                node.round += 1
                # The merge: the update halved (stands in for a hub's merge).
                node.merged = {k: v * 0.5 for k, v in st_load(body).items()}
                self.reply(202)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.api = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def no_sleep(_seconds):
    pass


class WithNode(unittest.TestCase):
    """A fresh stand-in node per test, and a client of it that retries without sleeping."""

    def setUp(self):
        self.node = FakeNode()
        self.client = Client(self.node.api, timeout=5, retries=3, sleep=no_sleep)

    def tearDown(self):
        self.node.close()


class ClientTest(WithNode):

    def test_spec_is_parsed(self):
        spec = self.client.spec()
        self.assertEqual(spec.names, ("w", "b"))
        self.assertEqual(spec.layers[0].shape, (2, 4))
        self.assertEqual(spec.layers[0].numel, 8)

    def test_update_of_the_wrong_shape_is_refused_before_sending(self):
        with self.assertRaises(SpecMismatch):
            self.client.push_update({"w": np.zeros((4, 2)), "b": np.zeros(2)}, samples=1)
        with self.assertRaises(SpecMismatch):
            self.client.push_update({"w": np.zeros((2, 4))}, samples=1)
        with self.assertRaises(ValueError):
            self.client.push_update({"w": np.full((2, 4), np.nan), "b": np.zeros(2)}, samples=1)
        self.assertEqual(self.node.updates, [])

    def test_update_is_sent_as_float32_with_samples_and_loss(self):
        self.client.push_update({"w": np.ones((2, 4), np.float64), "b": np.zeros(2)}, 32, 0.5)
        path, tensors = self.node.updates[0]
        self.assertIn("samples=32", path)
        self.assertIn("loss=0.5", path)
        self.assertEqual(tensors["w"].dtype, np.float32)

    def test_busy_node_is_retried_then_reported(self):
        self.node.update_answers = [(409, "another update upload is in progress")]
        self.client.push_update({"w": np.ones((2, 4)), "b": np.zeros(2)}, 1)
        self.assertEqual(len(self.node.updates), 1)
        self.node.update_answers = [(503, "an update for this round is already queued")] * 4
        with self.assertRaises(NodeBusy) as e:
            self.client.push_update({"w": np.ones((2, 4)), "b": np.zeros(2)}, 1)
        self.assertEqual(e.exception.status, 503)

    def test_refusal_is_raised_at_once_with_the_nodes_message(self):
        self.node.update_answers = [(422, "tensor `w` is F64"), (202, "")]
        with self.assertRaises(RequestRejected) as e:
            self.client.push_update({"w": np.ones((2, 4)), "b": np.zeros(2)}, 1)
        self.assertEqual(e.exception.status, 422)
        self.assertIn("F64", str(e.exception))
        self.assertEqual(len(self.node.update_answers), 1)  # not retried

    def test_unreachable_node_is_retried_then_reported(self):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()  # nothing listens there now
        slept = []
        client = Client(f"127.0.0.1:{port}", timeout=1, retries=3, backoff=0.5, sleep=slept.append)
        with self.assertRaises(NodeUnavailable):
            client.spec()
        self.assertEqual(slept, [0.5, 1.0, 2.0])

    def test_waiting_for_a_merge_times_out(self):
        client = Client(self.node.api, timeout=5, retries=0)
        with self.assertRaises(MergeTimeout):
            client.wait_merged(after=None, timeout=0.3, poll=0.05)

    def test_numpy_sync_replaces_the_update_by_the_merge_in_place(self):
        w = np.arange(8, dtype=np.float32).reshape(2, 4)
        params = {"w": w, "b": np.zeros(2, np.float16)}
        sync = Synchronizer(self.client, params)
        params["w"] += 2.0
        params["b"] += np.float16(1.0)
        round_ = sync.sync(samples=10, loss=1.0)
        self.assertEqual(round_, 1)
        self.assertIs(params["w"], w)  # in place
        np.testing.assert_allclose(w, np.arange(8).reshape(2, 4) + 1.0)  # start + half the change
        self.assertEqual(params["b"].dtype, np.float16)
        np.testing.assert_allclose(params["b"], [0.5, 0.5])
        # The next update is measured from the merged parameters.
        np.testing.assert_allclose(sync.update()["w"], np.zeros((2, 4)))
        params["w"] += 4.0
        self.assertEqual(sync.sync(samples=10), 2)
        np.testing.assert_allclose(w, np.arange(8).reshape(2, 4) + 3.0)


try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


@unittest.skipUnless(HAVE_TORCH, "torch is not installed: the TorchSync path is not tested here")
class TorchSyncTest(WithNode):

    def test_dtype_and_device_are_kept(self):
        import torch

        from kindred.torch import TorchSync

        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                module = torch.nn.Module()
                module.w = torch.nn.Parameter(torch.zeros(2, 4, dtype=dtype, device=device))
                module.b = torch.nn.Parameter(torch.zeros(2, dtype=dtype, device=device))
                sync = TorchSync(module, self.client, every=2)
                with torch.no_grad():
                    module.w += 2.0
                self.assertIsNone(sync.step(samples=8, loss=1.0))
                self.assertIsNotNone(sync.step(samples=8, loss=1.0))
                self.assertEqual(module.w.dtype, dtype)
                self.assertEqual(module.w.device.type, device)
                self.assertTrue(torch.all(module.w == 1.0))  # half of the change
                path, _ = self.node.updates[-1]
                self.assertIn("samples=16", path)

    def test_a_module_without_the_nodes_layers_is_refused(self):
        import torch

        from kindred import KindredError
        from kindred.torch import TorchSync

        module = torch.nn.Linear(4, 2)  # parameters `weight`, `bias`
        with self.assertRaises(KindredError):
            TorchSync(module, self.client, every=1)
        sync = TorchSync(module, self.client, every=1, names={"w": "weight", "b": "bias"})
        self.assertEqual([k for k, _ in sync.parameters()], ["w", "b"])


if __name__ == "__main__":
    unittest.main()
