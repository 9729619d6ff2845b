"""DHT record types: what the coordinator and peers publish (each in the signed envelope of
:mod:`potluck.protos.wire.envelope`, parsed tolerantly like Petals' ``ServerInfo``: unknown fields
ignored, missing optional ones defaulted).

Keys (one DHT per run, bootstrapped by its coordinator and named by its id, see
:func:`potluck.protos.net.dhtguard.run_key`; every node of the run refuses anything else):

* ``potluck/<coordinator>/manifest``: :class:`Manifest`, written by the coordinator.
* ``potluck/<coordinator>/plan``: :class:`Plan`, the membership of the coming outer steps, and
  ``.../plan_head``: :class:`PlanHead`, its ``seq`` (what peers poll).
* ``potluck/<coordinator>/peers``: one subkey per peer id, :class:`PeerRecord`, refreshed as a heartbeat.
* ``potluck/<coordinator>/admission`` and ``.../certs``: a peer's admission request and the
  coordinator's certificate answer, one subkey per peer id (:mod:`potluck.protos.wire.admissions`).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PrivateAttr,
    field_validator,
    model_validator,
)

from potluck.protos.wire.envelope import Record
from potluck.protos.wire.roundindex import MemberIndex
from potluck.protos.wire.states import PeerState

NAME_LEN, ADDRESS_LEN, HASH_LEN, ID_LEN, TEXT_LEN = 64, 256, 128, 64, 512
KIND_LEN = 32  # a traffic kind's name (protos/net/servicer.py: "outer", "audit", ...)
MAX_GROUPS = 1 << 14  # averaging groups of one stage
MAX_OWNERS = 32  # shard owners of one averaging group: each member reports every owner's outcome (StepReport.flags)
# in each of its heartbeat's reports, and a heartbeat must fit a DHT record (64 KiB): 8 reports of 32 owners, each
# naming one peer, are 35 KB (tests/test_groups.py); of 128 owners, 124 KB



class DataIdentity(Record):
    """Which data a run trains on, so that a peer can tell its own copy is the same (see protos/runcheck)."""

    source: str = Field("", description="'bytes', 'markov', 'shards' or 'hf'; '' from a coordinator that did not say")
    sha256: str = Field("", description="bytes: of the file's content; markov: of the parameters that define it; "
                        "shards and hf: of the shards' index.json (which hashes every shard and the tokenizer)")
    size: int = Field(0, ge=0, description="bytes: the file's size; shards: training tokens; markov: 0")
    samples: int = Field(0, ge=0, description="training samples (ids 0..samples-1); 0 from a coordinator that did not say")
    tokenizer: str = Field("", max_length=256, description="shards: the tokenizer they were made with")
    tokenizer_sha256: str = Field("", max_length=64, description="shards: the tokenizer's definition, hashed")


class Manifest(Record):
    """What a run is: its id, its config, and where the coordinator can be reached."""

    run_id: str
    coordinator: str = Field(description="coordinator peer id (its key signs manifest and plans)")
    config: dict[str, Any] = Field(description="RunConfig.manifest_sections()")
    coordinator_grpc: str = Field("", description="host:port serving checkpoints (FetchState)")
    status_url: str = ""
    created_at: float = 0.0
    finished: bool = False
    checkpoint_every: int = Field(0, description="outer steps between coordinator checkpoints (0: none)")
    checkpoint_version: int = Field(0, description="newest version the coordinator holds a checkpoint of")
    data: DataIdentity = Field(default_factory=DataIdentity, description="the identity of the run's data")
    security: Literal["mtls", "insecure"] = Field("mtls", description="peer-to-peer gRPC over mutual TLS, or not")
    admission: Literal["open", "private"] = Field("open", description="'private': joining needs the join token")
    pow_bits: int = Field(0, ge=0, le=32, description="open runs: the proof of work a new key must bring "
                          "(potluck.protos.wire.work)")
    ca_pem: str = Field("", description="the run's CA certificate: peers' TLS certificates chain to it")
    seq: int = 0


class StepReport(Record):
    """One outer step as a member lived it; a peer's last few ride on every heartbeat, so the
    coordinator can fill in its history even for steps it was not there to see."""

    step: int = Field(ge=0)
    epoch: int = Field(0, ge=0, description="the epoch of the round that produced this version")
    stage: int = Field(0, ge=0)
    replica: int = Field(0, ge=0)
    state_hash: str = Field("", max_length=HASH_LEN)
    loss: float | None = Field(None, description="the member's smoothed inner loss at the end of the step")
    eval_loss: float | None = Field(None, description="eval loss of theta_global at this version, once measured")
    outer_s: float = Field(0.0, ge=0, description="wall time of the outer step")
    allreduce_s: float = Field(0.0, ge=0, description="the all-reduce's own time in it (the rest is this peer's: "
                               "copies, the update, the snapshot)")
    outer_bytes: int = Field(0, ge=0, description="bytes this member sent in the all-reduce")
    members: int = Field(0, ge=0, description="members of this stage's all-reduce")
    contributors: int = Field(0, ge=0, description="fewest contributions any shard was averaged over")
    dropped: list[str] = Field(default_factory=list, max_length=256, description="members the all-reduce went on without")
    clipped: list[str] = Field(default_factory=list, max_length=256, description="contributors an owner scaled down")
    rejected: list[str] = Field(default_factory=list, max_length=256, description="contributors an owner left out")
    included: list[int] = Field(default_factory=list, max_length=1024, description="replicas whose contributions "
                                "this version holds (stage 0: the data cursor returns the others' samples)")
    samples: list[int] = Field(default_factory=list, max_length=1024, description="the samples each included "
                               "replica's contribution was trained on, in the order of `included` (its weight; the "
                               "data cursor returns the rest of its share); empty: each trained its whole share")
    trained: int = Field(0, ge=0, description="the samples this member's own inner phase trained on (its weight)")
    inner_steps: int = Field(0, ge=0, description="the inner steps this member trained in the step")
    window_s: float | None = Field(None, ge=0, description="where this member's inner phase expected the round's "
                                   "window to end, seconds after it began (None: not known yet)")
    phase_s: float = Field(0.0, ge=0, description="seconds this member's inner phase of the step took")
    pipe: dict[str, int] = Field(default_factory=dict, max_length=8, description="pipeline bytes of the step, by kind")
    flags: dict[str, list[str]] = Field(default_factory=dict, max_length=MAX_OWNERS, description="each owner's signed "
                                        "outcome: the contributors it clipped or left out (the coordinator counts "
                                        "owners, not the members that repeat them)")
    t: float = Field(0.0, description="wall-clock time of the commit")

    @field_validator("flags")
    @classmethod
    def _short_flag_lists(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        if any(len(k) > ID_LEN or len(ps) > 256 or any(len(p) > ID_LEN for p in ps) for k, ps in v.items()):
            raise ValueError("an owner's flags name at most 256 peer ids")
        return v


class PeerRecord(Record):
    """A peer's heartbeat: where it listens, what it is doing, what it contributes."""

    peer_id: str = Field(max_length=ID_LEN)
    address: str = Field(max_length=ADDRESS_LEN, description="host:port of the peer's gRPC server, as other peers reach it")
    state: PeerState = PeerState.JOINING
    version: int = Field(0, ge=0, description="committed outer steps of its theta_global")
    state_hash: str = Field("", max_length=HASH_LEN)
    inner_step: int = Field(0, ge=0)
    device: str = Field("cpu", max_length=16)
    device_name: str = Field("", max_length=NAME_LEN * 2)
    memory_gb: float = Field(0.0, ge=0)
    name: str = Field("", max_length=NAME_LEN, description="public name, only if the volunteer opted in")
    loss: float | None = None
    eval_loss: float | None = None
    eval_version: int = Field(-1, description="the version eval_loss was measured on")
    samples_per_s: float = Field(0.0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0)
    tokens_total: int = Field(0, ge=0)
    bytes_sent: dict[str, int] = Field(default_factory=dict, max_length=16)
    bytes_received: dict[str, int] = Field(default_factory=dict, max_length=16)
    last_outer_s: float = Field(0.0, ge=0, description="wall time of this peer's last outer step")
    last_outer_bytes: int = Field(0, ge=0, description="bytes this peer sent in its last outer all-reduce")
    send_bps: float = Field(0.0, ge=0, description="bytes per second it sent, all kinds, over its last 10 s")
    peak_send_bps: float = Field(0.0, ge=0, description="the most bytes it sent in one second since it started: what "
                                 "its uplink must carry at once")
    peak_send_kinds: dict[Annotated[str, Field(max_length=KIND_LEN)], NonNegativeInt] = Field(
        default_factory=dict, max_length=16, description="that second's bytes by kind (outer, audit, activations, ...)")
    compute_s: float = Field(0.0, ge=0, description="total seconds spent in inner steps")
    sync_s: float = Field(0.0, ge=0, description="total seconds the training loop spent in outer steps (network and "
                          "waiting)")
    hidden_s: float = Field(0.0, ge=0, description="total seconds of outer steps that ran while inner steps trained "
                            "(diloco.overlap)")
    parameters: int = Field(0, ge=0)
    loss_floor: float | None = Field(None, description="best achievable loss on the run's data, if known")
    stage: int = Field(0, ge=0, le=1024, description="the pipeline stage whose state `version`/`state_hash` describe")
    dht_maddrs: list[str] = Field(default_factory=list, max_length=4,
                                  description="this peer's DHT addresses (for re-bootstrap)")
    replica: int = Field(-1, ge=-1, description="the replica this peer last trained in; -1 if none")
    epoch: int = Field(0, ge=0, description="the epoch of the round that produced `version`")
    prev_version: int = Field(-1, ge=-1, description="the version before `version`, which the peer still serves (-1: none)")
    prev_hash: str = Field("", max_length=HASH_LEN)
    recent: list[StepReport] = Field(default_factory=list, max_length=16,
                                     description="its last few outer steps, newest last")
    software: str = Field("", max_length=32)
    started_at: float = 0.0
    seq: int = 0
    ts: float = 0.0
    extras: dict[str, Any] = Field(default_factory=dict, max_length=16)
    error: str = Field("", max_length=TEXT_LEN, description="state failed: why the peer stopped, in one line")
    round_steps: int = Field(0, ge=0, description="inner steps its last inner phase trained (the round's window "
                             "decides how many: at most diloco.inner_steps)")
    window_s: float | None = Field(None, ge=0, description="where its last inner phase expected the round's window to "
                                   "end, seconds after it began (None: not known: the first round, or the fastest)")
    step_s: float = Field(0.0, ge=0, description="seconds one of its inner steps takes (this device's speed)")
    busy_s: float = Field(0.0, ge=0, description="seconds one inner step of its stage computes, waits for pipeline "
                          "neighbours left out (how fast this device runs its layers: placement prices it)")
    too_slow: str = Field("", max_length=TEXT_LEN, description="set while one of its inner steps takes longer than "
                          "the round's whole window: why it contributes nothing, and what would help")
    audits: list[AuditReport] = Field(default_factory=list, max_length=16, description="its latest audits, newest last")

    @field_validator("dht_maddrs")
    @classmethod
    def _short_addresses(cls, v: list[str]) -> list[str]:
        if any(len(a) > ADDRESS_LEN for a in v):
            raise ValueError(f"a DHT address longer than {ADDRESS_LEN} characters")
        return v


