"""verify's forward hooks: the decoder layers of a model (transformers' or the engine's), the final norm, and the
recorder of their outputs during one teacher-forced forward."""
from __future__ import annotations

from typing import Any

from .verify_report import VerifyError


def _decoder_layers(model, n_layers: int):
    """The decoder layers of `model`: the ModuleList of `n_layers` modules, preferring one named `*layers` outside
    a vision tower."""
    import torch.nn as nn
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    found.sort(key=lambda nm: (not nm[0].endswith("layers"), "vis" in nm[0]))
    if not found:
        raise VerifyError(f"no list of {n_layers} decoder layers found in {type(model).__name__}")
    return list(found[0][1])


def _final_norm(model, name: str | None):
    """The final norm module `name` of a transformers model (the module of the checkpoint tensor the spec's final
    norm weight loads from), or the engine's decoder `model.norm`; None where there is none."""
    if name is None:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _final_norm_name(ir) -> str | None:
    """The module the spec's final norm weight is read from (`model.norm`, GPT-2's `transformer.ln_f`)."""
    if ir.norm is None:
        return None
    src = next((w.sources[0] for w in ir.weights if w.param.name == "model.norm.weight" and len(w.sources) == 1),
               "model.norm.weight")
    return src[: -len(".weight")] if src.endswith(".weight") and "{" not in src else None


class _Recorder:
    """Forward hooks on decoder layers: the residual stream after each layer, of the first forward call; with `tail`,
    the output of that module (the final norm) as one more stage."""

    def __init__(self, layers, engine: bool, tail=None):
        self.engine = engine
        self.out: dict[int, Any] = {}
        self.armed = False
        self.handles = [l.register_forward_hook(self._hook(i)) for i, l in enumerate(layers)]
        if tail is not None and layers:
            self.handles.append(tail.register_forward_hook(self._hook(len(layers), stream=False)))

    def _hook(self, i, stream: bool = True):
        def hook(module, args, output):
            # the final norm in transformers: its last call of the forward (NanoChat's one weightless `norm` module
            # also normalizes the embeddings first)
            if not self.armed or (i in self.out and (stream or self.engine)):
                return
            if not stream:              # the final norm: its output (the engine's norm returns (out, residual))
                output = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(output, (tuple, list)):      # (a list: transformers' GPT-1 blocks return [h, ...])
                h = output[0]
                if self.engine and len(output) > 1 and output[1] is not None:
                    h = h + output[1]        # the generated layers return (hidden, running residual)
            else:
                h = output
            scale = getattr(module, "stream_scale", 1.0) if self.engine and stream else 1.0
            if scale != 1.0:
                # a layer that scales the whole stream after itself (layers.stream_scale) does so where transformers
                # scales it outside its block, after the block's hook: compare the stream before that scale (the
                # next layer's state compares the scaled one)
                h = h / scale
            h = h.detach()              # float32 (a float64 run keeps its precision: the float32 yardstick)
            self.out[i] = (h if h.element_size() == 8 else h.float()).reshape(-1, h.shape[-1]).cpu()
        return hook

    def arm(self):
        self.out, self.armed = {}, True

    def take(self) -> list:
        self.armed = False
        return [self.out[i] for i in sorted(self.out)]

    def remove(self):
        for h in self.handles:
            h.remove()
