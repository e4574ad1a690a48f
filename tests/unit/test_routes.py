"""The routed-experts contract (lorarl.contract.routes): its wire form, how routes combine, and every bad shape
refused with the field it concerns."""

from __future__ import annotations

import numpy as np
import pytest

from lorarl.contract.routes import NOT_RECORDED, RoutedExperts, RoutesError, bytes_per_token
from lorarl.v1 import common_pb2


def routes(positions: int = 5, layers: int = 3, k: int = 2, experts: int = 8, seed: int = 0) -> RoutedExperts:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(experts, size=k, replace=False) for _ in range(layers)] for _ in range(positions)])
    return RoutedExperts(ids.astype(np.int16), experts)


@pytest.mark.parametrize("experts", [8, 254, 255, 1024])
def test_the_wire_form_round_trips_with_unrecorded_entries(experts: int) -> None:
    r = routes(experts=experts)
    r.ids[1] = NOT_RECORDED
    msg = r.to_proto()
    assert len(msg.data) == 5 * 3 * 2 * (1 if experts < 255 else 2)  # one byte an id below 255 experts
    back = RoutedExperts.from_proto(common_pb2.RoutedExperts.FromString(msg.SerializeToString()))
    assert back is not None and back.num_experts == experts
    np.testing.assert_array_equal(back.ids, r.ids)
    assert back.recorded_fraction == pytest.approx(4 / 5)


def test_a_message_without_routes_reads_as_none_and_the_costs_are_counted() -> None:
    assert RoutedExperts.from_proto(common_pb2.RoutedExperts()) is None
    assert bytes_per_token(48, 8, 128) == 384 and bytes_per_token(94, 8, 256) == 94 * 8 * 2


@pytest.mark.parametrize(("change", "field"), [
    (dict(layers=0), "layers"),
    (dict(top_k=0), "top_k"),
    (dict(num_experts=0), "num_experts"),
    (dict(data=b"\x00" * 29), "data"),  # 30 expected
    (dict(data=bytes([0, 1] * 14 + [1, 1])), "data"),  # an expert twice
    (dict(data=bytes([0, 1] * 14 + [0, 9])), "data"),  # expert 9 of 8
    (dict(data=bytes([0, 1] * 14 + [255, 3])), "data"),  # half recorded
    (dict(top_k=9, positions=1, layers=3, data=bytes(range(8)) * 3 + bytes(3)), "top_k"),  # top-9 of 8 experts
])
def test_every_bad_shape_is_refused_by_name(change: dict, field: str) -> None:
    msg = routes().to_proto()
    for key, value in change.items():
        setattr(msg, key, value)
    with pytest.raises(RoutesError) as err:
        RoutedExperts.from_proto(msg)
    assert err.value.field == field


def test_routes_must_fit_their_sequence_and_model() -> None:
    r = routes(positions=5)
    r.check_fits(6, 3, 2, 8)  # 6 tokens: every position but the last
    for args, field in [((5, 3, 2, 8), "positions"), ((6, 4, 2, 8), "layers"), ((6, 3, 1, 8), "top_k"),
                        ((6, 3, 2, 16), "num_experts")]:
        with pytest.raises(RoutesError) as err:
            r.check_fits(*args)
        assert err.value.field == field


def test_a_later_segment_overlays_what_it_recomputed_and_truncation_pads_as_unrecorded() -> None:
    first, later = routes(positions=4, seed=1), routes(positions=6, seed=2)
    later.ids[:2] = NOT_RECORDED  # a continuation that did not recompute the first two positions
    both = first.overlay(later)
    np.testing.assert_array_equal(both.ids[:2], first.ids[:2])
    np.testing.assert_array_equal(both.ids[2:], later.ids[2:])
    assert both.truncated(3).positions == 3
    padded = both.truncated(8)
    assert padded.positions == 8 and (padded.ids[6:] == NOT_RECORDED).all()
    with pytest.raises(RoutesError):
        first.overlay(routes(experts=16))
