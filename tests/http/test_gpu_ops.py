"""Out of memory on a real GPU (skipped without CUDA): a real CUDA allocation failure during a request is a
503, the memory of the failed request comes back, and the server goes on; /metrics reports GPU memory."""

from __future__ import annotations

import pytest
import torch

from conftest import make_settings, make_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

URL = "/v1/completions"


@pytest.fixture(scope="module")
def cuda_app(gpt2_dir):
    from app import create_app

    settings = make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", device="cuda", access_log="off")
    worker = make_worker(settings)
    assert worker.runner.input_device.type == "cuda"
    app = create_app(settings, worker=worker)
    app.config["TESTING"] = True
    return app


@pytest.mark.parametrize("stream", [False, True])
def test_real_cuda_out_of_memory_is_503_and_memory_comes_back(cuda_app, monkeypatch, stream):
    client = cuda_app.test_client()
    runner = cuda_app.extensions["saker.service"].worker.runner
    body = {
        "model": "tiny-gpt2",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "n": 4,
    }
    expected = client.post(URL, json=body).get_json()["choices"]
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()  # the block pool is reserved from the start, and stays
    step = "compiled_step" if runner.compiled_step is not None else "rows_step"  # the decode step in use
    real = getattr(runner, step)
    calls = {"n": 0}

    def decode_that_runs_out(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            ballast = torch.ones(64, 1024, 1024, device="cuda")  # 256 MiB the failed request holds
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: a real CUDA OOM
            del ballast
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, step, decode_that_runs_out)
    resp = client.post(URL, json={**body, "stream": stream})
    if stream:
        assert resp.status_code == 200
        frames = [f for f in resp.get_data(as_text=True).split("\n\n") if f]
        assert frames[-1] == "data: [DONE]" and '"out_of_memory"' in frames[-2]
    else:
        assert resp.status_code == 503, resp.get_data(as_text=True)
        assert resp.get_json()["error"]["code"] == "out_of_memory"
    monkeypatch.undo()
    torch.cuda.synchronize()
    # the failed request's tensors (its rows' blocks, the ballast) are gone, and the allocator gave the ballast's
    # 256 MiB back to the driver (the block pool, reserved at start-up, is the rest of what stays reserved)
    assert torch.cuda.memory_allocated() <= baseline + (1 << 20)
    assert torch.cuda.memory_reserved() < reserved + 64 * (1 << 20)
    again = client.post(URL, json=body)
    assert again.status_code == 200 and again.get_json()["choices"] == expected
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'saker_gpu_memory_allocated_bytes{device="0"}' in metrics
