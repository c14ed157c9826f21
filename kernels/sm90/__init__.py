"""Hopper (sm_90) attention, backends ``hopper`` and ``hopper-exact-scores``: the forward
(``hopper_fwd``, its warp-specialized Gluon kernel ``hopper_fwd_ws``), the backward (``hopper_bwd``,
Gluon ``hopper_bwd_ws``) and the rebasing passes that fold the MX scales outside ``wgmma`` (``rebase``)."""
