"""How long a small embeddings call waits beside one long list of long texts: the model as
configured, against the same model without `max_batch_tokens`, one after the other in one run.

A list of texts goes to the model as requests of up to its batch cap each (two per instance in
flight); a small call queued meanwhile waits for the one running and the one formed behind it.
The token budget bounds what such a request costs, and so that wait. Both copies take the batch
cap `--batch-cap` (default 64, what a fast machine's warm-up profile gives), so the profile's run-
to-run noise on a shared machine does not decide the chunk size.

    python -m loadtest.fairness --model-repository models --model minilm --server-cpu 0 --out out/fairness
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from loadtest.localserver import running_server

SMALL_TEXT = "How do I reset my password?"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "people", "walk", "past", "the",
         "old", "station"]
SMALL_EVERY_S = 0.05  # the small caller's pause between its calls
SMALL_AFTER_S = 0.5  # the small caller begins once the list's first requests are queued


@dataclass(frozen=True)
class Outcome:
    variant: str
    max_batch_tokens: int | None
    list_seconds: float
    small_calls: int
    small_p50_ms: float
    small_max_ms: float
    batches: dict[int, int]  # batch size -> batches run


def model_copy(source: Path, into: Path, batch_cap: int, keep_token_budget: bool) -> int | None:
    """`source` under `into`, its config copied with its warm-up's batch cap fixed and without
    its `max_batch_tokens` unless `keep_token_budget`, everything else linked. The budget it is
    served with."""
    target = into / source.name
    target.mkdir()
    for entry in source.iterdir():
        if entry.name != "config.yaml":
            (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    config_path = target / "config.yaml"
    config: dict[str, Any] = yaml.safe_load((source / "config.yaml").read_text())
    config.setdefault("warmup", {})["batch_cap"] = batch_cap
    config["warmup"].pop("profile", None)
    batching = config.setdefault("dynamic_batching", {})
    if not keep_token_budget:
        batching.pop("max_batch_tokens", None)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return batching.get("max_batch_tokens")


async def measure(url: str, model: str, texts: int, words: int) -> tuple[float, list[float], dict[int, int]]:
    """The list's time, each small call's latency (seconds), and the batches the model ran."""
    rng = random.Random(0)
    long_texts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(texts)]
    async with httpx.AsyncClient(timeout=600) as client:
        done = asyncio.Event()

        async def the_list() -> float:
            started = time.perf_counter()
            try:
                answer = await client.post(f"{url}/v1/embeddings", json={"model": model, "input": long_texts})
            finally:
                done.set()
            answer.raise_for_status()
            return time.perf_counter() - started

        async def small_caller() -> list[float]:
            latencies: list[float] = []
            await asyncio.sleep(SMALL_AFTER_S)
            while not done.is_set():
                started = time.perf_counter()
                answer = await client.post(f"{url}/v1/embeddings", json={"model": model, "input": SMALL_TEXT})
                answer.raise_for_status()
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(SMALL_EVERY_S)
            return latencies

        list_s, latencies = await asyncio.gather(the_list(), small_caller())
        stats = (await client.get(f"{url}/v2/models/{model}/stats")).json()["model_stats"][0]
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    return list_s, latencies, batches


def run(repository: Path, model: str, texts: int, words: int, batch_cap: int, cpu: int | None,
        out: Path) -> list[Outcome]:
    outcomes = []
    for variant, keep in (("as configured", True), ("without max_batch_tokens", False)):
        with tempfile.TemporaryDirectory(prefix="batchline-fairness-") as folder:
            budget = model_copy(repository / model, Path(folder), batch_cap, keep)
            with running_server(Path(folder), "--allow-grpc", "false", "--engine-threads", "1",
                                log_path=out / f"server-{'with' if keep else 'without'}.log", cpu=cpu) as url:
                list_s, latencies, batches = asyncio.run(measure(url, model, texts, words))
        if not latencies:
            raise RuntimeError(f"{variant}: the list was answered before the small caller began; send more texts")
        outcomes.append(Outcome(variant, budget, round(list_s, 2), len(latencies),
                                round(statistics.median(latencies) * 1000, 1), round(max(latencies) * 1000, 1),
                                batches))
    return outcomes


def table(outcomes: list[Outcome], texts: int, words: int) -> str:
    lines = [f"One list of {texts} texts of {words} words, and a small caller beside it (one short text a call).",
             "", "| model | max_batch_tokens | the list, s | small calls | small p50 ms | small max ms | batches run (size: count) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for o in outcomes:
        batches = ", ".join(f"{size}: {count}" for size, count in sorted(o.batches.items()))
        lines.append(f"| {o.variant} | {o.max_batch_tokens or '-'} | {o.list_seconds} | {o.small_calls} | "
                     f"{o.small_p50_ms} | {o.small_max_ms} | {batches} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fairness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="minilm", help="a text model served as OpenAI embeddings")
    parser.add_argument("--texts", type=int, default=256, help="texts in the long list")
    parser.add_argument("--words", type=int, default=400, help="words a text of the list (400: past 256 tokens)")
    parser.add_argument("--batch-cap", type=int, default=64, help="the warm-up batch cap both copies take")
    parser.add_argument("--server-cpu", type=int, default=None, help="pin the server to this CPU")
    parser.add_argument("--out", type=Path, default=Path("out/fairness"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = run(args.model_repository, args.model, args.texts, args.words, args.batch_cap, args.server_cpu,
                   args.out)
    (args.out / "fairness.json").write_bytes(orjson.dumps([asdict(o) for o in outcomes], option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    report = table(outcomes, args.texts, args.words)
    (args.out / "fairness.md").write_text(report)
    print(report, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
