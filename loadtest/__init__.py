"""Load-test and benchmark tooling for Batchline (issue "Measure").

`loadtest/locustfile.py` drives the server with locust users; `python -m loadtest.bench MODE`
measures the engine alone (`engine`), the server closed-loop with wrk (`closed`), open-loop with
Poisson arrivals (`open`) and batching on against off (`batching`). See loadtest/README.md.

Nothing here imports `server`: the tools speak KServe v2 over HTTP, or load the model artifacts
the way the engines do, so they keep measuring while the server is rewritten.
"""
