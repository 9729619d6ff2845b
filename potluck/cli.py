"""``potluck``: the command line.

    potluck demo                               a coordinator and 3 local peers on this CPU
    potluck coordinator --config run.toml      host a run (prints the join address)
    potluck peer --join ADDRESS                lend this machine to a run
    potluck status ADDRESS                     the run's status page, in a terminal
    potluck schedule --topology FILE.json      plan a tasklet grid offline (evolutionary search)
    potluck export --journal DIR --out F.pt    the latest checkpoint as one plain torch file
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from potluck import __version__


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"potluck: --set expects section.field=value, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _run_config(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    from potluck.protos.config import ConfigError, apply_overrides, load_config

    try:
        cfg = load_config(args.config)
        return apply_overrides(cfg, {**extra, **_overrides(args.set)})
    except ConfigError as err:
        raise SystemExit(f"potluck: {err}") from None


def cmd_coordinator(args: argparse.Namespace) -> int:
    from potluck.coordinator.app import Coordinator

    extra = {
        f"coordinator.{k}": v
        for k, v in (("host", args.host), ("dht_port", args.dht_port), ("status_port", args.status_port),
                     ("grpc_port", args.grpc_port), ("journal_dir", args.journal_dir), ("announce_host", args.announce_host))
        if v is not None
    }
    cfg = _run_config(args, extra)
    coordinator = Coordinator(cfg, exit_when_finished=args.exit_when_finished, ready_file=args.ready_file)
    _stop_on_signals(coordinator.stopping)
    return coordinator.run()


def cmd_peer(args: argparse.Namespace) -> int:
    from potluck.peer.daemon import Peer
    from potluck.protos.config import PeerConfig

    fields = {k: getattr(args, k) for k in ("join", "host", "port", "dht_port", "announce_host", "device", "name",
                                             "threads", "dht_client", "startup_timeout_s", "plan_wait_s", "netem", "region")
              if getattr(args, k) is not None}
    try:
        cfg = PeerConfig(**fields)
    except ValueError as err:
        raise SystemExit(f"potluck peer: {err}") from None
    peer = Peer(cfg)
    peer.install_signal_handlers()
    return peer.run()


def cmd_demo(args: argparse.Namespace) -> int:
    from potluck.demo import run_demo

    return run_demo(args)


def _stop_on_signals(event: Any) -> None:
    import signal

    def handler(signum: int, frame: object) -> None:
        event.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="potluck", description="Train one transformer on GPUs that volunteers lend.")
    p.add_argument("--version", action="version", version=f"potluck {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="TOML run config (see README); defaults are a tiny CPU run")
        sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field, e.g. --set diloco.inner_steps=100 (repeatable)")

    d = sub.add_parser("demo", help="run a coordinator and local peers on this machine, then exit")
    add_config(d)
    d.add_argument("--peers", type=int, default=3, help="local peer processes (default 3)")
    d.add_argument("--stages", type=int, default=1, help="pipeline stages S (default 1: pure DiLoCo)")
    d.add_argument("--replicas", type=int, default=None,
                   help="replicas R per stage; with --stages, runs S x R peers (default 2)")
    d.add_argument("--outer-steps", type=int, default=None, help="outer steps to train (default 12)")
    d.add_argument("--inner-steps", type=int, default=None, help="H, inner steps per outer step (default 30)")
    d.add_argument("--workdir", help="where journal, checkpoints and logs go (default: a temporary folder)")
    d.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                   help="keep the swarm and status page up this long after training ends")
    d.add_argument("--verbose", action="store_true", help="show the processes' logs instead of a progress bar")
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser("coordinator", help="host a run: DHT bootstrap, membership, journal, status page")
    add_config(c)
    c.add_argument("--host", help="interface to bind (default 0.0.0.0)")
    c.add_argument("--announce-host", help="address peers use to reach this box (default: auto-detected)")
    c.add_argument("--dht-port", type=int, help="DHT port (default: any free port)")
    c.add_argument("--grpc-port", type=int, help="checkpoint gRPC port (default: any free port)")
    c.add_argument("--status-port", type=int, help="status page port (default: any free port)")
    c.add_argument("--journal-dir", help="run state, identity and checkpoints (default ./potluck-run)")
    c.add_argument("--exit-when-finished", action="store_true", help="exit once all outer steps are committed")
    c.add_argument("--ready-file", help="write a JSON file with the join address once serving")
    c.set_defaults(fn=cmd_coordinator)

    pe = sub.add_parser("peer", help="lend this machine to a run")
    pe.add_argument("--join", required=True, help="the join address the coordinator printed")
    pe.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    pe.add_argument("--name", help="public name on the status page (opt-in)")
    pe.add_argument("--host", help="interface to bind (default 0.0.0.0)")
    pe.add_argument("--port", type=int, help="gRPC port (default: any free port)")
    pe.add_argument("--dht-port", type=int, help="DHT port (default: any free port)")
    pe.add_argument("--announce-host", help="address other peers use to reach this one (default: auto-detected)")
    pe.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    pe.add_argument("--dht-client", action="store_true", default=None, help="DHT client mode (behind NAT)")
    pe.add_argument("--startup-timeout-s", type=float, help="seconds allowed for the DHT daemon to start")
    pe.add_argument("--plan-wait-s", type=float, help="seconds to wait for the coordinator's round decision")
    pe.add_argument("--netem", metavar="TOPOLOGY.json", help="emulate a WAN: delay and bandwidth per region pair")
    pe.add_argument("--region", help="this peer's region in the --netem topology (default: its entry there)")
    pe.set_defaults(fn=cmd_peer)

    from potluck import export
    from potluck.coordinator import schedule_cli, status_cli

    status_cli.register(sub)
    schedule_cli.register(sub)
    export.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
