"""The CUDA serving path. Tests marked `gpu` need a CUDA device (run them with `pytest -m gpu` on the
device machine; bench/gpu_check.sh does): greedy speculation equals plain decoding on CUDA in fp32
(bf16 rounds differently across batch shapes), sampled speculation keeps the target's distribution,
and the Triton path's logits equal the CPU torch path's. The rest checks, on the CPU, how a device
and its default dtype are chosen and that the CPU-only layouts stay off other devices."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from specfleet_engine import loader
from specfleet_engine.model import TransposedLinear, transpose_linears
from specfleet_engine.quant import pack_linears
from specfleet_engine.testing import TINY_ARCHITECTURES, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def sibling(name: str):
    """A test module next to this one, loaded by path (tests are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_cuda_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_device_is_cuda_only_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loader.torch_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loader.torch_device("auto") == torch.device("cuda")
    assert loader.torch_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        loader.torch_device("tpu")


def test_default_dtype_is_bf16_on_cuda_and_fp32_on_the_cpu(tmp_path):
    assert loader.default_dtype(torch.device("cuda")) is torch.bfloat16
    assert loader.default_dtype(torch.device("cpu")) is torch.float32
    model = tiny_model()
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(model.args.to_hf_config()))
    save_file(loader.ours_to_hf_state_dict(model), tmp_path / "model.safetensors")
    loaded = loader.load_model(str(tmp_path), device="cpu")
    assert loaded.dtype is torch.float32 and loaded.device.type == "cpu"
    assert loader.load_model(str(tmp_path), torch.bfloat16, device="cpu").dtype is torch.bfloat16


def test_cpu_layouts_leave_a_model_on_another_device_alone():
    model = tiny_model().to("meta")  # not the CPU, and no GPU needed
    assert transpose_linears(model) is model
    assert type(model.layers[0].attention.wqkv) is torch.nn.Linear
    assert pack_linears(model) is False and type(model.output) is torch.nn.Linear
    assert isinstance(transpose_linears(tiny_model()).output, TransposedLinear)  # on the CPU they apply


def on(device: str, *more):
    """A device (and more parameters) for the tests below: "cuda" runs them in full on the device
    machine, "cpu" runs the same calls at a small size in CI, so that a helper they borrow cannot
    change under them unseen."""
    return pytest.param(device, *more, marks=[pytest.mark.gpu, cuda] if device == "cuda" else [],
                        id="-".join([device, *more]))


@pytest.mark.parametrize("device,arch", [on("cuda", a) for a in ("llama", "qwen2-bias", "mistral-window")]
                         + [on("cpu", "llama")])
def test_greedy_speculation_matches_plain_decoding_on_cuda_fp32(device, arch):
    lossless = sibling("test_lossless_greedy")
    target = tiny_model(seed=1, scale=4.0, **TINY_ARCHITECTURES[arch])
    proposers = lossless.proposers_for(target, device=device)
    assert next(target.parameters()).device.type == device
    lossless.check_speculation_matches_plain(target, proposers)


@pytest.mark.parametrize("device", [on("cuda"), on("cpu")])
@pytest.mark.parametrize("index", [0, 2])  # n-gram chain and tree (the draft model: the greedy test)
def test_sampled_speculation_follows_the_target_distribution_on_cuda(device, index):
    """On CUDA the full TV check; on the CPU one batch, the calls only (the CPU suite checks TV)."""
    sampled = sibling("test_lossless_sampling")
    case = sampled.CASES[index]
    models = sampled.make_models(device)
    assert models[0].output.weight.device.type == device
    n = sampled.N if device == "cuda" else sampled.BATCH
    dist, judged, draft_errors, *_ = sampled.sample_speculatively(models, case, n)
    assert draft_errors == 0
    assert judged[1, "accepted"] > 0 and judged[1, "rejected"] > 0, dict(judged)
    if device == "cuda":
        exact = sampled.exact_distribution(sampled.make_models()[0], sampled.SamplingParams(**case.params),
                                           list(case.prompt))  # on the CPU
        limit = sampled.tv_threshold(exact, n)
        tv = sampled.total_variation(dist.cpu(), exact)
        assert tv < limit, f"{case.name}: TV {tv:.4f} from the target distribution on CUDA (limit {limit:.4f})"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2-bias", "mha-rope-llama3"])
def test_triton_path_on_cuda_matches_the_cpu_torch_path(arch):
    triton_model = sibling("test_triton_model")
    torch.testing.assert_close(triton_model.verify_logits(arch, "cuda"), triton_model.verify_logits(arch, "cpu"),
                               atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@cuda
def test_bf16_engine_decodes_on_cuda():
    """bf16, the CUDA default: plain and n-gram decoding run on the device and emit every token (not
    compared token for token: bf16 rounds differently across batch shapes)."""
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import repeating_prompts

    engine = Engine(tiny_model(seed=1, scale=4.0).to("cuda", torch.bfloat16), max_kv_tokens=2048, block_size=16)
    for method in ("none", "ngram"):
        for prompt in repeating_prompts(3):
            seq = engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), method, 4)
            assert len(seq.output) == 16
    assert engine.cache.layers[0][0].is_cuda
