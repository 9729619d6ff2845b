"""The run configuration: one TOML file, one typed section per component.

A run file looks like::

    [model]
    d_model = 128
    n_layers = 4

    [diloco]
    inner_steps = 100
    outer_steps = 50

Every field has a documented default, so an empty file is a valid (tiny, CPU-friendly) run. Unknown
keys and bad values are rejected with the dotted name of the field (``diloco.outer_lr: Input should
be greater than 0``). CLI flags override the file through :func:`~potluck.protos.config.files.apply_overrides`.

The coordinator publishes the training-relevant sections (everything but ``coordinator``) as the run
manifest; peers build their model, data and optimizers from it, never from their own files, so a
swarm cannot silently train with two different configs.

A field left out of the file keeps its default, except where another section decides it: byte-level
data (``data.source = "bytes"``) is 256 tokens, so it sets ``model.vocab_size`` to 256 unless the
file sets it (to anything else, the run is refused with the fix). What depends on the machine the
coordinator runs on (its corpus, its address) is checked by :mod:`potluck.protos.config.runcheck`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from potluck.protos.config.modelconfig import HF_DECIDES, LLAMA_PRESETS, ModelConfig  # noqa: F401 - re-exported
from potluck.protos.config.section import Section
from potluck.protos.wire.records import MAX_OWNERS

BYTE_VOCAB = 256  # byte-level data: one token per byte value
MAX_RECORD_TTL_S = 300.0  # the DHT refuses records asking to live longer (potluck.protos.net.dhtguard)
INT4_BLOCK_SIZE = 128  # sync.block_size of an int4 run that sets none (potluck.compression.int4 measured it)
MAX_MARKOV_ENTRIES = 1 << 24  # transition-table entries of the synthetic source (2 float64 arrays of 128 MiB)


class DataConfig(Section):
    """Training data: the built-in synthetic Markov source (a known entropy floor), a byte file, or
    token shards (``potluck data prepare``) from a folder, a URL or a Hugging Face dataset."""

    source: Literal["markov", "bytes", "shards", "hf"] = Field(
        "markov", description="'markov' (built-in), 'bytes' (path: a text file), 'shards' (path: a prepared folder, "
        "or a file:// or https:// base URL to download it from) or 'hf' (hf_dataset, tokenized with `tokenizer`)")
    path: str | None = Field(
        None, description="source='bytes': the text file (byte-level tokens); source='shards': the folder "
        "`potluck data prepare` wrote, or its file:// / https:// base URL. A relative path is read from the working "
        "directory of the coordinator, and of each peer (a peer may point at its copy with --data-path)"
    )
    hf_dataset: str | None = Field(None, description="source='hf': a Hugging Face datasets name (or local folder)")
    hf_config: str | None = Field(None, description="source='hf': the dataset's configuration, if it has several")
    hf_split: str = Field("train", description="source='hf': the split to train on (a held-out part is cut off it)")
    text_field: str = Field("text", min_length=1, description="source='hf': the column holding the text")
    eval_fraction: float = Field(0.01, gt=0, lt=1, description="source='hf': the share of documents held out "
                                 "(the last ones) for the eval split")
    tokenizer: str = Field("bytes", min_length=1, description="source='hf': 'bytes' or a Hugging Face tokenizer "
                           "(a local folder or a Hub id); source='shards' records its own in the index")
    cache_dir: str = Field("~/.cache/potluck/data", description="where downloaded and prepared shards are kept "
                           "(each machine's own; not part of the run's identity)")
    markov_order: int = Field(1, ge=1, le=3, description="context length of the synthetic source")
    markov_concentration: float = Field(
        0.05, gt=0, description="Dirichlet concentration of the transition rows: lower is more predictable"
    )
    num_samples: int = Field(1 << 16, ge=1, description="training samples (stable ids 0..num_samples-1); a "
                             "file or shards give at most as many as they hold")
    eval_samples: int = Field(128, ge=1, description="held-out samples for eval loss")
    eval_every: int = Field(1, ge=0, description="evaluate theta_global every this many outer steps (0: never)")
    seed: int = Field(0, description="seed of the source and of the sample order")

    @model_validator(mode="after")
    def _source_needs_its_fields(self) -> DataConfig:
        if self.source == "bytes" and not self.path:
            raise ValueError("source='bytes' needs data.path (a text file)")
        if self.source == "shards" and not self.path:
            raise ValueError("source='shards' needs data.path: the folder `potluck data prepare` wrote, or its "
                             "file:// or https:// base URL")
        if self.source == "hf" and not self.hf_dataset:
            raise ValueError("source='hf' needs data.hf_dataset (a Hugging Face datasets name)")
        return self


class TrainConfig(Section):
    """The inner loop: AdamW on a peer's own shard."""

    batch_size: int = Field(16, ge=1, description="samples per inner step")
    lr: float = Field(3e-3, gt=0, description="inner AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    optimizer: Literal["adamw", "adamw8bit"] = Field(
        "adamw", description="the inner optimizer: AdamW with fp32 moments (16 bytes a parameter on the device with "
        "the weight and gradient), or 'adamw8bit': its moments in 8 bits a block of 256 at a time (about 10 bytes a "
        "parameter; potluck.peer.training.adamw8bit; quality at equal tokens in docs/benchmarks.md)")
    weights: Literal["fp32", "bf16"] = Field(
        "fp32", description="the inner phase's weights (and so their gradients) on the device: fp32, or 'bf16' (2 + 2 "
        "bytes a parameter instead of 4 + 4; AdamW's update computed in fp32 and rounded stochastically into them; "
        "the outer state stays fp32 on the host, and an outer step's pseudo-gradient is exactly what the inner steps "
        "changed). Needs train.precision 'bf16' or 'auto' (which then is bf16 on every device)")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up of the inner lr, in inner steps")
    grad_clip: float = Field(1.0, ge=0, description="max grad norm; 0 disables clipping")
    seed: int = Field(0, description="model init seed: every peer starts from the same theta_0")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="math of the forward and backward passes, under autocast: parameters, AdamW's moments "
        "and the outer state stay fp32 whatever this says. 'auto': bf16 on a GPU that has it, fp16 with loss "
        "scaling on one that does not (fp32 there when pipeline.stages > 1), fp32 on a CPU; 'bf16' and 'fp16' "
        "also run on a CPU when asked for (fp16 needs pipeline.stages = 1)")
    checkpoint_activations: bool | Literal["auto"] = Field(
        False, description="keep only each layer's input through the forward pass and recompute the rest in the "
        "backward: activation memory of one layer instead of all, for about a third more compute. 'auto': each "
        "peer decides from its device's memory, on where the size check says its stage needs more without it "
        "(the same gradients either way, so peers may differ)")
    grad_accum: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="pipeline.stages = 1: split each batch into this many micro-batches, run one at a time, "
        "their gradients summed (the same step as the whole batch, in less memory); must divide batch_size. 'auto': "
        "each peer picks the fewest that fit its device's memory (a GPU tries the whole batch first and splits on "
        "running out of memory; a CPU runs it whole). A pipeline splits its batch by pipeline.micro_batches instead")
    step_in_backward: bool = Field(
        False, description="update each parameter as soon as the backward pass has its gradient, and drop that "
        "gradient at once: the device never holds the stage's gradients (4 bytes a parameter less, 2 with bf16 "
        "weights; potluck.peer.training.inbackward). Needs train.grad_clip = 0 (clipping needs every gradient first), one "
        "micro-batch a step (train.grad_accum 1 or 'auto', which then stays 1; pipeline.micro_batches = 1), a "
        "single-device peer, and train.precision other than 'fp16'")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each layer (compiled on the first step; if compilation fails the peer "
        "says so once and runs eager). 'auto': on a GPU, not on a CPU (where compiling costs more than it saves)")

    @model_validator(mode="after")
    def _micro_batches_divide_the_batch(self) -> TrainConfig:
        if isinstance(self.grad_accum, int) and self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of grad_accum {self.grad_accum}")
        if self.step_in_backward:
            if self.grad_clip > 0:
                raise ValueError(f"train.step_in_backward updates each parameter before the others' gradients exist, "
                                 f"so it cannot clip by their norm: set train.grad_clip = 0 (it is {self.grad_clip})")
            if isinstance(self.grad_accum, int) and self.grad_accum > 1:
                raise ValueError(f"train.step_in_backward would update after the first of train.grad_accum = "
                                 f"{self.grad_accum} micro-batches: set it to 1 or 'auto'")
            if self.precision == "fp16":
                raise ValueError("train.step_in_backward cannot go with train.precision = 'fp16' (its loss scaler "
                                 "decides whether to step after the whole backward): use 'bf16', 'fp32' or 'auto'")
        return self


