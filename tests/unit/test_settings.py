"""Settings without a model: gpu_memory / peft_weights parsing, start-up checks, SAKER_* env vars, CLI flags
generated from the fields, and one-line start-up errors from `python -m app serve` and gunicorn.conf.py."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.settings import (
    DEFAULT_MODEL_NAME,
    Settings,
    add_settings_arguments,
    load_settings,
    parse_gpu_memory,
    parse_peft_weights,
    settings_from_args,
)

ROOT = Path(__file__).resolve().parents[2]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
GUNICORN = str(ROOT / ".venv" / "bin" / "gunicorn")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No SAKER_* variable from the caller's shell leaks into these tests."""
    for key in list(os.environ):
        if key.upper().startswith("SAKER_"):
            monkeypatch.delenv(key)


def env_without_saker(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SAKER_")}
    env.update(extra)
    return env


# -- gpu_memory -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("0:24 1:24", {0: 24.0, 1: 24.0}),
        ("0:24", {0: 24.0}),
        ("0:24,1:12", {0: 24.0, 1: 12.0}),
        ("0:24, 1:12", {0: 24.0, 1: 12.0}),
        ("  0:24\t1:12  ", {0: 24.0, 1: 12.0}),
        ("0:7.5 3:0.25", {0: 7.5, 3: 0.25}),
        ("2:10 0:20", {2: 10.0, 0: 20.0}),
        ("", {}),
        ("10:80", {10: 80.0}),
    ],
)
def test_parse_gpu_memory(text, expected):
    result = parse_gpu_memory(text)
    assert result == expected
    assert list(result) == list(expected)  # order kept: the first listed device fills first
    assert all(isinstance(v, float) for v in result.values())


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("0=24", "'0=24'"),
        ("a:24", "'a:24'"),
        ("0:", "'0:'"),
        (":24", "':24'"),
        ("0:24GiB", "'0:24GiB'"),
        ("0:-1", "'0:-1'"),
        ("-1:24", "'-1:24'"),
        ("0:24:1", "'0:24:1'"),
        ("0:0", "more than 0"),
        ("0:0.0", "more than 0"),
        ("0:24 0:12", "twice"),
        ("1:1,0:2,1:3", "twice"),
    ],
)
def test_parse_gpu_memory_rejects(text, fragment):
    with pytest.raises(ValueError) as info:
        parse_gpu_memory(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_gpu_memory_map_and_primary_gpu():
    settings = load_settings(gpu_memory="2:10 0:20")
    assert settings.gpu_memory_map == {2: 10.0, 0: 20.0}
    assert settings.primary_gpu == 2  # default: the first listed
    assert load_settings(gpu_memory="2:10 0:20", gpu_id=0).primary_gpu == 0
    assert load_settings(device="cuda:3").primary_gpu == 3
    assert load_settings().primary_gpu is None
    assert load_settings().gpu_memory_map == {}


@pytest.mark.parametrize(
    "values,fragments",
    [
        ({"gpu_id": 3, "gpu_memory": "0:24"}, ["gpu_id 3", "[0]"]),
        ({"gpu_id": 1, "gpu_memory": "0:24 2:24"}, ["gpu_id 1", "[0, 2]"]),
        ({"gpu_memory": "0:24 0:24"}, ["SAKER_GPU_MEMORY", "twice"]),
        ({"gpu_memory": "zero:24"}, ["SAKER_GPU_MEMORY", "'zero:24'"]),
        ({"gpu_memory": "0:24", "device": "cpu"}, ["gpu_memory", "cpu"]),
        ({"cpu_memory": 8}, ["cpu_memory", "gpu_memory"]),
        ({"offload_folder": "/tmp/off"}, ["offload_folder", "gpu_memory"]),
        ({"gpu_id": -1}, ["SAKER_GPU_ID"]),
        ({"max_n": 0}, ["SAKER_MAX_N"]),
        ({"max_logprobs": -1}, ["SAKER_MAX_LOGPROBS"]),
        ({"max_input_tokens": 100, "max_total_tokens": 50}, ["max_input_tokens", "max_total_tokens"]),
        ({"dtype": "float8"}, ["SAKER_DTYPE", "bfloat16"]),
        ({"device": "gpu"}, ["SAKER_DEVICE", "'gpu'"]),
        ({"device": "cuda:x"}, ["SAKER_DEVICE"]),
        ({"quantize": "bitsandbytes-4bit", "device": "cpu"}, ["quantize", "cpu"]),
        ({"quantize": "gptq"}, ["SAKER_QUANTIZE"]),
        ({"peft_weights": "a=/x b"}, ["SAKER_PEFT_WEIGHTS", "'b'"]),
        ({"peft_weights": "a=/x b=/y", "peft_merge": True}, ["peft_merge"]),
        ({"port": 70000}, ["SAKER_PORT"]),
        ({"log_level": "loud"}, ["SAKER_LOG_LEVEL"]),
    ],
)
def test_bad_settings_fail_with_one_line(values, fragments):
    with pytest.raises(ConfigError) as info:
        load_settings(**values)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("bad setting: ")
    for fragment in fragments:
        assert fragment in message, message


def test_gpu_id_among_listed_ids_is_fine():
    settings = load_settings(gpu_id=1, gpu_memory="0:24 1:24", cpu_memory=64, offload_folder="/tmp/off")
    assert settings.primary_gpu == 1 and settings.cpu_memory == 64.0


# -- environment variables ----------------------------------------------------------------------------
def test_env_vars_are_read(monkeypatch):
    monkeypatch.setenv("SAKER_MODEL", "/models/x")
    monkeypatch.setenv("SAKER_MAX_N", "5")
    monkeypatch.setenv("SAKER_MAX_LOGPROBS", "7")
    monkeypatch.setenv("SAKER_GPU_MEMORY", "0:24 1:24")
    monkeypatch.setenv("SAKER_GPU_ID", "1")
    monkeypatch.setenv("SAKER_TRUST_REMOTE_CODE", "true")
    monkeypatch.setenv("SAKER_DTYPE", "bfloat16")
    monkeypatch.setenv("SAKER_SERVED_MODEL_NAME", "main,alias")
    settings = load_settings()
    assert settings.model == "/models/x"
    assert settings.max_n == 5 and settings.max_logprobs == 7
    assert settings.gpu_memory_map == {0: 24.0, 1: 24.0} and settings.primary_gpu == 1
    assert settings.trust_remote_code is True
    assert settings.dtype == "bfloat16"
    assert settings.model_names == ["main", "alias"]


def test_env_defaults():
    settings = load_settings()
    assert settings.model is None and settings.trust_remote_code is False
    assert (settings.max_logprobs, settings.max_best_of, settings.max_stop_sequences) == (20, 128, 4)
    assert settings.dtype == "auto" and settings.device == "auto"


def test_bad_env_var_names_the_variable(monkeypatch):
    monkeypatch.setenv("SAKER_MAX_BEST_OF", "many")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "SAKER_MAX_BEST_OF" in str(info.value) and "\n" not in str(info.value)


def test_overrides_win_over_env(monkeypatch):
    monkeypatch.setenv("SAKER_MAX_N", "3")
    assert load_settings().max_n == 3
    assert load_settings(max_n=9).max_n == 9
    assert load_settings(max_n=None).max_n == 3  # None = not given


# -- peft_weights -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("/adapters/lora", {None: "/adapters/lora"}),
        ("  /adapters/lora ", {None: "/adapters/lora"}),
        ("sql=/a/sql", {"sql": "/a/sql"}),
        ("sql=/a/sql chat=/a/chat", {"sql": "/a/sql", "chat": "/a/chat"}),
        ("sql=/a/sql,chat=/a/chat", {"sql": "/a/sql", "chat": "/a/chat"}),
        ("org/adapter", {None: "org/adapter"}),
    ],
)
def test_parse_peft_weights(text, expected):
    assert parse_peft_weights(text) == expected


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("/a /b", "'/a'"),  # several adapters need names
        ("sql=/a /b", "'/b'"),
        ("=/a", "'=/a'"),
        ("sql=", "'sql='"),
        ("sql=/a sql=/b", "twice"),
    ],
)
def test_parse_peft_weights_rejects(text, fragment):
    with pytest.raises(ValueError) as info:
        parse_peft_weights(text)
    assert fragment in str(info.value)


