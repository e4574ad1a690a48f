"""The proto enums the client and the services both name in words: loss types, KL estimators, sync modes.

Job files and plain settings say "dr_grpo", "k3", "auto"; the wire says LOSS_TYPE_DR_GRPO,
KL_ESTIMATOR_K3, SYNC_MODE_AUTO. Both directions live here once. An UNSPECIFIED enum reads as the
default name (grpo, k3), which is what a proto zero means on the wire.
"""

from __future__ import annotations

from lorarl.v1 import common_pb2, trainer_pb2

LOSS_NAMES: dict[int, str] = {
    trainer_pb2.LOSS_TYPE_UNSPECIFIED: "grpo",
    trainer_pb2.LOSS_TYPE_GRPO: "grpo",
    trainer_pb2.LOSS_TYPE_DR_GRPO: "dr_grpo",
    trainer_pb2.LOSS_TYPE_DAPO: "dapo",
    trainer_pb2.LOSS_TYPE_RLOO: "rloo",
    trainer_pb2.LOSS_TYPE_GSPO: "gspo",
    trainer_pb2.LOSS_TYPE_PPO: "ppo",
    trainer_pb2.LOSS_TYPE_CROSS_ENTROPY: "cross_entropy",
    trainer_pb2.LOSS_TYPE_IMPORTANCE_SAMPLING: "importance_sampling",
    trainer_pb2.LOSS_TYPE_TOKEN_PPO: "token_ppo",
    trainer_pb2.LOSS_TYPE_TOKEN_CISPO: "token_cispo",
    trainer_pb2.LOSS_TYPE_OPD: "opd",
}
LOSS_TYPES: dict[str, int] = {name: enum for enum, name in LOSS_NAMES.items()
                              if enum != trainer_pb2.LOSS_TYPE_UNSPECIFIED}

KL_NAMES: dict[int, str] = {
    trainer_pb2.KL_ESTIMATOR_UNSPECIFIED: "k3",
    trainer_pb2.KL_ESTIMATOR_K1: "k1",
    trainer_pb2.KL_ESTIMATOR_K2: "k2",
    trainer_pb2.KL_ESTIMATOR_K3: "k3",
}
KL_ESTIMATORS: dict[str, int] = {name: enum for enum, name in KL_NAMES.items()
                                 if enum != trainer_pb2.KL_ESTIMATOR_UNSPECIFIED}

SYNC_MODES: dict[str, int] = {"adapter": common_pb2.SYNC_MODE_ADAPTER, "merged": common_pb2.SYNC_MODE_MERGED,
                              "auto": common_pb2.SYNC_MODE_AUTO}