class DiLoCoConfig(Section):
    """The outer loop (Douillard et al. 2023): H inner steps, then Nesterov on the mean pseudo-gradient."""

    inner_steps: int = Field(
        50, ge=1, description="H: inner steps per outer step (with sync.fragments = F each fragment is synced "
        "every F outer steps: set H/F here to keep H inner steps between a fragment's syncs)")
    outer_steps: int = Field(20, ge=1, description="outer steps in the whole run")
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = Field(True)
    overlap: bool = Field(
        False, description="one-step-delayed outer step: the all-reduce of step k runs while the inner steps of "
        "k + 1 go on, its result applied one outer step late (pipeline.stages = 1 only); false: blocking")
    rounds: Literal["window", "fixed"] = Field(
        "window", description="'window': a round lasts as long as its fastest member takes for inner_steps steps; "
        "each member trains as many as fit (a slower one fewer: the rest of its data goes back to the pool) and its "
        "pseudo-gradient counts by the samples it trained on, so peers of any speed add their work and none waits. "
        "'fixed': every member trains inner_steps and the round waits for the slowest (a run repeats bit for bit)")


class SyncConfig(Section):
    """The outer all-reduce over gRPC: codec and deadlines."""

    codec: Literal["int8", "int4", "raw"] = Field(
        "int8", description="'int8' (per-block absmax, 1 byte an element), 'int4' (per-block absmax, two codes a "
        "byte: 0.53x int8's bytes at its blocks of 128) or 'raw' (fp32)")
    block_size: int = Field(
        2048, ge=16, le=1 << 20, description=f"elements per int8 or int4 scale (int4: even; when not set, "
        f"{INT4_BLOCK_SIZE} for int4, 2048 otherwise)")
    chunk_bytes: int = Field(1 << 20, ge=1 << 12, le=1 << 22, description="payload bytes per gRPC message")
    deadline_floor_s: float = Field(
        10.0, gt=0, description="minimum wait for a slow member before it is dropped from the outer step"
    )
    deadline_factor: float = Field(
        0.5, ge=0, description="wait also up to this fraction of the measured inner-phase time"
    )
    rpc_timeout_s: float = Field(30.0, gt=0, description="timeout of a single transfer RPC")
    clip_factor: float = Field(
        4.0, ge=0, description="robust aggregation: each contribution is clipped to this many times the lower median "
        "contribution norm (0: a plain mean)")
    reject_below: float = Field(
        -0.1, ge=-1, le=1, description="robust aggregation: a contribution whose cosine with the others' median is "
        "below this is left out (with 3+ contributors; -1: never)")
    group_size: int = Field(
        0, description="grouped averaging (Moshpit SGD) for stages of many replicas: each outer step the "
        "coordinator splits a stage's members into groups of at most this many, each averaging on its own, "
        "regrouped every step so that up to group_size^2 members mix in two steps; a grouped step sends theta "
        "and momentum (2x the bytes). 0: every member of a stage in one group")
    quorum: float = Field(
        0.5, ge=0, le=1, description="an owner's result is adopted only if it names (averaged or rejected) at least "
        "this share of the step's live contributors (those any result of the step names); one that names fewer is "
        "taken over by the shard's backup, as if its owner had sent none (0: every result is adopted)")
    audit_fraction: float = Field(
        1.0, ge=0, le=1, description="verified reduction: the share of each step's shard results the coordinator "
        "has an auditor, picked after the step, recompute from their signed inputs during the next inner phase; a "
        "result that is not the average of what its owner signed it was averaged from gets the owner evicted and "
        "the run rolled back to before it (0: no audits)")
    second_audit: float = Field(
        0.25, ge=0, le=1, description="verified reduction: the share of audited shard results given a second, "
        "independent auditor (drawn by the coordinator among the others that hold it), so that an auditor colluding "
        "with the owner it audits does not hide its lie; each costs what an audit costs: the shard's inputs fetched "
        "(0: one auditor a shard)")
    demote_after: int = Field(
        3, ge=0, le=64, description="an owner named in this many of the last 16 steps, by at least two members past "
        "probation, for a result short of the quorum or for a contribution it neither receipted nor refused for the "
        "round's reasons, loses shard ownership for demote_steps steps (it still trains and contributes; a complaint "
        "is not a proof: nobody is evicted for it) (0: never)")
    demote_steps: int = Field(50, ge=1, description="outer steps a demoted owner owns no shard")
    fragments: int = Field(
        1, ge=1, le=64, description="streaming outer steps (Streaming DiLoCo): the stage's parameters are cut into "
        "this many contiguous fragments of equal size and outer step s all-reduces and Nesterov-steps fragment "
        "(s - 1) mod fragments only, cutting each step's outer bytes by this factor; the other fragments train on "
        "locally until their turn (set diloco.inner_steps to H / fragments to keep H inner steps between a "
        "fragment's syncs). A peer that restarts or joins starts from the committed state (its unsynced local "
        "progress is lost). Not with sync.group_size. 1: the whole stage every step")
    pace: float = Field(
        0.0, ge=0.0, lt=1.0, description="an overlapped outer step (diloco.overlap) spreads what it sends over this "
        "fraction of the measured inner phase it overlaps, instead of sending at line rate: the peak second of a "
        "peer's uplink falls to about the step's bytes over that time (with sync.fragments, 1/F of the vector). Must "
        "be under sync.deadline_factor (the owners wait that long for contributions). 0: as fast as the link takes")
    fragment_alpha: float = Field(
        0.5, ge=0.0, lt=1.0, description="streaming outer steps: a synced fragment's local copy becomes alpha x its "
        "local values + (1 - alpha) x the new global ones (Streaming DiLoCo's mixing; 0: the global values whole; "
        "0.5 measured closer to sync.fragments = 1 at equal tokens than 0: docs/benchmarks.md). "
        "theta_global is the same for every member either way")

    @model_validator(mode="before")
    @classmethod
    def _int4_blocks_by_default(cls, data: Any) -> Any:
        """An int4 run that names no block size gets int4's (set explicitly, so it travels and is journaled as is)."""
        if isinstance(data, dict) and data.get("codec") == "int4" and "block_size" not in data:
            return {**data, "block_size": INT4_BLOCK_SIZE}
        return data

    @model_validator(mode="after")
    def _int4_blocks_are_whole_bytes(self) -> SyncConfig:
        if self.codec == "int4" and self.block_size % 2:
            raise ValueError(f"codec 'int4' packs two codes a byte: block_size must be even, got {self.block_size}")
        return self

    @field_validator("group_size")
    @classmethod
    def _groups_of_two_or_more(cls, v: int) -> int:
        if v < 0 or v == 1:
            raise ValueError(f"group_size {v}: a group must hold at least 2 members (0 averages every member of a "
                             "stage in one group)")
        if v > MAX_OWNERS:
            raise ValueError(f"group_size {v}: a group holds at most {MAX_OWNERS} members (each reports every owner's "
                             "outcome in each heartbeat, which must fit a DHT record); 0 averages a whole stage, with "
                             "at most that many owners")
        return v


