"""Megatron's process-group layouts written out by hand, for the group maths (tests/unit) and the real
groups (tests/dist): every list from Megatron's rule (rank = tp + TP*(cp + CP*(dp + DP*pp)) for the
default order "tp-cp-ep-dp-pp"; a group varies only its own axes), never computed with the code
under test."""

from __future__ import annotations

from core import parallel_state as ps

SINGLETONS_8 = [[r] for r in range(8)]


# 8-rank configurations: (tp, pp, cp) -> every group of every kind.
EIGHT_RANK = {
    (2, 2, 1): {  # DP=2; rank = tp + 2*dp + 4*pp
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "cp": SINGLETONS_8,
        "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "tp_dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "embd": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pos_embd": [[0], [1], [2], [3]],
    },
    (1, 4, 1): {  # DP=2; rank = dp + 2*pp
        "tp": SINGLETONS_8,
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": SINGLETONS_8,
        "dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "mp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "tp_dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "embd": [[0, 6], [1, 7]],
        "pos_embd": [[0], [1]],
    },
    (2, 4, 1): {  # DP=1; rank = tp + 2*pp
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp": SINGLETONS_8,
        "cp": SINGLETONS_8,
        "dp_cp": SINGLETONS_8,
        "mp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "tp_dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "tp_dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "embd": [[0, 6], [1, 7]],
        "pos_embd": [[0], [1]],
    },
    (1, 2, 2): {  # CP=2, DP=2; rank = cp + 2*dp + 4*pp
        "tp": SINGLETONS_8,
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "mp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tp_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "embd": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pos_embd": [[0], [1], [2], [3]],
    },
}


SINGLETONS_16 = [[r] for r in range(16)]


# (world, tp, pp, cp, ep, etp, order) -> expert groups, written out from megatron-core's rule: with the
# default order, expert rank = etp_rank + ETP*(ep_rank + EP*(edp_rank + EDP*pp_rank)), EDP = world/(ETP*EP*PP).
EXPERT_LAYOUTS = {
    (8, 1, 1, 1, 2, 1, DEFAULT := ps.DEFAULT_ORDER): {  # EDP 4; rank = ep + 2*edp
        "tp_cp": SINGLETONS_8,
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    (8, 2, 2, 1, 2, 1, DEFAULT): {  # TP 2 x PP 2 x DP 2; experts: EDP 2, rank = ep + 2*(edp + 2*pp)
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "expt_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    (8, 1, 2, 1, 4, 1, DEFAULT): {  # EDP 1; rank = ep + 4*pp
        "tp_cp": SINGLETONS_8,
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "expt_dp": SINGLETONS_8,
    },
    (8, 2, 1, 1, 4, 1, DEFAULT): {  # EP spans TP and DP: dense rank = tp + 2*dp, expert rank = ep + 4*edp
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 1, 1, 2, 2, 1, DEFAULT): {  # CP 2: the expert grid has no cp axis, EP takes the cp ranks
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    (8, 2, 2, 1, 2, 1, "tp-cp-ep-pp-dp"): {  # pp before dp: rank = ep + 2*(pp + 2*edp), EDP = DP = 2
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 2, 1, 1, 2, 2, DEFAULT): {  # expert TP 2 (group maths only): rank = etp + 2*(ep + 2*edp)
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "expt_tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (16, 2, 2, 1, 4, 1, DEFAULT): {  # EDP 2; rank = ep + 4*(edp + 2*pp)
        "tp_cp": [[2 * i, 2 * i + 1] for i in range(8)],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "expt_tp": SINGLETONS_16,
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "expt_tp_ep_pp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    },
}


# (world, tp, pp, ep, N) -> megatron-core's groups of N distributed-optimizer instances over the expert
# data-parallel groups above (default order): create_hierarchical_groups(rank, expt_dp ranks, [EDP/N, N])
# cuts each expert-DP group into N blocks of EDP/N consecutive ranks (intra) and takes the ranks a
# block apart (inter); megatron-core's one inter-instance group, the same ranks as the dense layers'.
EXPERT_INSTANCES = {
    (4, 1, 1, 2, 2): {  # DP4, EP2: expert DP [0,2] [1,3], one replica per instance
        "intra_expt_dp": [[0], [2], [1], [3]],
        "inter_expt_dp": [[0, 2], [1, 3]],
    },
    (8, 1, 1, 2, 2): {  # DP8, EP2: expert DP [0,2,4,6] [1,3,5,7]
        "intra_expt_dp": [[0, 2], [4, 6], [1, 3], [5, 7]],
        "inter_expt_dp": [[0, 4], [2, 6], [1, 5], [3, 7]],
    },
    (8, 1, 1, 2, 4): {  # DP8, EP2, N=4
        "intra_expt_dp": [[0], [2], [4], [6], [1], [3], [5], [7]],
        "inter_expt_dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    (8, 2, 1, 1, 2): {  # TP2 x DP4, no EP: expert DP is tp x dp, [0..7] (experts are whole on every TP rank)
        "intra_expt_dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "inter_expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 2, 2, 2, 2): {  # TP2 x PP2 x DP2, EP2: expert DP [0,2] [1,3] [4,6] [5,7]
        "intra_expt_dp": [[0], [2], [1], [3], [4], [6], [5], [7]],
        "inter_expt_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
}