class Member(Record):
    peer_id: str
    address: str
    stage: int = Field(0, ge=0, description="the pipeline stage of this member's tasklet")
    replica: int = Field(0, ge=0, description="the replica (pipeline) of this member's tasklet")
    group: int = Field(0, ge=0, le=MAX_GROUPS, description="its averaging group within its stage in this step "
                       "(sync.group_size): it all-reduces with the stage's members of the same group only; every "
                       "member in group 0: one group")
    owns: bool = Field(True, description="owns a shard of its stage's all-reduce (false while on probation: it "
                       "contributes to every shard and gathers every result, but averages none)")


class GroupBase(Record):
    """The state the members of one averaging group start a grouped outer step from: a version of their
    stage they all hold (or fetch), so that averaging their differing states needs only small differences
    from it (see :mod:`potluck.coordinator.rounds.groups`). ``hash`` '' means each member's own current state."""

    stage: int = Field(ge=0)
    group: int = Field(ge=0, le=MAX_GROUPS)
    version: int = Field(ge=0)
    hash: str = Field("", max_length=HASH_LEN)


class ShardOf(Record):
    """One shard result of an outer step: which step (and epoch), stage and shard, by whom (its owner)."""

    step: int = Field(ge=1)
    epoch: int = Field(0, ge=0)
    stage: int = Field(0, ge=0)
    group: int = Field(0, ge=0, le=MAX_GROUPS, description="the stage's averaging group (sync.group_size) whose "
                       "all-reduce made it: shards are numbered within a group")
    shard: int = Field(0, ge=0)
    attempt: int = Field(0, ge=0)
    owner: str = Field(max_length=ID_LEN)