class PipelineConfig(Section):
    """Pipeline tasklets: the model cut into ``stages`` contiguous stages, run as S x R grid."""

    stages: int = Field(1, ge=1, le=64, description="S: pipeline stages (1 = pure DiLoCo, whole model per peer)")
    layers: list[int] | None = Field(
        None, description="layer-list entries per stage (embedding, blocks, head), summing to n_layers + 2; "
        "None splits by pipeline.balance"
    )
    balance: Literal["layers", "params", "flops"] = Field(
        "layers", description="without pipeline.layers: even entry counts, or the split minimising the largest "
        "stage's parameters or forward+backward FLOPs (counted on the meta device)"
    )
    micro_batches: int = Field(2, ge=1, description="micro-batches per inner step; must divide batch_size")
    schedule: Literal["gpipe", "1f1b"] = Field(
        "gpipe", description="'gpipe': every forward, then every backward; '1f1b': after a warm-up of forwards, one "
        "forward and one backward in turn, so fewer micro-batches' activations are held")
    in_flight: int | None = Field(
        None, ge=0, description="1f1b: forwards a stage runs ahead of its first backward beyond the S - s - 1 the "
        "schedule needs; None: measured each inner step, enough to cover the wait for the next stage's gradients")
    compression: Literal["none", "fp16", "direct", "acsgd"] = Field(
        "acsgd", description="forward activations: fp32 ('none'), fp16, direct quantization, or AC-SGD deltas"
    )
    bits: Literal[2, 3, 4, 8] = Field(4, description="bits of quantized activations ('direct' and 'acsgd')")
    grad_bits: Literal[4, 8, 32] | None = Field(
        8, description="bits of backward gradients: 4 or 8 (direct quantization), or 32 (fp32; None means the same, "
        "but a run file has no None)"
    )
    rounding: Literal["deterministic", "stochastic"] = Field("deterministic")
    first_visit: Literal["fp16", "quant"] = Field("fp16", description="AC-SGD: how a sample's first activation travels")
    buffer_memmap_bytes: int = Field(
        1 << 30, ge=0, description="AC-SGD buffers larger than this move to a memmap on disk"
    )
    pipe_timeout_s: float = Field(
        30.0, gt=0, description="a stage waiting this long for its neighbour's micro-batch reports the replica stalled"
    )

    @field_validator("layers")
    @classmethod
    def _positive_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(n < 1 for n in v)):
            raise ValueError("every stage needs at least one layer")
        return v


