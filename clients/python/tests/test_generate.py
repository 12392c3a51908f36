"""Unit tests of dsa_client.generate (`python -m dsa_client.generate`, what `dsa generate` runs)
with a byte-level fake tokenizer (no `tokenizers` package needed) against an in-process fake
coordinator that serves a "real model": the ChatML prompt, incremental detokenization across a
character split over tokens, the end token kept out of the text, the --json summary, and the exit
status for a pattern-model coordinator and a refused request."""

import contextlib
import io
import json
import os
import sys
import unittest
from concurrent import futures

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsa_client import CoordinatorClient  # noqa: E402
from dsa_client import generate as gen  # noqa: E402
from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
NUM_SPECIALS = 17
EOS = 2


class ByteTokenizer:
    """Ids 0-16 are special tokens (decoded as their strings), id 17 + b is the byte b: a
    character of several UTF-8 bytes spans several tokens, as in byte-level BPE."""

    class Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        assert not add_special_tokens
        return self.Encoding([NUM_SPECIALS + b for b in text.encode("utf-8")])

    def decode(self, ids, skip_special_tokens=False):
        names = {i: s for s, i in SPECIALS.items()}
        out = b""
        for i in ids:
            out += names.get(i, "?").encode() if i < NUM_SPECIALS else bytes([i - NUM_SPECIALS])
        return out.decode("utf-8", errors="replace")

    def token_to_id(self, token):
        return SPECIALS.get(token)


TOKENIZER = ByteTokenizer()


class FakeRealModel(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """A coordinator serving a byte-level "model": it streams `reply`'s tokens in events of two,
    then EOS (unless the request caps it first), like a real model's Generate; a prompt holding an
    id >= vocab_size is refused with INVALID_ARGUMENT. vocab_size 0 plays the pattern model."""

    def __init__(self, reply="Paris é!", vocab_size=NUM_SPECIALS + 256):
        self.reply = [NUM_SPECIALS + b for b in reply.encode("utf-8")] + [EOS]
        self.vocab_size = vocab_size
        self.requests = []

    def Generate(self, request, context):
        self.requests.append(request)
        for i, token in enumerate(request.context_tokens.tokens):
            if token >= self.vocab_size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"context_tokens[{i}] = {token} is not below {self.vocab_size}")
        yield coordinator_pb2.GenerateEvent(admitted=coordinator_pb2.Admitted())
        ids = self.reply[:request.max_new_tokens]
        position = len(request.context_tokens.tokens)
        for start in range(0, len(ids), 2):
            chunk = ids[start:start + 2]
            yield coordinator_pb2.GenerateEvent(tokens=coordinator_pb2.Tokens(
                first_position=position + start, count=len(chunk), token_ids=chunk,
                drafted=1, accepted=len(chunk) - 1))
        eos = ids[-1] == EOS
        finished = coordinator_pb2.Finished(
            generated_tokens=len(ids), time_to_first_token_seconds=0.01,
            mean_inter_token_latency_seconds=0.002,
            finish_reason=coordinator_pb2.FINISH_REASON_EOS if eos
            else coordinator_pb2.FINISH_REASON_LENGTH)
        if eos:
            finished.stop_token_id = EOS
        yield coordinator_pb2.GenerateEvent(finished=finished)

    def GetLoad(self, request, context):
        model = (coordinator_pb2.Model(name="bytes", vocab_size=self.vocab_size,
                                       eos_token_id=EOS, max_context=8192)
                 if self.vocab_size else coordinator_pb2.Model(name="pattern"))
        return coordinator_pb2.GetLoadResponse(model=model)


class TextStreamTest(unittest.TestCase):
    def test_a_character_split_over_tokens_is_held_until_whole(self):
        stream = gen.TextStream(TOKENIZER)
        e_acute = "é".encode("utf-8")  # two bytes, two tokens
        self.assertEqual(stream.feed([NUM_SPECIALS + ord("a")]), "a")
        self.assertEqual(stream.feed([NUM_SPECIALS + e_acute[0]]), "")  # incomplete: held back
        self.assertEqual(stream.feed([NUM_SPECIALS + e_acute[1]]), "é")
        self.assertEqual(stream.feed([]), "")
        self.assertEqual(stream.flush(), "")
        self.assertEqual(stream.text, "aé")

    def test_flush_returns_what_is_held_at_the_end(self):
        stream = gen.TextStream(TOKENIZER)
        self.assertEqual(stream.feed([NUM_SPECIALS + 0xC3]), "")
        self.assertEqual(stream.flush(), "\ufffd")


