"""``potluck``: the command line.

    potluck demo                               a coordinator and 3 local peers on this CPU
    potluck coordinator --config run.toml      host a run (prints the join address)
    potluck peer --join ADDRESS                lend this machine to a run
    potluck status ADDRESS                     the run's status page, in a terminal
    potluck schedule --topology FILE.json      plan a tasklet grid offline (evolutionary search)
    potluck export --journal-dir DIR --out F   the latest checkpoint as one plain torch file

Building the parser imports nothing heavy: torch, hivemind, numpy and pydantic load in the
command that needs them, so every ``--help`` answers at once (``benchmarks/cli_help.py``). A usage
mistake, caught by argparse or by a command, is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from potluck import __version__
from potluck.protos.runtime.stopping import DIE_WITH_ENV, die_with_launcher

DESCRIPTION = "Train one transformer on GPUs that volunteers lend over the internet."

QUICKSTART = """\
quick start:
  potluck demo                                    a whole swarm on this machine
  potluck coordinator --config examples/run.toml  host a run: prints its address
  potluck peer --join /ip4/.../p2p/12D3KooW...    lend this machine to that run
  potluck status 127.0.0.1:8080                   watch it from a terminal

'potluck COMMAND --help' describes a command and its flags, with examples."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written (wrapped to 80 columns by hand), and every command's
    summary in one column: argparse measures subcommand names one indent short, which would put
    'coordinator' on a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS:
            for sub in self._iter_indented_subactions(action):
                width = len(self._format_action_invocation(sub)) + self._current_indent
                self._action_max_length = max(self._action_max_length, width)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line naming the fix, not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class UsageError(Exception):
    """A command line that parsed but cannot run; :func:`main` reports it in argparse's format."""


