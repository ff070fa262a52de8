"""The token-shift block kinds' part of the resolver: `wkv` (a WKV time mix: token-shifted key / value / receptance
projections and the receptance-weighted key-value recurrence, RWKV-4's `attention`) and `channel_mix` (a
token-shifted MLP, RWKV's `feed_forward`): each one's IR (`resolve_wkv`, `resolve_channel_mix`) and its parameters
with their sharding (`wkv_params`, `channel_mix_params`). A mixin of resolver._Resolver (through
resolver_blocks.BlockResolver), which provides err / dim / ident / activation; the runtime side is
runtime/layers/recurrent/wkv.py."""
from __future__ import annotations

from typing import List

from .ir import WKVIR, ChannelMixIR, ParamIR, SegmentIR, Size
from .resolver_block_common import ACTIVATIONS, ParamBuilder
from .schema import ChannelMixBlock, WKVBlock


class WKVResolver:
    def _module_names(self, path, b, keys) -> list:
        """The block's projection module names, distinct and not the names of its own parameters."""
        names = [self.ident(path + (k,), getattr(b, k), "module name") for k in keys]
        for i, (k, v) in enumerate(zip(keys, names)):
            if v.startswith("time_") or v in ("act_fn",) or v in names[:i]:
                raise self.err(path + (k,), f"{self._where(path)}.{k}: module name '{v}' is already used in this "
                                            f"block")
        return names

    def resolve_wkv(self, path, name: str, b: WKVBlock, class_name: str) -> WKVIR:
        names = self._module_names(path, b, ("key", "value", "receptance", "out"))
        return WKVIR("wkv", name, class_name, self.dim(path + ("hidden",), b.hidden),
                     self.dim(path + ("width",), b.width), *names)

    def resolve_channel_mix(self, path, name: str, b: ChannelMixBlock, class_name: str) -> ChannelMixIR:
        names = self._module_names(path, b, ("key", "value", "receptance"))
        return ChannelMixIR("channel_mix", name, class_name, self.dim(path + ("hidden",), b.hidden),
                            self.dim(path + ("intermediate",), b.intermediate),
                            self.activation(path + ("activation",), b.activation, ACTIVATIONS, "an activation"),
                            *names)

    @staticmethod
    def wkv_params(pb: ParamBuilder, b: WKVIR) -> List[ParamIR]:
        """key / value / receptance column-parallel by channels with time_decay / time_first, the output
        row-parallel; the token-shift mixes replicated."""
        P, one = pb.P, Size.of(1)
        ch = SegmentIR("channels", b.width, one)
        ps = [P("time_decay", (b.width,), "colwise", (ch,)), P("time_first", (b.width,), "colwise", (ch,))]
        ps += [P(f"time_mix_{m}", (one, one, b.hidden), "replicated") for m in (b.key, b.value, b.receptance)]
        ps += [P(f"{m}.weight", (b.width, b.hidden), "colwise", (ch,)) for m in (b.key, b.value, b.receptance)]
        ps.append(P(f"{b.out_name}.weight", (b.hidden, b.width), "rowwise", (ch,)))
        return ps

    @staticmethod
    def channel_mix_params(pb: ParamBuilder, b: ChannelMixIR) -> List[ParamIR]:
        """key column-parallel, value row-parallel (its output summed over the ranks before the receptance gate),
        receptance and the token-shift mixes replicated."""
        P, one = pb.P, Size.of(1)
        ch = SegmentIR("intermediate", b.intermediate, one)
        return [P(f"time_mix_{b.key}", (one, one, b.hidden), "replicated"),
                P(f"time_mix_{b.receptance}", (one, one, b.hidden), "replicated"),
                P(f"{b.key}.weight", (b.intermediate, b.hidden), "colwise", (ch,)),
                P(f"{b.value}.weight", (b.hidden, b.intermediate), "rowwise", (ch,)),
                P(f"{b.receptance}.weight", (b.hidden, b.hidden), "replicated")]