def test_peft_adapters_property():
    assert load_settings(peft_weights="/x", peft_merge=True).peft_adapters == {None: "/x"}
    assert load_settings(peft_weights="a=/x b=/y").peft_adapters == {"a": "/x", "b": "/y"}
    assert load_settings().peft_adapters == {}


# -- served names -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values,names",
    [
        ({}, [DEFAULT_MODEL_NAME]),
        ({"model": "org/model"}, ["org/model"]),
        ({"model": "/m", "served_model_name": "tiny"}, ["tiny"]),
        ({"model": "/m", "served_model_name": "tiny, alias ,other"}, ["tiny", "alias", "other"]),
        ({"model": "/m", "served_model_name": "tiny,,"}, ["tiny"]),
        ({"model": "/m", "served_model_name": " , "}, ["/m"]),
    ],
)
def test_model_names(values, names):
    assert load_settings(**values).model_names == names


# -- CLI flags generated from the fields -------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return parser


def test_every_field_has_a_flag():
    parser = make_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in options, flag
        if field.annotation is bool:
            assert "--no-" + name.replace("_", "-") in options
    help_text = parser.format_help()
    assert "--gpu-memory" in help_text and "Aceso" in help_text  # the field's description is the help


def test_settings_from_args():
    args = make_parser().parse_args(
        [
            "--model",
            "/m",
            "--max-logprobs",
            "5",
            "--gpu-memory",
            "0:24 1:24",
            "--gpu-id",
            "1",
            "--trust-remote-code",
            "--served-model-name",
            "a,b",
            "--cpu-memory",
            "2.5",
            "--port",
            "9001",
        ]
    )
    settings = settings_from_args(args)
    assert settings.model == "/m"
    assert settings.max_logprobs == 5 and isinstance(settings.max_logprobs, int)
    assert settings.gpu_memory_map == {0: 24.0, 1: 24.0} and settings.primary_gpu == 1
    assert settings.trust_remote_code is True
    assert settings.cpu_memory == 2.5 and settings.port == 9001
    assert settings.model_names == ["a", "b"]