class Audit(ShardOf):
    """The coordinator's pick, made after the step: ``auditor`` recomputes this shard result from the signed
    contributions its owner says it averaged."""

    auditor: str = Field(max_length=ID_LEN)


class AuditReport(ShardOf):
    """What an auditor found: ``ok``; ``lie`` (the signed result is not what the signed inputs make, or the
    inputs shown are not those the result names: a proof the coordinator checks); ``unserved`` (the owner
    did not show its inputs). Or what a contributor found, auditor or not: ``omitted`` (the owner receipted
    its contribution and signed a result that leaves it out: a proof the coordinator checks too); ``unreceipted``
    (the owner neither receipted its contribution nor refused it for the round's reasons: it went to the backup);
    ``short`` (the owner's result named fewer than a quorum of the step's contributors: its backup took it over).
    The last two are complaints, not proofs: an owner named in several steps by several members loses ownership."""

    verdict: Literal["ok", "lie", "unserved", "omitted", "unreceipted", "short"]
    result: str = Field("", max_length=HASH_LEN, description="an audit's: the signature (hex) of the result it judged "
                        "(an ok to one result says nothing of another its owner signed)")
    reason: str = Field("", max_length=TEXT_LEN)
    t: float = 0.0


MAX_AUDITS = 256  # audits one round carries at most (a stage of more owners has a random subset audited)
MAX_POSITION = 1 << 62  # global sample positions: billions of epochs of billions of samples
MAX_SHARE = 1 << 24  # samples one replica trains on in one outer step
MAX_SHARE_SPANS = 64  # spans of one share


