#!/usr/bin/env python3
"""Kimi K3 at full size over H hosts (ranks as MPI processes, one per host):
the step time and tokens/s of a decode step (1 row) and a verify step (k + 1
rows), from the collectives our forward makes (counted by `cargo bench
--features mpi --bench mpi_step`, 10 per step on the 4-layer real-width slice
= what the per-layer formula below gives for it), the bytes each moves with
the algorithms of verify/src/tp/mpi.rs, a stated link, and a compute rate
measured on the slice. Computed, not measured; standard library only.

    python3 scripts/k3-mpi-projection.py --per-core-gbs 9.0 [--overhead-us 11]

Model of one step on H hosts (tensor parallel over all H, experts placed by
rank, every host one rank):
  compute  = weight bytes streamed per host / min(cores x per-core rate,
             usable memory bandwidth); the router (replicated) counts whole
             on every host, everything else / H. Routed experts: the distinct
             experts R rows touch, 896 (1 - (1 - 16/896)^R) per layer (random
             routing), at MXFP4 (4.25 bits/weight).
  comm     = per collective: rounds x (link latency + our per-call overhead)
             + bytes received / link bandwidth; an all-gather or all-to-all of
             H ranks takes ceil(log2 H) rounds (recursive doubling / Bruck).
             All-reduce: gather all and sum (1 collective, (H-1) x b in) up to
             1 MiB gathered, else scatter-sum-gather (2 collectives,
             2 (H-1)/H x b in); the logits are gathered (vocab x R floats),
             the step message broadcast (latency only).
Collectives per step: 93 attention all-reduces (hidden x R), 1 dense MLP
all-reduce, 92 MoE all-reduces (latent 3584 x R and shared hidden x R in one
buffer), the logits gather, the step broadcast: 188.
"""

import argparse
import importlib.util
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("k3mem", os.path.join(HERE, "k3-memory.py"))
k3mem = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k3mem)

F32 = 4
MIB = 1 << 20


def collectives(t, rows, hosts):
    """(name, count, bytes per rank contribution, kind) per step."""
    d, lat, v = t["hidden_size"], t["routed_expert_hidden_size"], t["vocab_size"]
    n_layer, n_dense = t["num_hidden_layers"], t["first_k_dense_replace"]
    n_moe = n_layer - n_dense
    return [
        ("attention output all-reduce", n_layer, d * rows * F32, "allreduce"),
        ("dense MLP all-reduce", n_dense, d * rows * F32, "allreduce"),
        ("MoE all-reduce (routed latent + shared, one buffer)", n_moe, (lat + d) * rows * F32,
         "allreduce"),
        ("logits all-gather", 1, math.ceil(v / hosts) * rows * F32, "gather"),
        ("step broadcast", 1, 64 + 16 * rows, "broadcast"),
    ]


def comm_seconds(kind, b, hosts, alpha, beta):
    rounds = math.ceil(math.log2(hosts))
    if kind == "allreduce":
        if b * (hosts - 1) <= MIB or hosts == 2:
            return rounds * alpha + (hosts - 1) * b / beta, 1
        return 2 * rounds * alpha + 2 * (hosts - 1) / hosts * b / beta, 2
    if kind == "gather":
        return rounds * alpha + (hosts - 1) * b / beta, 2  # lengths, then data
    return rounds * alpha + b / beta, 2  # length, then message


def step_bytes(inv, info, rows, hosts, nonexpert_bytes):
    """Weight bytes one host streams in a step of `rows` rows."""
    t_exp = 896
    distinct = t_exp * (1 - (1 - 16 / t_exp) ** rows)
    per_host = 0.0
    for group, n, kind, sharded in inv:
        if group == "embed_tokens":
            continue  # one row read per token
        if kind == "expert":
            b = info["n_moe"] * distinct * info["expert_params"] * k3mem.MXFP4_BYTES
        else:
            b = k3mem.nbytes(n, kind, nonexpert_bytes)
        per_host += b / hosts if sharded else b
    return per_host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-core-gbs", type=float, required=True,
                    help="weight GB/s one core streams through our kernels (measured)")
    ap.add_argument("--overhead-us", type=float, default=11.0,
                    help="our per-collective software cost (measured: the all-reduce alone, shm)")
    ap.add_argument("--rows", type=int, default=4, help="k + 1 of the verify step")
    ap.add_argument("--accepted", type=float, default=2.5,
                    help="tokens a verify step yields (stated, not measured on K3)")
    a = ap.parse_args()
    c = k3mem.CONFIG
    t = c["text_config"]
    inv, info = k3mem.model_inventory(c)
    links = [("100 GbE, TCP", 12.5e9, 20e-6), ("200 Gb/s RDMA (HDR IB / RoCE)", 25e9, 3e-6)]
    host = ("2 x 64-core EPYC, 24 x DDR5-4800 (921 GB/s nominal, 60% usable)", 128, 0.6 * 921.6e9)
    formats = [("BF16 + MXFP4 experts (as shipped)", k3mem.BF16),
               ("~Q4_K_M non-experts (4.85 bits) + MXFP4 experts", 4.85 / 8)]
    print(f"Host: {host[0]}; compute rate min({host[1]} cores x {a.per_core_gbs} GB/s, "
          f"{host[2] / 1e9:.0f} GB/s). Our per-collective overhead {a.overhead_us} us. "
          f"Verify step: {a.rows} rows yielding {a.accepted} tokens (stated).\n")
    print("| hosts | format | link | rows | weight GB/host | compute ms | collectives (MPI calls) "
          "| MB in/host | comm ms | step ms | tok/s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rate = min(host[1] * a.per_core_gbs * 1e9, host[2])
    for hosts in (8, 16):
        for fname, nb in formats:
            for lname, beta, lat in links:
                alpha = lat + a.overhead_us * 1e-6
                for rows in (1, a.rows):
                    gb = step_bytes(inv, info, rows, hosts, nb)
                    comp = gb / rate
                    calls = mpi_calls = 0
                    comm = bytes_in = 0.0
                    for _, n, b, kind in collectives(t, rows, hosts):
                        s, m = comm_seconds(kind, b, hosts, alpha, beta)
                        calls += n
                        mpi_calls += n * m
                        comm += n * s
                        if kind == "allreduce" and m == 2:
                            bytes_in += n * 2 * (hosts - 1) / hosts * b
                        elif kind == "broadcast":
                            bytes_in += n * b
                        else:
                            bytes_in += n * (hosts - 1) * b
                    step = comp + comm
                    toks = (1 if rows == 1 else a.accepted) / step
                    print(f"| {hosts} | {fname} | {lname} | {rows} | {gb / 1e9:.2f} | "
                          f"{comp * 1e3:.1f} | {calls} ({mpi_calls}) | {bytes_in / 1e6:.1f} | "
                          f"{comm * 1e3:.1f} | {step * 1e3:.1f} | {toks:.1f} |")


if __name__ == "__main__":
    main()
