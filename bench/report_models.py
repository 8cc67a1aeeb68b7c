"""bench.report's sections of runs of their own: the RAG ratios on a mid-size random-weight model
(serve_random.json) and the warm path against its floor (anatomy.json)."""
from __future__ import annotations

from bench.report_baseline import named, named_qps, vs_best
from bench.report_format import (PUBLISHED, command, hit_split, machine_load, ms, pct, ratio, short_name, tiers,
                                 times)
from common.engine.modes import LABELS, MODES


def random_section(rnd: dict) -> list[str]:
    """The RAG ratios on a random-weight model of a realistic shape (serve_random.json)."""
    h, wl, mach, p = rnd["headline"], rnd["workload"], rnd["machine"], rnd["params"]
    rag = rnd["closed"]["rag"]
    tr = rag["trace"]
    sw = rnd.get("sweep")
    out = [
        f"### RAG on a mid-size model ({rnd['random_weights']})",
        "",
        f"`{command(rnd)}` wrote `bench/results/serve_random.json` in one run of "
        f"{rnd['wall_s'] / 60:.1f} min, the same way as above: model {rnd['model']}. Its answers mean "
        "nothing; its compute per token and its entry sizes are a realistic model's, which is what the "
        "ratios depend on. A prefill of it costs two orders of magnitude more per token than the bundled "
        f"model's on this CPU, so the run is scaled down to take minutes: documents of {wl['doc_tokens'][0]}–"
        f"{wl['doc_tokens'][1]} tokens (corpus {wl['corpus_docs']}), a prompt budget of "
        f"{wl['max_prompt_tokens']} tokens ({tr['segments_mean']:.1f} segments and "
        f"{tr['prompt_tokens_mean']:.0f} tokens per RAG prompt on average), {rag['modes']['full']['n']} "
        f"closed-loop RAG requests per mode, {wl['max_tokens']} decoded tokens, segcache's host tier "
        f"capped at {mach['segcache_host_bytes']}; {machine_load(mach)}.",
        "",
        *steady_lines(rnd.get("warm_up", {}).get("steady", {}).get("rag")),
        *([f"![TTFT vs rate, mid-size model](bench/results/serve_random_ttft_vs_rate.png)", ""] if sw else []),
        "| mode (RAG) | TTFT p50 (ms) | p90 | hit rate | hits by tier | QPS at SLO | highest passing rate |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for mode in (m for m in MODES if m in rag["modes"]):  # a run may leave a mode out (--modes)
        s = rag["modes"][mode]
        d = sw["modes"][mode] if sw else None
        err = f" ({s['errors']} errors)" if s["errors"] else ""
        qps = "—" if d is None else f"{d['interpolated_qps']:.3f}{' (≥)' if d['lower_bound'] else ''}"
        best = "—" if d is None else f"{d['measured_qps']:.3f}"
        out.append(f"| {LABELS[mode]}{err} | {ms(s['ttft_p50_s'])} | {ms(s['ttft_p90_s'])} | {pct(s['hit_rate'])} | "
                   f"{tiers(s['hits_by_tier'])} | {qps} | {best} |")
    vb = vs_best(rnd)
    out += ["", f"Hypic vs the best baseline (the faster of full recompute and prefix cache at each point): "
            f"TTFT p50 **{named(vb.get('ttft_p50'))}** (aim ≥ 4×; the HYPIC paper {PUBLISHED['ttft_p50']}×)"]
    if sw:
        out[-1] += (f"; QPS at SLO (p90 TTFT ≤ {sw['slo_s']:.1f} s = {sw['slo_x_full_p50']:g} × full recompute's "
                    f"p50, rate ladder {', '.join(f'{x:g}' for x in sw['rates_x'])} × its service rate "
                    f"{sw['full_service_rate_rps']:.3f} req/s, {min(sw['n_per_rate'])}–{max(sw['n_per_rate'])} "
                    f"requests a point) **{named_qps(rnd, vb.get('qps_at_slo'))}** "
                    f"(aim ≥ 2×; the HYPIC paper {PUBLISHED['qps']}×)"
                    + (", a lower bound: hypic met the SLO at every rate of the ladder"
                       if sw["modes"]["hypic"]["lower_bound"] else ""))
    out[-1] += "."
    split = hit_split(rag["modes"]["hypic"].get("records", []))
    if split:
        (n_hit, p50_hit), (n_miss, p50_miss) = split
        prefix_p50 = rag["modes"]["prefix"]["ttft_p50_s"]
        hits = (f"{n_hit} had every segment cached (TTFT p50 {ms(p50_hit)} ms, "
                f"{times(ratio(prefix_p50, p50_hit))} below prefix cache's p50)" if n_hit else
                "none had every segment cached")
        out += ["", f"Where hypic's time goes: of its {n_hit + n_miss} closed-loop RAG requests, {hits}; "
                f"{n_miss} had at least one miss, built on a scatter worker while the hits arrived "
                f"(TTFT p50 {ms(p50_miss)} ms, compose p50 {ms(rag['modes']['hypic'].get('compose_p50_s'))} ms, "
                f"query p50 {ms(rag['modes']['hypic'].get('query_p50_s'))} ms). With a hit rate of "
                f"{pct(rag['modes']['hypic']['hit_rate'])} after this {warm_label(rnd)}, a request waits for the "
                "build of its longest missed document: the misses bound the ratio, not the warm path (its "
                "anatomy below: an all-hit request on this model is within a small factor of its floor)."]
    return out + [""]


def random_shapes_section(rs: dict | None) -> list[str]:
    """The five workloads' closed loops on the mid-size model (serve_random_shapes.json: one bench.serve
    run with every shape and no sweep): TTFT p50 per mode and hypic against the best baseline."""
    if not rs:
        return []
    per_shape = vs_best(rs).get("ttft_p50_per_shape", {})
    out = ["#### The five workloads on the mid-size model (closed loop)", "",
           f"`{command(rs)}` wrote `bench/results/serve_random_shapes.json` in {rs['wall_s'] / 60:.1f} min: the "
           f"same model and mesh, every workload's closed loop after its warm-up ({warm_text(rs)}"
           f"{'' if rs.get('warm_up', {}).get('steady') else ': a young server’s hit rates, below a steady state’s'}), no QPS "
           f"sweep (a sweep per workload on this model is hours on this machine); {machine_load(rs['machine'])}.",
           "", "| workload (segments, tokens per prompt) | TTFT p50 (ms) full / prefix / hypic | hypic hit rate | "
           "TTFT p50, hypic vs the best baseline |", "|---|---:|---:|---|"]
    for shape, d in rs["closed"].items():
        modes, tr = d["modes"], d["trace"]
        p50 = " / ".join(ms(modes[m]["ttft_p50_s"]) if m in modes else "—" for m in ("full", "prefix", "hypic"))
        hit = pct(modes["hypic"]["hit_rate"]) if "hypic" in modes else "—"
        out.append(f"| {shape} ({tr['segments_mean']:.1f} segs, {tr['prompt_tokens_mean']:.0f} tok) | {p50} | "
                   f"{hit} | {named(per_shape.get(shape))} |")
    return out + [""]


def warm_text(rs: dict) -> str:
    st = rs.get("warm_up", {}).get("steady")
    if st:
        return "rounds until hypic's hit rate stopped rising: " + ", ".join(
            f"{w} {v['rounds']} rounds{'' if v['reached'] else ' (capped)'}" for w, v in st.items())
    return "; ".join(f"{w} {n} requests" for w, n in rs.get("warm_up", {}).get("requests", {}).items())


def steady_lines(st: dict | None) -> list[str]:
    """The steady warm-up's curve (bench/steady.py), when the run warmed up that way."""
    if not st:
        return []
    rule, curve = st["rule"], st["curve"]
    pts = ", ".join(f"{p['requests']}: {pct(p['hit_rate'])}" for p in curve)
    pfx = ", ".join(pct(p.get("prefix_hit_rate")) for p in curve)
    cap = " (the cap)" if st["rounds"] == rule["max_rounds"] else ""
    end = (f"it stopped rising after {st['rounds']} rounds{cap} (the last {rule['patience']} above the {rule['patience']} "
           f"before them by {rule['eps'] * 100:g} points or less, on average)" if st["reached"] else
           f"**it was still rising** when the cap of {rule['max_rounds']} rounds ended the warm-up: the figures "
           "below are not the steady state's")
    return [f"Warm-up to steady state (`--steady`, bench/steady.py): rounds of {rule['round_requests']} fresh "
            f"RAG requests in every cache-using mode, {st['wall_s'] / 60:.1f} min. hypic's segment hit rate per "
            f"round (requests so far: hit rate): {pts}; {end}. The prefix cache's replayed hit rate over the "
            f"same rounds: {pfx}.", ""]


def warm_label(rnd: dict) -> str:
    st = rnd.get("warm_up", {}).get("steady", {}).get("rag")
    return "short warm-up" if not st else ("steady warm-up" if st["reached"] else "capped warm-up")


def anatomy_section(an: dict) -> list[str]:
    """Warm mesh TTFT against the all-hit floor, per model (bench/results/anatomy.json)."""
    out = [
        "### Warm path against its floor",
        "",
        f"`python -m bench.anatomy` (`bench/results/anatomy.json`, a separate run; {machine_load(an['machine'])}"
        f"): one request of {an['segments']} random segments of {an['seg_tokens']} tokens and a "
        f"{an['query_tokens']}-token query, every segment a segcache hit, median of {an['models'][0]['mesh']['reps']} "
        "requests through the whole mesh (client TTFT), against the all-hit floor measured in one process: the "
        "entries' bytes at memcpy speed plus the seam and query tokens at the per-token speed of a plain prefill "
        "of one segment.",
        "",
        "| model | client TTFT (ms) | transfer | compose (seams, query inside) | query | router + gRPC | floor (ms) | "
        "TTFT / floor | seam + query tokens as one forward (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in an["models"]:
        m, f = r["mesh"], r["floor"]
        out.append(f"| {short_name(r)} | {ms(m['client_ttft_s'])} | {ms(m['transfer_s'])} | {ms(m['compose_s'])} | "
                   f"{ms(m['query_prefill_s'])} | {ms(m['client_ttft_s'] - m['ttft_s'])} | {ms(f['floor_s'])} | "
                   f"{times(r['ttft_over_floor'])} | {ms(f.get('seam_query_one_forward_s'))} |")
    out += ["", "transfer: from the request's start until the last entry was in hand and verified (lookup, "
            "NIXL or gRPC read, the seal's Poly1305 tag over every byte -- the one check -- and a parse that views "
            "the tensors in place); compose: every seam through every layer with the "
            "cached bodies applied (one layer-major pass), the query folded into the same pass (query: 0, "
            "or the query tokens from the composed state where it was not folded). "
            "The last column is the floor's tokens as one plain forward from an empty state: the per-call "
            "cost of a model that size, which on the tiny bundled model is above the floor itself."]
    for r in an["models"]:
        m, f = r["mesh"], r["floor"]
        pt, seam = f["prefill_per_token_s"], f["seam_query_tokens"] - an["query_tokens"]
        name = short_name(r)
        folded = not m['query_prefill_s']
        compose_tokens = seam + (an['query_tokens'] if folded else 0)
        query = ("" if folded else f", the query {times(m['query_prefill_s'] / (an['query_tokens'] * pt))} "
                 f"its {an['query_tokens']} (a small batch reads every weight)")
        out[-1] += (f" {name[0].upper() + name[1:]}: the {'seams and the query' if folded else 'seams'} cost "
                    f"{times(m['compose_s'] / (compose_tokens * pt))} their {compose_tokens} tokens at prefill speed "
                    f"(each attends over every cached key, each linear layer composes {an['segments']} bodies)"
                    f"{query}, and the transfer adds "
                    f"{ms(m['transfer_s'])} ms to the floor's {1e3 * f['memcpy_s']:.1f} ms of memcpy.")
    return out + [""]


def closing_rows_random(rnd: dict) -> list[str]:
    h, best = rnd["headline"], vs_best(rnd)
    rows = [f"| hypic vs the best baseline, TTFT p50 (RAG), mid-size random-weight model | "
            f"{named(best.get('ttft_p50'))} | {PUBLISHED['ttft_p50']}× (aim ≥ 4×) |"]
    if "qps_at_slo" in best:
        rows.append(f"| hypic vs the best baseline, QPS at SLO (p90 TTFT ≤ {h['slo_s']:.1f} s), mid-size random-weight "
                    f"model | {named_qps(rnd, best['qps_at_slo'])} | {PUBLISHED['qps']}× (aim ≥ 2×) |")
    return rows
