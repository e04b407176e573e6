"""First audio: from submit to the first audio chunk, and to the last, streaming against serial.

For each config (the simulated Qwen3-Omni timings, and the tiny real model on this CPU) and each
mode, runs requests one at a time through the real pipeline and reports p50s next to the compute
floor measured in the same run: the executors' own step times on the critical path to the first
audio chunk (preprocessing, the slower encoder, the thinker steps the talker waited for, the
talker frames code2wav waited for, code2wav's first chunk), read from the stage processes' step
logs. First audio minus the floor is what the runtime adds.

Modes: `streaming` is the config as it is; `serial` runs the same model as generate() does,
thinker to its end, then the talker, then one vocoder pass (`serial: true` on the simulated
talker and code2wav; `configs/tiny-serial.yaml`, generate() itself in one stage, for the tiny
model).

With `--ray`, the simulated config's streaming run is repeated with its stages placed by Ray
(`runtime.placement: ray`) over three nodes of a local Ray cluster (every node on this machine,
a custom resource per node saying which stages go where: the encoders, the thinker, the
talker): the edges between them go over TCP with CurveZMQ, as between machines. Same run, same
requests: what the placement costs first audio.

    python benchmarks/first_audio.py [--configs simulated,tiny] [--requests 5] [--ray] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402

CONFIGS = {
    "simulated": (ROOT / "configs/simulated-qwen3-omni.yaml", None),
    "tiny": (ROOT / "configs/tiny.yaml", ROOT / "configs/tiny-serial.yaml"),
}


def load(name: str, mode: str) -> dict[str, Any] | None:
    streaming, serial = CONFIGS[name]
    if mode == "streaming":
        return yaml.safe_load(streaming.read_text())
    if serial is not None:
        return yaml.safe_load(serial.read_text()) if serial.exists() else None
    data = yaml.safe_load(streaming.read_text())
    for stage in ("talker_ar", "code2wav"):
        data["stages"][stage]["params"]["serial"] = True
    # All the audio comes as one chunk: give that edge room for it.
    edges = [e for e in data["edges"] if (e["src"], e["dst"]) != ("code2wav", "client")]
    big = {"src": "code2wav", "dst": "client", "slots": 2, "slot_bytes": 8 << 20}
    data["edges"] = [*edges, big]
    data["stages"]["code2wav"]["max_batch"] = 2  # one request at a time: two credits suffice
    return data


def request(name: str, max_tokens: int) -> dict[str, Any]:
    if name == "simulated":
        return {"max_tokens": max_tokens}
    t = np.arange(16000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)
    content = [{"type": "audio", "audio": "audio0"}, {"type": "text", "text": "Answer briefly."}]
    return {
        "messages": [{"role": "user", "content": content}],
        "audio0": audio,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "talker_temperature": 0.0,
        "talker_max_tokens": 3 * max_tokens,  # random weights never stop on their own
    }


def floor_ms(steps: dict[str, list[tuple[float, float]]], since: float) -> float:
    """Critical-path compute of the request submitted at `since` (requests run one at a time)."""
    mine = {s: [(t, d) for t, d in log if t >= since] for s, log in steps.items()}
    if "serial" in mine:  # one stage does it all
        return sum(d for _, d in mine["serial"]) * 1e3

    def first(stage: str) -> tuple[float, float]:
        return mine[stage][0] if mine.get(stage) else (since, 0.0)

    def before(stage: str, t: float) -> float:
        return sum(d for s, d in mine.get(stage, []) if s + d <= t)

    encoders = max(first(s)[1] for s in ("audio_encoder", "image_encoder"))
    talker_start, c2w = first("talker_ar")[0], first("code2wav")
    return 1e3 * (
        first("preprocessing")[1]
        + encoders
        + before("thinker", talker_start)
        + before("talker_ar", c2w[0])
        + c2w[1]
    )


# stage -> the node (by its custom resource) it runs on, with --ray
RAY_NODES = {
    "preprocessing": "zone_a", "image_encoder": "zone_a", "audio_encoder": "zone_a",
    "thinker": "zone_b", "decode": "zone_b", "talker_ar": "zone_c", "code2wav": "zone_c",
}  # fmt: skip


def ray_cluster() -> Any:
    """Three nodes on 127.0.0.1, one custom resource each (`RAY_NODES`); ray.init joins it."""
    import os

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind to 127.0.0.1, not outward
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "node_ip_address": "127.0.0.1"})  # fmt: skip
    for zone in sorted(set(RAY_NODES.values())):
        c.add_node(num_cpus=3, resources={zone: 4}, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, _node_ip_address="127.0.0.1")
    return c


async def run(name: str, mode: str, requests: int, max_tokens: int) -> dict[str, Any] | None:
    placement = "local"
    if mode == "ray":
        mode, placement = "streaming", "ray"
    data = load(name, mode)
    if data is None:
        print(f"{name} {mode}: skipped (no serial config)", file=sys.stderr)
        return None
    if placement == "ray":
        for stage, st in data["stages"].items():
            st["resources"] = {RAY_NODES[stage]: 1}
        data.setdefault("runtime", {})["placement"] = "ray"
    firsts, totals, floors = [], [], []
    async with Coordinator(parse_config(data)) as coord:
        for i in range(requests + 2):  # two warm-up requests first
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            first = None
            async for out in await coord.submit(request(name, max_tokens)):
                if first is None and "pcm" in out.data:
                    first = time.monotonic() - t0
            total = time.monotonic() - t0
            if i < 2 or first is None:
                continue
            stats = await coord.stats()
            steps = {s: log for st in stats.values() for s, log in st.steps.items()}
            firsts.append(first * 1e3)
            totals.append(total * 1e3)
            floors.append(floor_ms(steps, t0))
    return {
        "config": name,
        "mode": mode if placement == "local" else "ray",
        "first_audio_ms_p50": statistics.median(firsts),
        "total_ms_p50": statistics.median(totals),
        "compute_floor_ms": statistics.median(floors),
        "overhead_ms_p50": statistics.median(f - c for f, c in zip(firsts, floors, strict=True)),
        "requests": len(firsts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="simulated,tiny")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--ray", action="store_true", help="also the simulated config placed by Ray on 3 nodes"
    )
    args = parser.parse_args()
    runs = []
    cluster = ray_cluster() if args.ray else None
    for name in args.configs.split(","):
        ray_mode = ("ray",) if cluster is not None and name == "simulated" else ()
        for mode in ("streaming", "serial", *ray_mode):
            print(f"measuring {name} {mode} ...", file=sys.stderr, flush=True)
            r = asyncio.run(run(name, mode, args.requests, args.max_tokens))
            if r is not None:
                runs.append(r)
    print(
        f"{'config':10} {'mode':10} {'first audio':>12} {'total':>9} {'floor':>9} {'overhead':>9}"
    )
    for r in runs:
        print(
            f"{r['config']:10} {r['mode']:10} {r['first_audio_ms_p50']:>10.1f}ms "
            f"{r['total_ms_p50']:>7.1f}ms {r['compute_floor_ms']:>7.1f}ms "
            f"{r['overhead_ms_p50']:>7.1f}ms"
        )
    print("p50 over the requests; floor: the stages' own step times on the path to first audio;")
    print("overhead: first audio minus floor (target for streaming: <= 10 ms)")
    for name in dict.fromkeys(r["config"] for r in runs):
        by = {r["mode"]: r for r in runs if r["config"] == name}
        if len(by) == 2:
            ratio = by["serial"]["first_audio_ms_p50"] / by["streaming"]["first_audio_ms_p50"]
            print(f"{name}: serial / streaming first audio = {ratio:.1f}x")
        if "ray" in by:
            extra = by["ray"]["first_audio_ms_p50"] - by["streaming"]["first_audio_ms_p50"]
            print(f"{name}: placed by Ray over 3 nodes, first audio {extra:+.1f} ms against local")
    if cluster is not None:
        import ray

        ray.shutdown()
        cluster.shutdown()
    if args.json:
        args.json.write_text(json.dumps({"runs": runs}, indent=2))


if __name__ == "__main__":
    main()
