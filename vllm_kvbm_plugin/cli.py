"""`vllm-kvbm`: subscribe to and validate KV event streams, build tiny local models."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_kvbm_plugin.events.types import KVEventBatch
    from vllm_kvbm_plugin.events.validator import Prompt


REUSE_REPORTS_HELP = ('requests use kv_cache_report_mode "full": hashes announced again while held are '
                      'reuse reports, not duplicate_store')
SILENCE_HELP = "warn when the stream has delivered nothing for this many seconds {} (default %(default)s; 0: never)"


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return n


def _subscribe(args: argparse.Namespace) -> int:
    import logging

    from vllm_kvbm_plugin.events import recording
    from vllm_kvbm_plugin.events.subscriber import SilenceWatch, Subscriber
    from vllm_kvbm_plugin.events.validator import Validator

    validator = Validator(prompts=_prompts(args.prompts), reuse_reports=args.reuse_reports) if args.validate else None
    out = open(args.out, "w") if args.out else sys.stdout
    tiers: dict[str, dict[str, int]] = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    n = 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sub = Subscriber(args.endpoint, args.replay_endpoint, args.topic,
                     start_seq=None if args.from_now else 0)
    watch = SilenceWatch(None, args.endpoint, args.silence_warning)
    watch.expect()  # no request is seen from here: a stream silent since connecting is suspect
    try:
        while not stop and (args.max_batches is None or n < args.max_batches):
            got = sub.poll(int(args.idle_timeout * 1000) if args.idle_timeout else 500)
            if watch.batches == 0:
                watch.delivered(len(got))
                watch.check("since connecting (none ever arrived)")
            if not got and args.idle_timeout:
                break
            for seq, batch in got:
                n += 1
                _count_tiers(batch, tiers)
                if validator:
                    validator.apply(batch, seq)
                if not args.quiet:
                    out.write(recording.dump_line(seq, batch) + "\n")
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        if args.out:
            out.close()
    summary = {"subscriber": vars(sub.stats), "batches": n, "tiers": dict(sorted(tiers.items()))}
    if validator:
        summary["validator"] = validator.report()
    print(json.dumps(summary, indent=2), file=sys.stderr)
    return 1 if (validator and validator.errors) or sub.stats.lost else 0


def _count_tiers(batch: KVEventBatch, tiers: dict[str, dict[str, int]]) -> None:
    """Hashes stored and removed per tier ("medium[:locality[:ownership]]", see events.types.Tier)."""
    from vllm_kvbm_plugin.events.types import BlockRemoved, BlockStored, tier_of

    for ev in batch.events:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            counts = tiers.setdefault(tier_of(ev).label, {"stored": 0, "removed": 0})
            counts["stored" if isinstance(ev, BlockStored) else "removed"] += len(ev.block_hashes)


def _validate(args: argparse.Namespace) -> int:
    import heapq

    from vllm_kvbm_plugin.events import recording
    from vllm_kvbm_plugin.events.validator import Validator

    v = Validator(prompts=_prompts(args.prompts), reuse_reports=args.reuse_reports)
    files = [open(f) for f in args.file]
    try:  # several recordings: one stream each (a publisher), merged by batch time
        def stream(i, fp):
            for seq, b in recording.read(fp):
                yield b.ts, i, seq, b
        streams = [stream(i, fp) for i, fp in enumerate(files)]
        for _, i, seq, batch in heapq.merge(*streams, key=lambda r: (r[0], r[1])):
            v.apply(batch, seq, stream=i if len(files) > 1 else None)
    finally:
        for fp in files:
            fp.close()
    print(json.dumps(v.report(), indent=2))
    for p in v.problems[:20]:  # the report's first_problems, one line each on stderr
        print(f"#{p.seq} {p.rule} [{p.tier}]: {p.detail}", file=sys.stderr)
    return 1 if v.errors else 0


def _prompts(path: str | None) -> list[Prompt] | None:
    """The requests' prompts for the extra_keys rule, or None (rule off)."""
    if not path:
        return None
    from vllm_kvbm_plugin.events.validator import read_prompts

    with open(path) as fp:
        return read_prompts(fp)