class LinksConfig(Section):
    """Link measurement (peers) and link-aware placement (coordinator)."""

    probe_period_s: float = Field(
        10.0, gt=0, le=MAX_RECORD_TTL_S / 3, description="seconds between a peer's probing rounds (its link report "
        "lives 3 periods in the DHT)"
    )
    probes_per_period: int = Field(4, ge=0, description="peers probed per round at most (no all-pairs storms)")
    probe_bytes: int = Field(256 << 10, ge=1 << 10, le=4 << 20, description="payload of one bandwidth probe")
    budget_bytes_per_min: int = Field(1 << 20, ge=0, description="probe bytes per peer pair per minute at most")
    placement: Literal["scheduler", "sticky"] = Field(
        "scheduler", description="'scheduler': place tasklets from measured links (S > 1); 'sticky': keep tasklets"
    )
    search_budget_s: float = Field(1.0, gt=0, le=60, description="seconds of evolutionary search per re-plan")


class MembershipConfig(Section):
    """Liveness and admission (read by peers and the coordinator alike)."""

    heartbeat_s: float = Field(1.0, gt=0, description="how often a peer refreshes its DHT record")
    heartbeat_timeout_s: float = Field(
        8.0, gt=0, le=MAX_RECORD_TTL_S, description="a peer whose record is older than this is considered lost "
        "(its record lives this long in the DHT)"
    )
    min_peers: int = Field(1, ge=1, description="peers needed before the first outer step starts (and the "
                           "first after a round failed, until each member of the failed round is back or gone for "
                           "good, for 3 heartbeat timeouts at most: then the run goes on with the peers it has)")
    round_timeout_floor_s: float = Field(
        60.0, gt=0, description="a round none of whose members made visible progress for this long fails "
        "(and the run rolls back to the newest state it can still have)")
    round_timeout_factor: float = Field(
        4.0, ge=1, description="a round also fails once older than this many times the median measured step "
        "time (never sooner than the floor)")

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> MembershipConfig:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_s:
            raise ValueError("heartbeat_timeout_s must be at least twice heartbeat_s")
        return self


