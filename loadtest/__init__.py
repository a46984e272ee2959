"""Load-test and benchmark tooling for Batchline.

`loadtest/locustfile.py` drives the server with locust users; `batchline bench MODE`
measures the engine alone (`engine`), the server closed-loop with wrk (`closed`), open-loop with
Poisson arrivals (`open`), batching on against off (`batching`), the capacity per replica at a p99
target and the autoscaling target (`capacity`), two servers side by side (`compare`), client-side
batch sizes (`batchsize`) and precision variants (`precision`). See loadtest/README.md.

Nothing here imports `server`: the tools speak KServe v2 over HTTP, or load the model artifacts
the way the engines do, so they keep measuring while the server is rewritten.
"""