def _announce(args: argparse.Namespace) -> int:
    import logging
    import threading

    from vllm_kvbm_plugin.events.announcer import RemoteAnnouncer, ServerRefused, publish_to, zmq_publisher
    from vllm_kvbm_plugin.tiers.resp import check_url

    try:
        check_url(args.remote_url)
    except (ValueError, ImportError) as e:
        print(f"vllm-kvbm announce: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    publisher = zmq_publisher(args.endpoint, args.replay_endpoint, args.topic)
    try:
        RemoteAnnouncer(args.remote_url, publish_to(publisher), args.rescan_interval).run(stop)
    except ServerRefused as e:
        print(f"vllm-kvbm announce: {e}", file=sys.stderr)
        return 2
    finally:
        publisher.shutdown()
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    from vllm_kvbm_plugin.testing import tiny_models  # test helpers: imported by this command only

    if args.kind not in tiny_models.KINDS:  # what argparse's `choices` said, without importing them up front
        print(f"vllm-kvbm tiny-model: argument kind: invalid choice: {args.kind!r} "
              f"(choose from {', '.join(map(repr, tiny_models.KINDS))})", file=sys.stderr)
        return 2
    print(tiny_models.build(args.kind, args.dir))
    return 0


def _match(args: argparse.Namespace) -> int:
    from vllm_kvbm_plugin.reuse.subseq_feed import match_recording

    prompts = [[int(t) for t in args.prompt.replace(",", " ").split()]] if args.prompt else []
    if args.prompts:
        with open(args.prompts) as fp:
            prompts += [json.loads(line)["token_ids"] for line in fp if line.strip()]
    with open(args.file) as fp:
        for out in match_recording(fp, prompts, args.unit):
            print(json.dumps(out, separators=(",", ":")))
    return 0


def _route(args: argparse.Namespace) -> int:
    import logging

    from vllm_kvbm_plugin.events.index import WorkerConfig
    from vllm_kvbm_plugin.router import Router, Worker, serve

    try:
        workers = [Worker.parse(w) for w in args.worker]
        announcers = [Worker.announcer(a) for a in args.announcer or ()]
    except ValueError as e:
        print(f"vllm-kvbm route: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(workers, args.topic, WorkerConfig(args.hash_algo, args.hash_seed, connector=args.connector,
                                                         remote=args.remote), policy=args.policy,
                    silence_s=args.silence_warning, announcers=announcers, history=args.history)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(router, args.host, args.port, args.max_body_bytes)
    return 0


