"""Example of dsa_client against a running coordinator: waits for readiness, starts a long request,
streams a short one to its end, reads GetLoad while the long one runs, aborts the long one (its
stream ends with CANCELLED) and reads GetLoad again. Prints what it sees, and with --json one JSON
summary line at the end (the cluster test reads it).

    python examples/stream_abort_load.py --target 127.0.0.1:50051
    python examples/stream_abort_load.py --target dsa.example:443 --ca-cert ca.pem
    python examples/stream_abort_load.py --target 127.0.0.1:50051 --ca-cert ca.crt \
        --client-cert tls.crt --client-key tls.key --token-file token \
        --tls-server-name dsa-dsa-indexer-coordinator.serving.svc

Exit status: 0 when the short request finished and the long one ended CANCELLED, 1 otherwise.
"""

import argparse
import json
import os
import sys
import threading
import time

import grpc

# Run from a checkout without installing: the package is one folder up.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa_client import CoordinatorClient  # noqa: E402


def _read(path):
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _wait_ready(client, timeout_s):
    """Polls the coordinator's readiness (ready once a worker of each kind answers)."""
    deadline = time.monotonic() + timeout_s
    status = "UNKNOWN"
    while time.monotonic() < deadline:
        try:
            status = client.health("readiness", timeout_s=1.0)
            if status == "SERVING":
                return status
        except grpc.RpcError as error:
            status = error.code().name
        time.sleep(0.2)
    return status


def _load_summary(load):
    return {"queued": load.queued, "running": load.running,
            "cache_blocks_used": load.cache_blocks_used,
            "cache_blocks_capacity": load.cache_blocks_capacity,
            "retained_sequences": load.retained_sequences,
            "indexer_workers": [w.address for w in load.indexer_workers]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="coordinator host:port")
    parser.add_argument("--ca-cert", help="PEM file of the CA to trust (turns TLS on)")
    parser.add_argument("--client-cert", help="PEM certificate chain for mutual TLS")
    parser.add_argument("--client-key", help="PEM private key for mutual TLS")
    parser.add_argument("--tls-server-name", help="name expected in the server's certificate "
                        "instead of --target's host (e.g. behind a port-forward)")
    parser.add_argument("--token-file",
                        help="file holding the bearer token to send (needs --ca-cert)")
    parser.add_argument("--context-length", type=int, default=1024, help="synthetic tokens")
    parser.add_argument("--short-tokens", type=int, default=8, help="max_new_tokens (short)")
    parser.add_argument("--long-tokens", type=int, default=4096, help="max_new_tokens (long)")
    parser.add_argument("--ready-timeout-s", type=float, default=30.0)
    parser.add_argument("--json", action="store_true", help="print a JSON summary line last")
    args = parser.parse_args()

    summary = {}
    token = _read(args.token_file).decode().strip() if args.token_file else None
    with CoordinatorClient.connect(args.target, root_certificates=_read(args.ca_cert),
                                   certificate_chain=_read(args.client_cert),
                                   private_key=_read(args.client_key), token=token,
                                   server_name=args.tls_server_name) as client:
        summary["readiness"] = _wait_ready(client, args.ready_timeout_s)
        print(f"readiness: {summary['readiness']}")
        if summary["readiness"] != "SERVING":
            if args.json:
                print(json.dumps(summary, sort_keys=True))
            return 1

        # The long request, in a thread: note its first decode step, then read to its end.
        long_id = f"example-long-{os.getpid()}"
        long_running = threading.Event()
        long_result = {"tokens": 0}
        long_call = client.generate(long_id, context_length=args.context_length,
                                    max_new_tokens=args.long_tokens)

        def read_long():
            try:
                for event in long_call:
                    if event.WhichOneof("event") == "tokens":
                        long_result["tokens"] += event.tokens.count
                        long_running.set()
                long_result["end"] = "OK"
            except grpc.RpcError as error:
                long_result["end"] = error.code().name
            long_running.set()

        reader = threading.Thread(target=read_long, daemon=True)
        reader.start()
        long_running.wait(timeout=60)

        # The short request, streamed to its end.
        short_id = f"example-short-{os.getpid()}"
        short = {"tokens": 0, "steps": 0}
        for event in client.generate(short_id, context_length=args.context_length,
                                     max_new_tokens=args.short_tokens):
            kind = event.WhichOneof("event")
            if kind == "admitted":
                a = event.admitted
                print(f"{short_id}: admitted after {a.queue_seconds * 1e3:.1f} ms in the queue on "
                      f"indexer {a.indexer_worker}, attention {a.attention_worker}; prefill "
                      f"{a.prefill_seconds * 1e3:.1f} ms")
            elif kind == "tokens":
                t = event.tokens
                short["tokens"] += t.count
                short["steps"] += 1
                print(f"{short_id}: tokens at {t.first_position} (+{t.count}) step "
                      f"{t.step_seconds * 1e3:.2f} ms, blocks {t.blocks_scored}/{t.blocks_visible}")
            elif kind == "finished":
                f = event.finished
                short["finished"] = True
                print(f"{short_id}: finished, {f.generated_tokens} tokens, TTFT "
                      f"{f.time_to_first_token_seconds * 1e3:.1f} ms, mean ITL "
                      f"{f.mean_inter_token_latency_seconds * 1e3:.2f} ms")
        summary["short"] = short

        load = client.get_load()
        summary["load_while_long_runs"] = _load_summary(load)
        print(f"load: queued {load.queued}, running {load.running}, cache blocks "
              f"{load.cache_blocks_used}/{load.cache_blocks_capacity}")

        try:
            client.abort(long_id)
            summary["abort"] = "OK"
        except grpc.RpcError as error:  # NOT_FOUND: it finished before the abort came
            summary["abort"] = error.code().name
        reader.join(timeout=30)
        long_result.setdefault("end", "still running")
        summary["long"] = long_result
        print(f"{long_id}: abort {summary['abort']}, stream ended {long_result['end']} after "
              f"{long_result['tokens']} tokens")

        summary["load_after"] = _load_summary(client.get_load())
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    ok = short.get("finished") and summary["abort"] == "OK" and long_result["end"] == "CANCELLED"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