class CoordinatorConfig(Section):
    """Where the coordinator listens and keeps its journal. Not part of the manifest."""

    host: str = Field(
        "127.0.0.1", description="interface the DHT, gRPC and status servers bind to: this machine only by default "
        "(a local trial); 0.0.0.0 for volunteers elsewhere"
    )
    announce_host: str | None = Field(
        None, description="address peers should use to reach this box; auto-detected if unset"
    )
    dht_port: int = Field(0, ge=0, le=65535, description="DHT port (0 = any free port)")
    grpc_port: int = Field(0, ge=0, le=65535, description="checkpoint-serving gRPC port (0 = any)")
    status_port: int = Field(0, ge=0, le=65535, description="status page port (0 = any)")
    journal_dir: str = Field("potluck-run", description="run state, identity and checkpoints")
    checkpoint_every: int = Field(5, ge=0, description="outer steps between checkpoints; 0 disables them")
    keep_checkpoints: int = Field(3, ge=1, description="checkpoints kept, the newest (locally and at checkpoint_url)")
    checkpoint_url: str = Field(
        "", description="an fsspec URL (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, file:///PATH) that receives every "
        "checkpoint kept, uploaded off the coordinator's loop, each file verified by hash and the manifest last, "
        "pruned as the local ones; credentials and endpoint from the store's environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...); s3 needs pip install 'potluck[s3]'. '' = this disk only")
    tick_s: float = Field(0.2, gt=0, description="how often the coordinator re-reads the DHT")
    startup_timeout_s: float = Field(60.0, gt=0, description="time allowed for the DHT daemon to start")
    insecure: bool = Field(False, description="plaintext gRPC between peers: local experiments only (the status "
                           "page says so); by default it runs over mutual TLS with certificates from the run's CA")
    status_tls: Literal["off", "self-signed", "files"] = Field(
        "off", description="the status page over HTTPS, so the admin token never crosses the network in clear: "
        "'self-signed' makes a certificate once (status-tls.pem in journal_dir; the coordinator prints its SHA-256 "
        "fingerprint for visitors to compare), 'files' serves status_tls_cert and status_tls_key, 'off' is plain HTTP")
    status_tls_cert: str | None = Field(
        None, description="PEM certificate of the status page, its chain after it (status_tls = 'files')")
    status_tls_key: str | None = Field(None, description="PEM private key of status_tls_cert (status_tls = 'files')")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="experiment trackers the run is logged to, each an extra to install "
        "(pip install 'potluck[wandb]'): 'tensorboard', 'wandb', 'mlflow'. Once per committed outer step (its "
        "losses, tokens/s, tokens trained, live peers, bytes by kind, outer-step time), the run's config once, "
        "rollbacks and evictions as events; written off the coordinator's loop (a list, or 'a,b' on --set)")
    tracker_dir: str = Field("", description="the trackers' local files (TensorBoard's event files, W&B's run "
                             "folder, MLflow's file store when MLFLOW_TRACKING_URI is unset); '' = journal_dir/trackers")
    tracker_project: str = Field("potluck", min_length=1, description="the W&B project and the MLflow experiment "
                                 "the run is logged to")
    tracker_run_name: str = Field("", description="the run's name in the trackers; '' = the run id")

    @field_validator("trackers", mode="before")
    @classmethod
    def _tracker_list(cls, v: Any) -> Any:
        """``--set coordinator.trackers=tensorboard,wandb`` (a string) is the list it names."""
        return [t.strip() for t in v.split(",") if t.strip()] if isinstance(v, str) else v

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v}: each tracker is named once")
        return v

    @model_validator(mode="after")
    def _status_tls_files(self) -> CoordinatorConfig:
        given = bool(self.status_tls_cert or self.status_tls_key)
        if self.status_tls == "files" and not (self.status_tls_cert and self.status_tls_key):
            raise ValueError("status_tls = 'files' needs both status_tls_cert and status_tls_key")
        if self.status_tls != "files" and given:
            raise ValueError(f"status_tls_cert and status_tls_key are served only with status_tls = 'files' "
                             f"(it is {self.status_tls!r})")
        return self


