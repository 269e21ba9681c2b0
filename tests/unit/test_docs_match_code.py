"""The README and docs/ read against the code, so that the next drift fails ``make test``: every ``SAKER_*`` name is
a setting and every setting has its row in docs/configuration.md (env var, flags, default); every flag the docs give
a saker command exists on that command; every repository path they name exists; every request field docs/api.md's
tables list is a field of its request schema, and every schema field is documented; what api.md says of ``null``
holds; every markdown table has the same number of cells in each row. (docs/architecture.md's file map and code
names: test_architecture_map.py.)"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import re
from functools import cache
from pathlib import Path

import pytest

from app.protocol import ChatCompletionRequest, CompletionRequest
from app.protocol.tokenization import TokenizeRequest
from app.responses.request import ResponsesRequest
from app.responses.to_chat import PASSED_TO_CHAT
from app.settings import REMOVED, Settings, add_settings_arguments

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = ROOT / "docs" / "configuration.md"
API = ROOT / "docs" / "api.md"


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def split_row(line: str) -> list[str]:
    """A table row's cells: split at every ``|`` not escaped as ``\\|`` (GitHub splits inside code spans too)."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", inner)]


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def tables(text: str) -> list[tuple[int, list[list[str]]]]:
    """(line of the header, rows as cells, header first, the delimiter row left out) of each markdown table."""
    lines = outside_fences(text)
    found, i = [], 0
    while i < len(lines):
        number, line = lines[i]
        following = lines[i + 1][1] if i + 1 < len(lines) else ""
        if line.lstrip().startswith("|") and re.fullmatch(r"\s*\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", following):
            rows, j = [split_row(line)], i + 2
            while j < len(lines) and lines[j][1].lstrip().startswith("|") and lines[j][0] == lines[j - 1][0] + 1:
                rows.append(split_row(lines[j][1]))
                j += 1
            found.append((number, rows))
            i = j
        else:
            i += 1
    return found


def section(text: str, title: str, level: str = "## ") -> str:
    """The text under the heading ``title`` (exact heading line) down to the next heading of the same level."""
    start = text.index(f"\n{level}{title}\n")
    end = text.find(f"\n{level}", start + 1)
    return text[start : end if end != -1 else len(text)]


def code_names(cell: str) -> list[str]:
    """The bare identifiers in a cell's code spans (``model``, not ``{"type": ...}``)."""
    return [name for name in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"[a-z_][a-z0-9_]*", name)]


# -- settings --------------------------------------------------------------------------------------------------------
SETTING_NAMES = {f"SAKER_{name.upper()}" for name in Settings.model_fields}


def saker_names(text: str) -> set[str]:
    """``SAKER_*`` names in a text, except inside the quoted start-up error for an unknown one (a typo shown on
    purpose: ``saker: unknown setting SAKER_MODLE``)."""
    text = re.sub(r"unknown setting SAKER_\w+", "", text)
    return set(re.findall(r"\bSAKER_[A-Z0-9_]*[A-Z0-9]\b", text))


def test_every_saker_name_the_docs_and_deploy_files_use_is_a_setting():
    """An exported ``SAKER_`` variable that is not a setting stops saker's start, so the docs may name no other
    (removed settings are named only to say what replaced them: ``settings.REMOVED``)."""
    files = [*DOCS, ROOT / "Dockerfile", ROOT / "Makefile", ROOT / "gunicorn.conf.py"]
    files += [Path(p) for p in sorted(glob.glob(str(ROOT / "deploy" / "**" / "*"), recursive=True))]
    files += [Path(p) for p in sorted(glob.glob(str(ROOT / "scripts" / "**" / "*"), recursive=True))]
    unknown = {}
    for path in files:
        if path.is_file():
            names = saker_names(path.read_text(errors="replace")) - SETTING_NAMES - set(REMOVED)
            if names:
                unknown[rel(path)] = sorted(names)
    assert not unknown, f"SAKER_ names that are not settings (add the setting, or rename): {unknown}"


