"""The tables and target lines benchmarks/secagg.py prints and writes into its JSON."""

from __future__ import annotations

from typing import Any

from _secagg_setup import FLOWER_STAGES, STAGES


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def tables(rows: list[dict[str, Any]]) -> str:
    head = ("| clients | params | dropout | gRPC plain s | gRPC secure s | ratio | local "
            "plain s | local secure s | ratio | Flower plain s | Flower SecAgg+ s | ratio | "
            "Flower SecAgg+ / local secure | secure bytes sent / float32 (fedloom, Flower) |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        g, lo, f = r.get("grpc", {}), r.get("local", {}), r.get("flower", {})
        gp, gs = g.get("plain", {}).get("round_s"), g.get("secure", {}).get("round_s")
        lp, ls = lo.get("plain", {}).get("round_s"), lo.get("secure", {}).get("round_s")
        fp, fs = f.get("plain", {}).get("round_s"), f.get("secure", {}).get("round_s")
        float32 = 4 * r["params"]
        ours = g.get("secure", {}).get("sent_bytes") or lo.get("secure", {}).get("sent_bytes")
        theirs = f.get("secure", {}).get("sent_bytes")
        lines.append(
            f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | {fmt(gp)} | "
            f"{fmt(gs)} | {fmt(ratio(gs, gp), '.2f')}x | {fmt(lp)} | {fmt(ls)} | "
            f"{fmt(ratio(ls, lp), '.2f')}x | {fmt(fp)} | {fmt(fs)} | "
            f"{fmt(ratio(fs, fp), '.2f')}x | {fmt(ratio(fs, ls), '.1f')}x | "
            f"{fmt(ratio(ours, float32), '.4f')}, {fmt(ratio(theirs, float32), '.3f')} |")
    lines += ["", "fedloom over gRPC: fastest steady round (s), server CPU s per round, "
              "client process CPU s per client per round, MB sent / received per client "
              "per round (plain | secure):", "",
              "| clients | params | dropout | fastest round | server CPU | client CPU | "
              "MB sent | MB received |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("grpc", {})
        if "plain" not in g or "secure" not in g:
            continue
        p, q = g["plain"], g["secure"]
        lines.append(
            f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | "
            f"{p['min_round_s']:.3f} / {q['min_round_s']:.3f} | "
            f"{p['server_cpu_s']:.3f} / {q['server_cpu_s']:.3f} | "
            f"{p['client_process_cpu_s']:.4f} / {q['client_process_cpu_s']:.4f} | "
            f"{p['sent_bytes'] / 1e6:.3f} / {q['sent_bytes'] / 1e6:.3f} | "
            f"{p['received_bytes'] / 1e6:.3f} / {q['received_bytes'] / 1e6:.3f} |")
    lines += ["", "Client CPU seconds per client per round, by stage (0% dropout rows; "
              "fedloom gRPC | fedloom local | Flower):", ""]
    lines.append("| clients | params | mode | fedloom gRPC | fedloom local | Flower |")
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        if r["dropout"]:
            continue
        for mode in ("plain", "secure"):
            cells = []
            for system in ("grpc", "local", "flower"):
                cpu = r.get(system, {}).get(mode, {}).get("client_cpu_s", {})
                order = FLOWER_STAGES if system == "flower" else STAGES
                cells.append(", ".join(f"{s} {cpu[s]:.4f}" for s in order if s in cpu) or "-")
            lines.append(f"| {r['clients']} | {r['params'] // 1000}k | {mode} | "
                         + " | ".join(cells) + " |")
    lines += ["", "fedloom over gRPC, each SecAgg+ stage of a steady secure round: wall s "
              "(median), client CPU s and bytes sent per client:", "",
              "| clients | params | dropout | " + " | ".join(STAGES[1:6]) + " |",
              "|---|---|---|" + "---|" * 5]
    for r in rows:
        q = r.get("grpc", {}).get("secure")
        if q is None:
            continue
        cells = [f"{q.get('stage_s', {}).get(s, 0):.4f} s, "
                 f"{q.get('client_cpu_s', {}).get(s, 0) * 1e3:.2f} ms, "
                 f"{q.get('stage_sent_bytes', {}).get(s, 0):,.0f} B" for s in STAGES[1:6]]
        lines.append(f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | "
                     + " | ".join(cells) + " |")
    ddp = [r for r in rows if "secure-ddp" in r.get("grpc", {}) or "secure-ddp" in r.get(
        "local", {})]
    if ddp:
        lines += ["", "Distributed DP under SecAgg+ (Skellam, z = 1) beside the secure round "
                  "without it: steady round s, and bytes sent per client / float32:", "",
                  "| clients | params | dropout | gRPC secure s | gRPC secure + DDP s | ratio "
                  "| local secure s | local secure + DDP s | ratio | DDP bytes / float32 |",
                  "|" + "---|" * 10]
    for r in ddp:
        g, lo = r.get("grpc", {}), r.get("local", {})
        gs, gd = g.get("secure", {}).get("round_s"), g.get("secure-ddp", {}).get("round_s")
        ls, ld = lo.get("secure", {}).get("round_s"), lo.get("secure-ddp", {}).get("round_s")
        sent = (g.get("secure-ddp", {}).get("sent_bytes")
                or lo.get("secure-ddp", {}).get("sent_bytes"))
        lines.append(f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | "
                     f"{fmt(gs)} | {fmt(gd)} | {fmt(ratio(gd, gs), '.2f')}x | {fmt(ls)} | "
                     f"{fmt(ld)} | {fmt(ratio(ld, ls), '.2f')}x | "
                     f"{fmt(ratio(sent, 4 * r['params']), '.3f')} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["params"] != 1_000_000:
            continue
        g, lo, f = r.get("grpc", {}), r.get("local", {}), r.get("flower", {})
        tag = f"{r['clients']} clients, 1M, {r['dropout']:.0%} dropout"
        if r["clients"] == 20 and "secure" in g and "plain" in g:
            x = ratio(g["secure"]["round_s"], g["plain"]["round_s"])
            # The fastest steady rounds beside the medians: one slow plain run on a
            # shared machine moves a median of two runs a long way.
            fast = ratio(g["secure"].get("min_round_s"), g["plain"].get("min_round_s"))
            out.append(f"gRPC secure / plain ({tag}): {fmt(x, '.2f')}x median, "
                       f"{fmt(fast, '.2f')}x fastest rounds (target <= 1.5x)")
        if "secure" in f and "secure" in lo and "plain" in lo:
            x = ratio(f["secure"]["round_s"], lo["secure"]["round_s"])
            out.append(f"Flower SecAgg+ / fedloom local secure ({tag}): {fmt(x, '.1f')}x "
                       "(target >= 5x)")
        if r["clients"] == 20 and "secure" in g and "secure-ddp" in g:
            x = ratio(g["secure-ddp"]["round_s"], g["secure"]["round_s"])
            fast = ratio(g["secure-ddp"].get("min_round_s"), g["secure"].get("min_round_s"))
            out.append(f"gRPC secure with distributed DP / secure ({tag}): {fmt(x, '.2f')}x "
                       f"median, {fmt(fast, '.2f')}x fastest rounds (target <= 1.2x)")
        if not r["dropout"] and "secure" in g:
            x = ratio(g["secure"]["sent_bytes"], 4e6)
            out.append(f"upload expansion, gRPC bytes sent / float32 ({tag}): "
                       f"{fmt(x, '.4f')}x (target <= 1.1x)")
    return out
