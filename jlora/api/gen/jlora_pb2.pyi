from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class AdapterState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_STATE_UNSPECIFIED: _ClassVar[AdapterState]
    ADAPTER_STATE_HOST: _ClassVar[AdapterState]
    ADAPTER_STATE_LOADING: _ClassVar[AdapterState]
    ADAPTER_STATE_DEVICE: _ClassVar[AdapterState]

class ModelKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_KIND_UNSPECIFIED: _ClassVar[ModelKind]
    MODEL_KIND_BASE: _ClassVar[ModelKind]
    MODEL_KIND_ADAPTER: _ClassVar[ModelKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
ADAPTER_STATE_UNSPECIFIED: AdapterState
ADAPTER_STATE_HOST: AdapterState
ADAPTER_STATE_LOADING: AdapterState
ADAPTER_STATE_DEVICE: AdapterState
MODEL_KIND_UNSPECIFIED: ModelKind
MODEL_KIND_BASE: ModelKind
MODEL_KIND_ADAPTER: ModelKind

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "adapter", "sampling", "resume")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    adapter: str
    sampling: SamplingParams
    resume: ResumeState
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., adapter: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., resume: _Optional[_Union[ResumeState, _Mapping]] = ...) -> None: ...

class ResumeState(_message.Message):
    __slots__ = ("generated_ids", "seed")
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, generated_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias", "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choice
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_id", "text", "timing", "finish_reason", "usage", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    text: str
    timing: TokenTiming
    finish_reason: FinishReason
    usage: Usage
    logprobs: PositionLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., timing: _Optional[_Union[TokenTiming, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Union[PositionLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenTiming(_message.Message):
    __slots__ = ("since_arrival_us", "since_previous_us")
    SINCE_ARRIVAL_US_FIELD_NUMBER: _ClassVar[int]
    SINCE_PREVIOUS_US_FIELD_NUMBER: _ClassVar[int]
    since_arrival_us: int
    since_previous_us: int
    def __init__(self, since_arrival_us: _Optional[int] = ..., since_previous_us: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "path", "rank", "alpha", "target_modules", "sha256", "size_bytes", "state", "slot", "pinned", "running_requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    sha256: str
    size_bytes: int
    state: AdapterState
    slot: int
    pinned: bool
    running_requests: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., state: _Optional[_Union[AdapterState, str]] = ..., slot: _Optional[int] = ..., pinned: _Optional[bool] = ..., running_requests: _Optional[int] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "load", "pin", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    load: bool
    pin: bool
    sha256: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., load: _Optional[bool] = ..., pin: _Optional[bool] = ..., sha256: _Optional[str] = ...) -> None: ...

class RegisterAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "pin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    pin: bool
    def __init__(self, name: _Optional[str] = ..., pin: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnregisterAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunningRequest(_message.Message):
    __slots__ = ("request_id", "adapter", "rank", "slot", "prompt_tokens", "generated_tokens", "max_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: str
    rank: int
    slot: int
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[str] = ..., rank: _Optional[int] = ..., slot: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("running", "queued", "max_queue", "max_slots", "free_slots", "max_seq_len", "memory", "adapter_slots", "draining", "waiting")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    running: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    queued: int
    max_queue: int
    max_slots: int
    free_slots: int
    max_seq_len: int
    memory: Memory
    adapter_slots: AdapterSlots
    draining: bool
    waiting: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    def __init__(self, running: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ..., queued: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., memory: _Optional[_Union[Memory, _Mapping]] = ..., adapter_slots: _Optional[_Union[AdapterSlots, _Mapping]] = ..., draining: _Optional[bool] = ..., waiting: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ...) -> None: ...

class Memory(_message.Message):
    __slots__ = ("kv_blocks_total", "kv_blocks_free", "kv_block_size", "host_store_bytes_used", "host_store_bytes_capacity", "device_bytes_in_use", "device_bytes_limit", "kv_bytes_per_block", "cache")
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_STORE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_STORE_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    host_store_bytes_used: int
    host_store_bytes_capacity: int
    device_bytes_in_use: int
    device_bytes_limit: int
    kv_bytes_per_block: int
    cache: CacheStats
    def __init__(self, kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., host_store_bytes_used: _Optional[int] = ..., host_store_bytes_capacity: _Optional[int] = ..., device_bytes_in_use: _Optional[int] = ..., device_bytes_limit: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("policy", "page_bytes", "pages_total", "pages_kv", "pages_kv_cached", "pages_lora", "host_bytes_used", "host_bytes_capacity", "prompt_tokens", "hit_tokens", "swaps_out", "swaps_in", "swap_out_bytes", "swap_in_bytes", "invalid_kv_pages")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_KV_FIELD_NUMBER: _ClassVar[int]
    PAGES_KV_CACHED_FIELD_NUMBER: _ClassVar[int]
    PAGES_LORA_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAPS_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAPS_IN_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    INVALID_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    page_bytes: int
    pages_total: int
    pages_kv: int
    pages_kv_cached: int
    pages_lora: int
    host_bytes_used: int
    host_bytes_capacity: int
    prompt_tokens: int
    hit_tokens: int
    swaps_out: int
    swaps_in: int
    swap_out_bytes: int
    swap_in_bytes: int
    invalid_kv_pages: int
    def __init__(self, policy: _Optional[str] = ..., page_bytes: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_kv: _Optional[int] = ..., pages_kv_cached: _Optional[int] = ..., pages_lora: _Optional[int] = ..., host_bytes_used: _Optional[int] = ..., host_bytes_capacity: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., swaps_out: _Optional[int] = ..., swaps_in: _Optional[int] = ..., swap_out_bytes: _Optional[int] = ..., swap_in_bytes: _Optional[int] = ..., invalid_kv_pages: _Optional[int] = ...) -> None: ...

class AdapterSlots(_message.Message):
    __slots__ = ("total", "free", "loading", "loads", "evictions")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    total: int
    free: int
    loading: int
    loads: int
    evictions: int
    def __init__(self, total: _Optional[int] = ..., free: _Optional[int] = ..., loading: _Optional[int] = ..., loads: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class ModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "kind", "parent", "rank", "max_seq_len", "tool_call_parser")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: ModelKind
    parent: str
    rank: int
    max_seq_len: int
    tool_call_parser: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[ModelKind, str]] = ..., parent: _Optional[str] = ..., rank: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., tool_call_parser: _Optional[str] = ...) -> None: ...

class ModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "generated_ids", "seed", "sampling", "adapter", "streamed_tokens", "running", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STREAMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    sampling: SamplingParams
    adapter: str
    streamed_tokens: int
    running: bool
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., generated_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., adapter: _Optional[str] = ..., streamed_tokens: _Optional[int] = ..., running: _Optional[bool] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
