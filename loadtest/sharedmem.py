"""`bench shm`: what system shared memory saves on an image model, against binary HTTP, in one run.

The model takes one 3x224x224 FP32 image (602,112 bytes) and answers 1,000 scores; its compute
is small (a strided convolution, a pooling, a dense layer), so what differs between the two ways
of sending the image shows. Both go through the same server, one after the other, closed loop
with wrk (loadtest/wrk.py), and ask for the scores as a binary output:

  binary  the image in the request body, Triton's binary tensor extension
  shm     the image in a system shared-memory region registered once before the run; the body
          is the JSON header alone, naming the region

wrk sends prepared bodies, so neither side counts the client's own work (serializing the
image, or writing it into the region): the figures are the server's and the transport's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import localserver, report, runs, wrk
from loadtest.localmodels import onnx_bytes, write_onnx_model
from loadtest.payloads import InferRequest
from server.protocol.binary import tensor_to_bytes

MODEL = "image224"
SHAPE = (3, 224, 224)
CLASSES = 1000
REGION = "bench-images"
WAYS = ("binary", "shm")
HEADER_LENGTH = "Inference-Header-Content-Length"

HELP = """Starts a server (pinned to --server-cpu) on a model repository of its own holding one
image model (3x224x224 FP32 in, 1,000 scores out, little compute), with --allow-client-shm, and
measures it closed loop with wrk (pinned to --generator-cpu) at each --concurrency, two ways in
the same run: the image in the body as a binary tensor, and the image in a shared-memory region
registered once (the body names it). Scores come back as a binary output both ways. Reports
req/s, images/s, p50/p99 latency and errors, and the ratio shm/binary per level."""


def image_model_onnx(seed: int = 0) -> bytes:
    """Conv 3->16 (7x7, stride 4) -> ReLU -> global average pool -> dense 16->1000: random
    weights, since only the bytes moved matter here."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["image", "W"], ["features"], strides=[4, 4], kernel_shape=[7, 7]),
            helper.make_node("Relu", ["features"], ["active"]),
            helper.make_node("GlobalAveragePool", ["active"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Gemm", ["flat", "D", "b"], ["scores"]),
        ],
        MODEL,
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", *SHAPE])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=[
            numpy_helper.from_array(rng.normal(0, 0.1, (16, 3, 7, 7)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.normal(0, 0.1, (16, CLASSES)).astype(np.float32), "D"),
            numpy_helper.from_array(np.zeros(CLASSES, np.float32), "b"),
        ],
    )
    return onnx_bytes(graph)


def write_image_model(root: Path) -> Path:
    """`root/image224`: its config and version 1."""
    config = {
        "name": MODEL, "max_batch_size": 8,
        "inputs": [{"name": "image", "datatype": "FP32", "dims": list(SHAPE)}],
        "outputs": [{"name": "scores", "datatype": "FP32", "dims": [CLASSES]}],
        "dynamic_batching": {"max_queue_delay_microseconds": 0},
        "onnxruntime": {"intra_op_num_threads": 1, "inter_op_num_threads": 1},
        "warmup": {"batch_sizes": [1]},
    }
    return write_onnx_model(root, config, image_model_onnx())


def requests(image: np.ndarray) -> dict[str, InferRequest]:
    """The two prepared requests for one image: in the body, and named in the region."""
    path = f"/v2/models/{MODEL}/infer"
    outputs = [{"name": "scores", "parameters": {"binary_data": True}}]
    blob = tensor_to_bytes(image, "FP32")
    header = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, *SHAPE],
                                     "parameters": {"binary_data_size": len(blob)}}],
                         "outputs": outputs}).encode()
    binary = InferRequest(MODEL, 1, True, path, header + blob,
                          {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))})
    shm = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, *SHAPE],
                                  "parameters": {"shared_memory_region": REGION,
                                                 "shared_memory_byte_size": image.nbytes}}],
                      "outputs": outputs}).encode()
    return {"binary": binary, "shm": InferRequest(MODEL, 1, False, path, shm, {"Content-Type": "application/json"})}


def scores_of(status: int, headers: dict[str, str], body: bytes) -> np.ndarray:
    """The scores of a binary answer; SystemExit with the server's words for anything else."""
    if status != 200:
        raise SystemExit(f"bench shm: the server answered {status}: {body[:300]!r}")
    length = int({k.lower(): v for k, v in headers.items()}[HEADER_LENGTH.lower()])
    return np.frombuffer(body[length:], np.float32)


def preflight(url: str, prepared: dict[str, InferRequest], timeout: float) -> None:
    """Both ways answer the same scores for the same image before any load."""
    answers = {way: scores_of(*runs.post(url, r.path, r.body, r.headers, timeout)) for way, r in prepared.items()}
    if answers["binary"].shape != (CLASSES,) or not np.array_equal(answers["binary"], answers["shm"]):
        raise SystemExit("bench shm: the two ways answered different scores for the same image")


