"""Section bad: the corpus of malformed and hostile requests over raw sockets; no answer >= 500, every error
answer JSON in the OpenAI shape, and a normal request answered 200 afterwards."""

from __future__ import annotations

from collections import Counter

from tooling.reliability.bad_bodies import Case, body_cases
from tooling.reliability.bad_http import http_cases
from tooling.reliability.base import RunBase
from tooling.reliability.wire import build, exchange, is_error_object, post_json


def bad_input_corpus(model: str, quick: bool = False, context: int = 2048) -> list[Case]:
    """Malformed and hostile requests (each a Case of raw bytes). A body is sent with Connection: close."""
    return body_cases(model, quick, context) + http_cases(model)


class BadSection(RunBase):
    """``section_bad``: every case of the corpus on a connection of its own, then a normal request."""

    def bad_cases(self) -> list["Case"]:
        return bad_input_corpus(self.name, quick=self.plan.values == "quick", context=self.context)

    def section_bad(self) -> dict:
        cases = self.bad_cases()
        by_status: Counter = Counter()
        by_group: dict[str, Counter] = {}
        failures: list[dict] = []
        unanswered: list[str] = []
        slowest: list[tuple[float, str]] = []
        growth: list[tuple[int, str]] = []
        rss = self.server.rss_bytes() if self.server else 0
        for case in cases:
            answer = exchange(self.port, case.data, shut=case.shut, timeout=case.timeout, pause=case.pause)
            if self.server:
                now = self.server.rss_bytes()
                growth.append((now - rss, case.name))
                rss = now
            status = answer.status
            key = str(status) if status is not None else "no answer"
            by_status[key] += 1
            by_group.setdefault(case.group, Counter())[key] += 1
            slowest.append((answer.seconds, case.name))
            problem = None
            if status is None:
                unanswered.append(case.name)
                if not case.may_close:
                    problem = f"no answer ({answer.error or 'closed'})"
            elif status >= 500 and status not in case.allowed:
                problem = "5xx"
            elif status >= 400:
                if answer.headers.get("content-type", "").split(";")[
                    0
                ].strip() != "application/json" or not is_error_object(answer.json()):
                    problem = "error answer not JSON in the OpenAI shape"
            if problem:
                failures.append(
                    {
                        "case": case.name,
                        "group": case.group,
                        "problem": problem,
                        "status": status,
                        "answer": answer.body[:300].decode("utf-8", "replace"),
                        "request": case.preview(),
                    }
                )
        normal, _ = post_json(self.port, "/v1/completions", {"model": self.name, "prompt": "Hello", "max_tokens": 4})
        health = exchange(self.port, build("GET", "/health"))
        five = sum(1 for f in failures if f["problem"] == "5xx")
        allowed = [c.name for c in cases if c.allowed]
        not_json = sum(1 for f in failures if f["problem"].startswith("error answer"))
        no_answer = sum(1 for f in failures if f["problem"].startswith("no answer"))
        result = {
            "tried": len(cases),
            "by_status": dict(sorted(by_status.items())),
            "by_group": {g: dict(sorted(c.items())) for g, c in by_group.items()},
            "answers_5xx": five,
            "answers_5xx_allowed": allowed,
            "errors_not_json": not_json,
            "unexpected_no_answer": no_answer,
            "closed_without_answer": unanswered,
            "normal_request_after": normal.status,
            "health_after": health.status,
            "slowest": [{"case": n, "seconds": round(s, 2)} for s, n in sorted(slowest, reverse=True)[:5]],
            "rss_growth_largest": [{"case": n, "bytes": b} for b, n in sorted(growth, reverse=True)[:5]],
            "failures": failures[:40],
        }
        self.goal(
            "bad",
            "no answer >= 500 (besides 501 for an unknown transfer coding, RFC 9112 6.1)",
            five == 0,
            f"{five} of {len(cases)}",
            True,
        )
        self.goal(
            "bad",
            "every error answer JSON in the OpenAI shape",
            not_json == 0 and no_answer == 0,
            f"{not_json} not JSON, {no_answer} unanswered",
            True,
        )
        self.goal(
            "bad",
            "a normal request answered 200 afterwards",
            normal.status == 200 and health.status == 200,
            f"completion {normal.status}, /health {health.status}",
            True,
        )
        return result