def test_flags_win_over_env_and_absent_flags_keep_it(monkeypatch):
    monkeypatch.setenv("SAKER_MAX_N", "3")
    monkeypatch.setenv("SAKER_TRUST_REMOTE_CODE", "true")
    assert settings_from_args(make_parser().parse_args([])).max_n == 3
    settings = settings_from_args(make_parser().parse_args(["--max-n", "7", "--no-trust-remote-code"]))
    assert settings.max_n == 7 and settings.trust_remote_code is False
    assert settings_from_args(make_parser().parse_args([])).trust_remote_code is True


def test_bad_flag_value_is_config_error():
    with pytest.raises(ConfigError) as info:
        settings_from_args(make_parser().parse_args(["--max-n", "abc"]))
    assert "max_n".upper() in str(info.value).upper() and "\n" not in str(info.value)


# -- start-up errors in real processes -------------------------------------------------------------------
def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env_without_saker(**env), capture_output=True, text=True, timeout=60)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_serve_with_gpu_id_outside_gpu_memory_exits_2():
    proc = run([PYTHON, "-m", "app", "serve", "--gpu-id", "3", "--gpu-memory", "0:24"])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = one_line(proc.stderr)
    assert "gpu_id 3" in line and "gpu_memory" in line
    assert proc.stdout == ""


def test_serve_with_bad_env_exits_2():
    proc = run([PYTHON, "-m", "app", "serve"], SAKER_GPU_MEMORY="0:lots")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "SAKER_GPU_MEMORY" in one_line(proc.stderr)


def test_gunicorn_config_with_bad_setting_exits_with_one_line():
    proc = run([GUNICORN, "-c", "gunicorn.conf.py", "--check-config", "wsgi:app"], SAKER_MAX_N="0")
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    line = one_line(proc.stderr)
    assert "SAKER_MAX_N" in line
    assert "Traceback" not in proc.stdout


# -- typos and spellings ----------------------------------------------------------------------------------
def test_unknown_saker_variable_is_a_clear_error(monkeypatch):
    from app.errors import ConfigError
    from app.settings import load_settings

    monkeypatch.setenv("SAKER_MODLE", "gpt2")
    with pytest.raises(ConfigError, match="unknown setting SAKER_MODLE"):
        load_settings()


