from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    UNKNOWN_RUN: _ClassVar[Refusal]
    WRONG_STEP: _ClassVar[Refusal]
    WRONG_EPOCH: _ClassVar[Refusal]
    BASE_MISMATCH: _ClassVar[Refusal]
    NOT_A_MEMBER: _ClassVar[Refusal]
    NOT_OWNER: _ClassVar[Refusal]
    ALREADY_REDUCED: _ClassVar[Refusal]
    TAKEN_OVER: _ClassVar[Refusal]
    DUPLICATE: _ClassVar[Refusal]
    NOT_YET: _ClassVar[Refusal]
    BUFFER_MISS: _ClassVar[Refusal]
    BAD_MESSAGE: _ClassVar[Refusal]
    NO_STATE: _ClassVar[Refusal]
    UNSUPPORTED: _ClassVar[Refusal]
    OVERLOADED: _ClassVar[Refusal]
    BAD_IDENTITY: _ClassVar[Refusal]
    OVERCLAIM: _ClassVar[Refusal]
REFUSAL_UNSPECIFIED: Refusal
UNKNOWN_RUN: Refusal
WRONG_STEP: Refusal
WRONG_EPOCH: Refusal
BASE_MISMATCH: Refusal
NOT_A_MEMBER: Refusal
NOT_OWNER: Refusal
ALREADY_REDUCED: Refusal
TAKEN_OVER: Refusal
DUPLICATE: Refusal
NOT_YET: Refusal
BUFFER_MISS: Refusal
BAD_MESSAGE: Refusal
NO_STATE: Refusal
UNSUPPORTED: Refusal
OVERLOADED: Refusal
BAD_IDENTITY: Refusal
OVERCLAIM: Refusal

