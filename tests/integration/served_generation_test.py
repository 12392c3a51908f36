"""Served generation with the real model (ctest label `model`): a local cluster of the three
binaries on loopback (`dsa up --model smollm2`: dsa-indexer at H 16, D 64, dsa-attention --model
smollm2, the coordinator at top-K 512, every port 0) serves SmolLM2-135M, and its tokens are
checked against the numpy reference (python/dsa_model/reference.py):

- "The capital of France is" (ids [504, 3575, 282, 4649, 314]) and a ChatML prompt, greedy, 12 new
  tokens: the served ids equal the reference's dense greedy ids (K 512 > the prompt, so the sparse
  model is the dense one), with draft length 0 and 2 (n-gram drafts change nothing under greedy),
  and the decoded text holds "Paris";
- ~1,500 tokens of the held-out text (K 512: the selections are really sparse): real ids in
  range, a finish reason, fewer blocks scored than visible;
- a request holding the id 49,152 (the vocabulary's size) is INVALID_ARGUMENT and the cluster
  serves the next request the same;
- `dsa generate --coordinator ... --json` (the CLI through dsa_client.generate) returns the
  reference's ids; `dsa replay --model smollm2` of three Mooncake requests completes and its
  content-hashed prefixes share exactly what the trace's hash ids allow.

Run with scripts/model_setup.sh's venv (grpcio, protobuf, tokenizers, numpy):
    .venv-model/bin/python tests/integration/served_generation_test.py --bin-dir build/bin
Exit status 0 when every check passes; 1 otherwise, or when the model files are missing."""
from __future__ import annotations

import argparse
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "clients" / "python"))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from dsa_client import CoordinatorClient  # noqa: E402
from dsa_client import generate as client_generate  # noqa: E402
from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2  # noqa: E402
from dsa_model.config import CORPUS_HELDOUT_FILE, DEFAULT_MODEL_DIR, MODEL_FILE  # noqa: E402
from dsa_model.reference import Reference  # noqa: E402
from dsa_model.tokenizer import chat_prompt, decode, encode, load_tokenizer  # noqa: E402

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
CHAT_QUESTION = "What is the capital of France?"
NEW_TOKENS = 12
LONG_PROMPT_TOKENS = 1500
LONG_PROMPT_OFFSET = 20000  # into the held-out split
VOCAB_SIZE = 49152
EOS = 2
LISTENING = re.compile(r"^dsa up: coordinator listening on (\S+)$")
STARTUP_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 120

ARGS = argparse.Namespace(bin_dir=REPO / "build" / "bin", model_dir=REPO / DEFAULT_MODEL_DIR)


def served(client, request_id, prompt_ids, max_new_tokens=NEW_TOKENS, **kwargs):
    """(token ids, Finished, Tokens events) of one Generate."""
    ids, events, finished = [], [], None
    for event in client.generate(request_id, context_tokens=prompt_ids,
                                 max_new_tokens=max_new_tokens, timeout_s=REQUEST_TIMEOUT_S,
                                 **kwargs):
        kind = event.WhichOneof("event")
        if kind == "tokens":
            ids.extend(event.tokens.token_ids)
            events.append(event.tokens)
        elif kind == "finished":
            finished = event.finished
    return ids, finished, events


class ServedGenerationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        model_dir = Path(ARGS.model_dir)
        if not (model_dir / MODEL_FILE).is_file():
            raise unittest.SkipTest  # replaced by a failure in main(): see below
        cls.tokenizer = load_tokenizer(model_dir)
        cls.reference = Reference.from_dir(model_dir)
        cls.logs = tempfile.TemporaryDirectory(prefix="served-generation-")
        cls.up_stderr = open(os.path.join(cls.logs.name, "dsa-up.stderr"), "w+")
        cls.cluster = subprocess.Popen(
            [str(Path(ARGS.bin_dir) / "dsa"), "up", "--model", "smollm2", "--model-file",
             str(model_dir / MODEL_FILE), "--log-dir", cls.logs.name],
            stdout=subprocess.PIPE, stderr=cls.up_stderr, text=True)
        try:
            cls.address = cls._read_address()
        except BaseException:
            cls._stop()
            raise
        cls.client = CoordinatorClient.connect(cls.address)
        cls.expected = {}  # prompt (tuple) -> the reference's greedy ids

    @classmethod
    def _read_address(cls):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([cls.cluster.stdout], [], [], 1.0)
            if ready:
                line = cls.cluster.stdout.readline()
                if not line:
                    break
                match = LISTENING.match(line.strip())
                if match:
                    return match.group(1)
            if cls.cluster.poll() is not None:
                break
        cls.up_stderr.seek(0)
        raise RuntimeError(f"dsa up printed no coordinator address:\n{cls.up_stderr.read()}")

    @classmethod
    def _stop(cls):
        if cls.cluster.poll() is None:
            cls.cluster.send_signal(signal.SIGINT)
            try:
                cls.cluster.wait(timeout=30)
            except subprocess.TimeoutExpired:
                cls.cluster.kill()
                cls.cluster.wait()
        cls.cluster.stdout.close()
        cls.up_stderr.close()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls._stop()
        if cls.cluster.returncode != 0:
            print(f"dsa up exited with {cls.cluster.returncode}; logs in {cls.logs.name}",
                  file=sys.stderr)
        else:
            cls.logs.cleanup()

    def greedy(self, prompt_ids):
        key = tuple(prompt_ids)
        if key not in self.expected:
            self.expected[key] = self.reference.greedy(list(prompt_ids), NEW_TOKENS,
                                                       stop_token=EOS)
        return self.expected[key]

    def check_finish(self, ids, finished):
        self.assertIsNotNone(finished)
        self.assertEqual(finished.generated_tokens, len(ids))
        if ids[-1] == EOS:
            self.assertEqual(finished.finish_reason, coordinator_pb2.FINISH_REASON_EOS)
            self.assertEqual(finished.stop_token_id, EOS)
        else:
            self.assertEqual(len(ids), NEW_TOKENS)
            self.assertEqual(finished.finish_reason, coordinator_pb2.FINISH_REASON_LENGTH)

    def test_prompt_matches_the_reference_with_and_without_drafts(self):
        prompt = encode(self.tokenizer, PROMPT)
        self.assertEqual(prompt, PROMPT_IDS)
        self.assertEqual(client_generate.encode(self.tokenizer, PROMPT), PROMPT_IDS)
        expected = self.greedy(prompt)
        for draft_length in (0, 2):
            with self.subTest(draft_length=draft_length):
                ids, finished, events = served(self.client, f"paris-d{draft_length}", prompt,
                                               draft_length=draft_length)
                self.assertEqual(ids, expected)
                self.check_finish(ids, finished)
                self.assertIn("Paris", decode(self.tokenizer, ids))
                if draft_length == 0:
                    self.assertTrue(all(e.drafted == 0 for e in events))

    def test_chat_prompt_matches_the_reference(self):
        prompt = chat_prompt(self.tokenizer, CHAT_QUESTION)
        # The client's ChatML (what `dsa generate --chat` sends) is the model package's.
        self.assertEqual(client_generate.chat_prompt_ids(self.tokenizer, CHAT_QUESTION), prompt)
        expected = self.greedy(prompt)
        ids, finished, _ = served(self.client, "chat", prompt, draft_length=2)
        self.assertEqual(ids, expected)
        self.check_finish(ids, finished)

    def test_long_prompt_is_served_with_sparse_selections(self):
        heldout = np.load(Path(ARGS.model_dir) / CORPUS_HELDOUT_FILE)
        prompt = [int(t) for t in heldout[LONG_PROMPT_OFFSET:LONG_PROMPT_OFFSET
                                          + LONG_PROMPT_TOKENS]]
        ids, finished, events = served(self.client, "long", prompt, draft_length=2)
        self.assertGreaterEqual(len(ids), 1)
        self.assertTrue(all(0 <= i < VOCAB_SIZE for i in ids), ids)
        self.check_finish(ids, finished)
        # K 512 of ~24 blocks: SPIN scores fewer blocks than the context holds (the first step
        # after the prefill scores all of them: its warm-up).
        scored = sum(e.blocks_scored for e in events)
        visible = sum(e.blocks_visible for e in events)
        self.assertGreater(visible, 0)
        self.assertLess(scored, visible)

    def test_an_id_beyond_the_vocabulary_is_refused_and_the_next_request_served(self):
        with self.assertRaises(grpc.RpcError) as raised:
            served(self.client, "bad-id", [504, VOCAB_SIZE, 314])
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn(str(VOCAB_SIZE), raised.exception.details())
        ids, finished, _ = served(self.client, "after-bad-id", PROMPT_IDS)
        self.assertEqual(ids, self.greedy(PROMPT_IDS))
        self.check_finish(ids, finished)

    def test_dsa_generate_returns_the_reference_ids(self):
        run = subprocess.run(
            [str(Path(ARGS.bin_dir) / "dsa"), "generate", "--coordinator", self.address,
             "--python", sys.executable, "--tokenizer", str(Path(ARGS.model_dir) /
                                                            "tokenizer.json"),
             "--max-new-tokens", str(NEW_TOKENS), "--draft-length", "2", "--json", PROMPT],
            capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        self.assertEqual(summary["prompt_ids"], PROMPT_IDS)
        self.assertEqual(summary["token_ids"], self.greedy(PROMPT_IDS))
        self.assertIn("Paris", summary["text"])

    def test_dsa_replay_of_real_text_shares_what_the_trace_shares(self):
        report_path = os.path.join(self.logs.name, "replay.json")
        run = subprocess.run(
            [str(Path(ARGS.bin_dir) / "dsa"), "replay", "--coordinator", self.address,
             "--model", "smollm2", "--token-corpus",
             str(Path(ARGS.model_dir) / CORPUS_HELDOUT_FILE), "--trace",
             str(REPO / "data" / "traces" / "mooncake_conversation_trace.jsonl"), "--limit", "3",
             "--max-context", "1024", "--max-output", "4", "--time-scale", "0",
             "--max-in-flight", "1", "--json", report_path],
            capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        with open(report_path) as f:
            report = json.load(f)
        self.assertEqual(report["requests"]["completed"], 3)
        self.assertEqual(sum(report["finish_reasons"].values()), 3)
        # The three requests share the trace's first hash id: one 512-token block each after the
        # first, found by the coordinator's hashing of the tokens themselves.
        self.assertEqual(report["indexer"]["prefix_slots_reusable"], 1024)
        self.assertEqual(report["indexer"]["prefix_slots_reused"], 1024)
        self.assertEqual(len(report["samples"]), 3)
        for sample in report["samples"]:
            self.assertTrue(all(0 <= i < VOCAB_SIZE for i in sample["token_ids"]))

    def test_the_openai_front_serves_the_reference_text(self):
        """python -m dsa_openai in front of the cluster, driven by the openai package: a chat
        answer and a streamed completion, greedy, are the reference's text, and the chat prompt
        is the model's ChatML (its usage counts the same prompt tokens)."""
        import openai

        front = subprocess.Popen(
            [sys.executable, "-m", "dsa_openai", "--coordinator", self.address, "--model-dir",
             str(ARGS.model_dir), "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": f"{REPO / 'python'}:{REPO / 'clients' / 'python'}"})
        try:
            line = front.stdout.readline()
            match = re.search(r"listening on (http://\S+)", line)
            self.assertIsNotNone(match, line + (front.stdout.read() if front.poll() else ""))
            client = openai.OpenAI(base_url=match.group(1) + "/v1", api_key="none",
                                   max_retries=0, timeout=REQUEST_TIMEOUT_S)
            (model,) = [m.id for m in client.models.list().data]
            chat_ids = chat_prompt(self.tokenizer, CHAT_QUESTION)
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": CHAT_QUESTION}],
                temperature=0, max_tokens=NEW_TOKENS)
            expected = self.greedy(chat_ids)
            self.assertEqual(answer.usage.prompt_tokens, len(chat_ids))
            self.assertEqual(answer.usage.completion_tokens, len(expected))
            self.assertEqual(answer.choices[0].message.content,
                             decode(self.tokenizer, expected, skip_special_tokens=True))
            self.assertEqual(answer.choices[0].finish_reason,
                             "stop" if expected[-1] == EOS else "length")
            pieces = [c.choices[0].text for c in client.completions.create(
                model=model, prompt=PROMPT, temperature=0, max_tokens=NEW_TOKENS, stream=True)]
            text = "".join(pieces)
            self.assertEqual(text, decode(self.tokenizer, self.greedy(PROMPT_IDS),
                                          skip_special_tokens=True))
            self.assertIn("Paris", text)
            self.assertGreater(len([p for p in pieces if p]), 1)
        finally:
            front.send_signal(signal.SIGTERM)
            try:
                front.wait(timeout=30)
            except subprocess.TimeoutExpired:
                front.kill()
                front.wait()
            front.stdout.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", type=Path, default=ARGS.bin_dir,
                        help="folder of dsa and the three servers")
    parser.add_argument("--model-dir", type=Path,
                        default=Path(os.environ.get("DSA_MODEL_DIR", ARGS.model_dir)),
                        help="scripts/model_setup.sh's folder")
    args, rest = parser.parse_known_args()
    ARGS.bin_dir, ARGS.model_dir = args.bin_dir, args.model_dir
    if not (args.model_dir / MODEL_FILE).is_file():
        print(f"served_generation_test: no {args.model_dir / MODEL_FILE}: run "
              "bash scripts/model_setup.sh", file=sys.stderr)
        return 1
    program = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
