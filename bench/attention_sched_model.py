"""The timing model of docs/attention-scheduling.md (CPU only, a few seconds):

    python -m bench.attention_sched_model [--dense-causal-ms 0.667] [--dense-full-ms 1.094] [--varlen-ms 0.381]

The forward's programs (128 x 64 blocks, D128, causal, the grid's order) are dispatched in
order to 132 SMs holding one CTA each. A program costs ``c0 + u * unmasked steps + m * masked
steps`` (+ ``e``, packed sequences' extra prologue). For each ``c0``, ``u`` and ``m`` are fitted
to the dense causal and non-causal times (B4 H16 L4096). The model then gives ``e`` from the
varlen time and the makespans of the orders: today's, longest-first on the hardware's
in-order dispatch (``SCHED`` 1), and longest-first on a static persistent snake (``SCHED`` 2).
Defaults are the H200 measurements of 2026-12-04. ``varlen.LENGTHS`` stands in for the
probe's unrecorded draw: same tokens and visible pairs.
"""
import argparse
import heapq
import sys

from bench.attention_sched import LENGTHS

SMS, BM, BN, H, D = 132, 128, 64, 16, 128


def dispatch(costs) -> float:
    """Makespan of ``costs`` handed out in order to the first free SM."""
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def snake(costs) -> float:
    """Makespan of ``costs`` sorted, most first, dealt to SMS programs in snake order."""
    load = [0.0] * SMS
    for i, c in enumerate(sorted(costs, reverse=True)):
        k, p = divmod(i, SMS)
        load[p if k % 2 == 0 else SMS - 1 - p] += c
    return max(load)


def _steps(start, L):
    """(unmasked, masked) key steps of the causal query block at ``start`` of a length-L sequence."""
    hi = min(L, start + BM)
    full = min(L // BN * BN, (start + 1) // BN * BN) // BN
    return full, -(-hi // BN) - full


def dense_programs(B, L, causal):
    n = -(-L // BM)
    per_head = [_steps(i * BM, L) if causal else (L // BN, -(-L // BN) - L // BN) for i in reversed(range(n))]
    return [(*s, True) for _ in range(B * H) for s in per_head]


def varlen_programs(lengths):
    """Today's grid: per head the virtual blocks (helpers._find_seq) in reverse."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    first = [cu[b] // BM + b for b in range(len(lengths))]
    n_virtual = cu[-1] // BM + len(lengths)
    out = []
    for v in reversed(range(n_virtual)):
        b = max(i for i in range(len(lengths)) if first[i] <= v)
        start = (v - first[b]) * BM
        out.append((*_steps(start, lengths[b]), True) if start < lengths[b] else (0, 0, False))
    return out * H


def costs(programs, u, m, c0, e=0.0):
    """Per program; an unused virtual block costs half the extra prologue (its search, no maps)."""
    return [c0 + e + u * a + m * b if real else e / 2 for a, b, real in programs]


def _solve(f, lo, hi, target):
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if f(mid) > target else (mid, hi)
    return (lo + hi) / 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense-causal-ms", type=float, default=0.667)
    parser.add_argument("--dense-full-ms", type=float, default=1.094)
    parser.add_argument("--varlen-ms", type=float, default=0.381)
    args = parser.parse_args(argv)
    full, causal, varlen = dense_programs(4, 4096, False), dense_programs(4, 4096, True), varlen_programs(LENGTHS)
    real = [p for p in varlen if p[2]]
    flops_d = 4 * H * D * 4 * 4096 * 4097 // 2
    flops_v = 4 * H * D * sum(n * (n + 1) // 2 for n in LENGTHS)
    tf = lambda flops, us: round(flops / us * 1e-6)  # noqa: E731
    print("c0 us | u, m us/step | varlen e us | dense causal us (TF/s): today, LPT, snake | "
          "varlen us (TF/s): today, LPT e=0, snake e=0")
    for c0 in (0.0, 2.0, 4.0, 6.0, 8.0):
        def fit_m(r):
            u = _solve(lambda u: dispatch(costs(full, u, r * u, c0)), 0.1, 3.0, args.dense_full_ms * 1e3)
            return dispatch(costs(causal, u, r * u, c0)), u

        r = _solve(lambda r: fit_m(r)[0], 1.0, 8.0, args.dense_causal_ms * 1e3)
        u = fit_m(r)[1]
        m = r * u
        e = _solve(lambda e: dispatch(costs(varlen, u, m, c0, e)), 0.0, 40.0, args.varlen_ms * 1e3)
        d = costs(causal, u, m, c0)
        v0 = costs(real, u, m, c0)
        dense = [dispatch(d), dispatch(sorted(d, reverse=True)), snake(d)]
        var = [dispatch(costs(varlen, u, m, c0, e)), dispatch(sorted(v0, reverse=True)), snake(v0)]
        print(f"{c0:5.1f} | {u:.2f}, {m:.2f} | {e:.2f} | "
              + ", ".join(f"{t:.0f} ({tf(flops_d, t)})" for t in dense) + " | "
              + ", ".join(f"{t:.0f} ({tf(flops_v, t)})" for t in var))
    return 0


if __name__ == "__main__":
    sys.exit(main())
