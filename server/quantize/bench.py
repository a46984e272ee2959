"""Engine-alone speed of a build, per batch size, in a child process.

A child process gives each measurement a clean peak RSS (`ru_maxrss` is a high-water mark of the
whole process) and its own thread settings (torch's are process-wide). The engine runs alone:
no HTTP, no batcher, one intra-op thread by default, short timed loops after a warm-up. Pin
the whole build to a core (`taskset -c 1 batchline build ...`) for steadier figures: the child
inherits the affinity.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ModelConfig
from server.devices import Device
from server.engines.timing import time_runs
from server.quantize.progress import Track, untracked

DEFAULT_BATCHES = (1, 8, 32)
RESULT = "BATCHLINE-BENCH-RESULT "  # marks the figures among whatever else libraries print


def batch_sizes(config: ModelConfig) -> list[int]:
    """The config's batch buckets (its ladder), else 1, 8 and 32 (within max_batch_size): a
    build is timed where it will serve, and a model without buckets at three points of its ladder."""
    if not config.batched or config.batch_buckets:
        return config.batch_ladder()
    return [b for b in DEFAULT_BATCHES if b <= config.max_batch_size] or [config.max_batch_size]


def benchmark(
    config: ModelConfig,
    version_dir: Path,
    data_dirs: tuple[Path, Path],
    *,
    batches: list[int] | None = None,
    seconds: float = 1.0,
    threads: int = 1,
    sequence_length: int | None = 32,
    workdir: Path,
    track: Track = untracked,
    label: str = "timing",
    device: str = "cpu",
) -> dict[str, Any]:
    """Time `config`'s engine over `version_dir` in a child process; returns the figures.

    The child prints a line as each batch size is done (the bar's steps), then the figures on
    a line of their own marked RESULT."""
    request: dict[str, Any] = {
        "config": config.model_dump(mode="json"),
        "version_dir": str(version_dir),
        "model_dir": str(data_dirs[0]),
        "data_version_dir": str(data_dirs[1]),
        "batches": batches or batch_sizes(config),
        "seconds": seconds,
        "threads": threads,
        "sequence_length": sequence_length if config.tokenize else None,
        "device": device,
    }
    path = workdir / f"bench-{os.getpid()}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(request))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryFile("w+") as errors, subprocess.Popen(
        [sys.executable, "-m", "server.quantize.bench", str(path)],
        stdout=subprocess.PIPE, stderr=errors, text=True, env=env, cwd=root,
    ) as child:
        assert child.stdout is not None
        lines = list(track(child.stdout, label, len(request["batches"]) + 1))
        code = child.wait()
        errors.seek(0)
        stderr = errors.read()
    results = [line.partition(RESULT)[2] for line in lines if RESULT in line]  # even glued to other output
    if code != 0 or not results:
        from server.quantize.errors import BuildError

        raise BuildError(f"the benchmark failed: {stderr.strip()[-2000:]}")
    return json.loads(results[-1])


@dataclass(frozen=True)
class Timing:
    """How every timing of one build runs: same data, seconds, sequence length and device, so the
    build, FP32 and the FP32 export in the build's engine compare."""

    dirs: tuple[Path, Path]  # the source's model folder and version folder (its evaluation data)
    seconds: float
    sequence_length: int
    work: Path
    track: Track
    device: str

    def run(self, config: ModelConfig, version_dir: Path, batches: list[int] | None, label: str) -> dict[str, Any]:
        return benchmark(config, version_dir, self.dirs, batches=batches, seconds=self.seconds,
                         sequence_length=self.sequence_length, workdir=self.work, track=self.track,
                         label=label, device=self.device)


def _child(request_path: Path) -> dict[str, Any]:
    from server.quantize.data import load_eval_data
    from server.quantize.runner import Runner, with_threads

    request = json.loads(request_path.read_text())
    config = with_threads(ModelConfig.model_validate(request["config"]), request["threads"])
    data = load_eval_data(Path(request["model_dir"]), Path(request["data_version_dir"]), config)
    rss_before = _rss_mb()
    runner = Runner(config, Path(request["version_dir"]), request["device"])
    rows = []
    for batch in request["batches"]:
        feed = runner.feed(data, batch, request["sequence_length"])
        def one_run(_: int, feed: dict[str, Any] = feed) -> object:
            return runner.run(feed)

        timings = time_runs(one_run, request["seconds"]).latencies_s
        mean = statistics.fmean(timings)
        rows.append({
            "batch": batch,
            "latency_ms": mean * 1e3,
            "latency_p50_ms": statistics.median(timings) * 1e3,
            "throughput": batch / mean,
            "runs": len(timings),
        })
        print(json.dumps({"timed_batch": batch}), flush=True)
    gpu_memory = _gpu_memory_mb(runner.device)
    runner.close()
    return {
        "threads": request["threads"],
        "seconds": request["seconds"],
        "sequence_length": request["sequence_length"],
        "buckets": rows,
        "rss_before_load_mb": rss_before,
        "peak_rss_mb": _rss_mb(),
        "device": str(runner.device),
        "gpu_memory_mb": gpu_memory,
    }


def _gpu_memory_mb(device: Device) -> float | None:
    """What this process holds on the build's GPU after timing (engine, workspace, buffers)."""
    if device.kind != "GPU":
        return None
    from server.gpu import process_memory_bytes

    used = process_memory_bytes(device.index, os.getpid())
    return round(used / 2**20, 1) if used is not None else None


def _rss_mb() -> float:
    """This process's peak RSS in MB.

    Linux carries the parent's high-water mark across fork+exec into `getrusage().ru_maxrss`,
    so a child started by a build that loaded torch would report the build's peak; VmHWM in
    /proc/self/status is per address space and starts afresh at exec. getrusage elsewhere.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


if __name__ == "__main__":
    print(RESULT + json.dumps(_child(Path(sys.argv[1]))), flush=True)
