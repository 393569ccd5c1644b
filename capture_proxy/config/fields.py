"""The settings' fields: name, type, bounds, default and description of each, in the order
the configuration reference (docs/configuration.md, generated from them) lists them.
``settings.Settings`` adds their validators and the values derived from them.

Defaults that bite a proxy are set explicitly, not left to the libraries: the request body limit
(64 MiB, long agent histories), no total upstream timeout (long generations), a large
upstream connection pool, and an upstream keep-alive shorter than the engines' so the proxy
never reuses a connection the engine is about to close.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AnyHttpUrl, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

ImageUrlScheme = Literal["data", "http", "https"]
_DEFAULT_IMAGE_SCHEMES: tuple[ImageUrlScheme, ...] = ("data", "https")


class SettingsFields(BaseSettings):
    """The fields of ``Settings``, without its checks: build ``Settings``, never this. Times in
    seconds, sizes in bytes."""

    model_config = SettingsConfigDict(env_prefix="CAPTURE_PROXY_", frozen=True, extra="forbid")

    backend: AnyHttpUrl = Field(
        description="Engine base URL, e.g. http://127.0.0.1:8000, without /v1: the proxy adds "
        "/v1/... itself (a URL ending in /v1 is warned about at start-up)"
    )
    host: str = Field(
        "127.0.0.1",
        description="listen address; one that is not a loopback address needs captures_token "
        "(or allow_unauthenticated_read_api)",
    )
    port: int = Field(8080, ge=0, le=65535, description="listen port; 0: a free port")
    store: Path | str = Field(
        Path("capture-store"),
        description="Embedded store directory (SQLite WAL + binary arrays, created on first "
        "use; one proxy per directory: a second one refuses to start, while serve --read-only "
        "and show read a store in use), or a postgresql:// URL: the shared PostgreSQL store "
        "for proxy replicas (needs the 'postgres' extra)",
    )
    store_pool_size: int = Field(
        8, ge=1, le=256, description="PostgreSQL store: pooled connections (and threads)"
    )
    store_synchronous: Literal["full", "normal"] = Field(
        "full",
        description="SQLite synchronous mode of the store (WAL). full: each call's commit is "
        "fsynced before its response ends (one commit covers the calls that arrived while the "
        "previous one ran: group commit), so an acknowledged call survives a proxy crash, a "
        "kernel crash and a power loss. normal: no fsync per commit (about 0.3-0.5 ms less per "
        "call here); an acknowledged call survives a proxy crash (SIGKILL, OOM kill) but a "
        "power loss or kernel crash can drop the calls committed since the last checkpoint",
    )
    workers: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Worker processes serving the port (each its own event loop and core); "
        "None: one per CPU this process may use (its affinity mask, capped by its cgroup's CPU "
        "quota: a container's CPU limit, rounded down), at most one per 256 MB of the memory "
        "it may use (per 1 GB where each may load a local tokenizer: setting tokenizer, or "
        "model_families in exact_tokens; the machine's memory, "
        "capped by its cgroup's memory limit). With an embedded store the supervisor process "
        "is its one writer (workers read it themselves and send their writes there); "
        "with PostgreSQL each worker is a replica. 1: one process, no supervisor",
    )
    store_failure: Literal["refuse", "answer"] = Field(
        "refuse",
        description="a call whose record the store cannot write (disk full, database "
        "read-only): refuse (default): not answered as a success: a 503 (store_unavailable, "
        "Retry-After) in the API's error shape, or for a stream already under way the API's "
        "in-band error and no clean end; answer: the harness gets its answer, the loss is "
        "counted (capture_proxy_calls_answered_unstored_total) and the rollout marked "
        "incomplete (store_failed, naming the lost calls) once the store takes writes again",
    )
    max_request_body_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="largest request body accepted (413 above it); long agent histories need "
        "more than aiohttp's default of 1 MiB",
    )
    upstream_connect_timeout_s: float = Field(
        10.0, gt=0, description="max seconds to open a connection to the engine"
    )
    upstream_first_byte_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Max seconds from sending a request to the engine's response headers; "
        "None: no limit (long prompts take long to prefill). On a captured call it does not "
        "cut a request the engine holds while paused (GET /is_paused true: a keep or wait "
        "pause for a weight update)",
    )
    upstream_read_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Max seconds between bytes from the engine; None: no limit. On a captured "
        "call it does not cut a stream the engine holds while paused (GET /is_paused true)",
    )
    upstream_connect_retries: int = Field(
        2,
        ge=0,
        description="Retries of a request whose connection to the engine could not be made "
        "(refused, or no connection within upstream_connect_timeout_s): nothing was sent, so "
        "a retry is safe (engines' listen queues overflow under load); backoff 0.2 s, "
        "0.4 s, ...",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="auto: uvloop when installed (a dependency on Linux), else asyncio"
    )
    listen_backlog: int = Field(
        4096, gt=0, description="Listen queue of the proxy's socket (aiohttp's default is 128)"
    )
    upstream_connection_limit: int = Field(
        4096,
        ge=0,
        description="Max concurrent upstream connections (0: unlimited); aiohttp's default "
        "of 100 starves thousands of concurrent rollouts",
    )
    upstream_keepalive_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Idle upstream connections are closed after this; below the "
        "engine's own keep-alive (uvicorn: 5 s) so both sides never race",
    )
    parent_resolution: Literal["captured_tokens", "source_history"] = Field(
        "captured_tokens",
        description="captured_tokens: the digest-resolved parent's stored tokens are the truth "
        "(a call after a rewritten harness note resolves to the note call and verification "
        "decides); source_history: a parent whose prompt carried a rewritten note is not taken, "
        "so each call past a step limit starts a new chain",
    )
    prompt_mode: Literal["backend_template", "exact_tokens"] = Field(
        "backend_template",
        description="backend_template: the engine renders the chat template; exact_tokens: the "
        "proxy builds the prompt from the parent's own tokens and calls the tokens-in endpoint",
    )
    prompt_mode_by_model: dict[str, Literal["backend_template", "exact_tokens"]] = Field(
        default_factory=dict, description="per-model override of prompt_mode"
    )
    routed_experts: Literal["required", "optional", "off"] = Field(
        "optional",
        description="what a model's calls promise about routed experts: required (an MoE "
        "model trained with routing replay: a call without rows is incomplete and the rollout "
        "says so), optional (rows kept when the engine sends them; a call whose parent had "
        "rows but that got none, e.g. a vLLM OpenAI-format stream, is flagged "
        "routed_experts_unavailable), off (not asked for, not checked)",
    )
    routed_experts_by_model: dict[str, Literal["required", "optional", "off"]] = Field(
        default_factory=dict, description="per-model override of routed_experts"
    )
    tokenizer: Path | None = Field(
        None,
        description="local HF tokenizer directory with the model's chat template (exact_tokens); "
        "unset: render with the engine's /tokenize",
    )
    tokens_in_dialect: Literal["vllm_completions", "vllm_generate", "sglang_generate"] = Field(
        "vllm_completions", description="the engine endpoint that takes token ids (exact_tokens)"
    )
    tokens_in_echo_prompt: bool = Field(
        False,
        description="exact_tokens with vllm_completions: ask the engine to echo the prompt ids "
        "(return_token_ids) and check them id for id; off: the prompt is checked by its length "
        "(usage.prompt_tokens) and no per-call work grows with the prompt (the echo costs about "
        "2 ms per call at 54k prompt tokens)",
    )
    output_parser: Literal["qwen", "qwen3", "qwen3_coder"] = Field(
        "qwen",
        description="model family whose output format turns tokens back into a message: qwen "
        "or qwen3 (Hermes JSON tool calls, <think> reasoning), qwen3_coder (XML tool calls)",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="context length in tokens; unset: the engine's /v1/models"
    )
    routed_experts_shape: tuple[int, int] | None = Field(
        None,
        description="exact_tokens with sglang_generate on an MoE model: (num_hidden_layers, "
        "num_experts_per_tok), to ask SGLang for routed experts and reshape its int32 rows "
        "(vLLM's dialects need none: its rows carry their shape)",
    )
    exact_prompt_full_render: bool = Field(
        False,
        description="exact_tokens: render each resolved call's whole conversation and splice it "
        "(the path before per-call extension, O(history) per call; for comparison only)",
    )
    end_of_turn_token: str = Field(
        "<|im_end|>", description="the chat template's end-of-turn token (exact_tokens splice)"
    )
    model_families: dict[
        str, Literal["qwen3", "qwen3_coder", "gpt_oss", "llama3", "qwen2_5", "qwen3_vl"]
    ] = Field(
        default_factory=dict,
        description="exact_tokens: the model family of a model (its renderer, output parser and "
        "turn-closing tokens, see capture_proxy.families): qwen3 (Hermes JSON tool calls), "
        "qwen3_coder (XML tool calls), gpt_oss (harmony), llama3 (Llama 3.x JSON tool calls; "
        "needs family_tokenizers.llama3), qwen2_5 (Qwen2.5 / Qwen2.5-Coder Instruct, Hermes JSON "
        "tool calls; needs family_tokenizers.qwen2_5), qwen3_vl (Qwen3-VL Instruct: images, the "
        "published template or family_tokenizers.qwen3_vl; its image processor from "
        "image_processors); models not named use tokenizer, "
        "output_parser and end_of_turn_token",
    )
    family_tokenizers: dict[
        Literal["qwen3", "qwen3_coder", "llama3", "qwen2_5", "qwen3_vl"], Path
    ] = Field(
        default_factory=dict,
        description="a local HF tokenizer directory (the model's own tokenizer and chat "
        "template) per family; unset: the built-in Qwen tokenizer and our template (Qwen "
        "families; llama3 and qwen2_5 have no built-in one and need their directory)",
    )
    system_start_date: str | None = Field(
        None,
        pattern=r"^\d{4}-\d{2}-\d{2}$",
        description="gpt_oss: the 'Current date:' (Y-M-D),"
        " the serving vLLM's VLLM_SYSTEM_START_DATE; unset: today (local time zone), as vLLM",
    )
    image_max_bytes: int = Field(
        20 * 1024 * 1024,
        gt=0,
        description="largest image a call may carry (decoded bytes); a larger one is answered "
        "400 naming its field",
    )
    images_per_call_max: int = Field(
        100, ge=0, description="most image parts one call may carry (0: images refused)"
    )
    image_url_schemes: list[ImageUrlScheme] = Field(
        default_factory=lambda: list(_DEFAULT_IMAGE_SCHEMES),
        description="URL schemes an image part's URL may have (data: base64 inline; http, "
        "https: fetched by the proxy, only with image_fetch_remote); base64 image blocks are "
        "always taken",
    )
    image_fetch_remote: bool = Field(
        False,
        description="fetch an image given by an http(s) URL (within image_url_schemes) and send "
        "the engine those bytes (stored with the call); off: such an image is answered 400, as "
        "the proxy would otherwise record an image it never saw. On, the proxy requests any "
        "URL a harness names (no redirects followed): enable it only where that is safe",
    )
    image_fetch_timeout_s: float = Field(
        10.0, gt=0, description="longest wait for one remote image (image_fetch_remote)"
    )
    image_processors: dict[str, str] = Field(
        default_factory=dict,
        description="per model, the image processor whose arithmetic gives each image's "
        "placeholder tokens and the pixel input a trainer rebuilds: qwen3_vl or qwen2_5_vl "
        "(the published Qwen3-VL / Qwen2.5-VL processor settings), or the path of the model's "
        "preprocessor_config.json (or of its directory) when the engine was started with other "
        "settings; a call with images to a model not named is answered 400",
    )
    captures_token: SecretStr | None = Field(
        None,
        description="bearer token required by the /captures read API, the viewer and /metrics "
        "(unset: open)",
    )
    proxy_token: SecretStr | None = Field(
        None,
        description="bearer token harnesses must send to proxied paths (unset: open); it is "
        "stripped before forwarding",
    )
    allow_unauthenticated_read_api: bool = Field(
        False,
        description="allow a non-loopback host without captures_token (--insecure-read-api): "
        "anyone who reaches the port can then read and delete captures; by default such "
        "settings stop start-up",
    )
    backend_api_key: SecretStr | None = Field(
        None, description="bearer token the proxy sends to the engine (unset: the harness's)"
    )
    tombstone_retention_s: float = Field(
        86_400.0,
        gt=0,
        description="how long a deleted rollout's tombstone refuses late calls (seconds); a "
        "sweep every retention / 10 (at most hourly) removes older ones",
    )
    late_calls: Literal["record", "refuse"] = Field(
        "record",
        description="a call to a frozen rollout: record (default): answered and stored as "
        "late, left out of the snapshot and its exports; refuse: answered 409 "
        "(rollout_frozen) in the API's error shape without reaching the engine",
    )
    uncaptured_generation: Literal["forward", "refuse"] = Field(
        "forward",
        description="a generation call outside a capture path (plain /v1/chat/completions, "
        "/v1/responses, /v1/messages, /v1/completions, tokens-in /generate ..., or the same on "
        "the correlation path /ng-rollout/<rollout_id>/v1/...): forward "
        "(default): forwarded uncaptured, warned once per path and counted in "
        "capture_proxy_uncaptured_generation_calls_total; refuse: answered 400 "
        "(capture_path_required) in the API's error shape, naming the capture path's form",
    )
    link_index_max_rollouts: int = Field(
        10_000,
        gt=0,
        description="rollouts whose parent-digest index stays in memory (least recently used "
        "ones are reloaded from the store when needed; one with calls in flight stays until "
        "they end)",
    )
    link_index_max_calls: int | None = Field(
        None,
        gt=0,
        description="calls the parent-digest indexes in memory hold at most, over all their "
        "rollouts (about 3.5 KB each; least recently used rollouts go first, as for "
        "link_index_max_rollouts): a rollout's index grows with its calls. None: their share "
        "of cache_memory_mb (131,072 at 1,232 MB)",
    )
    cache_memory_mb: int | None = Field(
        None,
        ge=8,
        description="MB the caches of each proxy process (each worker) may hold: recent "
        "records, parent-digest indexes, message facts, request bodies, tool lists, in fixed "
        "shares (a smaller bound costs store reads, never a wrong link). None: 1,232, or less "
        "where the memory this process may use (the machine's, capped by its cgroup's "
        "memory.max, or memory.high where lower: a container's memory limit) is small: the "
        "workers' caches together at "
        "most a quarter of it and half of what the processes themselves leave (at least 32 "
        "MB each)",
    )
    engine_health_interval_s: float = Field(
        5.0,
        ge=0,
        description="/health probes the engine's /health at most once per this many seconds "
        "(the answer is cached in between)",
    )
    engine_health_timeout_s: float = Field(
        2.0, gt=0, description="longest wait for the engine's /health answer (seconds)"
    )
    extra_backends: list[AnyHttpUrl] = Field(
        default_factory=list,
        description="more engine base URLs besides backend (serve --backend repeated): each "
        "rollout's calls go to the engine it is pinned to until that engine is unhealthy "
        "(placed by rendezvous hashing on the routing key, bounded by backend_balance_factor); "
        "no user info (the engines share backend's credential)",
    )
    backend_balance_factor: float = Field(
        1.1,
        ge=1.0,
        description="with several backends: a rollout being placed (its first call, or its "
        "engine down) passes over an engine whose requests in flight reach this factor x the "
        "mean (consistent hashing with bounded loads); 1.0: strict balance, larger: more "
        "rollouts on their first-choice engine",
    )
    backend_pin_idle_s: int = Field(
        600,
        ge=1,
        description="with several backends: seconds after a rollout's last request ended that "
        "it stays pinned to its engine (a request in flight keeps it pinned; after that its "
        "next call is placed again)",
    )
    backend_health_interval_s: float = Field(
        2.0, gt=0, description="with several backends: seconds between /health probes of each"
    )
    backend_health_timeout_s: float = Field(
        1.0, gt=0, description="with several backends: longest wait for one /health probe"
    )
    weight_version_poll_s: float | None = Field(
        1.0,
        gt=0,
        description="seconds between readings of each engine's weight version (GET "
        "/weight_info, vLLM with VLLM_SERVER_DEV_MODE=1), off the calls' path: a call whose "
        "engine does not name its tokens' versions (chat completions, /v1/completions) gets "
        "the versions observed around it (weight_version_source observed); unset: not read",
    )
    engine_pause_wait_s: float = Field(
        900.0,
        gt=0,
        description="after the engine aborts a generation for a weight update "
        "(finish_reason abort), the longest wait for it to serve again (GET /is_paused false) "
        "before the call ends incomplete with a retryable error; a stream gets an SSE comment "
        "every 15 s meanwhile, so the harness's connection stays alive",
    )
    routing_key: Literal["rollout", "episode", "none"] = Field(
        "rollout",
        description="the routing key sent on every engine request, for a router's session "
        "affinity: rollout: the rollout id; episode: the rollout id without its attempt suffix "
        "-a<n>; none: no header",
    )
    routing_key_header: str = Field(
        "x-smg-routing-key",
        pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$",
        description="the header carrying the routing key: x-smg-routing-key (SMG's default); "
        "X-Session-ID for vLLM production stack's session router; any name a router reads",
    )
    record_dir: Path | None = Field(
        None,
        description="record every request under a capture path, with the answer sent, to "
        "DIR/<rollout_id>.jsonl in the replay format (for building fixtures; unset: off)",
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host header values (names or addresses, without the port) the proxy "
        "answers; any other gets a 421 (host_not_allowed), so a web page that rebinds its own "
        "DNS name to this address cannot read or write through the operator's browser. '*' "
        "allows any. Unset: loopback names and addresses, the listen host, and any IP "
        "address literal (a rebinding page always uses a name)",
    )
    client_header_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a client connection that has not sent a complete request head (request "
        "line and headers) this many seconds after it opened, or after its previous answer "
        "(an idle keep-alive), is closed (aiohttp's keepalive_timeout)",
    )
    client_body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="longest wait for a request body after its headers (seconds); a body "
        "that stops coming is answered 408 (request_timeout) and never reaches the engine",
    )
    read_api_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest a read of the read API (GET under /captures: rollouts, chains, "
        "npz, exports, images, the viewer) may take before its answer starts (seconds); past "
        "it the answer is a 503 (read_timeout, Retry-After) and the read's work not yet "
        "started is dropped. Once the answer has started, read_send_timeout_s bounds it",
    )
    read_send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="longest a started answer of the read API (GET under /captures) may wait "
        "for its client to take bytes (seconds; nginx's send_timeout): each wait, not the "
        "whole answer, so a client taking 128 KiB in each such time is never cut, however "
        "long a large export takes. Past it the answer is cut (the connection closed: an "
        "export then lacks its end-of-stream marker), logged at WARNING and counted "
        "(capture_proxy_read_answers_cut_total)",
    )
    shutdown_timeout_s: float = Field(
        60.0,
        gt=0,
        description="on SIGTERM or SIGINT: longest wait for the calls in flight to finish "
        "(seconds; aiohttp's shutdown_timeout); the calls still running then are cut, stored "
        "incomplete, and named in the log. Give the container runtime's grace period more "
        "(docker stop -t, Kubernetes terminationGracePeriodSeconds)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="log level (any case); logs carry sizes, never bodies or credentials"
    )
