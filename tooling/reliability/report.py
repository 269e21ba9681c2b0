"""The table printed at the end of a run."""

from __future__ import annotations


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def format_table(report: dict) -> str:
    lines = [
        f"saker reliability ({'quick' if report['plan']['quick'] else 'full'}), "
        f"{report['server']['model']}, {report['machine']['cpus']} CPUs, {report['started']}",
        "",
    ]
    load = report.get("load")
    if load and "levels" in load:
        lines.append("load with drops    clients  sent  answered  429/503  dropped  lost  settled  p50 s  max s")
        for x in load["levels"]:
            lines.append(
                f"                   {x['clients']:>7}  {x['sent']:>4}  {x['answered']:>8}  "
                f"{x['busy_429_503']:>7}  {x['dropped_by_us']:>7}  {x['lost']:>4}  "
                f"{'yes' if x['settled'] else 'NO':>7}  {x['answered_latency_p50_s'] or '-':>5}  "
                f"{x['answered_latency_max_s'] or '-':>5}"
            )
        lines.append("")
    bad = report.get("bad")
    if bad and "tried" in bad:
        lines.append(
            f"bad inputs         {bad['tried']} tried; by status {bad['by_status']}; "
            f"5xx {bad['answers_5xx']}; "
            f"errors not JSON {bad['errors_not_json']}; unanswered {bad['unexpected_no_answer']}; "
            f"normal request after: {bad['normal_request_after']}"
        )
        lines.append("")
    slow = report.get("slow")
    if slow and "slow_clients" in slow:
        lines.append(
            f"slow clients       {slow['slow_clients']} connections, one header line every "
            f"{slow['line_every_s']:g} s for {slow['seconds']:g} s: held {slow['held_at_once']} at once "
            f"({slow['connections_opened']} opened, answers {slow['answers_to_slow_clients']}); normal "
            f"requests {slow['normal_answered']}/{slow['normal_sent']} answered; completion p50 "
            f"{slow['completion_latency_p50_s']} s, max {slow['completion_latency_max_s']} s (alone "
            f"{slow['completion_latency_alone_p50_s']} s); /health max {slow['health_latency_max_s']} s"
        )
        lines.append("")
    memory = report.get("memory")
    for part in [memory, memory.get("small_budget")] if memory and "variants" in memory else []:
        if not part:
            continue
        lines.append(
            f"memory             KV budget {part['kv_budget_tokens']} tokens x "
            f"{part['kv_bytes_per_token']} B = "
            f"{_mib(part['kv_budget_bytes'])}; weights {_mib(part['weights_bytes_on_disk'])}; RSS at ready "
            f"{_mib(part['rss_at_ready'])}; bound {_mib(part['bound_bytes'])}"
        )
        for name, v in part["variants"].items():
            lines.append(
                f"  {name:<16} {v['status']} in {v['seconds']} s; RSS {_mib(v['baseline_rss'])} -> peak "
                f"{_mib(v['peak_rss'])} (+{_mib(v['peak_minus_baseline'])}; its KV "
                f"{_mib(v['request_kv_bytes'])}) -> after {_mib(v['after_rss'])}"
            )
        lines.append("")
    close = report.get("close")
    if close and "cases" in close:
        lines.append(
            f"client close       one decode step {close['decode_step_ms']} ms, one prefill chunk "
            f"({close['prefill_chunk_tokens']} tokens) {close['prefill_chunk_ms']} ms"
        )
        for name, c in close["cases"].items():
            if c.get("finished_before_close"):
                lines.append(f"  {name:<17} finished before the close (not measured)")
                continue
            if c.get("finished_before_noticed"):
                lines.append(
                    f"  {name:<17} closed after {c['seconds_open']} s, not noticed: ran to its end "
                    f"({c['access_completion_tokens']} tokens), {c['ran_on_after_close_s']} s after the close"
                )
                continue
            lines.append(
                f"  {name:<17} closed in {c['phase']} after {c['seconds_open']} s: running 0 after "
                f"{c['stop_s_metrics']} s, log line after {c['stop_s_log']} s"
                + (f", {c['tokens_after_close']} tokens after the close" if "tokens_after_close" in c else "")
            )
        lines.append("")
    wedge = report.get("wedge")
    if wedge and "wide" in wedge:
        wide = wedge["wide"]
        lines.append(f"wide requests      n = best_of = {wide['n']}   max_tokens  alone              beside traffic")
        beside = {(c["route"], c["max_tokens"]): c for c in wide["beside_traffic"]}
        for c in wide["alone"]:
            other = beside.get((c["route"], c["max_tokens"]))
            lines.append(f"  {c['route']:<29} {c['max_tokens']:>10}  {_wide(c):<17}  {_wide(other) if other else '-'}")
        t = wide["traffic"]
        lines.append(
            f"  beside them: {t['clients']} clients sent {t['sent']}, answered {t['answered']}, busy "
            f"{t['busy_429_503']}, not answered {t['lost'] + t['failed_clean'] + t['refused_400']}; afterwards "
            f"settled {'yes' if wide['settled'] else 'NO'}, greedy {'same' if wide['greedy_same'] else 'DIFFERENT'}, "
            f"repairs {wide['repairs_total']:g}"
        )
        for mode, f in wedge.get("faults", {}).items():
            lines.append(
                f"injected faults    {mode}: p = {f['fault_rate']:g} for {f['seconds']:g} s, {f['clients']} clients: "
                f"sent {f['sent']}, 200 whole {f['answered']}, failed clean {f['failed_clean']} "
                f"({f['failed_in_stream']} in a stream), busy {f['busy_429_503']}, lost {f['lost']}; "
                f"{f['step_failures']:g} failed steps"
            )
            lines.append(
                f"  afterwards: settled {'yes' if f['settled'] else 'NO'}, KV usage {f['kv_cache_usage_after']:g}, "
                f"repairs {f['repairs_total']:g}, /livez {f['livez']}, /health {f['health']}, greedy "
                f"{'same' if f['greedy_same'] else 'DIFFERENT'}, worker boots {f['workers_booted']}, exits "
                f"{f['worker_exits']}"
            )
        lines.append("")
    lines.append("goals")
    for g in report.get("goals", []):
        mark = "ok " if g["met"] else ("n/a" if g["met"] is None else "NOT")
        lines.append(
            f"  [{mark}] {g['section']:<7} {g['goal']}: {g['figure']}" + ("" if g["correctness"] else "  (reported)")
        )
    return "\n".join(lines)


def _wide(case: dict) -> str:
    """A wide request's answer: status, the n it ran with (when a KV 400 halved it), seconds."""
    halved = f" n={case['n_ran']}" if case["refused_kv_at"] else ""
    return f"{case['status']}{halved} in {case['seconds']} s" + ("" if case["ok"] else " NOT OK")
