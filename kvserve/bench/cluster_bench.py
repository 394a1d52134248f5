"""The ingress's cost: `kvserve serve` directly against `kvserve cluster` with one replica.

Both run the same engine settings on the same machine, one after the other in the same run, and
the load generator measures output throughput at each concurrency (streaming completions). The
ratio (cluster / direct) is what the ingress and Ray Serve cost; the target is at least 85%.

A row with two replicas sharing the machine's cores is measured too when asked: on one machine
it cannot beat one replica with all the cores (each gets half), and the table says so.

    python -m kvserve.bench.cluster_bench --concurrency 8,32
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass

from kvserve.bench.loadgen import BenchConfig, BenchResult, run_benchmark
from kvserve.bench.run import serving

__all__ = ["ClusterBenchRow", "format_cluster_table", "run_cluster_bench"]


@dataclass(frozen=True)
class ClusterBenchRow:
    concurrency: int
    direct: BenchResult
    cluster: BenchResult
    two_replicas: BenchResult | None = None

    @property
    def ratio(self) -> float:
        return self.cluster.output_throughput / self.direct.output_throughput


def _measure(url: str, concurrencies: list[int], output_len: int) -> dict[int, BenchResult]:
    results = {}
    for concurrency in concurrencies:
        config = BenchConfig(
            url=url,
            concurrency=concurrency,
            num_prompts=2 * concurrency,
            input_len=128,
            output_len=output_len,
            endpoint="completions",
            ignore_eos=True,
            warmup=1,
        )
        results[concurrency] = asyncio.run(run_benchmark(config))
        throughput = results[concurrency].output_throughput
        print(f"  {url} C={concurrency}: {throughput:.0f} out tok/s", flush=True)
    return results


def run_cluster_bench(
    concurrencies: list[int],
    *,
    output_len: int = 64,
    two_replicas: bool = False,
    engine_flags: list[str] = (),
) -> list[ClusterBenchRow]:
    """Measure `kvserve serve` and `kvserve cluster --replicas 1` (and 2, if asked)."""
    cores = os.cpu_count() or 1
    # A pool sized for the workload (128-token prompts): replicas on one machine must not each
    # claim half its free memory, the default.
    blocks = max(concurrencies) * 16
    slots = ["--max-num-seqs", str(max(concurrencies)), "--max-model-len", "512"]
    slots += ["--num-kv-blocks", str(blocks), *engine_flags]
    one = ["--replicas", "1", "--cpus-per-replica", str(cores)]
    # Both up at once, measured in turn at each concurrency: a machine whose other load drifts
    # during the run then shifts both sides alike.
    with (
        serving("--threads", str(cores), *slots) as direct_url,
        serving(*one, "--threads", str(cores), *slots, command="cluster") as cluster_url,
    ):
        # One unmeasured round each first: Ray's own processes are busy for a while after it
        # starts, and each engine meets its batch shapes for the first time.
        for url in (direct_url, cluster_url):
            _measure(url, [min(concurrencies)], output_len)
        direct, cluster = {}, {}
        for concurrency in concurrencies:
            direct |= _measure(direct_url, [concurrency], output_len)
            cluster |= _measure(cluster_url, [concurrency], output_len)
    pair: dict[int, BenchResult] = {}
    if two_replicas:
        half = max(1, cores // 2)
        two = ["--replicas", "2", "--cpus-per-replica", str(half)]
        with serving(*two, "--threads", str(half), *slots, command="cluster") as url:
            pair = _measure(url, concurrencies, output_len)
    return [ClusterBenchRow(c, direct[c], cluster[c], pair.get(c)) for c in concurrencies]


def format_cluster_table(rows: list[ClusterBenchRow]) -> str:
    """Markdown: throughput direct and through the ingress, and their ratio."""
    two = any(row.two_replicas is not None for row in rows)
    head = "| concurrent | `kvserve serve` out tok/s | ingress + 1 replica out tok/s | ratio |"
    rule = "| --- | --- | --- | --- |"
    if two:
        head += " ingress + 2 replicas (half the cores each) out tok/s |"
        rule += " --- |"
    lines = [head, rule]
    for row in rows:
        line = (
            f"| {row.concurrency} | {row.direct.output_throughput:.0f} | "
            f"{row.cluster.output_throughput:.0f} | {row.ratio:.0%} |"
        )
        if two:
            pair = row.two_replicas
            line += f" {pair.output_throughput:.0f} |" if pair is not None else " - |"
        lines.append(line)
    failed = sum(r.direct.num_failed + r.cluster.num_failed for r in rows)
    lines.append("")
    lines.append(f"Failed requests in these runs: {failed}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--two-replicas", action="store_true")
    args = parser.parse_args(argv)
    rows = run_cluster_bench(
        [int(c) for c in args.concurrency.split(",")],
        output_len=args.output_len,
        two_replicas=args.two_replicas,
    )
    print(format_cluster_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
