"""The model's forward passes: prefill a prompt, decode a batch step, pick a PEFT adapter."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from app.engine.kv_cache import use_growing_layers
from app.engine.logprobs import is_byte_level


@dataclass
class ModelRunner:
    model: torch.nn.Module
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    adapters: tuple[str, ...] = ()            # named PEFT adapters (the model is a PeftModel when any)
    input_device: torch.device = field(default=None)  # type: ignore[assignment]
    byte_level: bool = False

    def __post_init__(self):
        if self.input_device is None:
            self.input_device = self.model.get_input_embeddings().weight.device
        self.byte_level = is_byte_level(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @contextlib.contextmanager
    def adapter(self, name: str | None):
        """Run with the named adapter active, or with adapters disabled (the base model) for None."""
        if not self.adapters:
            yield
            return
        if name is None:
            with self.model.disable_adapter():
                yield
            return
        self.model.set_adapter(name)
        yield

    def prefill(self, prompt_ids: list[int], all_logits: bool):
        """Forward the prompt; logits (1, L or 1, V) and the KV cache."""
        from transformers import DynamicCache
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.input_device)
        cache = DynamicCache(config=self.model.config)
        use_growing_layers(cache)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1)
        return out.logits, out.past_key_values

    def decode(self, tokens: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One step for a batch of sequences; float32 logits (B, V). With left padding, ``attention_mask``
        (B, cached + 1) hides the pads and ``position_ids`` (B,) are each row's own positions."""
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.input_device)
            kwargs["position_ids"] = position_ids.view(-1, 1).to(self.input_device)
        out = self.model(input_ids=tokens.view(-1, 1).to(self.input_device), past_key_values=cache,
                         use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()
