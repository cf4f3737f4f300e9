"""The server fuzzed against its own OpenAPI schema (schemathesis, schema-valid and schema-invalid
requests): no 5xx, no status, content type, header or body the schema does not declare, invalid
data refused, and afterwards no slot or page held and greedy tokens as on a fresh server.

The tiny random model on the numpy backend, served in this process. CI runs a bounded number of
cases per operation (`NUMBA_VLLM_FUZZ_EXAMPLES`, default 20); `make fuzz` runs thousands.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from numba_vllm import LLM, SamplingParams  # noqa: E402
from numba_vllm.model.config import ModelConfig  # noqa: E402
from tests.helpers.server import TINY_NAME, M, ServerThread  # noqa: E402
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("NUMBA_VLLM_FUZZ_EXAMPLES", "20"))  # cases per operation in the fuzzing phase
MAX_LEN = 256
PROBE = [4, 5, 6]
STATUSES: Counter = Counter()  # (mode, status) -> cases: the run's figures, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    cfg = tiny_config_dict(max_position_embeddings=MAX_LEN)
    return write_checkpoint(tmp_path_factory.mktemp("fuzz"), cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


@pytest.fixture(scope="module")
def fuzz_server(fuzz_dir):
    server = ServerThread(LLM(str(fuzz_dir), backend="numpy", max_num_seqs=4).engine, [TINY_NAME])
    yield server
    server.close()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_server_keeps_to_its_schema(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not len(operation.body):
            continue  # a GET has nothing to get wrong (any string is a model name)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def keeps_to_the_schema(case):
            # Every check but "schema-valid data is accepted": the schema cannot say everything the server
            # refuses with a 400 (ranges, a prompt too long, text for a model without a tokenizer).
            response = case.call(timeout=60)
            STATUSES[mode.value, response.status_code] += 1
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

        keeps_to_the_schema()


def test_after_the_fuzzing_nothing_is_held_and_greedy_is_unchanged(fuzz_dir, fuzz_server):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(fuzz_dir), backend="numpy").generate([PROBE], params, use_tqdm=False)[0].outputs[0].token_ids
    r = fuzz_server.client().completions.create(
        model=TINY_NAME, prompt=PROBE, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    assert r.choices[0].model_extra["token_ids"] == want
    m = fuzz_server.wait_idle()
    assert m[M + "kv_cache_pages_used"] == 0 and m[M + "num_requests_running"] == 0 and m[M + "num_requests_waiting"] == 0
    total = sum(STATUSES.values())
    by_status = ", ".join(f"{mode} {status}: {n}" for (mode, status), n in sorted(STATUSES.items()))
    print(f"\nfuzz: {total} requests ({by_status}); {int(m[M + 'engine_steps_total'])} engine steps")