def settings_rows() -> dict[str, list[str]]:
    """docs/configuration.md's "All settings" table: field name -> its cells."""
    rows = {}
    for _, table in tables(section(CONFIGURATION.read_text(), "All settings")):
        for cells in table[1:]:
            rows[cells[0].strip("`")] = cells
    return rows


def expected_flags(name: str) -> set[str]:
    flag = "--" + name.replace("_", "-")
    return {flag, "--no-" + flag[2:]} if Settings.model_fields[name].annotation is bool else {flag}


def test_every_setting_has_its_row_in_configuration_md():
    rows = settings_rows()
    missing = sorted(set(Settings.model_fields) - set(rows))
    assert not missing, f"settings without a row in docs/configuration.md's table: {missing}"
    stale = sorted(set(rows) - set(Settings.model_fields))
    assert not stale, f"docs/configuration.md has rows for settings that do not exist: {stale}"
    wrong = []
    for name, cells in rows.items():
        env, flags, default = cells[1], cells[2], cells[4]
        if env != f"`SAKER_{name.upper()}`":
            wrong.append(f"{name}: env var cell {env}")
        if set(re.findall(r"--[a-z][\w-]*", flags)) != expected_flags(name):
            wrong.append(f"{name}: flags {flags}, expected {sorted(expected_flags(name))}")
        value = Settings.model_fields[name].default
        shown = re.match(r"`([^`]*)`", default)
        if value is None:
            continue  # unset: the cell says what takes its place ("unset", "derived", "the model", ...)
        if isinstance(value, bool):
            ok = shown is not None and shown.group(1) == str(value).lower()
        elif isinstance(value, (int, float)):
            ok = shown is not None and re.fullmatch(r"-?[\d.]+", shown.group(1)) and float(shown.group(1)) == value
        else:
            ok = shown is not None and shown.group(1) == str(value)
        if not ok:
            wrong.append(f"{name}: default cell {default!r}, the code's default is {value!r}")
    assert not wrong, "docs/configuration.md disagrees with app/settings.py:\n" + "\n".join(wrong)


def test_defaults_the_prose_states_are_the_codes():
    """ "`SAKER_X` (N by default)" anywhere in the docs is the current default; an old one is written as history
    ("N by default when this was measured")."""
    wrong = []
    for path in DOCS:
        text = " ".join(path.read_text().split())
        for name, value, rest in re.findall(r"`SAKER_(\w+)`[,:]? \(?`?([\d,.]+)`?,? by default( when| then)?", text):
            default = Settings.model_fields[name.lower()].default if name.lower() in Settings.model_fields else None
            if not rest and default is not None and float(value.replace(",", "")) != float(default):
                wrong.append(f"{rel(path)}: SAKER_{name} {value} by default; the code's default is {default}")
    assert not wrong, "\n".join(wrong)


def test_serve_has_the_flags_configuration_md_gives():
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    flags = {s for action in parser._actions for s in action.option_strings}
    for name in Settings.model_fields:
        assert expected_flags(name) <= flags, name


# -- command-line flags ----------------------------------------------------------------------------------------------
@cache
def command_flags() -> dict[str, set[str]]:
    """Every flag of each saker command, from the parsers themselves."""
    from app import batch
    from tooling import chat_client, reliability
    from tooling.bench import cli as bench

    out = {}
    for command, add in {
        "serve": add_settings_arguments,
        "batch": batch.add_arguments,
        "chat": chat_client.add_arguments,
        "bench": bench.add_arguments,
        "reliability": reliability.add_arguments,
    }.items():
        parser = argparse.ArgumentParser()
        add(parser)
        out[command] = {s for action in parser._actions for s in action.option_strings}
    from tooling.bench import replicas

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        replicas.main(["--help"])  # builds its parser inside main: --help prints it and exits
    usage = help_text.getvalue().split("\n\n", 1)[0]  # the usage lines list every flag (no descriptions)
    out["replicas"] = set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", usage)) | {"-h", "--help"}
    return out


