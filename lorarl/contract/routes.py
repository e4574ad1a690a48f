"""Routed experts: which experts the rollout's MoE routers picked for each token, so the trainer can replay them
(R3, "rollout routing replay": arXiv 2510.11370).

One array per sequence, ``[positions, layers, top_k]``: row p holds, for every MoE layer in model order, the
top-k expert ids the rollout's router chose for the token at position p of prompt + completion (the forward
that read token p). The last token of a sequence is never read by a forward whose output the loss needs, so a
sequence of n tokens has n - 1 rows. An entry of -1 (``NOT_RECORDED``) means "do not replay": the trainer keeps
its own live routing there (a position the rollout never computed, a preempted or evicted request), never
expert 0. A (position, layer) entry is either all -1 or k distinct ids in [0, num_experts).

On the wire (lorarl.v1.RoutedExperts) the ids travel as one byte each when the model has fewer than 255 experts
(255 marks -1), else as little-endian int16: 48 layers x top-8 is 384 B/token at Qwen3-30B-A3B (128 experts).
Everything here is plain numpy: the rollout, the client and the trainer all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lorarl.v1 import common_pb2

NOT_RECORDED = -1
BYTE_SENTINEL = 255


class RoutesError(ValueError):
    """Routes that do not fit their sequence or model; ``field`` names the part (a proto field's name)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


def wire_bytes_per_id(num_experts: int) -> int:
    """Bytes one expert id takes on the wire (and in a trajectory buffer)."""
    return 1 if num_experts < BYTE_SENTINEL else 2


def bytes_per_token(layers: int, top_k: int, num_experts: int) -> int:
    """What recording costs per token of a sequence: the bandwidth and memory plans count it."""
    return layers * top_k * wire_bytes_per_id(num_experts)


@dataclass(frozen=True)
class RoutedExperts:
    """A sequence's routes: ``ids`` int16 [positions, layers, top_k], -1 where not recorded."""

    ids: np.ndarray
    num_experts: int

    @property
    def positions(self) -> int:
        return int(self.ids.shape[0])

    @property
    def layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def recorded_fraction(self) -> float:
        """Share of (position, layer) entries that carry a route."""
        if not self.ids.size:
            return 0.0
        return float((self.ids[..., 0] != NOT_RECORDED).mean())

    @classmethod
    def empty(cls, positions: int, layers: int, top_k: int, num_experts: int) -> RoutedExperts:
        return cls(np.full((positions, layers, top_k), NOT_RECORDED, dtype=np.int16), num_experts)

    def check(self) -> None:
        """RoutesError unless every entry is -1 throughout or k distinct ids in range."""
        if self.ids.ndim != 3 or self.ids.dtype != np.int16:
            raise RoutesError("data", f"must be int16 [positions, layers, top_k], got {self.ids.dtype} "
                                      f"{list(self.ids.shape)}")
        if not 0 < self.num_experts <= 32767:
            raise RoutesError("num_experts", f"must be in 1..32767, got {self.num_experts}")
        if self.top_k < 1 or self.top_k > self.num_experts:
            raise RoutesError("top_k", f"must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        ids = self.ids
        missing = ids == NOT_RECORDED
        partial = missing.any(-1) & ~missing.all(-1)
        if partial.any():
            p, layer = (int(v) for v in np.argwhere(partial)[0])
            raise RoutesError("data", f"position {p}, layer {layer}: a route is all {NOT_RECORDED} (not recorded) "
                                      f"or {self.top_k} expert ids, got {ids[p, layer].tolist()}")
        bad = ~missing & ((ids < 0) | (ids >= self.num_experts))
        if bad.any():
            p, layer, _ = (int(v) for v in np.argwhere(bad)[0])
            raise RoutesError("data", f"position {p}, layer {layer}: expert ids must be in 0..{self.num_experts - 1}, "
                                      f"got {ids[p, layer].tolist()}")
        if self.top_k > 1:
            ordered = np.sort(ids, axis=-1)
            repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & ~missing.all(-1)
            if repeated.any():
                p, layer = (int(v) for v in np.argwhere(repeated)[0])
                raise RoutesError("data", f"position {p}, layer {layer}: an expert is chosen twice "
                                          f"({ids[p, layer].tolist()})")

    def check_fits(self, tokens: int, layers: int, top_k: int, num_experts: int) -> None:
        """RoutesError unless these routes belong to a ``tokens``-token sequence of this model."""
        if self.num_experts != num_experts:
            raise RoutesError("num_experts", f"the model has {num_experts} experts, the routes {self.num_experts}")
        if self.layers != layers:
            raise RoutesError("layers", f"the model has {layers} MoE layers, the routes {self.layers}")
        if self.top_k != top_k:
            raise RoutesError("top_k", f"the model routes each token to {top_k} experts, the routes to {self.top_k}")
        if self.positions != tokens - 1:
            raise RoutesError("positions", f"a sequence of {tokens} tokens (prompt + completion) has {tokens - 1} "
                                           f"routed positions (all but the last token), the routes {self.positions}")

    def overlay(self, later: RoutedExperts) -> RoutedExperts:
        """These routes with ``later``'s recorded entries on top, over the longer of the two (a continuation or
        a later turn recomputed some positions: what it computed is what its tokens were sampled under)."""
        if (later.layers, later.top_k, later.num_experts) != (self.layers, self.top_k, self.num_experts):
            raise RoutesError("data", "routes of different models cannot be combined")
        n = max(self.positions, later.positions)
        ids = np.full((n, self.layers, self.top_k), NOT_RECORDED, dtype=np.int16)
        ids[: self.positions] = self.ids
        part = ids[: later.positions]
        recorded = later.ids[..., :1] != NOT_RECORDED
        ids[: later.positions] = np.where(recorded, later.ids, part)
        return RoutedExperts(ids, self.num_experts)

    def truncated(self, positions: int) -> RoutedExperts:
        """The first ``positions`` rows, padded with not-recorded rows if there are fewer."""
        if positions <= self.positions:
            return RoutedExperts(self.ids[:positions], self.num_experts)
        return self.overlay(RoutedExperts.empty(positions, self.layers, self.top_k, self.num_experts))

    # ------------------------------------------------------------ wire form

    def to_proto(self) -> common_pb2.RoutedExperts:
        if wire_bytes_per_id(self.num_experts) == 1:
            data = np.where(self.ids == NOT_RECORDED, np.int16(BYTE_SENTINEL), self.ids).astype(np.uint8).tobytes()
        else:
            data = self.ids.astype("<i2").tobytes()
        return common_pb2.RoutedExperts(data=data, positions=self.positions, layers=self.layers, top_k=self.top_k,
                                        num_experts=self.num_experts)

    @classmethod
    def from_proto(cls, msg: common_pb2.RoutedExperts) -> RoutedExperts | None:
        """The routes a message carries (None: none were sent); RoutesError naming the field if malformed."""
        if not msg.data and not msg.positions:
            return None
        if not msg.layers or not msg.top_k or not msg.num_experts:
            raise RoutesError("layers" if not msg.layers else "top_k" if not msg.top_k else "num_experts",
                              "must be set with data")
        width = wire_bytes_per_id(msg.num_experts)
        expected = msg.positions * msg.layers * msg.top_k * width
        if len(msg.data) != expected:
            raise RoutesError("data", f"{msg.positions} positions x {msg.layers} layers x top-{msg.top_k} x {width} "
                                      f"byte(s) is {expected} bytes, got {len(msg.data)}")
        shape = (msg.positions, msg.layers, msg.top_k)
        if width == 1:
            raw = np.frombuffer(msg.data, dtype=np.uint8).reshape(shape).astype(np.int16)
            ids = np.where(raw == BYTE_SENTINEL, np.int16(NOT_RECORDED), raw)
        else:
            ids = np.frombuffer(msg.data, dtype="<i2").reshape(shape).astype(np.int16)
        routes = cls(ids, int(msg.num_experts))
        routes.check()
        return routes