class AdmissionConfig(Section):
    """Who may take part (the coordinator's policy). Not part of the manifest: peers learn the mode only."""

    mode: Literal["open", "private"] = Field(
        "open", description="'open': anyone may join (volunteer runs); 'private': the join token or `allow` is needed")
    allow: list[str] = Field(default_factory=list, description="peer ids admitted to a private run without the token")
    cert_lifetime_s: float = Field(6 * 3600.0, ge=60, description="lifetime of a peer's certificate; renewed at half "
                                   "of it while the peer heartbeats (the coordinator must be back within it)")
    max_per_minute: int = Field(120, ge=1, description="new peers admitted a minute at most")
    evict_after: int = Field(3, ge=1, description="a peer clipped or rejected in this many of its last 5 outer steps "
                             "is evicted")
    probation_steps: int = Field(3, ge=0, description="outer steps a newly admitted peer commits as a member before "
                                 "it may own a shard, audit one or count in an eviction (until then it trains and "
                                 "contributes; a stage with no peer past probation lets all its members own shards)")
    pow_bits: int = Field(0, ge=0, le=32, description="open runs: leading zero bits of sha256(run id, peer id, nonce) "
                          "a peer must find before it is admitted (20: about a second of a core; each further bit "
                          "doubles it), so a thousand fresh keys cost real compute")