class ChatPromptTest(unittest.TestCase):
    def test_chatml_with_the_specials_by_id(self):
        ids = gen.chat_prompt_ids(TOKENIZER, "Hi <|im_end|>", system_prompt="Be brief")
        text = TOKENIZER.decode(ids)
        self.assertEqual(text, "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\n"
                               "Hi <|im_end|><|im_end|>\n<|im_start|>assistant\n")
        # The user's "<|im_end|>" stays plain text: one control token per turn end only.
        self.assertEqual(ids.count(SPECIALS["<|im_end|>"]), 2)
        self.assertEqual(ids.count(SPECIALS["<|im_start|>"]), 3)

    def test_a_tokenizer_without_chatml_tokens_is_refused(self):
        class Plain(ByteTokenizer):
            def token_to_id(self, token):
                return None

        with self.assertRaises(ValueError):
            gen.chat_prompt_ids(Plain(), "hi")


class GenerateMainTest(unittest.TestCase):
    def start(self, fake):
        self.fake = fake
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(fake, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.addCleanup(self.server.stop, None)
        return f"127.0.0.1:{port}"

    def run_main(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = gen.main(argv, tokenizer=TOKENIZER)
        return code, out.getvalue(), err.getvalue()

    def test_streams_the_text_and_reports_the_end(self):
        target = self.start(FakeRealModel())
        code, out, err = self.run_main(["--target", target, "--tokenizer", "unused",
                                        "--max-new-tokens", "20", "The capital is"])
        self.assertEqual(code, 0, err)
        self.assertEqual(out, "Paris é!\n")  # the EOS token is not text
        self.assertIn("[EOS (token 2) after 10 tokens of bytes", err)
        request = self.fake.requests[-1]
        self.assertEqual(TOKENIZER.decode(request.context_tokens.tokens), "The capital is")
        self.assertEqual(request.max_new_tokens, 20)
        self.assertEqual(request.draft_length, 2)
        self.assertFalse(request.HasField("sampling"))

    def test_json_summary_with_chat_sampling_and_stop_ids(self):
        target = self.start(FakeRealModel())
        code, out, err = self.run_main([
            "--target", target, "--tokenizer", "unused", "--json", "--chat", "--max-new-tokens",
            "3", "--temperature", "0.5", "--top-p", "0.8", "--seed", "9", "--stop-token-id", "5",
            "--ignore-eos", "Where?"])
        self.assertEqual(code, 0, err)
        summary = json.loads(out.strip().splitlines()[-1])
        self.assertEqual(summary["token_ids"], [NUM_SPECIALS + ord(c) for c in "Par"])
        self.assertEqual(summary["text"], "Par")
        self.assertEqual(summary["finish_reason"], "LENGTH")
        self.assertIsNone(summary["stop_token_id"])
        self.assertEqual(summary["model"], "bytes")
        self.assertEqual((summary["drafted"], summary["accepted"]), (2, 1))
        request = self.fake.requests[-1]
        self.assertEqual(list(request.context_tokens.tokens),
                         gen.chat_prompt_ids(TOKENIZER, "Where?"))
        self.assertAlmostEqual(request.sampling.temperature, 0.5, places=6)
        self.assertEqual(request.sampling.seed, 9)
        self.assertEqual(list(request.stop_token_ids), [5])
        self.assertTrue(request.ignore_eos)

    def test_a_refused_request_exits_1_with_its_code(self):
        # A vocabulary of 17 specials + 100 bytes: "z" (byte 122) is beyond it.
        target = self.start(FakeRealModel(vocab_size=NUM_SPECIALS + 100))
        code, _, err = self.run_main(["--target", target, "--tokenizer", "unused", "zz"])
        self.assertEqual(code, 1)
        self.assertIn("INVALID_ARGUMENT", err)

    def test_the_pattern_model_exits_2(self):
        target = self.start(FakeRealModel(vocab_size=0))
        code, _, err = self.run_main(["--target", target, "--tokenizer", "unused", "hi"])
        self.assertEqual(code, 2)
        self.assertIn("pattern model", err)
        self.assertEqual(self.fake.requests, [])

    def test_a_missing_tokenizer_file_exits_2(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = gen.main(["--target", "127.0.0.1:1", "--tokenizer", "/nonexistent/tok.json",
                             "hi"])
        self.assertEqual(code, 2)
        self.assertTrue("no tokenizer file" in err.getvalue() or "tokenizers" in err.getvalue(),
                        err.getvalue())

    def test_generate_text_with_a_client(self):
        target = self.start(FakeRealModel(reply="ok"))
        pieces = []
        with CoordinatorClient.connect(target) as client:
            result = gen.generate_text(client, TOKENIZER, [NUM_SPECIALS + 1], request_id="t",
                                       max_new_tokens=8, eos_token_id=EOS, on_text=pieces.append)
        self.assertEqual("".join(pieces), "ok")
        self.assertEqual(result["token_ids"], [NUM_SPECIALS + ord("o"), NUM_SPECIALS + ord("k"),
                                               EOS])
        self.assertEqual(result["finish_reason"], "EOS")
        self.assertEqual(result["stop_token_id"], EOS)


if __name__ == "__main__":
    unittest.main()