def measure(args: argparse.Namespace, url: str, prepared: dict[str, InferRequest]) -> list[dict[str, Any]]:
    levels = []
    for way in WAYS:
        request = prepared[way]
        script, arguments = wrk.write_script(args.out / way, [request])
        target = url + request.path
        if args.warmup > 0:
            wrk.run(target, script, arguments, max(args.concurrency), args.warmup, args.timeout, args.generator_cpu)
        for connections in args.concurrency:
            level = wrk.run(target, script, arguments, connections, args.duration, args.timeout,
                            args.generator_cpu).as_dict(1)
            level["way"] = way
            levels.append(level)
            print(f"  {way} c={connections}: {level['req_s']:,.0f} req/s, p50 {level['latency_ms']['p50']:.2f} ms, "
                  f"p99 {level['latency_ms']['p99']:.2f} ms, errors {level['error_count']}", file=sys.stderr)
    return levels


HEADERS = ["way", "clients", "req/s", "MB/s of images", "p50 ms", "p99 ms", "errors", "shm/binary req/s"]


def table_rows(levels: list[dict[str, Any]]) -> list[list[Any]]:
    binary = {level["concurrency"]: level["req_s"] for level in levels if level["way"] == "binary"}
    rows = []
    for level in levels:
        against = binary.get(level["concurrency"]) if level["way"] == "shm" else None
        rows.append([level["way"], level["concurrency"], level["req_s"],
                     round(level["req_s"] * int(np.prod(SHAPE)) * 4 / 1e6, 1), level["latency_ms"]["p50"],
                     level["latency_ms"]["p99"], level["error_count"],
                     round(level["req_s"] / against, 2) if against else ""])
    return rows


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("shm", help="an image model: shared memory vs binary HTTP",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for shm.json, shm.md and shm.png")
    parser.add_argument("--note", default="", help="free text stored in the report")
    parser.add_argument("--concurrency", type=runs.ints, default=[1, 4], help="comma-separated clients")
    parser.add_argument("--duration", type=runs.positive, default=10.0, help="seconds per way and level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each way's levels")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a request may take")
    parser.add_argument("--server-cpu", type=int, metavar="N", help="pin the server to CPU N (taskset)")
    parser.add_argument("--generator-cpu", type=int, metavar="N", help="pin wrk to CPU N (taskset)")


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    image = np.random.default_rng(1).uniform(0, 1, (1, *SHAPE)).astype(np.float32)
    prepared = requests(image)
    parameters = {"model": f"{MODEL} (1x{'x'.join(map(str, SHAPE))} FP32 in, {CLASSES} FP32 out)",
                  "concurrency": args.concurrency, "duration_s": args.duration, "warmup_s": args.warmup,
                  "server_cpu": args.server_cpu, "generator_cpu": args.generator_cpu}
    record = runs.record(args, argv, parameters)
    region = shared_memory.SharedMemory(create=True, size=image.nbytes, name=f"batchline-bench-{time.monotonic_ns()}")
    try:
        np.ndarray(image.shape, np.float32, buffer=region.buf)[:] = image
        with tempfile.TemporaryDirectory(prefix="batchline-shm-") as folder:
            repository = Path(folder) / "models"
            write_image_model(repository)
            with localserver.running_server(repository, "--allow-client-shm", "--engine-threads", "1",
                                            "--allow-grpc", "false", log_path=Path(folder) / "server.log",
                                            cpu=args.server_cpu) as url:
                register = json.dumps({"key": "/" + region.name, "offset": 0, "byte_size": image.nbytes}).encode()
                status, _, body = runs.post(url, f"/v2/systemsharedmemory/region/{REGION}/register", register,
                                        {"Content-Type": "application/json"}, args.timeout)
                if status != 200:
                    raise SystemExit(f"bench shm: registering the region failed ({status}): {body[:300]!r}")
                preflight(url, prepared, args.timeout)
                record["server"] = runs.server_info(url)
                levels = measure(args, url, prepared)
    finally:
        region.close()
        region.unlink()
    record["results"] = levels
    record["headline"] = {f"{level['way']}@{level['concurrency']}_req_s": level["req_s"] for level in levels}
    record["notes"] += [
        "both ways: the same server and image, one after the other; scores asked for as a binary output",
        "wrk sends prepared bodies: the client's own work (serializing, or writing into the region) is not counted",
        "MB/s of images: req/s x 602,112 bytes",
    ]

    def plot(path: Path) -> None:
        plot_ways(path, levels)

    return report.write(args.out, "shm", record, HEADERS, table_rows(levels), plot=plot)


def plot_ways(path: Path, levels: list[dict[str, Any]]) -> None:
    """Bars per way, grouped by clients: req/s on the left, p50 (solid) and p99 (hatched) on the right."""
    fig, (rates, latency) = report.panels(f"{MODEL}: the image through shared memory vs in the body", 2)
    counts = list(dict.fromkeys(level["concurrency"] for level in levels))
    groups = [f"{c} client(s)" for c in counts]

    def per_way(read: Any) -> list[tuple[str, list[float]]]:
        found = {(level["way"], level["concurrency"]): read(level) for level in levels}
        return [(way, [found[way, c] for c in counts]) for way in WAYS]

    report.grouped_bars(rates, groups, per_way(lambda level: level["req_s"]))
    report.grouped_bars(latency, groups, per_way(lambda level: level["latency_ms"]["p99"]), legend=False,
                        alpha=0.35, hatch="//")
    report.grouped_bars(latency, groups, per_way(lambda level: level["latency_ms"]["p50"]))
    rates.set_ylabel("served (req/s)")
    latency.set_ylabel("latency (ms): p50 solid, p99 hatched")
    report.save(fig, path)