class Share(Record):
    """The samples one stage-0 replica trains on in the round's step: spans of global positions (see
    :mod:`potluck.data.order`), handed out by the coordinator's data cursor (:mod:`potluck.coordinator.rounds.cursor`)."""

    replica: int = Field(ge=0)
    count: int = Field(ge=0, description="samples of the round's own step (at most inner_steps x batch_size)")
    spans: list[tuple[int, int]] = Field(default_factory=list, max_length=MAX_SHARE_SPANS,
                                         description="[start, stop) positions for the round's own step")
    next: int = Field(0, ge=0, le=MAX_SHARE, description="samples of each later step run on this plan, sized to the "
                      "replica's measured speed (0: count)")

    @model_validator(mode="after")
    def _spans_hold_count(self) -> Share:
        return self._held_to_rules()

    def _held_to_rules(self) -> Share:
        """The share, if its spans are [start, stop) positions that hold ``count`` (else ValueError): the
        validator's rule, which :meth:`made` applies too."""
        if any(a < 0 or b < a or b > MAX_POSITION for a, b in self.spans):
            raise ValueError(f"a span must be [start, stop) with 0 <= start <= stop <= {MAX_POSITION}")
        if self.count > MAX_SHARE or self.next > MAX_SHARE:
            raise ValueError(f"count {self.count} is more than {MAX_SHARE} samples per outer step")
        if sum(b - a for a, b in self.spans) != self.count:
            raise ValueError(f"the spans hold {sum(b - a for a, b in self.spans)} positions, not count = {self.count}")
        return self

    @property
    def later(self) -> int:
        """Samples of each later step run on the round's plan."""
        return self.next or self.count

    @classmethod
    def made(cls, replica: int, count: int, spans: Sequence[tuple[int, int]], next: int = 0) -> Share:
        """A share the coordinator's own cursor made, held to the same rules without pydantic's validation (5 ms
        of each decision at 1,000 replicas); a peer reading the plan validates it in full."""
        share = cls.model_construct(replica=replica, count=count, spans=[(int(a), int(b)) for a, b in spans],
                                    next=int(next))
        if replica < 0 or len(share.spans) > MAX_SHARE_SPANS:
            raise ValueError(f"replica {replica} with {len(share.spans)} spans: not a share a round may hold")
        return share._held_to_rules()


