"""Runs the examples against real local clusters: examples/stream_abort_load.py against `dsa up
--indexers 1 --attention-workers 1` (the pattern model), and examples/stream_text.py against `dsa up
--model smollm2` (the real model) with the model's venv (.venv-model: grpcio, protobuf,
tokenizers), from build/bin (or $DSA_BIN_DIR) on loopback, the coordinator address read from the
line `dsa up` prints. Skipped when the binaries are not built; the real model's test also when its
files or its venv are missing (scripts/model_setup.sh makes them)."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_ROOT = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(os.path.dirname(CLIENT_ROOT))
BIN_DIR = os.environ.get("DSA_BIN_DIR", os.path.join(REPO_ROOT, "build", "bin"))
DSA = os.path.join(BIN_DIR, "dsa")
LISTENING = re.compile(r"^dsa up: coordinator listening on (\S+)$")
STARTUP_TIMEOUT_S = 90
MODEL_DIR = os.environ.get("DSA_MODEL_DIR",
                           os.path.join(REPO_ROOT, "build", "models", "smollm2-135m"))
MODEL_PYTHON = os.path.join(REPO_ROOT, ".venv-model", "bin", "python")


def _model_python_ready():
    """The model's venv has what the text example needs."""
    if not os.access(MODEL_PYTHON, os.X_OK):
        return False
    probe = subprocess.run([MODEL_PYTHON, "-c", "import grpc, google.protobuf, tokenizers"],
                           capture_output=True)
    return probe.returncode == 0


class _LocalCluster(unittest.TestCase):
    """Starts `dsa up` with UP_ARGS in setUp and stops it (SIGINT) at cleanup."""

    UP_ARGS = ["--indexers", "1", "--attention-workers", "1"]

    def setUp(self):
        self.logs = tempfile.TemporaryDirectory()
        self.stderr = open(os.path.join(self.logs.name, "dsa-up.stderr"), "w+")
        self.cluster = subprocess.Popen(
            [DSA, "up", *self.UP_ARGS, "--log-dir", self.logs.name],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.addCleanup(self._stop)
        self.address = self._read_address()

    def _read_address(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.cluster.stdout], [], [], 1.0)
            if ready:
                line = self.cluster.stdout.readline()
                if not line:
                    break  # dsa up exited
                match = LISTENING.match(line.strip())
                if match:
                    return match.group(1)
            if self.cluster.poll() is not None:
                break
        self.stderr.seek(0)
        self.fail(f"dsa up printed no coordinator address; its stderr:\n{self.stderr.read()}")

    def _stop(self):
        if self.cluster.poll() is None:
            self.cluster.send_signal(signal.SIGINT)  # dsa up stops its servers on SIGINT
            try:
                self.cluster.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.cluster.kill()
                self.cluster.wait()
        self.cluster.stdout.close()
        self.stderr.close()
        self.logs.cleanup()


@unittest.skipUnless(os.access(DSA, os.X_OK), f"{DSA} not built")
class ExampleAgainstLocalClusterTest(_LocalCluster):
    def test_stream_abort_load(self):
        example = subprocess.run(
            [sys.executable, os.path.join(CLIENT_ROOT, "examples", "stream_abort_load.py"),
             "--target", self.address, "--json"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(example.returncode, 0, example.stdout + example.stderr)
        summary = json.loads(example.stdout.strip().splitlines()[-1])
        self.assertEqual(summary["readiness"], "SERVING")
        self.assertTrue(summary["short"]["finished"])
        self.assertEqual(summary["short"]["tokens"], 8)
        self.assertEqual(summary["abort"], "OK")
        self.assertEqual(summary["long"]["end"], "CANCELLED")
        self.assertGreaterEqual(summary["load_while_long_runs"]["running"], 1)
        self.assertEqual(summary["load_after"]["queued"], 0)
        self.assertEqual(len(summary["load_after"]["indexer_workers"]), 1)
        self.assertGreater(summary["load_after"]["cache_blocks_capacity"], 0)


@unittest.skipUnless(os.access(DSA, os.X_OK), f"{DSA} not built")
@unittest.skipUnless(os.path.isfile(os.path.join(MODEL_DIR, "model.safetensors")),
                     f"no model in {MODEL_DIR} (scripts/model_setup.sh)")
@unittest.skipUnless(_model_python_ready(), f"{MODEL_PYTHON} lacks grpcio, protobuf or tokenizers "
                     "(scripts/model_setup.sh)")
class TextExampleAgainstRealModelTest(_LocalCluster):
    UP_ARGS = ["--model", "smollm2", "--model-file", os.path.join(MODEL_DIR, "model.safetensors")]

    def test_stream_text(self):
        example = subprocess.run(
            [MODEL_PYTHON, os.path.join(CLIENT_ROOT, "examples", "stream_text.py"),
             "--target", self.address, "--tokenizer", os.path.join(MODEL_DIR, "tokenizer.json"),
             "--max-new-tokens", "8", "--json", "The capital of France is"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(example.returncode, 0, example.stdout + example.stderr)
        summary = json.loads(example.stdout.strip().splitlines()[-1])
        self.assertEqual(summary["model"], "smollm2-135m")
        self.assertEqual(summary["prompt_ids"], [504, 3575, 282, 4649, 314])
        self.assertEqual(len(summary["token_ids"]), 8)
        self.assertIn("Paris", summary["text"])
        self.assertEqual(summary["finish_reason"], "LENGTH")
        # The text was streamed to stdout before the summary.
        self.assertTrue(example.stdout.startswith(summary["text"]), example.stdout)


if __name__ == "__main__":
    unittest.main()
