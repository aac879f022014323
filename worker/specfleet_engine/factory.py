"""Builds what an engine needs from names: the target model, its tokenizer and the proposers."""

from __future__ import annotations

import torch

from specfleet_api.enums import (
    SERVED_QUANTIZATIONS, Device, Dtype, Method, Quantization, not_served, resolve_device, resolve_dtype,
)

from .loader import load_model, load_tokenizer
from .model import fuse_layers, interleave_rope, transpose_linears
from .proposers import default_proposers, proposer_class
from .quant import pack_linears, quantize_int8

#: The torch dtype of each dtype specfleet_api serves (auto resolves to float32 first).
TORCH_DTYPES = {Dtype.FLOAT32.value: torch.float32, Dtype.BFLOAT16.value: torch.bfloat16}


def device_of(device: str = Device.AUTO.value) -> str:
    """The device engine.json's `device` names here: `auto` is cuda when torch sees a GPU."""
    return resolve_device(device, torch.cuda.is_available())


def prepare_model(name: str, dtype: str = "fp32", quantization: str = "none", fp32_kernel: bool = True,
                  device: str = Device.CPU.value):
    """The model `name` in `dtype` (a specfleet_api dtype or its short name: fp32, bf16; auto is
    the device's) with `quantization` applied, on `device` (resolved: cpu or cuda); ValueError
    names a dtype or quantization this engine does not serve."""
    dtype = resolve_dtype(dtype, device)
    if quantization not in SERVED_QUANTIZATIONS:
        raise ValueError(not_served("quantization", quantization, SERVED_QUANTIZATIONS))
    model = load_model(name, TORCH_DTYPES[dtype], device="cpu")  # CPU layouts first, moved last
    fp32 = dtype == Dtype.FLOAT32
    if fp32:
        interleave_rope(model)  # RoPE as one complex multiply
    if quantization == Quantization.INT8:
        quantize_int8(model)
    elif fp32 and device == Device.CPU and not (fp32_kernel and pack_linears(model)):  # our few-row kernel, or
        transpose_linears(model)  # the layout in which MKL's fp32 GEMM is fastest with few rows
    model = model.to(device)  # loaded on the CPU (a no-op there)
    fuse_layers(model)  # a few-row step's layers in one call, where the CPU kernel serves them all
    return model


def build_engine_parts(model_name: str, dtype: str = "fp32", quantization: str = "none",
                       draft_model: str | None = None, threads: int | None = None, device: str = Device.CPU.value,
                       ngram_corpus_tokens: int = 0, draft_head: str | None = None, medusa_head: str | None = None,
                       ngram_mix: bool = False):
    """(model, tokenizer, proposers) for `Engine(model, tokenizer, proposers=proposers)`; `device`,
    `ngram_corpus_tokens` and `ngram_mix` as engine.json's (device auto: cuda when torch sees a GPU);
    draft_head: an EAGLE head's directory (`specfleet train-draft`), refused when it does not fit;
    medusa_head: Medusa heads' directory (`specfleet train-draft --method medusa`), likewise."""
    if threads:
        torch.set_num_threads(threads)
    device = device_of(device)
    model = prepare_model(model_name, dtype, quantization, device=device)
    tokenizer = load_tokenizer(model_name)
    proposers = default_proposers(ngram_corpus_tokens)
    if draft_model:
        draft_class = proposer_class(Method.DRAFT_MODEL)
        draft_class.check_tokenizers(tokenizer, load_tokenizer(draft_model))
        proposers[Method.DRAFT_MODEL.value] = draft_class(prepare_model(draft_model, dtype, quantization, device=device))
    if draft_head:
        proposers[Method.EAGLE.value] = eagle_proposer(draft_head, model)
    if medusa_head:
        proposers[Method.MEDUSA.value] = medusa_proposer(medusa_head, model)
    if ngram_mix:
        mix_ngram(proposers)
    return model, tokenizer, proposers


def mix_ngram(proposers: dict) -> dict:
    """`draft.ngram.mix`: each head's or draft model's proposer in `proposers` (keyed by method)
    wrapped in a MixedProposer with the n-gram method's proposer (one corpus for both); in place."""
    from specfleet_api.engine_config import MIX_METHODS

    from .proposers import MixedProposer

    for method in MIX_METHODS:
        if method in proposers:
            proposers[method] = MixedProposer(proposers[Method.NGRAM.value], proposers[method])
    return proposers


def eagle_proposer(path: str, model):
    """The EAGLE proposer of the head at `path` (a folder, or the name of a head the package
    carries) for `model` (HeadMismatch names what does not fit)."""
    from specfleet_api.engine_config import bundled_model

    from .draft_head import load_head

    head = load_head(bundled_model(path) or path, model).to(model.device).serving_layout()
    return proposer_class(Method.EAGLE)(head, model)


def medusa_proposer(path: str, model):
    """The Medusa proposer of the heads at `path` (a folder) for `model` (HeadMismatch names what
    does not fit)."""
    from .medusa_head import load_medusa_head

    head = load_medusa_head(path, model).to(model.device)
    return proposer_class(Method.MEDUSA)(head, model)