class Round(Record):
    """The tasklet grid of one outer step and the state each stage must start from.

    ``members`` are sorted by (stage, replica); the members of one stage, in replica order, are the
    shard order of that stage's outer all-reduce.
    """

    step: int = Field(description="the outer step these members run (it produces version `step`)")
    members: list[Member]
    base_hash: str = Field("", description="hash of stage 0's version step-1 that most members hold; '' if unknown")
    stages: int = Field(1, ge=1, description="S: pipeline stages of the grid")
    base_hashes: list[str] = Field(default_factory=list, description="per stage: the hash of version step-1")
    epoch: int = Field(0, ge=0, description="grows each time a round fails and the run rolls back: a member "
                       "holding a version made in an older epoch than its round's must roll back to step-1")
    decided_at: float = 0.0
    shares: list[Share] = Field(default_factory=list, max_length=1024, description="per stage-0 replica, its samples")
    data_next: int = Field(0, ge=0, le=MAX_POSITION, description="the data frontier after `step`: later steps on this "
                           "plan read `pool`, then on from it")
    pool: list[tuple[int, int]] = Field(default_factory=list, max_length=256, description="positions handed back "
                                        "and not re-issued at `step`: later steps on this plan read them first")
    groups: list[GroupBase] = Field(default_factory=list, max_length=MAX_GROUPS, description="grouped averaging: "
                                    "per (stage, group) of the members, the state the group starts from; empty: "
                                    "each stage's members average as one group from `base_hashes`")
    audits: list[Audit] = Field(default_factory=list, max_length=MAX_AUDITS, description="shard results of an earlier "
                                "step to recompute during this step's inner phase, and by whom")

    @model_validator(mode="after")
    def _pool_is_ordered(self) -> Round:
        if any(not 0 <= a < b <= self.data_next for a, b in self.pool) or \
                any(self.pool[i][1] > self.pool[i + 1][0] for i in range(len(self.pool) - 1)):
            raise ValueError("pool must hold sorted, disjoint, non-empty spans below data_next")
        return self

    @model_validator(mode="after")
    def _groups_cover_members(self) -> Round:
        """Each stage's groups are numbered 0..k-1 with none empty, and ``groups`` names exactly those."""
        used: dict[int, set[int]] = {}
        for m in self.members:
            used.setdefault(m.stage, set()).add(m.group)
        for stage, groups in sorted(used.items()):
            if groups != set(range(len(groups))):
                raise ValueError(f"stage {stage}'s members are in groups {sorted(groups)}: groups must be numbered "
                                 f"0..k-1, none empty")
        named = [(g.stage, g.group) for g in self.groups]
        if len(set(named)) != len(named):
            raise ValueError("groups names a (stage, group) twice")
        want = {(s, g) for s, groups in used.items() for g in groups}
        if self.groups and set(named) != want:
            missing, extra = sorted(want - set(named)), sorted(set(named) - want)
            raise ValueError(f"groups must name every (stage, group) of the members and no other: "
                             f"missing {missing}, without members {extra}")
        if not self.groups and any(len(groups) > 1 for groups in used.values()):
            raise ValueError("members are in several groups but the round names no group's base state (groups)")
        if any(g.version >= self.step for g in self.groups):
            raise ValueError(f"a group's base state must be a version before step {self.step}")
        return self
    _index: MemberIndex = PrivateAttr(default_factory=lambda: MemberIndex())

    def member(self, peer_id: str) -> Member | None:
        """The member ``peer_id``, found in a dict built once per member list (a round of 1,000 members is
        asked once per peer report per coordinator tick: a scan each time was a million comparisons)."""
        return self._members_index().by_id.get(peer_id)

    def member_ids(self) -> Collection[str]:
        """The members' peer ids (a view of that dict: no copy)."""
        return self._members_index().by_id.keys()

    def _members_index(self) -> MemberIndex:
        # (read from pydantic's private dict itself: ``self._index`` goes through BaseModel.__getattr__,
        # which cost more than the lookup it serves)
        private = self.__pydantic_private__
        index = private.get("_index") if private is not None else None
        if index is None or index.source is not self.members or index.count != len(self.members):
            index = MemberIndex(self.members)
            if private is not None:
                private["_index"] = index
        return index

    def stage_members(self, stage: int) -> list[Member]:
        return list(self._cells().get((stage, None), ()))

    def group_members(self, stage: int, group: int) -> list[Member]:
        """The members of ``stage`` that average with each other, in replica order (their shard order)."""
        return list(self._cells().get((stage, group), ()))

    def _cells(self) -> dict[tuple[int, int | None], list[Member]]:
        return self._members_index().grouped()

    def stage_groups(self, stage: int) -> dict[int, list[Member]]:
        """The averaging groups of ``stage`` (one, group 0, without grouped averaging), each in shard order."""
        return {g: self.group_members(stage, g) for g in sorted({m.group for m in self.stage_members(stage)})}

    def cohort(self, peer_id: str) -> list[Member]:
        """The members ``peer_id`` averages with in this round (its group of its stage, itself included)."""
        me = self.member(peer_id)
        return self.group_members(me.stage, me.group) if me is not None else []

    def shard_owners(self, stage: int, group: int = 0) -> list[str]:
        """Who owns the shards of a group's all-reduce, in shard order: its members past probation (``owns``), or
        all of them while none is."""
        cells = self.group_members(stage, group)
        return [m.peer_id for m in cells if m.owns] or [m.peer_id for m in cells]

    def group_base(self, stage: int, group: int) -> GroupBase | None:
        """The state group ``group`` of ``stage`` starts from; None: one group per stage, from ``base_hashes``."""
        return next((g for g in self.groups if (g.stage, g.group) == (stage, group)), None)

    def share_of(self, replica: int) -> Share | None:
        return self._shares_index().by_replica.get(replica)

    def _shares_index(self) -> MemberIndex:
        index = self._members_index()
        if index.shares is not self.shares or index.share_count != len(self.shares):
            index.index_shares(self.shares)
        return index

    def data_spans(self, step: int, replica: int) -> list[tuple[int, int]]:
        """The global sample positions ``replica`` trains on at ``step``: this round's share, or, for a later
        step run on the same plan, the next ``next`` positions per replica (in replica order) of the
        round's ``pool`` followed by everything from ``data_next`` on."""
        mine = self.share_of(replica)
        if mine is None or step < self.step:
            return []
        if step == self.step:
            return [(a, b) for a, b in mine.spans]
        index = self._shares_index()  # (every replica's spans were a pass over every share: 0.15 s at 1,000)
        start = (step - self.step - 1) * index.total + index.before[replica]
        return self._read_on(start, start + mine.later)

    def _read_on(self, a: int, b: int) -> list[tuple[int, int]]:
        """Positions ``[a, b)`` of what later steps on this plan read: ``pool``'s spans, then ``data_next`` on."""
        segments, starts = self._members_index().reads(self.pool, (self.data_next, MAX_POSITION))
        out, i = [], bisect.bisect_right(starts, a) - 1  # (the segment ``a`` falls in: 1,000 replicas each walked the
        while i < len(segments) and starts[i] < b:  # pool from its start, 7 ms of a decision with a pool of 32)
            (x, y), at = segments[i], starts[i]
            lo, hi = max(a, at), min(b, at + y - x)
            if lo < hi:
                out.append((x + lo - at, x + hi - at))
            i += 1
        return out

    def handed(self, step: int, stage: int, group: int = 0) -> dict[str, int]:
        """The samples each member of a group of ``stage`` was handed at ``step`` (its replica's share): the most
        work it may claim for its contribution. Empty for a round from before shares (unchecked)."""
        if not self.shares:
            return {}
        return {m.peer_id: sum(b - a for a, b in self.data_spans(step, m.replica)) for m in self.group_members(stage, group)}

    def base_hash_of(self, stage: int) -> str:
        if self.base_hashes:
            return self.base_hashes[stage] if stage < len(self.base_hashes) else ""
        return self.base_hash if stage == 0 else ""