class Header(_message.Message):
    __slots__ = ("run_id", "sender", "step", "epoch")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sender: str
    step: int
    epoch: int
    def __init__(self, run_id: _Optional[str] = ..., sender: _Optional[str] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class RefusalInfo(_message.Message):
    __slots__ = ("code", "at_step", "at_epoch")
    CODE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    AT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    code: Refusal
    at_step: int
    at_epoch: int
    def __init__(self, code: _Optional[_Union[Refusal, str]] = ..., at_step: _Optional[int] = ..., at_epoch: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "scales", "payload", "offset", "numel", "bits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    scales: bytes
    payload: bytes
    offset: int
    numel: int
    bits: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., scales: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., bits: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("header", "sent_at", "padding", "reply_bytes", "finished", "send_s", "abstain", "phase_s")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SEND_S_FIELD_NUMBER: _ClassVar[int]
    ABSTAIN_FIELD_NUMBER: _ClassVar[int]
    PHASE_S_FIELD_NUMBER: _ClassVar[int]
    header: Header
    sent_at: float
    padding: bytes
    reply_bytes: int
    finished: bool
    send_s: float
    abstain: bool
    phase_s: float
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., sent_at: _Optional[float] = ..., padding: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ..., finished: _Optional[bool] = ..., send_s: _Optional[float] = ..., abstain: _Optional[bool] = ..., phase_s: _Optional[float] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("peer_id", "state", "version", "inner_step", "eta_s", "sent_at", "padding", "epoch")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    state: str
    version: int
    inner_step: int
    eta_s: float
    sent_at: float
    padding: bytes
    epoch: int
    def __init__(self, peer_id: _Optional[str] = ..., state: _Optional[str] = ..., version: _Optional[int] = ..., inner_step: _Optional[int] = ..., eta_s: _Optional[float] = ..., sent_at: _Optional[float] = ..., padding: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("header", "shard", "num_shards", "attempt", "base_hash", "contributors", "tensor", "clipped", "rejected", "signer", "signature", "inputs", "input_digests", "samples", "weights", "receipt")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    BASE_HASH_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    header: Header
    shard: int
    num_shards: int
    attempt: int
    base_hash: str
    contributors: _containers.RepeatedScalarFieldContainer[str]
    tensor: Tensor
    clipped: _containers.RepeatedScalarFieldContainer[str]
    rejected: _containers.RepeatedScalarFieldContainer[str]
    signer: str
    signature: bytes
    inputs: _containers.RepeatedScalarFieldContainer[str]
    input_digests: _containers.RepeatedScalarFieldContainer[bytes]
    samples: int
    weights: _containers.RepeatedScalarFieldContainer[int]
    receipt: bytes
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., attempt: _Optional[int] = ..., base_hash: _Optional[str] = ..., contributors: _Optional[_Iterable[str]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., clipped: _Optional[_Iterable[str]] = ..., rejected: _Optional[_Iterable[str]] = ..., signer: _Optional[str] = ..., signature: _Optional[bytes] = ..., inputs: _Optional[_Iterable[str]] = ..., input_digests: _Optional[_Iterable[bytes]] = ..., samples: _Optional[int] = ..., weights: _Optional[_Iterable[int]] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class InputsRequest(_message.Message):
    __slots__ = ("header", "shard", "num_shards", "attempt", "skip")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    header: Header
    shard: int
    num_shards: int
    attempt: int
    skip: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., attempt: _Optional[int] = ..., skip: _Optional[_Iterable[str]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("received_bytes", "handler_s", "receipt")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLER_S_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    handler_s: float
    receipt: bytes
    def __init__(self, received_bytes: _Optional[int] = ..., handler_s: _Optional[float] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class ResultRequest(_message.Message):
    __slots__ = ("header", "shard", "num_shards", "attempt")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    header: Header
    shard: int
    num_shards: int
    attempt: int
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class StateInfoRequest(_message.Message):
    __slots__ = ("header", "stage", "version")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    header: Header
    stage: int
    version: int
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., stage: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class StateInfo(_message.Message):
    __slots__ = ("version", "state_hash", "tensors", "meta_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    state_hash: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    meta_json: str
    def __init__(self, version: _Optional[int] = ..., state_hash: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., meta_json: _Optional[str] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("name", "offset", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    numel: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("header", "version", "ranges", "stage")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    version: int
    ranges: _containers.RepeatedCompositeFieldContainer[Range]
    stage: int
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., version: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., stage: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("version", "tensor")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensor: Tensor
    def __init__(self, version: _Optional[int] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ActPacket(_message.Message):
    __slots__ = ("mode", "bits", "shape", "dtype", "scales", "payload")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    mode: str
    bits: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    scales: bytes
    payload: bytes
    def __init__(self, mode: _Optional[str] = ..., bits: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., scales: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PipeMessage(_message.Message):
    __slots__ = ("header", "kind", "inner_step", "micro", "sample_ids", "labels", "label_shape", "versions", "first", "delta", "loss", "stage", "replica", "abort", "last")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LABEL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    header: Header
    kind: str
    inner_step: int
    micro: int
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    labels: bytes
    label_shape: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    first: ActPacket
    delta: ActPacket
    loss: float
    stage: int
    replica: int
    abort: str
    last: bool
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., kind: _Optional[str] = ..., inner_step: _Optional[int] = ..., micro: _Optional[int] = ..., sample_ids: _Optional[_Iterable[int]] = ..., labels: _Optional[bytes] = ..., label_shape: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ..., first: _Optional[_Union[ActPacket, _Mapping]] = ..., delta: _Optional[_Union[ActPacket, _Mapping]] = ..., loss: _Optional[float] = ..., stage: _Optional[int] = ..., replica: _Optional[int] = ..., abort: _Optional[str] = ..., last: _Optional[bool] = ...) -> None: ...

class PipeChunk(_message.Message):
    __slots__ = ("head", "body_bytes", "data")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    head: PipeMessage
    body_bytes: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, head: _Optional[_Union[PipeMessage, _Mapping]] = ..., body_bytes: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("call", "method", "caller", "message", "end", "status", "details", "refusal", "header")
    CALL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    call: int
    method: str
    caller: str
    message: bytes
    end: bool
    status: int
    details: str
    refusal: bytes
    header: Header
    def __init__(self, call: _Optional[int] = ..., method: _Optional[str] = ..., caller: _Optional[str] = ..., message: _Optional[bytes] = ..., end: _Optional[bool] = ..., status: _Optional[int] = ..., details: _Optional[str] = ..., refusal: _Optional[bytes] = ..., header: _Optional[_Union[Header, _Mapping]] = ...) -> None: ...
