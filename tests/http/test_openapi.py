"""/openapi.json: a valid OpenAPI 3.1 document (openapi-spec-validator), and the server agrees with it: a
schema-driven fuzzer (schemathesis) sends a bounded number of generated requests to every operation, in-process
on the tiny GPT-2, and checks no server errors and answers that match their declared schemas and statuses."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from conftest import make_settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "fuzz-key"  # the document declares bearer auth on the API routes: the server has a key


@pytest.fixture(scope="module")
def fuzz_app(gpt2_dir, gpt2_worker):
    from app import create_app

    app = create_app(
        make_settings(
            model=str(gpt2_dir), served_model_name="tiny-gpt2", max_n=4, max_best_of=4, max_logprobs=5, api_keys=KEY
        ),
        worker=gpt2_worker,
    )
    app.config["TESTING"] = True
    return app


def test_the_document_is_valid_openapi_31(fuzz_app):
    from openapi_spec_validator import validate

    document = fuzz_app.test_client().get("/openapi.json").get_json()
    validate(document)
    assert document["openapi"] == "3.1.0"


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_wsgi("/openapi.json", fuzz_app)


# A request can be valid field by field and still a 400 for rules across fields or about the model, which a
# JSON schema cannot state (stream_options without stream, min_tokens above max_tokens, best_of below n, token
# ids outside the vocabulary, prompts past the context): the "positive data is accepted" check is left out; every
# other check runs (no 5xx, declared statuses and content types, answers matching their schemas).
CROSS_FIELD = [schemathesis.checks.positive_data_acceptance]


def shorten(case) -> None:
    """Generated requests may ask for hundreds of thousands of tokens on a 2-core machine: keep them short."""
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 4:
                case.body[key] = 4


@pytest.mark.slow
def test_the_server_agrees_with_its_document(api_schema):
    """Every operation (schemathesis 4 through hypothesis directly: its pytest plugin does not run under
    pytest 9): bounded examples each, all of schemathesis' checks (no 5xx, statuses, content types, answers
    matching their schemas)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        def run(case):
            shorten(case)
            case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, excluded_checks=CROSS_FIELD)

        run()
