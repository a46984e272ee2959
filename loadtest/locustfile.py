"""Locust users for Batchline's default models, over KServe v2 HTTP (JSON or binary bodies).

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 10s --host http://127.0.0.1:8000 --csv out/run

Chosen when the file is imported, so by environment variable only:
  BATCHLINE_LT_MODEL   digits (default) | minilm | all  (all: both users; pick one by class name
                       on locust's command line, e.g. `... MinilmUser`)
  BATCHLINE_LT_SHAPE   unset (default: locust's -u/-r/-t) | steady | step | spike (loadtest/shapes.py;
                       -u is the peak, -t the length; the shape ends the run)
Per run, as locust arguments or environment variables:
  --lt-binary / BATCHLINE_LT_BINARY=1   Triton binary tensor bodies (and binary outputs)
  --lt-items N / BATCHLINE_LT_ITEMS=N   items per request (default 1)
  --lt-wait S / BATCHLINE_LT_WAIT=S     think time between a user's requests (default 0: closed loop)

Every reply is checked (status 200, output shape [N, width], size of the data); a wrong one is a
locust failure, so a fast server that answers garbage does not pass.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from locust import FastHttpUser, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `loadtest` when run as locust -f

from loadtest import payloads, shapes

MODEL = os.environ.get("BATCHLINE_LT_MODEL", "digits").strip().lower()
SHAPE = os.environ.get("BATCHLINE_LT_SHAPE", "").strip().lower()
REQUEST_VARIANTS = 32  # different bodies per user, cycled

if MODEL not in ("all", *payloads.SPECS):
    raise SystemExit(f"BATCHLINE_LT_MODEL={MODEL!r}: use digits, minilm or all")
if SHAPE and SHAPE not in shapes.SHAPES:
    raise SystemExit(f"BATCHLINE_LT_SHAPE={SHAPE!r}: use {', '.join(shapes.SHAPES)} or leave it unset")


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    group = parser.add_argument_group("Batchline", "KServe v2 request options (loadtest/locustfile.py)")
    group.add_argument("--lt-binary", action="store_true", env_var="BATCHLINE_LT_BINARY",
                       default=False, help="send Triton binary tensor bodies instead of JSON")
    group.add_argument("--lt-items", type=int, env_var="BATCHLINE_LT_ITEMS", default=1,
                       help="items (batch rows) per request")
    group.add_argument("--lt-wait", type=float, env_var="BATCHLINE_LT_WAIT", default=0.0,
                       help="seconds each user waits between requests")


class _InferUser(FastHttpUser):
    """Posts infer requests for `model` in a loop; checks every reply."""

    abstract = True
    model = ""

    def wait_time(self) -> float:
        return self.environment.parsed_options.lt_wait

    def on_start(self) -> None:
        options = self.environment.parsed_options
        if options.lt_items < 1:
            raise ValueError("--lt-items must be >= 1")
        self.requests = payloads.build_requests(
            self.model, options.lt_items, bool(options.lt_binary), REQUEST_VARIANTS
        )
        self.next_index = 0
        self.label = f"{self.model} {'binary' if options.lt_binary else 'json'} x{options.lt_items}"

    @task
    def infer(self) -> None:
        request = self.requests[self.next_index % len(self.requests)]
        self.next_index += 1
        with self.client.post(
            request.path, data=request.body,  # type: ignore[arg-type]  # locust's annotation says str; bytes go as they are
            headers=request.headers, name=self.label, catch_response=True,
        ) as response:
            headers = {payloads.HEADER_LENGTH: response.headers.get(payloads.HEADER_LENGTH)}
            if headers[payloads.HEADER_LENGTH] is None:
                headers = {}
            problem = payloads.check_response(
                self.model, request.items, response.status_code or 0, headers, response.content or b""
            )
            if problem:
                response.failure(problem)
            else:
                response.success()


class DigitsUser(_InferUser):
    """image FP32 [n,1,8,8] from models/digits/1/heldout.npz → probabilities [n,10]."""

    abstract = MODEL not in ("digits", "all")
    model = "digits"


class MinilmUser(_InferUser):
    """text BYTES [n,1] from varied sentences → embedding [n,384]."""

    abstract = MODEL not in ("minilm", "all")
    model = "minilm"


if SHAPE:
    LoadShape = shapes.SHAPES[SHAPE]  # the only shape class in this namespace: locust runs it
