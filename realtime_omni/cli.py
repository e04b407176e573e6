"""The `realtime-omni` command.

realtime-omni serve [--config C] [--host H] [--port P]
                                       start the pipeline and the gateway (the OpenAI
                                       Realtime WebSocket at /v1/realtime, the demo page)
realtime-omni check --config C [--gpu NAME | --gpu-memory GIB]
                                       validate a config and print its stage graph; with a
                                       card, what each GPU holds and whether it fits
realtime-omni run --config C           stream requests through the pipeline, print timings
realtime-omni stage --config C --process NAME
                                       run one stage process on this host (for stages
                                       whose `host` is this machine; the coordinator's
                                       host starts the rest)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time

from realtime_omni import aio
from realtime_omni.errors import ConfigError, OmniError
from realtime_omni.logs import FORMAT_ENV
from realtime_omni.logs import setup as setup_logging
from realtime_omni.pipeline.config import load_config
from realtime_omni.pipeline.graph import Graph

DEFAULT_SERVE_CONFIG = "configs/tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="realtime-omni", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the pipeline and the real-time gateway")
    serve.add_argument("--config", default=DEFAULT_SERVE_CONFIG)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-sessions", type=int, default=16)
    serve.add_argument(
        "--max-lead-ms", type=float, default=2000.0, help="audio made ahead of playout"
    )
    serve.add_argument(
        "--ice-servers",
        default="[]",
        help='WebRTC STUN/TURN servers as JSON: [{"urls": "turn:host:3478", "username": "u", '
        '"credential": "p"}]; none by default (host candidates: loopback and LAN calls)',
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="log lines as text (default) or one JSON object each, with session and request "
        "ids (the stage processes too; REALTIME_OMNI_LOG_FORMAT sets it as well)",
    )
    serve.add_argument(
        "--ice-host-address",
        action="append",
        help="offer only this address as a WebRTC host candidate (repeatable; e.g. 127.0.0.1)",
    )
    serve.add_argument(
        "--ice-denied-networks",
        help="comma-separated CIDR networks an offer's ICE candidates may not name (the server "
        "would send STUN checks there); default link-local and metadata addresses, multicast "
        "(GatewayConfig.ice_denied_networks); '' for none",
    )
    serve.add_argument(
        "--sip-port",
        type=int,
        help="answer SIP calls on this UDP port (the config's `sip:` section says the rest; "
        "0: any free port)",
    )
    serve.add_argument(
        "--event-log",
        help="append every server event sent to this file, one JSON line each, audio left out "
        "(for debugging a client)",
    )
    serve.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="place and supervise the stage processes on this Ray cluster (ray.init's address; "
        "'auto': the one this machine is in); sets runtime.placement: ray (the `ray` extra)",
    )
    serve.add_argument(
        "--drain-s",
        type=float,
        default=25.0,
        help="on SIGTERM, /readyz turns 503 and new sessions are refused at once; live calls go "
        "on up to this many seconds, then end, then the server exits (0: end them at once; a "
        "second SIGTERM or SIGINT: at once too)",
    )
    serve.add_argument(
        "--drain-media-timeout-s",
        type=float,
        default=3.0,
        help="in a drain, a WebRTC call whose caller has sent no audio for this many seconds "
        "(a peer gone without hanging up) ends at once instead of holding the drain (0: never)",
    )
    serve.add_argument(
        "--allow-no-auth",
        action="store_true",
        help="serve a non-loopback --host without API keys (REALTIME_OMNI_API_KEYS unset): only "
        "behind something that authenticates",
    )
    serve.add_argument(
        "--generate-api-key",
        action="store_true",
        help="with no API keys set, make one for this run and print it in the ready line (the "
        "Docker image's default)",
    )
    serve.add_argument(
        "--loop",
        choices=aio.LOOPS,
        default=aio.DEFAULT_LOOP,
        help="the event loop: uvloop's where installed (the default: fewer late frames with "
        "many calls), or asyncio's own",
    )
    from realtime_omni.models.qwen3_omni.memory_plan import CARDS

    check = sub.add_parser("check", help="validate a config and print its stage graph")
    check.add_argument("--config", required=True)
    card = check.add_mutually_exclusive_group()
    card.add_argument(
        "--gpu",
        choices=sorted(CARDS),
        help="plan every CUDA device of the config as this card: per device the weights, KV "
        "pools, largest steps and reserve (meta tensors: no GPU, no weights); exit 1 when a "
        "device does not fit",
    )
    card.add_argument(
        "--gpu-memory", type=float, metavar="GIB", help="as --gpu, for a card of GIB GiB"
    )
    run = sub.add_parser("run", help="stream requests through the pipeline and print timings")
    run.add_argument("--config", required=True)
    run.add_argument("--requests", type=int, default=5, help="requests, one after another")
    run.add_argument("--max-tokens", type=int, default=32)
    stage = sub.add_parser("stage", help="run one stage process of a multi-host pipeline")
    stage.add_argument("--config", required=True)
    stage.add_argument("--process", required=True, help="group#replica, e.g. talker_ar#0")
    sub.add_parser("keygen", help="print a new CurveZMQ secret key for a multi-host pipeline")
    args = parser.parse_args(argv)
    if getattr(args, "log_format", None):
        os.environ[FORMAT_ENV] = args.log_format  # the stage processes inherit it
    setup_logging(f"stage {args.process}" if args.command == "stage" else "gateway")
    if args.command == "keygen":
        from realtime_omni.pipeline.sockets import keygen

        print(keygen())
        return 0
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "check":
            return _check(args.config, args.gpu, args.gpu_memory)
        if args.command == "run":
            return asyncio.run(_run(args.config, args.requests, args.max_tokens))
        return _stage(args.config, args.process)
    except OmniError as e:
        print(f"realtime-omni: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from realtime_omni.gateway.app import serve
    from realtime_omni.gateway.config import GatewayConfig, load_server_config

    server = load_server_config(args.config)
    if args.ray:
        rt = server.pipeline.runtime.model_copy(
            update={"placement": "ray", "ray_address": args.ray}
        )
        server = dataclasses.replace(
            server, pipeline=server.pipeline.model_copy(update={"runtime": rt})
        )
    sip = server.sip
    try:
        ice_servers = json.loads(args.ice_servers)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--ice-servers = {args.ice_servers!r} is not JSON: {e}") from None
    gw = GatewayConfig(
        max_sessions=args.max_sessions,
        max_lead_ms=args.max_lead_ms,
        ice_servers=ice_servers if isinstance(ice_servers, list) else [ice_servers],
        ice_host_addresses=args.ice_host_address,
        phone=server.phone,
        realtime=server.realtime,
        sip=sip.model_copy(update={"port": args.sip_port}) if args.sip_port is not None else None,
        event_log=args.event_log,
        allow_no_auth=args.allow_no_auth,
        generate_api_key=args.generate_api_key,
        drain_s=args.drain_s,
        drain_media_timeout_s=args.drain_media_timeout_s,
    )
    if args.ice_denied_networks is not None:
        denied = [n for n in args.ice_denied_networks.split(",") if n]
        gw = dataclasses.replace(gw, ice_denied_networks=denied)
    aio.run(serve(server.pipeline, args.host, args.port, gw), args.loop)
    return 0


def _check(path: str, gpu: str | None = None, gpu_memory_gib: float | None = None) -> int:
    cfg = load_config(path)
    graph = Graph(cfg)
    for name, group in graph.groups.items():
        where = f" on host {group.host}" if group.host else ""
        batches = ", ".join(f"{s} (max_batch {graph.stages[s].max_batch})" for s in group.stages)
        print(f"process {name} x{group.replicas}{where}: {batches}")
    for e in graph.edges:
        # Mooncake's slots are memory the sender registers with its engine (`pipeline/mooncake.py`).
        reserved = e.slots * e.slot_bytes if e.transport in ("shm", "cuda_ipc", "mooncake") else 0
        print(
            f"  {e.key:32} {e.kind:6} {e.transport:9} {e.slots:4} slots x {e.slot_bytes} B, "
            f"{e.request_slots} per request, reserves {reserved / 2**20:.1f} MiB"
        )
    if gpu is None and gpu_memory_gib is None:
        return 0
    from realtime_omni.models.qwen3_omni import memory_plan

    if gpu is not None:
        name, card = gpu, memory_plan.CARDS[gpu]
    else:
        assert gpu_memory_gib is not None
        if gpu_memory_gib <= 0:
            raise ConfigError(f"--gpu-memory = {gpu_memory_gib}: give the card's GiB, above 0")
        name, card = f"{gpu_memory_gib:g} GiB card", int(gpu_memory_gib * memory_plan.GIB)
    plans = memory_plan.plan(cfg, card, name)
    if not plans:
        print("no stage on a CUDA device: nothing to plan")
        return 0
    print(memory_plan.render(plans))
    problems = memory_plan.check(plans)
    for problem in problems:
        print(f"realtime-omni: {problem}", file=sys.stderr)
    return 1 if problems else 0


async def _run(path: str, requests: int, max_tokens: int) -> int:
    from realtime_omni.pipeline.coordinator import Coordinator

    cfg = load_config(path)
    t0 = time.monotonic()
    async with Coordinator(cfg) as coord:
        print(
            f"{len(coord.graph.processes())} stage processes ready in {time.monotonic() - t0:.1f} s"
        )
        firsts, totals = [], []
        for i in range(requests):
            start = time.monotonic()
            first = None
            stream = await coord.submit(
                {
                    "messages": [{"role": "user", "content": "Hello! How are you today?"}],
                    "max_tokens": max_tokens,
                    "talker_max_tokens": 3 * max_tokens,  # random weights never stop on their own
                }
            )
            async for out in stream:
                if first is None and "pcm" in out.data:
                    first = time.monotonic() - start
            totals.append(time.monotonic() - start)
            firsts.append(first or float("nan"))
            first_ms, total_ms = firsts[-1] * 1e3, totals[-1] * 1e3
            print(f"request {i}: first audio {first_ms:.1f} ms, done {total_ms:.1f} ms")
        print(
            f"median first audio {statistics.median(firsts) * 1e3:.1f} ms, "
            f"median total {statistics.median(totals) * 1e3:.1f} ms"
        )
    return 0


def _stage(path: str, process: str) -> int:
    from realtime_omni.pipeline.worker import WorkerArgs, worker_main

    cfg = load_config(path)
    graph = Graph(cfg)
    if not graph.use_tcp:
        raise OmniError(
            "the stage command runs stages of a multi-host config; this config declares no "
            "`hosts`, so the coordinator starts every stage itself"
        )
    if process not in graph.processes():
        raise OmniError(f"--process {process!r}: not in this config; one of {graph.processes()}")
    worker_main(
        WorkerArgs(
            config=cfg.model_dump(),
            process=process,
            epoch=0,
            epochs={p: 0 for p in graph.processes()},
            ipc_dir=cfg.runtime.ipc_dir or "",
            owner_pid=os.getpid(),
            watch_parent=False,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
