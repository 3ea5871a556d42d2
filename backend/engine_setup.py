"""The engine's start-up stages that need no engine yet: what LLMEngine._build calls, in order,
once the target's weights are loaded (backend/engine.py).
"""
from __future__ import annotations

import gc

import torch
from transformers import GenerationConfig

from backend.config import EngineConfig
from backend.errors import ValidationError
from backend.model.executor import Executor
from backend.model.linear_tuner import tune_cpu_linears, tune_quantized_linears, tune_small_batch_linears
from backend.model.model_loader import load_draft_model, load_eagle_head
from backend.model.model_runner import ModelRunner, kv_cache_bytes_per_block, target_graph_query_lens
from backend.sample.sampler import Sampler
from backend.speculative.draft_proposer import DraftProposer
from backend.speculative.eagle_proposer import EagleProposer
from backend.speculative.ngram_proposer import NgramProposer
from backend.speculative.proposer import Proposer
from backend.speculative.suffix_proposer import SuffixProposer


def eos_token_ids(model_dir: str, tokenizer) -> frozenset[int]:
    """The model's generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_draft(config: EngineConfig, model, tokenizer, device: torch.device, max_model_len: int):
    """The draft model or EAGLE head speculation drafts with; None without one."""
    if config.speculative_method == "draft":
        return load_draft_model(config.draft_model, model, tokenizer, config.draft_dtype, device, max_model_len)
    if config.speculative_method == "eagle":  # a head on the target's hidden states
        return load_eagle_head(config.draft_model, model, config.draft_dtype, device, max_model_len, config.model)
    return None


def choose_linear_kernels(config: EngineConfig, model, draft_model, use_triton: bool,
                          device: torch.device) -> dict[str, dict]:
    """Triton kernels on CUDA, and the fastest linear kernel per weight shape, measured at load:
    model ("target", "draft") -> weight shape -> the kernel chosen."""
    choices: dict[str, dict] = {}
    for name, m in (("target", model), ("draft", draft_model)):
        if m is None:
            continue
        m.use_triton_kernels(use_triton)  # RMSNorm and SiLU-multiply too
        if use_triton and device.type == "cuda":
            choices[name] = tune_small_batch_linears(m)
    if config.quantization in ("int8", "int4") and device.type == "cpu":  # (the target's layers only)
        choices["target"] = tune_quantized_linears(model, config.quantization_dense_rows)
    copies = device.type == "cpu" and config.tensor_parallel_size == 1 and config.cpu_weight_copies
    if copies and config.quantization not in ("int8", "int4"):  # (float32 layers only)
        choices["target"] = tune_cpu_linears(model)
    if copies and draft_model is not None:
        choices["draft"] = tune_cpu_linears(draft_model)
    return choices


def size_kv_pool(config: EngineConfig, model, draft_model, dtype: torch.dtype, draft_dtype: torch.dtype,
                 device: torch.device) -> int:
    """KV blocks for the memory budget (target, draft and the head's feature pool per block);
    the EAGLE feature pool is made here."""
    eagle = config.speculative_method == "eagle"
    bytes_per_block = kv_cache_bytes_per_block(model, config.block_size, dtype)
    if draft_model is not None:
        bytes_per_block += kv_cache_bytes_per_block(draft_model, config.block_size, draft_dtype)
    if eagle:  # the target's features at every slot, for the head
        bytes_per_block += config.block_size * draft_model.feature_width * dtype.itemsize
    num_blocks = config.num_kv_blocks or _num_blocks_for_budget(config, device, bytes_per_block)
    if num_blocks < 2:
        raise ValidationError("kv_cache_memory_bytes", f"room for {num_blocks} KV blocks; need >= 2")
    if eagle:  # written by the target's forwards, read by the head's (padding rows write the last)
        model.feature_pool = draft_model.feature_pool = torch.zeros(
            num_blocks * config.block_size + 1, draft_model.feature_width, dtype=dtype, device=device)
        model.feature_layers = draft_model.feature_layers
    return num_blocks


def _num_blocks_for_budget(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    if device.type == "cuda":
        # memory an engine made before this one in the process held counts as free once that
        # engine is gone: collected, and handed back by the allocator's cache
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
    else:
        budget = config.kv_cache_memory_bytes
    return max(budget // bytes_per_block, 0)


def make_proposer(config: EngineConfig, draft_model, draft_runner: ModelRunner | None, sampler: Sampler,
                  vocab_size: int) -> Proposer | None:
    """What drafts for speculation: the draft model, the EAGLE head (on draft_runner), n-gram, or none."""
    if draft_model is not None:
        eagle = config.speculative_method == "eagle"
        return (EagleProposer if eagle else DraftProposer)(draft_runner, sampler, vocab_size)
    if config.speculative_method == "ngram":
        return NgramProposer()
    if config.speculative_method == "suffix":
        return SuffixProposer()
    return None


def prepare_steps(config: EngineConfig, runner: Executor, proposer: Proposer | None, device: torch.device,
                  attention, max_model_len: int) -> None:
    """CUDA graphs of the uniform steps, or the CPU's compiled steps, asked for."""
    query_lens = target_graph_query_lens(config, device, attention)
    if query_lens:  # the target: decode steps, and verifications of num_speculative_tokens drafts each
        # (under tensor parallelism every worker captures the same graphs with it);
        # the draft: its one-token forwards, and its first after a verification (2 tokens)
        runner.capture_graphs(config.max_num_seqs, max_model_len, query_lens)
        if proposer is not None and proposer.runner is not None and config.speculative_method != "eagle":
            proposer.runner.capture_graphs(config.max_num_seqs, max_model_len, (1, 2))  # (the head runs eagerly)
    if config.compile_decode and device.type == "cpu":  # (on CUDA decode steps replay graphs)
        runner.compile_decode()
    if config.compile_prefill and device.type == "cpu":
        runner.compile_prefill()


