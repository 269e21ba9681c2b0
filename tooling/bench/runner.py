"""One run of the suite (``Bench``): the servers it starts, the order of the parts, the repetitions that other
processes disturbed (set aside and replaced within a part's budget), and the report's JSON."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from tooling.bench import parts, profile
from tooling.bench.client import Client
from tooling.bench.machine import CpuMonitor, machine_info
from tooling.bench.models import GPT2_SMALL, GPT2_TINY, PROMPT_TEXT, ModelSpec, load_reference, model_meta, prompt_ids
from tooling.bench.plan import CLEAN_SHARE, GOALS, SCHEMA, Plan
from tooling.bench.server import Server, batch_env, settings_fields

# the parts that run on the main server (the --size model), in this order; the others start servers of their own
MAIN_SERVER_PARTS = ("A", "T", "B", "L", "R")


class Bench:
    def __init__(self, args: argparse.Namespace, selected: tuple[str, ...]):
        self.args = args
        self.plan = Plan.quick() if args.quick else Plan()
        self.parts = selected
        self.external = args.url is not None
        self.cache_dir = Path(args.cache_dir).expanduser().resolve()
        self.out_dir = Path(args.out_dir).expanduser().resolve()
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.servers: list[Server] = []
        self.server_info: dict[str, Any] = {}
        self.models: dict[str, Any] = {}
        self.threads = args.threads
        self._refs: dict[str, Any] = {}
        self.log_lines: list[str] = []
        # set by the run: the main server's client, its model name and (ours) the model folder
        self.main_client: Client | None = None
        self.main_name = ""
        self.main_path: Path | None = None
        self.tiny_server: Server | None = None  # the main server when it is the tiny model: C reuses it
        monitor = CpuMonitor()
        # with --url the server is not ours: its CPU would read as other processes', so nothing is set aside
        self.cpu = monitor if monitor.available() and not self.external else None

    # -- helpers ------------------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        line = f"[bench {time.strftime('%H:%M:%S')}] {message}"
        self.log_lines.append(line)
        print(line, file=sys.stderr, flush=True)

    @staticmethod
    def settle() -> None:
        """Between the server's turn and the in-process turn: let the other side's OpenMP threads go idle."""
        time.sleep(0.05)

    def main_spec(self) -> ModelSpec:
        return GPT2_TINY if self.args.size == "tiny" else GPT2_SMALL

    def server_env(self, device: str = "cpu", dtype: str = "float32") -> dict[str, str]:
        fields = settings_fields()
        env = {
            "SAKER_DEVICE": device,
            "SAKER_DTYPE": dtype,
            "SAKER_THREADS": str(3 * max(max(self.plan.l_levels), self.plan.b_clients) + 4),
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
        }
        if "max_queue" in fields:  # 16 clients must queue, not be turned away with 429
            env["SAKER_MAX_QUEUE"] = str(2 * max(max(self.plan.l_levels), self.plan.b_clients))
        if "prefix_cache_tokens" in fields:  # every part repeats one prompt: measure its prefill, not a cache
            env["SAKER_PREFIX_CACHE_TOKENS"] = "0"
        if self.args.max_batch_size is not None:
            env.update(batch_env(self.args.max_batch_size))
        for item in self.args.server_env or []:
            key, _, value = item.partition("=")
            env[key] = value
        return env

    def start_server(
        self,
        model_dir: Path,
        name: str,
        device: str = "cpu",
        dtype: str = "float32",
        extra_env: dict[str, str] | None = None,
    ) -> Server:
        env = {**self.server_env(device, dtype), **(extra_env or {})}
        self.log(f"starting gunicorn for {name} ({', '.join(f'{k}={v}' for k, v in env.items())})")
        start = time.perf_counter()
        server = Server(model_dir, name, env, self.cache_dir / "logs")
        self.servers.append(server)
        server.wait_ready()
        self.log(f"gunicorn ready in {time.perf_counter() - start:.1f} s on {server.url}")
        fields = settings_fields()
        info = {
            "url": server.url,
            "model": name,
            "env": env,
            "ready_s": round(time.perf_counter() - start, 1),
        }
        if "max_batch_rows" in fields:  # the decode batch's rows (the JSON's key from when one setting held both)
            from app.settings import Settings

            default = Settings.model_fields["max_batch_rows"].default
            info["max_batch_size"] = int(
                env.get("SAKER_MAX_BATCH_ROWS", os.environ.get("SAKER_MAX_BATCH_ROWS", default))
            )
        self.server_info[name] = info
        return server

    def repeat(self, fn: Callable[[int], Any], reps: int, extra: int, budget: float) -> list[tuple[Any, float | None]]:
        """Run ``fn(i)`` ``reps`` times; repetitions disturbed by other processes (over CLEAN_SHARE of the CPU)
        are replaced by up to ``extra`` more while the part has run less than ``budget`` seconds. Returns
        (value, foreign CPU share) per repetition."""
        out: list[tuple[Any, float | None]] = []
        clean = 0
        start = time.perf_counter()
        while len(out) < reps or (len(out) < reps + extra and time.perf_counter() - start < budget):
            snap = self.cpu.snapshot() if self.cpu else None
            value = fn(len(out))
            share = self.cpu.since(snap).get("foreign_cpu_share") if snap is not None else None
            out.append((value, share))
            clean += share is None or share <= CLEAN_SHARE
            if clean >= reps:
                break
            if share is not None and share > CLEAN_SHARE:
                self.log(f"  repetition {len(out)}: other processes used {share:.0%} of the CPU; not counted")
        return out

    @staticmethod
    def select(runs: list[tuple[Any, float | None]]) -> tuple[list[Any], dict]:
        """The quiet repetitions when there are at least 3 of them, else all; and what was chosen."""
        clean = [v for v, share in runs if share is None or share <= CLEAN_SHARE]
        used = clean if len(clean) >= 3 or len(clean) == len(runs) else [v for v, _ in runs]
        info = {
            "repetitions": len(runs),
            "used": len(used),
            "quiet": len(clean),
            "threshold": CLEAN_SHARE,
            "foreign_cpu_share": [share for _, share in runs],
        }
        return used, info

    def wait_idle(self, limit: float) -> float:
        """Wait (up to ``limit`` s) until other processes use under 10 % of the CPU over 5 s."""
        start = time.perf_counter()
        while True:
            snap = self.cpu.snapshot()
            time.sleep(5.0)
            share = self.cpu.since(snap).get("foreign_cpu_share", 0)
            waited = time.perf_counter() - start
            if share < 0.1:
                return round(waited, 1)
            if waited >= limit:
                self.log(f"still busy after {waited:.0f} s ({share:.0%} of the CPU used by others); going on")
                return round(waited, 1)
            self.log(f"waiting for a quiet machine: others use {share:.0%} of the CPU")

    def stop_server(self, server: Server) -> None:
        server.stop()
        if server in self.servers:
            self.servers.remove(server)

    def reference(self, key: str, path: Path, dtype: str = "float32", device: str = "cpu"):
        if key not in self._refs:
            self._refs[key] = load_reference(path, dtype, device)
        return self._refs[key]

    def drop_reference(self, key: str) -> None:
        self._refs.pop(key, None)

    def record_model(self, key: str, spec: ModelSpec, path: Path) -> None:
        self.models[key] = model_meta(spec, path)

    def run_part(self, part: str, fn: Callable[[], dict | None] | None = None) -> None:
        """Run part ``part`` (its module's ``run``, or ``fn``) and keep its result, or its error."""
        self.log(f"part {part} ...")
        start = time.perf_counter()
        snap = self.cpu.snapshot() if self.cpu else None
        try:
            result = fn() if fn is not None else parts.module(part).run(self)
            if result is not None:
                result["seconds"] = round(time.perf_counter() - start, 1)
                if snap is not None:
                    result["cpu"] = self.cpu.since(snap)
                    share = result["cpu"].get("foreign_cpu_share", 0)
                    if share > 0.05:
                        self.log(f"warning: other processes used {share:.0%} of the CPU during part {part}")
                self.results[part] = result
        except Exception as exc:
            import traceback

            self.errors[part] = f"{type(exc).__name__}: {exc}"
            self.log(f"part {part} failed: {self.errors[part]}")
            traceback.print_exc(file=sys.stderr)
        self.log(f"part {part} done in {time.perf_counter() - start:.1f} s")

    def profile(self, server: Server, client: Client, body: dict, reps: int, label: str) -> None:
        """``--profile``: py-spy on ``server`` for ``reps`` more requests, as the pseudo-part profile_<label>."""
        self.run_part(
            f"profile_{label}", lambda: profile.record(server, client, body, reps, label, self.out_dir, self.log)
        )

    # -- orchestration ---------------------------------------------------------------------------------------
    def run(self) -> dict:
        import torch

        started = time.time()
        torch.set_num_threads(self.threads)
        machine = machine_info(self.threads)
        self.log(
            f"machine: {machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
            f"{self.threads} torch threads, load average {machine['load_average_start']}"
        )
        if self.args.wait_idle and self.cpu:
            machine["waited_for_idle_s"] = self.wait_idle(self.args.wait_idle)
        if self.cpu:
            snap = self.cpu.snapshot()
            time.sleep(1.0)
            machine["foreign_cpu_share_before"] = self.cpu.since(snap).get("foreign_cpu_share")
            if machine["foreign_cpu_share_before"] > 0.1:
                self.log(
                    f"warning: other processes use {machine['foreign_cpu_share_before']:.0%} of the CPU; "
                    f"timings will be noisy (--wait-idle SECONDS waits for a quiet machine)"
                )
        run_snap = self.cpu.snapshot() if self.cpu else None
        try:
            main_parts = [p for p in MAIN_SERVER_PARTS if p in self.parts]
            if self.external:
                self._run_external(main_parts)
            else:
                self._run_ours(main_parts)
        finally:
            for server in list(self.servers):
                self.stop_server(server)
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        if run_snap is not None:
            machine["foreign_cpu_share_during_run"] = self.cpu.since(run_snap).get("foreign_cpu_share")
        return {
            "schema": SCHEMA,
            "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - started, 1),
            "quick": bool(self.args.quick),
            "target": self.args.url or "saker (started by the bench)",
            "parts": list(self.parts),
            "machine": machine,
            "plan": asdict(self.plan),
            "models": self.models,
            "servers": self.server_info,
            "goals": {k: {"op": op, "value": v} for k, (op, v) in GOALS.items()},
            "results": self.results,
            "errors": self.errors,
        }

    def _run_ours(self, main_parts: list[str]) -> None:
        from tooling.bench.models import ensure_model

        spec = self.main_spec()
        tiny_main = "C" in self.parts and spec is GPT2_TINY
        if main_parts or tiny_main:
            path = ensure_model(spec, self.cache_dir, self.log)
            self.record_model("main", spec, path)
        if main_parts:
            server = self.start_server(path, spec.name)
            try:
                self.main_client, self.main_name, self.main_path = Client(server.url), spec.name, path
                for part in main_parts:
                    self.run_part(part)
                if self.args.profile and "A" in self.parts:
                    body = self.body(self.plan.a_tokens)
                    self.profile(server, self.main_client, body, max(3, self.plan.a_reps // 2), "A")
            finally:
                if self.main_client is not None:
                    self.main_client.close()
                if tiny_main:
                    self.tiny_server = server  # reused by C
                else:
                    self.stop_server(server)
        for part in self.parts:
            if part not in MAIN_SERVER_PARTS:
                self.run_part(part)

    def _run_external(self, main_parts: list[str]) -> None:
        client = Client(self.args.url, self.args.api_key)
        name = self.args.model
        if not name:
            models = client.get_json("/v1/models")
            name = models["data"][0]["id"]
        self.server_info[name] = {"url": client.url, "model": name, "started_by_bench": False}
        self.main_client, self.main_name, self.main_path = client, name, None
        try:
            for part in main_parts:
                self.run_part(part)
            for part in self.parts:
                if part in MAIN_SERVER_PARTS:
                    continue
                if parts.BY_LETTER[part].with_url:
                    self.run_part(part)  # S: the given server's chat endpoint; its compile times are ours
                else:
                    self.errors[part] = f"{part} needs our own server and the model in-process (not with --url)"
        finally:
            client.close()  # this thread's kept-alive connection (else an unclosed socket: ResourceWarning)

    # -- request bodies ---------------------------------------------------------------------------------------
    def body(self, max_tokens: int, stream: bool = False, prompt: Any = None) -> dict:
        """A greedy completion request to the main server (``ignore_eos`` unless --no-ignore-eos)."""
        body: dict[str, Any] = {"model": self.main_name, "max_tokens": max_tokens, "temperature": 0}
        if prompt is None:
            prompt = self.main_prompt()
        body["prompt"] = prompt
        if not self.args.no_ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def main_prompt(self) -> Any:
        """The main server's prompt: exactly ``plan.prompt_tokens`` ids of ours, or text for a foreign server."""
        if self.external:
            return self.args.prompt or PROMPT_TEXT
        if not hasattr(self, "_prompt_ids"):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.main_path))
            self._prompt_ids = prompt_ids(tok, self.plan.prompt_tokens)
        return self._prompt_ids