INVOCATION = re.compile(
    r"python -m tooling\.bench\.replicas\b|python -m app (serve|batch|chat|bench|reliability)\b"
    r"|make (bench|reliability|bench-replicas) (?:BENCH|RELIABILITY|REPLICA_BENCH)_ARGS="
)


def invocations(text: str) -> list[tuple[int, str, str]]:
    """(offset, command, the text of its arguments) of every saker command line in a document: the rest of an
    inline code span, or of a code line (continuation lines joined), up to a comment or another command."""
    out = []
    text = re.sub(r"\\\n\s*", " ", text)
    for match in INVOCATION.finditer(text):
        command = match.group(1) or match.group(2) or "replicas"
        command = {"bench-replicas": "replicas"}.get(command, command)
        line_start = text.rfind("\n", 0, match.start()) + 1
        line_end = text.find("\n", match.end())
        rest = text[match.end() : line_end if line_end != -1 else len(text)]
        if text[line_start : match.start()].count("`") % 2:  # inside an inline code span
            rest = rest.split("`", 1)[0]
        rest = re.split(r"\s#|;|&&|\|\||\s>|\s2>|\|\s+(?=[^\s-])|`", rest, maxsplit=1)[0]
        out.append((match.start(), command, rest))
    return out


def test_every_flag_the_docs_give_a_saker_command_exists():
    flags = command_flags()
    wrong = []
    for path in DOCS:
        text = path.read_text()
        calls = invocations(text)
        for _, command, args in calls:
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", args):
                if flag not in flags[command]:
                    wrong.append(f"{rel(path)}: {command} has no {flag} ({args.strip()[:80]})")
        # tables of flags: a column headed "flag(s)" or "argument" lists flags of the command last shown above it
        offsets = [m.start() for m in re.finditer(r"^", text, re.M)]
        for line, table in tables(text):
            columns = [i for i, head in enumerate(table[0]) if re.search(r"flag|argument", head, re.I)]
            before = [c for c in calls if c[0] < offsets[line - 1]]
            if not columns or not before:
                continue
            command = before[-1][1]
            for row in table[1:]:
                for i in columns:
                    for span in re.findall(r"`([^`]*)`", row[i] if i < len(row) else ""):
                        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", span):
                            if flag not in flags[command]:
                                wrong.append(f"{rel(path)}:{line}: {command} has no {flag} (table)")
    assert not wrong, "flags the docs give that the commands do not have:\n" + "\n".join(wrong)


# -- paths -----------------------------------------------------------------------------------------------------------
PATH = re.compile(
    r"(?<![\w./-])((?:app|tooling|tests|deploy|docs|scripts|\.ci)/[\w./{},*-]*[\w}*]/?)(`? at `[0-9a-f]{7,40}`)?"
)


def expand(path: str) -> list[str]:
    """Shell brace expansion: ``bench.{json,png}`` -> both names."""
    braces = re.search(r"\{([^{}]*)\}", path)
    if not braces:
        return [path]
    head, tail = path[: braces.start()], path[braces.end() :]
    return [p for alt in braces.group(1).split(",") for p in expand(head + alt + tail)]


def path_exists(path: str) -> bool:
    path = path.split("::")[0]
    if glob.glob(str(ROOT / path.rstrip("/"))):
        return True
    module, dot, name = path.rpartition(".")  # tooling/processes.GunicornServer: a name in a module
    source = ROOT / f"{module}.py"
    return bool(dot) and source.is_file() and re.search(rf"^(class|def) {name}\b|^{name} =", source.read_text(), re.M)


