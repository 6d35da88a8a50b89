"""The simulated testbeds of the paper grid (launch/reproduce.py): device pools and prices.

Each entry: `pool` (a `task_costs.Pool.parse` spec: KIND:N with an even role split, or
rollout=KIND:N,train=KIND:N), `devices_per_host`, `cross_host_bw` (bytes/s per GPU between
hosts) and `prices` ($ per device-hour, overriding task_costs.DEVICES' defaults). The 16- and
32-GPU H800 testbeds are the paper's sizes; the heterogeneous one puts rollout on H800s and
training on cheaper L40S cards (a PCIe card: no NVLink, 48 GB).
"""
import ml_collections

PRICES = {"h800": 2.00, "l40s": 0.90, "a100": 1.30, "h100": 2.50}


def get_config():
    c = ml_collections.ConfigDict()
    common = dict(devices_per_host=8, cross_host_bw=25e9, prices=PRICES)
    c.testbeds = [
        dict(name="16xH800", pool="h800:16", **common),
        dict(name="32xH800", pool="h800:32", **common),
        dict(name="16xH800+16xL40S", pool="rollout=h800:16,train=l40s:16", **common),
    ]
    return c