def _tiers_inspect(args: argparse.Namespace) -> int:
    from vllm_kvbm_plugin.log import redact_url
    from vllm_kvbm_plugin.tiers import inspector

    def progress(n: int) -> None:
        print(f"\r[inspect] {n:,} entries", end="", file=sys.stderr, flush=True)

    tty = sys.stderr.isatty()
    try:
        report = inspector.inspect(args.target, args.verify, progress if tty else None)
    except (OSError, ValueError, ImportError) as e:
        print(f"vllm-kvbm tiers inspect: {redact_url(args.target)}: {e}", file=sys.stderr)
        return 2
    finally:
        if tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2) if args.json else inspector.summary(report))
    return 1 if report["verify"] and report["verify"]["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    from vllm_kvbm_plugin.events.subscriber import ENDPOINT_FORMS

    p = argparse.ArgumentParser(prog="vllm-kvbm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("subscribe", help="print (and optionally validate) vLLM's KV event stream",
                       epilog=ENDPOINT_FORMS)
    s.add_argument("--endpoint", default="tcp://127.0.0.1:5557",
                   help="vLLM's KV events PUB endpoint (the worker binds tcp://*:PORT or ipc://; see below)")
    s.add_argument("--replay-endpoint", default=None, help="vLLM's replay endpoint, to recover gaps")
    s.add_argument("--topic", default="", help="topic prefix to subscribe to")
    s.add_argument("--from-now", action="store_true",
                   help="start with the next batch instead of recovering the stream from seq 0")
    s.add_argument("--out", help="write JSON lines here instead of stdout")
    s.add_argument("--quiet", action="store_true", help="do not print batches")
    s.add_argument("--validate", action="store_true", help="check the stream like a router would")
    s.add_argument("--prompts", help="with --validate: JSON lines of the requests' prompts, to check extra_keys")
    s.add_argument("--reuse-reports", action="store_true", help=REUSE_REPORTS_HELP)
    s.add_argument("--idle-timeout", type=float, default=None, help="stop after this many idle seconds")
    s.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    s.add_argument("--silence-warning", type=float, default=30.0, metavar="SECONDS",
                   help=SILENCE_HELP.format("since connecting"))
    s.set_defaults(func=_subscribe)

    v = sub.add_parser("validate", help="check recorded streams (JSON lines from `subscribe`); several "
                       "files: the streams of a fleet's instances and the announcer, merged by batch time")
    v.add_argument("file", nargs="+")
    v.add_argument("--prompts", help='JSON lines, one per request: {"token_ids": [...], "images": '
                   '[{"offset": N, "length": N, "identifier": optional}]}; checks each prompt block\'s extra_keys')
    v.add_argument("--reuse-reports", action="store_true", help=REUSE_REPORTS_HELP)
    v.set_defaults(func=_validate)

    a = sub.add_parser("announce", help="publish the remote tier's KV events once per tier (vLLM's wire "
                       "format, with replay), from the server's keyspace notifications")
    a.add_argument("--remote-url", required=True, help="the fleet's remote_url (redis://, rediss://, unix://, redis+cluster://)")
    a.add_argument("--endpoint", default="tcp://*:5560", help="PUB endpoint to bind")
    a.add_argument("--replay-endpoint", default=None, help="ROUTER endpoint to bind for replay requests")
    a.add_argument("--topic", default="", help="topic of the published batches")
    a.add_argument("--rescan-interval", type=float, default=60.0,
                   help="seconds between full rescans of the server's keys (also after every reconnect)")
    a.set_defaults(func=_announce)

    t = sub.add_parser("tiny-model", help="build a tiny random-weight model locally (no hub)")
    t.add_argument("kind", help="which model (testing/tiny_models.py KINDS; an unknown kind lists them)")
    t.add_argument("--dir", default=None, help="cache directory (default ~/.cache/vllm-kvbm/tiny-models)")
    t.set_defaults(func=_tiny_model)

    m = sub.add_parser("match", help="sub-sequences of prompts that a recorded stream's blocks hold, "
                       "at any offset (runs, prefix and reusable non-prefix tokens)")
    m.add_argument("file", help="recorded KV events (JSON lines from `subscribe`)")
    m.add_argument("--prompt", help="token ids, separated by spaces or commas")
    m.add_argument("--prompts", help='JSON lines, one per request: {"token_ids": [...]}')
    m.add_argument("--unit", type=int, default=None, help="hash unit (default: smallest stored block size)")
    m.set_defaults(func=_match)

    r = sub.add_parser("route", help="route OpenAI completions to the worker holding most of the prompt "
                       "(its KV event stream fed to events.index)", epilog=ENDPOINT_FORMS)
    r.add_argument("--worker", action="append", required=True, metavar="URL,EVENTS[,REPLAY]",
                   help="a `vllm serve` URL, its KV events endpoint and replay endpoint (repeat per worker)")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    r.add_argument("--topic", default="", help="KV events topic prefix")
    r.add_argument("--policy", choices=("kv", "round-robin"), default="kv",
                   help="default policy (a request's X-KVBM-Policy header overrides it)")
    r.add_argument("--hash-algo", default="sha256", help="the workers' --prefix-caching-hash-algo")
    r.add_argument("--hash-seed", default=None, help="the workers' PYTHONHASHSEED, if set")
    r.add_argument("--connector", choices=("KVBMConnector", "OffloadingConnector"), default="KVBMConnector",
                   help="the workers' offloading connector, whose rule serves their tiers (OffloadingConnector: "
                        "vLLM's, with KVBMOffloadingSpec)")
    r.add_argument("--announcer", action="append", metavar="EVENTS[,REPLAY]",
                   help="the events (and replay) endpoint of a remote tier's `vllm-kvbm announce` (repeatable)")
    r.add_argument("--remote", choices=("announced", "all", "none"), default="announced",
                   help="which shared remote tiers a worker serves from: those its own stream announced blocks in "
                        "(default), every one any stream announced (a fleet on one Redis), or none")
    r.add_argument("--silence-warning", type=float, default=30.0, metavar="SECONDS",
                   help=SILENCE_HELP.format("after its worker served a request"))
    r.add_argument("--history", type=_positive, default=1000, metavar="N",
                   help="request records /router/stats keeps, the latest (its sums cover every request; "
                        "default %(default)s)")
    r.add_argument("--max-body-bytes", type=_positive, default=16 << 20, metavar="BYTES",
                   help="largest request body accepted; a larger one is answered 413 unread "
                        "(default %(default)s: 16 MiB)")
    r.set_defaults(func=_route)

    ti = sub.add_parser("tiers", help="look into a tier").add_subparsers(dest="tiers_cmd", required=True)
    i = ti.add_parser("inspect", help="entries, bytes, layouts (model fingerprints) and ages of a disk tier's "
                      "directory or a remote tier's server, read-only (no link followed, no special file opened)")
    i.add_argument("target", metavar="DISK_PATH|REMOTE_URL", help="a disk_path, or a remote_url (redis://...)")
    i.add_argument("--verify", action="store_true",
                   help="read every entry as a load does, under the fingerprint its header names, and count "
                        "those failing verification or of another fingerprint than their rank's others (exit 1 if any)")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=_tiers_inspect)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