def _subparser(sub: Any, name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand with a one-line ``summary`` (in ``potluck --help``), a paragraph and examples."""
    return sub.add_parser(name, help=summary, description=description, epilog="examples:\n" + examples,
                          formatter_class=HelpFormatter)


# ---------------------------------------------------------------------- commands


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"--set expects section.field=value, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _run_config(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    from potluck.protos.config.files import apply_overrides, load_config
    from potluck.protos.config.section import ConfigError

    try:
        cfg = load_config(args.config)
        return apply_overrides(cfg, {**extra, **_overrides(args.set)})
    except ConfigError as err:
        raise UsageError(str(err)) from None


def cmd_coordinator(args: argparse.Namespace) -> int:
    extra = {
        f"coordinator.{k}": v
        for k, v in (("host", args.host), ("dht_port", args.dht_port), ("status_port", args.status_port),
                     ("grpc_port", args.grpc_port), ("journal_dir", args.journal_dir), ("announce_host", args.announce_host),
                     ("status_tls", args.status_tls), ("status_tls_cert", args.status_tls_cert),
                     ("status_tls_key", args.status_tls_key), ("trackers", args.tracker))
        if v is not None
    }
    if args.status_tls is None and (args.status_tls_cert or args.status_tls_key):
        extra["coordinator.status_tls"] = "files"  # giving the files says it
    if args.insecure:
        extra["coordinator.insecure"] = True
    cfg = _run_config(args, extra)
    from potluck.coordinator.preflight import preflight
    from potluck.coordinator.store.journal import JournalError
    from potluck.protos.config.section import ConfigError

    if args.backup_identity:  # (a one-shot: what makes this run the same run on another box, then exit)
        from pathlib import Path

        from potluck.coordinator.store.offbox import backup_identity

        try:
            copied = backup_identity(Path(cfg.coordinator.journal_dir), Path(args.backup_identity))
        except (ConfigError, OSError) as err:
            raise UsageError(str(err)) from None
        print(f"wrote {', '.join(copied)} to {args.backup_identity}: keep it secret; on a new box, copy them into "
              "a fresh --journal-dir before --resume-from URL", flush=True)
        return 0
    try:  # what refuses a run (no corpus, too big, another run's journal): before torch, hivemind or any write
        preflight(cfg)
    except (ConfigError, JournalError) as err:
        raise UsageError(str(err)) from None
    if args.resume_from:
        from potluck.coordinator.store.offbox import resume_journal

        try:
            print(resume_journal(cfg, args.resume_from), flush=True)
        except (ConfigError, JournalError, OSError) as err:
            raise UsageError(str(err)) from None
    from potluck.protos.runtime.heap import shed, tame

    tame()  # (the C allocator's settings for a long-running process: before any thread or the DHT process's fork)
    from potluck.coordinator.app import Coordinator
    from potluck.protos.net.identity import IdentityError
    from potluck.protos.runtime.log import get_logger
    from potluck.protos.runtime.stopping import exit_process, install_stop_handlers

    given = shed()  # (the imports are done, and the DHT process, which would share those pages, is not forked yet)
    try:  # opening the run (journal, keys, data) refuses what cannot work, in one line
        coordinator = Coordinator(cfg, exit_when_finished=args.exit_when_finished, ready_file=args.ready_file)
    except (ConfigError, JournalError, IdentityError, OSError) as err:
        raise UsageError(str(err)) from None
    get_logger("potluck.coordinator").info("gave back %.0f MB of library pages its imports touched", given / 2**20)
    install_stop_handlers(coordinator.stopping)
    exit_process(coordinator.run())


# PeerConfig field -> the flag that sets it, where the two are not spelled alike
_PEER_FLAGS = {"port": "--grpc-port"}


def cmd_peer(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from potluck.protos.config.runconfig import PeerConfig

    fields = {k: getattr(args, k) for k in ("join", "host", "port", "dht_port", "announce_host", "device", "devices", "name", "outer_state_dir",
                                             "threads", "dht_client", "relay", "startup_timeout_s", "plan_wait_s",
                                             "coordinator_timeout_s", "netem", "region",
                                             "data_path", "identity", "token")
              if getattr(args, k) is not None}
    try:
        cfg = PeerConfig(**fields)
    except ValidationError as err:
        raise UsageError("; ".join(_flag_error(e) for e in err.errors())) from None
    # checked before torch and hivemind load and before the DHT node starts: a mistake is one line, at once
    from potluck.protos.net.identity import IdentityError
    from potluck.protos.net.join import JoinError, parse_join_address

    try:
        parse_join_address(cfg.join)
    except JoinError as err:
        raise UsageError(str(err)) from None
    from potluck.protos.config.section import ConfigError

    if cfg.outer_state_dir is not None:
        from pathlib import Path

        from potluck.peer.outer.spill import check_folder

        try:
            check_folder(Path(cfg.outer_state_dir).expanduser())
        except ConfigError as err:
            raise UsageError(str(err)) from None
    if cfg.devices == "shard" and (os.environ.get("WORLD_SIZE") or "1") == "1":
        raise UsageError("--devices shard splits a stage over the processes of one peer: start it with torchrun "
                         "--nproc-per-node N -m potluck peer ... (N >= 2)")
    identity = None
    if (os.environ.get("WORLD_SIZE") or "1") == "1" or os.environ.get("RANK") == "0":  # (under torchrun, rank 0 is the peer)
        from potluck.peer.swarm.keyfile import load_identity

        try:
            identity = load_identity(cfg.identity)
        except IdentityError as err:
            raise UsageError(str(err)) from None
        wrong = _wrong_join_address(cfg.join, cfg.host, cfg.dht_port)
        if wrong:
            raise UsageError(wrong)
    from potluck.protos.runtime.heap import hold

    hold()  # (the C allocator keeps what a step frees for the next step: before any thread or the DHT process's fork)
    from potluck.peer.devices import multidevice

    try:  # under torchrun, one process per device: they form their group here (rank 0 is the peer)
        group = multidevice.start(cfg.device)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    if group is not None and not group.leads:
        return multidevice.Helper(group, cfg.threads).run()
    from potluck.peer.daemon import Peer
    from potluck.protos.runtime.stopping import exit_process, install_stop_handlers

    leader = multidevice.Leader(group, shard=cfg.devices == "shard") if group is not None else None
    try:
        peer = Peer(cfg, progress=args.progress, devices=leader, identity=identity)
        install_stop_handlers(peer.stopping)
        code = peer.run()
    finally:
        if leader is not None:
            leader.close("the peer stopped")
    exit_process(code)  # (the interpreter's teardown after it only costs time: see exit_process)


def _wrong_join_address(join: str, host: str, dht_port: int) -> str:
    """What is wrong with the join address, asked of whoever answers there in under a second (''
    when its node is the coordinator it names, or nothing is known): nothing listening, another run's
    node, or not a DHT node at all. The peer's own DHT port is checked first (that mistake is its own)."""
    from potluck.protos.net import probe
    from potluck.protos.net.errors import CannotBind, check_port_free
    from potluck.protos.net.join import host_port, parse_join_address

    try:
        check_port_free("DHT port", host, dht_port, "--dht-port")
    except CannotBind as err:
        return str(err)
    address, coordinator = parse_join_address(join)
    where = host_port(address)
    if where is None:
        return ""
    return probe.explain(address, *where, coordinator, probe.probe(*where))


def _flag_error(error: Any) -> str:
    """One pydantic error about a PeerConfig field, told in terms of the flag that set it."""
    field = str(error["loc"][0]) if error["loc"] else ""
    flag = _PEER_FLAGS.get(field, "--" + field.replace("_", "-"))
    msg = str(error["msg"]).removeprefix("Value error, ")
    return f"{flag} {error['input']!r}: {msg}" if field else msg


def demo_grid(stages: int, replicas: int | None, peers: int | None) -> tuple[int, int | None]:
    """(peers, replicas) for ``potluck demo``: a pipeline run has exactly stages x replicas peers."""
    for flag, value in (("--stages", stages), ("--replicas", replicas), ("--peers", peers)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if stages == 1 and replicas is None:
        return (peers or 3), None
    if replicas is None:
        if peers is None:
            replicas = 2
        elif peers % stages:
            fits = sorted({stages * max(1, peers // stages), stages * (peers // stages + 1)})
            raise UsageError(f"--peers {peers} with --stages {stages}: peers must be stages x replicas "
                             f"(--peers {' or '.join(map(str, fits))}, or --replicas R for {stages} x R peers)")
        else:
            replicas = peers // stages
    elif peers is not None and peers != stages * replicas:
        raise UsageError(f"--peers {peers} with --stages {stages} --replicas {replicas}: peers must be "
                         f"stages x replicas = {stages * replicas} (or leave --peers out)")
    return stages * replicas, replicas


def cmd_demo(args: argparse.Namespace) -> int:
    args.peers, args.replicas = demo_grid(args.stages, args.replicas, args.peers)
    from potluck.demo import run_demo

    return run_demo(args)


# ---------------------------------------------------------------------- the parser


def _add_config(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", metavar="RUN.toml", help="TOML run config (see README); defaults are a tiny CPU run")
    sp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override one config field, e.g. --set diloco.inner_steps=100 (repeatable)")


def _add_demo(sub: Any) -> None:
    d = _subparser(
        sub, "demo", "a whole swarm on this machine: train a tiny model, then exit",
        "Run a whole swarm on this machine: a coordinator and local peer processes\n"
        "(real DHT, real gRPC on 127.0.0.1) train the built-in tiny model on synthetic\n"
        "data. It prints the join address, the status page, the loss of every outer\n"
        "step and the final eval loss next to the data's entropy floor, then stops\n"
        "every process it started (also on Ctrl+C). With --stages S the peers form a\n"
        "grid of S pipeline stages x R replicas, so there are S x R of them.",
        "  potluck demo                          3 peers, pure DiLoCo\n"
        "  potluck demo --stages 2 --replicas 2  4 peers: 2 pipelines of 2 stages\n"
        "  potluck demo --linger 300             then keep the status page up 5 min\n"
        "  potluck demo --set diloco.inner_steps=100 --outer-steps 20",
    )
    _add_config(d)
    d.add_argument("--peers", type=int, default=None, metavar="N",
                   help="local peer processes (default 3; with --stages, stages x replicas)")
    d.add_argument("--stages", type=int, default=1, metavar="S", help="pipeline stages (default 1: pure DiLoCo)")
    d.add_argument("--replicas", type=int, default=None, metavar="R",
                   help="replicas per stage (default 2 with --stages, else one per peer)")
    d.add_argument("--outer-steps", type=int, default=None, metavar="N", help="outer steps to train (default 12)")
    d.add_argument("--inner-steps", type=int, default=None, metavar="H", help="inner steps per outer step (default 30)")
    d.add_argument("--workdir", metavar="DIR", help="where journal, checkpoints and logs go (default: a temporary folder)")
    d.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                   help="keep the swarm and status page up this long after training ends")
    d.add_argument("--verbose", action="store_true", help="show the processes' logs instead of a progress bar")
    d.set_defaults(fn=cmd_demo)


def _add_coordinator(sub: Any) -> None:
    c = _subparser(
        sub, "coordinator", "host a run: DHT bootstrap, membership, journal, status page",
        "Host a run: the DHT node peers join through, the membership of every outer\n"
        "step, the journal (run state, identity, checkpoints) and the status page. It\n"
        "prints the join address to give to volunteers ('potluck peer --join ...') and\n"
        "the status page's address. The --config file describes the run (default: a\n"
        "tiny CPU run); the flags below and --set override it.",
        "  potluck coordinator --config run.toml\n"
        "  potluck coordinator --config run.toml --dht-port 31337 --status-port 8080\n"
        "  potluck coordinator --set diloco.outer_steps=100 --journal-dir runs/first",
    )
    _add_config(c)
    c.add_argument("--host", metavar="HOST", help="interface to bind (default 127.0.0.1: this machine only; 0.0.0.0 for volunteers elsewhere)")
    c.add_argument("--announce-host", metavar="HOST", help="address peers use to reach this box (default: auto-detected)")
    c.add_argument("--dht-port", type=int, metavar="PORT", help="DHT port (default: any free port; fix it for a real run)")
    c.add_argument("--grpc-port", type=int, metavar="PORT", help="checkpoint gRPC port (default: any free port)")
    c.add_argument("--status-port", type=int, metavar="PORT", help="status page port (default: any free port)")
    c.add_argument("--journal-dir", metavar="DIR", help="run state, identity and checkpoints (default ./potluck-run)")
    c.add_argument("--status-tls", choices=("off", "self-signed", "files"),
                   help="status page over HTTPS: a self-signed certificate kept in the journal dir (its fingerprint "
                   "is printed), or --status-tls-cert/--status-tls-key (default off: plain HTTP)")
    c.add_argument("--status-tls-cert", metavar="FILE", help="PEM certificate (and chain) of the status page")
    c.add_argument("--status-tls-key", metavar="FILE", help="PEM private key of --status-tls-cert")
    c.add_argument("--insecure", action="store_true", help="plaintext gRPC between peers, no certificates: local "
                   "experiments only (the status page says so)")
    c.add_argument("--tracker", action="append", choices=("tensorboard", "wandb", "mlflow"), metavar="NAME",
                   help="also log the run to this experiment tracker: tensorboard, wandb or mlflow (again for "
                   "another; each an extra: pip install 'potluck[wandb]'); coordinator.trackers in the run file")
    c.add_argument("--exit-when-finished", action="store_true", help="exit once all outer steps are committed")
    c.add_argument("--ready-file", metavar="FILE", help="write a JSON file with the join address once serving")
    c.add_argument("--resume-from", metavar="URL", help="start a fresh --journal-dir from the newest complete "
                   "checkpoint at URL (coordinator.checkpoint_url of the run, e.g. s3://BUCKET/PREFIX)")
    c.add_argument("--backup-identity", metavar="PATH", help="write the run's identity, CA key and tokens (from "
                   "--journal-dir) to the new folder PATH and exit: on a new box, copy them into the fresh journal "
                   "dir before --resume-from, so it is the same run")
    c.set_defaults(fn=cmd_coordinator)


def _add_peer(sub: Any) -> None:
    pe = _subparser(
        sub, "peer", "lend this machine to a run (needs its join address)",
        "Lend this machine to a run: join the swarm at the address the coordinator\n"
        "printed, fetch the current model state from other peers at the next outer\n"
        "step boundary, and train the stage and replica the coordinator assigns,\n"
        "syncing with the other replicas of that stage every outer step.",
        "  potluck peer --join /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...\n"
        "  potluck peer --join ADDRESS --device cuda:1 --name alice\n"
        "  potluck peer --join ADDRESS --dht-client   behind a NAT (no incoming)\n"
        "  potluck peer --join ADDRESS --data-path ~/corpus.txt   the run's text file\n"
        "  torchrun --nproc-per-node 4 -m potluck peer --join ADDRESS\n"
        "                        one peer of 4 GPUs (a batch split 4 ways; stages = 1)",
    )
    pe.add_argument("--join", required=True, metavar="ADDRESS",
                    help="the join address the coordinator printed (/ip4/HOST/tcp/PORT/p2p/12D3KooW...)")
    pe.add_argument("--device", help="auto (default: cuda if present, else cpu), cpu, cuda, cuda:N or mps")
    pe.add_argument("--name", help="public name on the status page (opt-in)")
    pe.add_argument("--identity", metavar="KEY_FILE",
                    help="this peer's key (created if missing; default ~/.potluck/peer.key, one peer at a time)")
    pe.add_argument("--token", help="the join token of a private run (default: $POTLUCK_JOIN_TOKEN)")
    pe.add_argument("--host", metavar="HOST", help="interface to bind (default 0.0.0.0)")
    pe.add_argument("--grpc-port", dest="port", type=int, metavar="PORT", help="gRPC port (default: any free port)")
    pe.add_argument("--port", dest="port", type=int, help=argparse.SUPPRESS)  # the old spelling
    pe.add_argument("--dht-port", type=int, metavar="PORT", help="DHT port (default: any free port)")
    pe.add_argument("--announce-host", metavar="HOST", help="address other peers use to reach this one (default: auto-detected)")
    pe.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    pe.add_argument("--outer-state-dir", metavar="DIR",
                    help="keep the outer state in memory-mapped files here, not in RAM (a peer short of memory)")
    pe.add_argument("--devices", choices=["replicate", "shard"],
                    help="under torchrun: each process holds the whole stage, or its 1/N share of it (FSDP2)")
    pe.add_argument("--dht-client", action="store_true", default=None, help="DHT client mode (behind NAT)")
    pe.add_argument("--relay", action="store_true", default=None,
                    help="behind a NAT: listen on no port, take calls through the coordinator (with --dht-client)")
    pe.add_argument("--startup-timeout-s", type=float, metavar="SECONDS",
                    help="seconds allowed for the DHT daemon to start (default 60)")
    pe.add_argument("--plan-wait-s", type=float, metavar="SECONDS",
                    help="seconds to wait for the coordinator's round decision (default 10)")
    pe.add_argument("--coordinator-timeout-s", type=float, metavar="SECONDS",
                    help="train on the last plan at most this long while the coordinator is away, then stop "
                    "(default 1800; 0: never)")
    pe.add_argument("--netem", metavar="TOPOLOGY.json", help="emulate a WAN: delay and bandwidth per region pair")
    pe.add_argument("--region", help="this peer's region in the --netem topology (default: its entry there)")
    pe.add_argument("--progress", choices=("auto", "bar", "lines", "off"), default="auto",
                    help="inner-step progress: a line redrawn in place (bar), a log line every 15 s (lines) or none "
                    "(default auto: bar on a terminal, else lines); POTLUCK_LOG=WARNING hides it too")
    pe.add_argument("--data-path", metavar="PATH",
                    help="this machine's copy of the run's data: its text file (data.source = bytes), or its shards "
                    "(a folder, or a file:// or https:// URL to fetch them from); default: the run's data.path, "
                    "relative to this folder. Its sha256 (a shards index's) must be the run's")
    pe.set_defaults(fn=cmd_peer)


def build_parser() -> argparse.ArgumentParser:
    from potluck import export, generate
    from potluck.coordinator.placement import schedule_cli
    from potluck.coordinator.status import status_cli
    from potluck.data import cli as data_cli

    p = Parser(prog="potluck", description=DESCRIPTION, epilog=QUICKSTART, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"potluck {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    _add_demo(sub)
    _add_coordinator(sub)
    _add_peer(sub)
    status_cli.register(sub)
    schedule_cli.register(sub)
    export.register(sub)
    generate.register(sub)
    data_cli.register(sub)
    return p


def set_without_equals(argv: list[str]) -> str:
    """``--set FIELD VALUE`` (a space where the ``=`` goes): the spelling that works, or ''."""
    for i, word in enumerate(argv[:-1]):
        if word == "--set" and "=" not in argv[i + 1]:
            value = argv[i + 2] if i + 2 < len(argv) and not argv[i + 2].startswith("-") else "VALUE"
            return f"--set takes SECTION.FIELD=VALUE as one word: --set {argv[i + 1]}={value}"
    return ""


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun worker: its launcher is its parent, torchrun's agent
        os.environ[DIE_WITH_ENV] = str(os.getppid())
    die_with_launcher()
    words = sys.argv[1:] if argv is None else argv
    hint = set_without_equals(words)
    if hint:  # (argparse would say "unrecognized arguments: 10", or the value would be read as the field)
        command = next((w for w in words if not w.startswith("-")), "")
        print(f"potluck {command}: error: {hint}".replace("potluck : ", "potluck: "), file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except UsageError as err:
        print(f"potluck {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
