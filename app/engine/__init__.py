"""The engine: tokenizer + model -> per-step events. No Flask here."""