def test_every_path_the_docs_name_exists():
    """Paths under app/, tooling/, tests/, deploy/, docs/, scripts/ and .ci/ in the README and docs/ exist (globs and
    ``{a,b}`` expanded; ``module.Name`` is a name defined in that module). A path pinned to a commit (`path` at
    `abc1234`) is history and may be gone."""
    gone = []
    for doc in DOCS:
        text = doc.read_text()
        for match in PATH.finditer(text):
            if match.group(2):
                continue
            for path in expand(match.group(1)):
                if not path_exists(path):
                    gone.append(f"{rel(doc)}:{text.count(chr(10), 0, match.start()) + 1}: {path}")
    assert not gone, "paths the docs name that do not exist:\n" + "\n".join(gone)


# -- docs/api.md's request fields ------------------------------------------------------------------------------------
ENDPOINTS = {
    # api.md section: the schema whose fields its "Field | Type" tables list, and what else the route reads
    "POST /v1/completions": (CompletionRequest, set()),
    "POST /v1/chat/completions": (ChatCompletionRequest, set()),
    "POST /v1/responses": (ResponsesRequest, set(PASSED_TO_CHAT)),
    "POST /tokenize": (TokenizeRequest, set()),
}


def documented_fields(title: str) -> set[str]:
    names = set()
    for _, table in tables(section(API.read_text(), title)):
        if table[0][:2] == ["Field", "Type"]:
            for row in table[1:]:
                names.update(code_names(row[0]))
    return names


@pytest.mark.parametrize("title", ENDPOINTS)
def test_the_request_fields_api_md_lists_are_the_schemas(title):
    schema, read_from_body = ENDPOINTS[title]
    fields = set(schema.model_fields) | read_from_body
    listed = documented_fields(title)
    assert listed, f"docs/api.md has no request-field table under {title}"
    unknown = sorted(listed - fields)
    assert not unknown, f"docs/api.md lists fields {schema.__name__} does not have under {title}: {unknown}"
    text = section(API.read_text(), title)
    mentioned = set(re.findall(r"`([a-z_][a-z0-9_]*)`", text))
    undocumented = sorted(fields - mentioned)
    assert not undocumented, f"fields of {schema.__name__} that docs/api.md's {title} never names: {undocumented}"


def null_exceptions(title: str, pattern: str) -> list[str]:
    """The fields api.md names as the ones that may not be null, read from its own sentence."""
    sentence = re.search(pattern, " ".join(section(API.read_text(), title).split()))
    assert sentence, f"docs/api.md's {title} no longer says which fields may be null"
    return re.findall(r"`(\w+)`", sentence.group(1))


@pytest.mark.parametrize(
    "title, schema, body, pattern",
    [
        (
            "POST /v1/completions",
            CompletionRequest,
            {"prompt": "x"},
            r"Any field except (.*?) may be `null`",
        ),
        (
            "POST /v1/chat/completions",
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}]},
            r"`null` means the default except for (.*?), every violation",
        ),
    ],
)
def test_null_is_taken_where_api_md_says_so(title, schema, body, pattern):
    """api.md: "Any field except `prompt` may be `null`" (completions) and chat's list of exceptions. Each other
    field, sent as null, is accepted (it means its default)."""
    exceptions = null_exceptions(title, pattern)
    assert set(exceptions) <= set(schema.model_fields), exceptions
    refused = []
    for name in schema.model_fields:
        if name in exceptions:
            continue
        try:
            schema.model_validate({**body, name: None})
        except Exception as exc:  # a pydantic ValidationError or the schema's own InvalidRequestError
            refused.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
    assert not refused, f"{title}: fields docs/api.md says take null, refused:\n" + "\n".join(refused)


# -- markdown tables -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_table_row_has_the_headers_cell_count(doc):
    """A ``|`` inside a cell must be written ``\\|`` (code spans included), or the row splits into more cells."""
    wrong = []
    for line, table in tables(doc.read_text()):
        width = len(table[0])
        for offset, row in enumerate(table[1:]):
            if len(row) != width:
                wrong.append(f"line {line + 2 + offset}: {len(row)} cells, the header has {width}")
    assert not wrong, f"{rel(doc)}: " + "; ".join(wrong)
