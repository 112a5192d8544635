"""How fast the router refuses a prompt longer than its engines take.

An operator's probe sent a 100 MB prompt to Router.Generate: it was forwarded and refused by
the engine 20 s later. The router now compares a prompt's length with the engines' reported
`max_req_input_len` before routing. This starts a real router process and one simulated
engine (which reports 2^20 tokens), then sends `--mb` MB of prompt (token id 2^21, four bytes
each on the wire, built as raw protobuf bytes) `--rounds` times, and reports each refusal's
wall time (client send to status), its status code and the length of its message; then one
call that fits, to show the router still serves.

Usage: python bench/prompt_bound.py [--mb 100] [--rounds 5]
Last line: {"prompt_mb": ..., "prompt_tokens": ..., "refusal_s": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import grpc

from services._proto.riptide.v1 import router_pb2
from services.testing.router_process import router_with_engine

_TOKEN = b"\x80\x80\x80\x01"  # the varint of 2**21


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def huge_request(num_tokens: int) -> bytes:
    """A serialized GenerateRequest (session_key, packed input_ids) of `num_tokens` ids."""
    key = b"bench-huge"
    ids = _TOKEN * num_tokens
    return (b"\x0a" + _varint(len(key)) + key + b"\x12" + _varint(len(ids)) + ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="prompt size on the wire")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    num_tokens = args.mb * 1_000_000 // len(_TOKEN)
    payload = huge_request(num_tokens)
    times, codes, details = [], set(), set()
    with router_with_engine() as (router, engine):
        size = 256 << 20
        with grpc.insecure_channel(router.address, options=[
                ("grpc.max_send_message_length", size),
                ("grpc.max_receive_message_length", size)]) as channel:
            call = channel.unary_unary("/riptide.v1.Router/Generate",
                                       response_deserializer=router_pb2.GenerateResponse.FromString)
            for _ in range(args.rounds):
                started = time.perf_counter()
                try:
                    call(payload, timeout=120)
                    codes.add("OK")
                except grpc.RpcError as exc:
                    codes.add(exc.code().name)
                    details.add(exc.details())
                times.append(time.perf_counter() - started)
        served = router.generate("bench-fits", [1, 2, 3], max_new_tokens=4)
    print(json.dumps({
        "prompt_mb": round(len(payload) / 1e6, 1), "prompt_tokens": num_tokens,
        "status": sorted(codes), "message_chars": max(len(d) for d in details) if details else 0,
        "message": sorted(details)[0] if details else "",
        "refusal_s": {"median": round(statistics.median(times), 3),
                      "min": round(min(times), 3), "max": round(max(times), 3)},
        "still_serving": len(served.output_ids) == 4,
    }))


if __name__ == "__main__":
    main()