def test_gguf_file_needs_a_model():
    from app.errors import ConfigError
    from app.settings import load_settings

    with pytest.raises(ConfigError, match="gguf_file needs model"):
        load_settings(gguf_file="x.gguf")


def test_log_level_any_case(monkeypatch):
    from app.settings import load_settings

    monkeypatch.setenv("SAKER_LOG_LEVEL", "WARNING")
    assert load_settings().log_level == "warning"


def test_batch_rows_and_running_requests_are_two_settings():
    settings = load_settings()
    assert (settings.max_batch_rows, settings.max_running_requests) == (8, 8)
    settings = load_settings(max_batch_rows="32", max_running_requests="4")
    assert (settings.max_batch_rows, settings.max_running_requests) == (32, 4)


@pytest.mark.parametrize(
    "name, instead",
    [("SAKER_MAX_BATCH_SIZE", "SAKER_MAX_BATCH_ROWS"), ("SAKER_MAX_BATCH_TOKENS", "SAKER_KV_CACHE_TOKENS")],
)
def test_a_removed_setting_stops_the_start_saying_what_to_set_instead(monkeypatch, name, instead):
    monkeypatch.setenv(name, "3")
    with pytest.raises(ConfigError, match=f"{name} was removed: .*{instead}"):
        load_settings()


def test_the_worker_takes_rows_and_running_requests_apart():
    from app.engine.core.worker import Worker

    worker = Worker.from_settings(Settings(max_batch_rows=16, max_running_requests=3))
    assert worker.config.max_batch_rows == 16 and worker.config.running_requests == 3


def test_the_load_config_is_the_settings_the_loader_reads():
    """``LoadConfig.of(settings)``: every field from the setting of its name (gpu_memory and peft_weights parsed,
    the primary GPU derived); the engine's defaults are the server's."""
    from dataclasses import fields

    from app.engine.model.load_config import LoadConfig

    assert LoadConfig.of(Settings()) == LoadConfig()  # the embedded default, placed automatically
    settings = Settings(
        model="/m",
        gguf_file="m.gguf",
        tokenizer="/t",
        revision="r1",
        trust_remote_code=True,
        cache_dir="/c",
        device="cuda",
        dtype="bfloat16",
        quantize="bitsandbytes-4bit",
        gpu_memory="3:10 1:20",
        cpu_memory=4,
        offload_folder="/o",
        peft_weights="/x",
        peft_merge=True,
        compile=True,
        batch_invariant=False,
        speculative="draft",
        speculative_model="/d",
    )
    config = LoadConfig.of(settings)
    assert config == LoadConfig(
        model="/m",
        gguf_file="m.gguf",
        tokenizer="/t",
        revision="r1",
        trust_remote_code=True,
        cache_dir="/c",
        device="cuda",
        dtype="bfloat16",
        quantize="bitsandbytes-4bit",
        gpu_memory_map={3: 10.0, 1: 20.0},
        primary_gpu=3,
        cpu_memory=4.0,
        offload_folder="/o",
        peft_adapters={None: "/x"},
        peft_merge=True,
        compile=True,
        batch_invariant=False,
        speculative="draft",
    )
    assert list(config.gpu_memory_map) == [3, 1]  # the order given: the device map fills the primary first
    assert {f.name for f in fields(LoadConfig)} <= set(dir(settings))
    draft = config.draft("/d")  # the speculative draft: loaded like the model, without its GGUF, tokenizer, PEFT
    assert (draft.model, draft.tokenizer, draft.gguf_file, draft.peft_adapters) == ("/d", None, None, {})
    assert (draft.device, draft.dtype, draft.quantize, draft.gpu_memory_map, draft.cache_dir) == (
        "cuda",
        "bfloat16",
        "bitsandbytes-4bit",
        {3: 10.0, 1: 20.0},
        "/c",
    )


def test_every_setting_is_documented():
    """docs/configuration.md has a row for every field: its env var and its flag."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`SAKER_{name.upper()}`" in doc, name
        assert f"`--{name.replace('_', '-')}" in doc, name


def test_an_unknown_flag_shows_the_subcommands_usage():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--bogus"], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m app serve") and "unrecognized arguments: --bogus" in done.stderr
