"""The machine the bench runs on: what it is (CPU, torch, GPUs) and how much of its CPU other processes take while
the bench measures (shared machines)."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# the instruction sets that decide what the CPU's kernels can use (torch's, vLLM's, llama.cpp's, ours)
FLAG_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4", "vnni", "bf16")


def cpu_flags() -> list[str]:
    """The CPU's instruction-set flags of interest (AVX, AVX2, FMA, AVX-512 and its kinds, AMX, ...), from the first
    ``flags`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(FLAG_PREFIXES))
    except OSError:
        pass
    return []


class CpuMonitor:
    """How much of the machine's CPU went to processes other than the bench and its servers: the honest noise
    figure of a run on a shared machine. Ours = this process and its descendants (reaped children count through
    their parents' cutime/cstime); busy = /proc/stat's non-idle time. Steal is the hypervisor's share."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.cores = os.cpu_count() or 1

    @staticmethod
    def _system() -> tuple[int, int]:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return user + nice + system + irq + softirq, steal

    def _ours(self) -> int:
        stats: dict[int, tuple[int, int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "stat").read_text()
            except OSError:
                continue
            rest = raw[raw.rindex(")") + 2 :].split()
            # fields after the name: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based from pid
            stats[int(entry.name)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        total, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in stats:
                total += stats[pid][1]
            todo.extend(children.get(pid, []))
        return total

    def snapshot(self) -> tuple[float, int, int, int]:
        busy, steal = self._system()
        return time.perf_counter(), busy, steal, self._ours()

    def since(self, snap: tuple[float, int, int, int]) -> dict:
        now = self.snapshot()
        capacity = (now[0] - snap[0]) * self.cores * self.tick
        if capacity <= 0:
            return {}
        foreign = max(0, (now[1] - snap[1]) - (now[3] - snap[3]))
        # clock ticks are coarse (1/CLK_TCK s): in a short window one stray tick reads as a large share
        share = foreign / capacity if foreign >= 3 else 0.0
        return {
            "foreign_cpu_share": round(min(1.0, share), 3),
            "steal_share": round((now[2] - snap[2]) / capacity, 3),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }

    def available(self) -> bool:
        try:
            self.snapshot()
            return True
        except (OSError, ValueError, IndexError):
            return False


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    info = {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(OSError, ValueError):
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
