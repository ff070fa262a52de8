"""The fixed, model-agnostic runtime: it never names a model family."""
