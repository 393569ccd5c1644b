"""The model side of the audit: teacher-forced log probs and router choices with transformers.

Owns loading a Hugging Face model directory (local files only, never a hub download) and one
forward pass per sample, batched by a token budget, on CPU or CUDA. The only module of the audit
that imports torch and transformers (the ``audit`` extra); it compares nothing (``compare``).

Log probs: the base model's last hidden state at ``t - 1`` through the output embedding
(``lm_head``) in the model's dtype (on CPU, a bf16/fp16 head is multiplied in float32 from the
same weights and the logits rounded to the model's dtype: the same values, several times
faster), then ``logit - logsumexp(logits)`` in float32 over the whole vocabulary:
the raw log prob of ``input_ids[t]``, as vLLM's default ``logprobs_mode=raw_logprobs`` reports
it (before temperature, penalties, logit bias or grammars). ``temperature`` other than 1 divides
the logits first (for an engine that returned processed log probs). Gemma-style
``final_logit_softcapping`` is applied when the config has it.

Routing: a forward hook on each router module, in module order (the model's MoE layers, which
is the order of the captured ``[num_layers]`` axis). The router is the class the model names
under ``_can_record_outputs["router_logits"]`` (transformers 5), else every ``mlp.gate``
linear (transformers 4). When the router returns its chosen indices (``(logits, scores,
indices)``, transformers 5's top-k routers) they are used as they are; otherwise the top-k of
its logits (exact for softmax top-k routers: Qwen-MoE, Mixtral, OLMoE).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from capture_proxy.audit.sources import AuditSample

#: Rows of the vocabulary projection computed at once: bounds memory at
#: ``LOGIT_CHUNK * vocab * 4`` bytes (about 310 MB for Qwen's 151,936 ids).
LOGIT_CHUNK = 512
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelOptions:
    """``device``: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:N``; ``dtype``:
    ``auto`` (the config's ``dtype``) or a name in ``DTYPES``; ``max_batch_tokens``: padded
    tokens per forward pass (batch size x longest sample); ``temperature``: logits divisor."""

    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    max_batch_tokens: int = 16384
    temperature: float = 1.0


@dataclass(frozen=True)
class ModelScores:
    """One sample scored: ``log_probs`` float32 ``[seq]`` (the model's log prob of
    ``input_ids[t]``; NaN where not generated or at 0), ``experts`` int64
    ``[seq, num_moe_layers, top_k]`` (the router's choice at every position) or None."""

    log_probs: np.ndarray
    experts: np.ndarray | None


def _router_modules(model: nn.Module) -> list[nn.Module]:
    recorders = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if isinstance(target, type):
        found = [m for m in model.modules() if isinstance(m, target)]
        if found:
            return found
    return [
        m
        for name, m in model.named_modules()
        if name.endswith("mlp.gate") and isinstance(m, nn.Linear)
    ]


def _top_k(config: Any) -> int | None:
    for key in ("num_experts_per_tok", "experts_per_token", "moe_topk", "num_experts_per_token"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class AuditModel:
    """A loaded model. ``num_moe_layers`` (0 for a dense model) and ``top_k`` (None for a
    dense model) describe its routing; ``device`` and ``dtype`` what it runs on."""

    def __init__(self, options: ModelOptions) -> None:
        from transformers import AutoModelForCausalLM

        self.options = options
        if options.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(options.device)
        dtype: Any = "auto" if options.dtype == "auto" else DTYPES[options.dtype]
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(options.model_dir), dtype=dtype, local_files_only=True
        )
        self.model: Any = model.to(self.device).eval()
        self.dtype = next(self.model.parameters()).dtype
        self.routers = _router_modules(self.model)
        self.num_moe_layers = len(self.routers)
        self.top_k = _top_k(self.model.config) if self.routers else None
        self._captured: list[Any] = []
        half = self.dtype in (torch.bfloat16, torch.float16)
        head = self.model.get_output_embeddings()
        self._head_f32 = head.weight.float() if half and self.device.type == "cpu" else None
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if isinstance(output, tuple) and len(output) >= 3 and not output[2].is_floating_point():
            self._captured.append(output[2])
            return
        logits = output[0] if isinstance(output, tuple) else output
        assert self.top_k is not None, "a router without a known top_k"
        self._captured.append(torch.topk(logits.float(), self.top_k, dim=-1).indices)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        if self._head_f32 is not None:
            # The same weights in float32, the result rounded to the model's dtype: what a
            # bf16 matmul outputs, several times faster on CPUs without bf16 units.
            bias = None if head.bias is None else head.bias.float()
            logits = F.linear(hidden.float(), self._head_f32, bias).to(self.dtype).float()
        else:
            logits = head(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits / self.options.temperature

    def batches(self, samples: list[AuditSample]) -> Iterator[list[int]]:
        """Indices of ``samples`` per forward pass, longest first, within the token budget."""
        order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
        batch: list[int] = []
        for i in order:
            longest = samples[batch[0]].num_tokens if batch else samples[i].num_tokens
            if batch and longest * (len(batch) + 1) > self.options.max_batch_tokens:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    @torch.inference_mode()
    def score(self, batch: list[AuditSample]) -> list[ModelScores]:
        """One forward pass over ``batch`` (right-padded), its samples scored in order."""
        seq = max(s.num_tokens for s in batch)
        ids = torch.zeros((len(batch), seq), dtype=torch.long)
        attention = torch.zeros((len(batch), seq), dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, : s.num_tokens] = torch.from_numpy(s.input_ids)
            attention[b, : s.num_tokens] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        self._captured = []
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        experts = self._experts(len(batch), seq)
        out = []
        for b, s in enumerate(batch):
            log_probs = np.full(s.num_tokens, np.nan, np.float32)
            positions = np.flatnonzero(s.loss_mask)
            positions = positions[positions >= 1]
            for lo in range(0, positions.shape[0], LOGIT_CHUNK):
                at = torch.from_numpy(positions[lo : lo + LOGIT_CHUNK]).to(self.device)
                logits = self._logits(hidden[b, at - 1])
                picked = logits.gather(1, ids[b, at].unsqueeze(1)).squeeze(1)
                picked = picked - torch.logsumexp(logits, dim=-1)
                log_probs[positions[lo : lo + LOGIT_CHUNK]] = picked.cpu().numpy()
            rows = None if experts is None else experts[b, : s.num_tokens]
            out.append(ModelScores(log_probs, rows))
        return out

    def _experts(self, batch: int, seq: int) -> np.ndarray | None:
        """The hooks' indices as int64 ``[batch, seq, num_moe_layers, top_k]``."""
        if not self.routers:
            return None
        if len(self._captured) != self.num_moe_layers:
            raise RuntimeError(
                f"{len(self._captured)} router outputs for {self.num_moe_layers} MoE layers"
            )
        layers = []
        for indices in self._captured:
            if indices.shape[0] != batch * seq:
                raise RuntimeError(f"router rows {indices.shape[0]} != tokens {batch * seq}")
            layers.append(indices.reshape(batch, seq, -1).cpu().numpy().astype(np.int64))
        self._captured = []
        return np.stack(layers, axis=2)


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model directory's tokenizer (to name tokens in the report), or None without one."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError):
        return None
