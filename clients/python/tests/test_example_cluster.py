"""Runs examples/stream_abort_load.py against a real local cluster: `dsa up --indexers 1
--attention-workers 1` from build/bin (or $DSA_BIN_DIR) on loopback, the coordinator address read
from the line it prints. Skipped when the binaries are not built."""

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


@unittest.skipUnless(os.access(DSA, os.X_OK), f"{DSA} not built")
class ExampleAgainstLocalClusterTest(unittest.TestCase):
    def setUp(self):
        self.logs = tempfile.TemporaryDirectory()
        self.stderr = open(os.path.join(self.logs.name, "dsa-up.stderr"), "w+")
        self.cluster = subprocess.Popen(
            [DSA, "up", "--indexers", "1", "--attention-workers", "1",
             "--log-dir", self.logs.name],
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


if __name__ == "__main__":
    unittest.main()
