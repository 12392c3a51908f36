"""The committed stubs under dsa_client/proto are what generate.sh makes from proto/ now: the
test regenerates them into a temporary folder and fails on any file added, missing or different
(then run clients/python/generate.sh and commit the result)."""

import filecmp
import os
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_ROOT = os.path.dirname(HERE)
COMMITTED = os.path.join(CLIENT_ROOT, "dsa_client", "proto")


def _files(root):
    """Relative paths of every file under root but Python's caches."""
    found = set()
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            found.add(os.path.relpath(os.path.join(folder, name), root))
    return found


class CommittedStubsTest(unittest.TestCase):
    def test_regenerated_stubs_equal_the_committed_ones(self):
        with tempfile.TemporaryDirectory() as fresh:
            subprocess.run(["bash", os.path.join(CLIENT_ROOT, "generate.sh"), fresh], check=True,
                           stdout=subprocess.DEVNULL)
            committed, regenerated = _files(COMMITTED), _files(fresh)
            self.assertEqual(committed - regenerated, set(), "committed but no longer generated")
            self.assertEqual(regenerated - committed, set(), "generated but not committed")
            self.assertGreater(len(committed), 0)
            different = [path for path in sorted(committed)
                         if not filecmp.cmp(os.path.join(COMMITTED, path),
                                            os.path.join(fresh, path), shallow=False)]
            self.assertEqual(different, [], "stale stubs: run clients/python/generate.sh")

    def test_every_proto_has_its_module(self):
        repo_proto = os.path.join(os.path.dirname(os.path.dirname(CLIENT_ROOT)), "proto")
        for path in _files(repo_proto):
            if path.endswith(".proto"):
                module = path[: -len(".proto")] + "_pb2.py"
                self.assertTrue(os.path.isfile(os.path.join(COMMITTED, module)), module)


if __name__ == "__main__":
    unittest.main()