class Plan(Record):
    """The coordinator's decisions for the coming outer steps; the newest round at or below a step wins."""

    seq: int
    rounds: list[Round]
    ts: float = 0.0
    revoked: list[str] = Field(default_factory=list, max_length=4096,
                               description="peers evicted from the run: every peer refuses their calls")

    def round_for(self, step: int) -> Round | None:
        """The membership that applies to ``step``: the latest round decided at or before it."""
        best: Round | None = None
        for r in self.rounds:
            if r.step <= step and (best is None or r.step > best.step):
                best = r
        return best

    def newest_epoch(self) -> tuple[int, int]:
        """The newest epoch among its rounds, and that epoch's first step (where a rollback or a failed round
        started it over): a round of an earlier epoch at or past that step was abandoned."""
        epoch = max((r.epoch for r in self.rounds), default=0)
        return epoch, min((r.step for r in self.rounds if r.epoch == epoch), default=0)


class PlanHead(Record):
    """What a peer polls several times a second instead of the plan: the plan's ``seq`` (and its newest round),
    a few hundred bytes. A plan of 1,000 members is ~700 KB and ~30 ms to verify: polled whole every 0.2 s by
    every peer it was GB a second across the DHT; now a peer reads it once per new plan."""

    seq: int
    step: int = Field(0, ge=0, description="the newest round's step")
    epoch: int = Field(0, ge=0, description="the newest round's epoch")