class PeerConfig(Section):
    """One volunteer's peer process: how it joins and what it lends. Not part of the manifest."""

    join: str = Field("", description="the coordinator's join address (/ip4/.../tcp/.../p2p/12D3KooW...)")
    host: str = Field("0.0.0.0", description="interface the gRPC and DHT servers bind to")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = any free port)")
    dht_port: int = Field(0, ge=0, le=65535, description="DHT port (0 = any free port)")
    announce_host: str | None = Field(
        None, description="address other peers should use to reach this one; auto-detected if unset"
    )
    device: str = Field("auto", description="'auto' (cuda if present, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    devices: Literal["replicate", "shard"] = Field(
        "replicate", description="a torchrun peer of N processes: 'replicate' holds the whole stage on each; "
        "'shard' splits its weights, gradients and AdamW state over them (FSDP2), 1/N each")
    name: str = Field("", max_length=64, description="public name shown on the status page (opt-in)")
    outer_state_dir: str | None = Field(
        None, description="keep the outer state (theta_global, its momentum, the version before: 16 bytes a "
        "parameter) in memory-mapped files in this folder instead of RAM, for a peer short of memory; each outer "
        "step writes 8 bytes a parameter there")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    dht_client: bool = Field(False, description="join the DHT as a client only (behind NAT)")
    relay: bool = Field(False, description="accept no connections (behind a NAT): serve other peers' calls over "
                        "one outbound tunnel to the coordinator, which relays them")
    startup_timeout_s: float = Field(60.0, gt=0, description="time allowed for the DHT daemon to start")
    join_timeout_s: float = Field(120.0, gt=0, description="time allowed to find the run manifest")
    region: str = Field("", description="this peer's region in the --netem topology file")
    netem: str | None = Field(None, description="emulate the WAN described by this topology file (tests, demos)")
    plan_wait_s: float = Field(
        10.0, gt=0, description="wait this long for the coordinator's round decision before using the last plan"
    )
    coordinator_timeout_s: float = Field(
        1800.0, ge=0, description="train on the last plan at most this long while the coordinator is away (its "
        "records gone from the DHT), saying so at every outer step; then stop with exit code 3. 0: never stop")
    identity: str = Field("", description="this peer's Ed25519 key file (created 0600 if missing); default "
                          "~/.potluck/peer.key, one peer at a time")
    token: str = Field("", description="the join token of a private run (or $POTLUCK_JOIN_TOKEN)")
    data_path: str | None = Field(
        None, description="this machine's copy of the run's corpus (data.source='bytes'); default: the run's "
        "data.path, relative to the working directory"
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda", "mps") and not (v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError("device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
        return v


class RunConfig(Section):
    """The whole run file."""

    run_id: str = Field("", description="run name; a fresh one is generated when empty")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    links: LinksConfig = Field(default_factory=LinksConfig)
    membership: MembershipConfig = Field(default_factory=MembershipConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)

    @model_validator(mode="after")
    def _data_fits_model(self) -> RunConfig:
        m, d = self.model, self.data
        if d.source == "bytes" and m.family == "hf" and m.vocab_size < BYTE_VOCAB:
            raise ValueError(f"{m.hf_model} has {m.vocab_size} tokens; data.source = 'bytes' needs {BYTE_VOCAB}")
        if d.source == "bytes" and m.vocab_size != BYTE_VOCAB and m.family != "hf":
            if "vocab_size" in m.model_fields_set:
                raise ValueError(f"model.vocab_size = {m.vocab_size}, but data.source = 'bytes' has {BYTE_VOCAB} "
                                 f"tokens (one per byte value): set model.vocab_size = {BYTE_VOCAB}, or leave it out")
            # decided by the data, not set by the user: a copy, and not marked as set, so that a later
            # override of data.source decides again (apply_overrides keeps only what was set)
            model = m.model_copy()
            model.__dict__["vocab_size"] = BYTE_VOCAB
            self.__dict__["model"] = model
        entries = self.model.vocab_size ** (d.markov_order + 1)
        if d.source == "markov" and entries > MAX_MARKOV_ENTRIES:
            raise ValueError(f"the synthetic source's transition table would hold model.vocab_size ** "
                             f"(data.markov_order + 1) = {entries} entries, more than {MAX_MARKOV_ENTRIES}: "
                             "lower model.vocab_size or data.markov_order")
        return self

    @model_validator(mode="after")
    def _pipeline_fits_model(self) -> RunConfig:
        if self.pipeline.grad_bits is None:  # fp32 written as 32, so that a run file can say it
            pipeline = self.pipeline.model_copy()
            pipeline.__dict__["grad_bits"] = 32
            self.__dict__["pipeline"] = pipeline
        p, entries = self.pipeline, self.model.n_layers + 2
        if p.layers is not None:
            if len(p.layers) != p.stages:
                raise ValueError(f"pipeline.layers has {len(p.layers)} entries for {p.stages} stages")
            if sum(p.layers) != entries:
                raise ValueError(f"pipeline.layers sums to {sum(p.layers)}; the model has {entries} "
                                 f"(embedding + {self.model.n_layers} blocks + head)")
        elif p.stages > entries:
            raise ValueError(f"pipeline.stages = {p.stages} exceeds the model's {entries} layers")
        if p.stages > 1 and self.train.batch_size % p.micro_batches:
            raise ValueError(f"train.batch_size {self.train.batch_size} is not a multiple of "
                             f"pipeline.micro_batches {p.micro_batches}")
        if p.stages > 1 and self.model.tie_embeddings and "tie_embeddings" not in self.model.model_fields_set \
                and self.model.family == "hf":
            model = self.model.model_copy()  # the model ties them; split, each stage trains its own copy
            model.__dict__["tie_embeddings"] = False
            self.__dict__["model"] = model
        if p.stages > 1 and self.model.tie_embeddings:
            raise ValueError("model.tie_embeddings needs embedding and head in one stage; set it false for stages > 1")
        if p.stages > 1 and self.train.step_in_backward and p.micro_batches > 1:
            raise ValueError(f"train.step_in_backward would update after the first of pipeline.micro_batches = "
                             f"{p.micro_batches}: set pipeline.micro_batches = 1")
        if p.stages > 1 and isinstance(self.train.grad_accum, int) and self.train.grad_accum > 1:
            raise ValueError(f"train.grad_accum = {self.train.grad_accum} splits the batch of a single-stage run; a "
                             "pipeline splits it into pipeline.micro_batches already: set that instead")
        if self.train.weights == "bf16" and self.train.precision in ("fp32", "fp16"):
            raise ValueError(f"train.weights = 'bf16' computes in bf16: train.precision = '{self.train.precision}' "
                             "cannot go with it; set it to 'bf16' or 'auto'")
        if p.stages > 1 and self.train.precision == "fp16":
            raise ValueError("train.precision = 'fp16' needs pipeline.stages = 1 (every stage would have to share "
                             "one loss scale); use 'bf16' or 'auto'")
        if p.stages > 1 and self.diloco.overlap:
            raise ValueError("diloco.overlap needs pipeline.stages = 1: a pipeline starts each step only on the "
                             "coordinator's round for it, which waits for the step before")
        if self.sync.pace and not self.diloco.overlap:
            raise ValueError(f"sync.pace = {self.sync.pace} spreads an overlapped outer step's sends over the inner "
                             "phase it overlaps: it needs diloco.overlap = true (a blocking step would only wait longer)")
        if self.sync.pace and self.sync.pace >= self.sync.deadline_factor:
            raise ValueError(f"sync.pace = {self.sync.pace} must be under sync.deadline_factor = "
                             f"{self.sync.deadline_factor}: owners wait that share of the inner phase for contributions")
        if self.sync.fragments > 1 and self.sync.group_size:
            raise ValueError(f"sync.fragments = {self.sync.fragments} needs sync.group_size = 0: a grouped step "
                             "averages whole states of members that hold different ones, a fragment's step only "
                             "one slice of a state every member holds alike; use one or the other")
        return self

    @field_validator("run_id")
    @classmethod
    def _printable_run_id(cls, v: str) -> str:
        if v and not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("run_id may hold letters, digits, '-', '_' and '.' only")
        return v

    def manifest_sections(self) -> dict[str, Any]:
        """What every peer must agree on: the config minus the coordinator's local settings."""
        return self.model_dump(exclude={"coordinator", "admission"})
