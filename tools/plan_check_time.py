"""Check the planner's step times against real runs on this machine, and its rebalancer.

    python tools/plan_check_time.py layouts    # plan a 4-rank, 8-layer GPT with --profile-local, run 8
                                               # of its layouts for real (turns, medians): Spearman rank
                                               # correlation, the top pick's step over the best's, and
                                               # how many predictions are within 15% of measured
    python tools/plan_check_time.py layouts --models gpt-256 llama-256 gpt-512   # GPT and LLaMA, 3 sizes
    python tools/plan_check_time.py layouts --models gpt-256-s128   # the planner issue's own example model
    python tools/plan_check_time.py layouts --refit   # then close the loop: one run of the top pick with
                                               # --timeline-dir, refit (--from-timeline), the same 8
                                               # re-predicted against the same measured steps (10%)
    python tools/plan_check_time.py layouts --model-flags "--num-layers 6 --hidden-size 384 ..."   # any
                                               # model (its flags and --global-batch-size), as custom-1
    python tools/plan_check_time.py layouts --calibrations 3   # then the same 8 predicted by two more
                                               # fresh calibrations: how far the goals move between them
    python tools/plan_check_time.py cp-share   # each model's decoder layer on one CP2 and CP4 rank (what
                                               # --profile-local measures) over 1 / cp of the whole-
                                               # sequence layer, forward and backward, one thread
    python tools/plan_check_time.py rebalance  # a PP=4 GPT with a large vocabulary on its last stage: run it
                                               # with --timeline-dir, plan --from-timeline, then run both
                                               # layouts in turns: the measured step-time ratio

Runs are ``torchrun --nproc-per-node 4 pretrain_gpt.py <the plan's flags>`` with mock data; a run's
step time is the median of its iterations after the first two (``--log-interval 1``), and each
candidate runs ``--rounds`` times, in turns with the others, so that load from elsewhere falls on all
alike; the median over rounds is kept. The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--vocab-size 8191 --global-batch-size 16 --attention-dropout 0.0 --hidden-dropout 0.0"
)
MODELS = {
    "gpt-256": MODEL,
    "llama-256": (
        "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
        "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
        "--disable-bias-linear --seq-length 256 --max-position-embeddings 256 --vocab-size 8191 "
        "--global-batch-size 16 --attention-dropout 0.0 --hidden-dropout 0.0"
    ),
    "gpt-256-s128": (  # the planner issue's own example: gpt-256 at half the sequence, a smaller vocabulary
        "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--vocab-size 4095 --global-batch-size 16 --attention-dropout 0.0 --hidden-dropout 0.0"
    ),
    "gpt-512": (
        "--num-layers 6 --hidden-size 512 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--vocab-size 16383 --global-batch-size 16 --attention-dropout 0.0 --hidden-dropout 0.0"
    ),
}
"""The models ``layouts`` checks (``--models``): GPT and LLaMA, three sizes, and the GPT at a shorter sequence."""
WITHIN = 0.15
"""The issue's goal per candidate: predicted within this share of measured."""
REFIT_WITHIN = 0.10
"""The goal after one refit from a short run's timeline (``layouts --refit``)."""
UNBALANCED = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--vocab-size 32767 --global-batch-size 16 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--pipeline-model-parallel-size 4 --micro-batch-size 2"
)
_ITERATION = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_steps(args: list[str], iterations: int, extra: list[str] = ()) -> list[float]:
    """Seconds of each iteration after the first two of a real 4-rank run of ``args``."""
    command = ["torchrun", "--nproc-per-node", "4", os.path.join(ROOT, "pretrain_gpt.py"), *args,
               "--train-iters", str(iterations), "--log-interval", "1", "--eval-iters", "0",
               "--num-workers", "0", *extra]  # fmt: skip
    done = subprocess.run(
        command, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    times = [float(t) / 1e3 for t in _ITERATION.findall(done.stdout)]
    return times[2:]


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def _strip(args: list[str]) -> list[str]:
    """A plan's flags without the placeholders this script sets itself."""
    out, skip = [], False
    for token in args:
        if skip:
            skip = False
            continue
        if token in ("--train-iters",):
            skip = True
            continue
        out.append(token)
    return out


def choose(planned: list, count: int) -> list:
    """The top pick and ``count - 1`` more spread over the predicted range, one per split and schedule."""
    seen, distinct = set(), []
    for p in planned:
        key = (p["split"], p["schedule"], p["micro_batch_size"])
        if key not in seen:
            seen.add(key)
            distinct.append(p)
    if len(distinct) <= count:
        return distinct
    step = (len(distinct) - 1) / (count - 1)
    return [distinct[round(i * step)] for i in range(count)]


def _planned(plan_input, cluster, profile, fixed: dict, top: int = 1000) -> list[dict]:
    """Every candidate the planner ranks (as ``tools/plan.py --json`` gives them), best first."""
    from planner.report import candidate_json
    from planner.search import search

    result = search(plan_input.spec, cluster, global_batch_size=plan_input.global_batch_size, fixed=fixed,
                    allow_distributed_optimizer=plan_input.distributed_optimizer_allowed, top=top,
                    profile=profile, device="cpu")  # fmt: skip
    payload = [(p.cand, candidate_json(p, plan_input.base_flags)) for p in result.candidates]
    return [
        {"split": _split(c), "schedule": c["schedule"], "micro_batch_size": c["micro_batch_size"],
         "predicted": c["step_seconds"], "args": _strip(c["args"]), "recompute": c["recompute"],
         "cand": cand}
        for cand, c in payload
    ]  # fmt: skip


def _table(rows: list[dict], predicted_key: str, within: float) -> dict:
    """Print predicted against measured; the ranking figures."""
    predicted, actual = [r[predicted_key] for r in rows], [r["measured"] for r in rows]
    result = {
        "spearman": _spearman(predicted, actual),
        "top_pick_over_best": actual[min(range(len(rows)), key=predicted.__getitem__)] / min(actual),
        "within": sum(abs(p / a - 1) <= within for p, a in zip(predicted, actual)),
        "load": _load(),
    }
    print(f"{'candidate':45s} {'predicted s':>12s} {'measured s':>11s} {'error':>7s}")
    for r in rows:
        print(f"{r['split'] + ' ' + r['schedule'] + ' mbs ' + str(r['micro_batch_size']):45s} "
              f"{r[predicted_key]:12.3f} {r['measured']:11.3f} {r[predicted_key] / r['measured'] - 1:+7.0%}")  # fmt: skip
    print(f"Spearman {result['spearman']:.3f}; top pick {result['top_pick_over_best']:.3f}x the best measured; "
          f"{result['within']}/{len(rows)} within {within:.0%}; {result['load']}")  # fmt: skip
    return result


def _calibration(cluster, profile, spec, chosen: list[dict]) -> dict:
    """Print what the calibration measured (``tools/plan.py``'s ``measured here:`` line) and the
    profiled decoder layer of each chosen candidate's shape; the same as JSON. The predictions' level
    moves with these from one calibration to the next."""
    from planner.cli import describe_cluster

    print("\n".join(describe_cluster(cluster, spec)[1:]))
    shapes = {}
    for c in chosen:
        cand = c["cand"]
        key = (cand.tp, cand.micro_batch_size, cand.recompute, cand.cp)
        shapes[f"TP{key[0]} CP{key[3]} mbs {key[1]} recompute {key[2]}"] = profile.for_shape(*key)[0]
    print("decoder layer F / I / W ms: " + "; ".join(
        f"{name} {' / '.join(f'{1e3 * t:.1f}' for t in layer)}" for name, layer in shapes.items()))  # fmt: skip
    host = cluster.host
    return {"slowdown": list(host.slowdown), "action_seconds": host.action_seconds,
            "step_seconds": host.step_seconds, "layer_seconds": shapes}  # fmt: skip


def _calibrated(model: str) -> tuple:
    """(plan input, cluster, profile) of ``model`` on this machine's 4 ranks, as ``--profile-local`` plans."""
    from planner.inputs import read_input
    from planner.profile import LocalProfile, local_cluster

    plan_input = read_input(model.split())
    return (
        plan_input,
        local_cluster(4, plan_input.spec.precision),
        LocalProfile(plan_input.spec, plan_input.args),
    )


def check_layouts(
    count: int, rounds: int, iterations: int, model: str = MODEL, refit: bool = False, calibrations: int = 1
) -> dict:
    """Plan ``model`` with this machine's calibration, run ``count`` candidates ``rounds`` times in turns,
    print predicted against measured; with ``refit``, then :func:`refit_layouts`; with ``calibrations``
    above 1, then :func:`recalibrated`."""
    plan_input, cluster, profile = _calibrated(model)
    planned = _planned(plan_input, cluster, profile, plan_input.fixed)
    chosen = choose(planned, count)
    calibration = _calibration(cluster, profile, plan_input.spec, chosen)
    print(
        f"{len(planned)} candidates planned; running {len(chosen)} in {rounds} rounds ({_load()})", flush=True
    )
    measured: dict[int, list[float]] = {i: [] for i in range(len(chosen))}
    for round_ in range(rounds):
        for i, c in enumerate(chosen):
            times = run_steps(c["args"], iterations)
            measured[i].append(statistics.median(times))
            print(f"  round {round_ + 1} #{i + 1} {c['split']} {c['schedule']} mbs {c['micro_batch_size']}: "
                  f"{statistics.median(times):.3f} s ({_load()})", flush=True)  # fmt: skip
    rows = [{**{k: v for k, v in c.items() if k not in ("args", "cand")}, "measured": statistics.median(measured[i]),
             "rounds": measured[i], "args": c["args"]} for i, c in enumerate(chosen)]  # fmt: skip
    result = {"rows": rows, "calibration": calibration, **_table(rows, "predicted", WITHIN)}
    if calibrations > 1:
        result["recalibrated"] = recalibrated(model, chosen, rows, calibrations - 1)
    if refit:
        result["refit"] = refit_layouts(plan_input, cluster, profile, chosen, rows, iterations)
    return result


def _fresh_calibration(model: str, cands: list, results) -> None:
    """In a fresh process, as ``tools/plan.py`` plans: calibrate, profile and predict ``cands``."""
    from planner.step_time import estimate_step

    plan_input, cluster, profile = _calibrated(model)
    predicted = [estimate_step(plan_input.spec, c, cluster, profile).step_seconds for c in cands]
    results.put((predicted, _calibration(cluster, profile, plan_input.spec, [{"cand": c} for c in cands])))


def recalibrated(model: str, chosen: list[dict], rows: list[dict], times: int) -> list[dict]:
    """The same candidates predicted by ``times`` fresh calibrations (``--profile-local`` and the
    host's), each in a fresh process as a plan's is, against the steps already measured: how far the
    goals move from one calibration to the next on an unchanged machine."""
    import multiprocessing

    from core.spawned import first_result

    context, found = multiprocessing.get_context("spawn"), []
    for k in range(times):
        key = f"calibration {k + 2}"
        print(f"{key} ({_load()}):", flush=True)
        results = context.Queue()
        process = context.Process(
            target=_fresh_calibration, args=(model, [c["cand"] for c in chosen], results)
        )
        process.start()
        try:
            predicted, calibration = first_result(results, [process], 900, "calibration")
        finally:
            process.join(timeout=60)
        again = [{**r, key: t} for r, t in zip(rows, predicted)]
        found.append({"rows": again, "calibration": calibration, **_table(again, key, WITHIN)})
    return found


def refit_layouts(
    plan_input, cluster, profile, chosen: list[dict], rows: list[dict], iterations: int
) -> dict:
    """The loop closed: run the top pick once with ``--timeline-dir``, refit the costs from its timeline
    (``tools/plan.py --from-timeline``: compute and the collectives its layout exercised), re-plan with
    the same calibration, and print the same candidates' new predictions against the steps already
    measured (within :data:`REFIT_WITHIN`)."""
    from planner.inputs import read_input
    from planner.rebalance import rebalance_report
    from planner.step_time import estimate_step

    top = chosen[0]
    with tempfile.TemporaryDirectory() as tmp:
        timeline = os.path.join(tmp, "timeline")
        recorded = [str(i) for i in range(3, iterations + 1)]  # every timed iteration (not the first two)
        times = run_steps(
            top["args"], iterations, ["--timeline-dir", timeline, "--timeline-iters", *recorded]
        )
        run_input = read_input(top["args"])
        report, refitted, _ = rebalance_report(run_input, cluster, timeline, profile)
    print(f"refit from a {iterations}-iteration run of the top pick, {top['split']} {top['schedule']} mbs "
          f"{top['micro_batch_size']} ({statistics.median(times):.3f} s a step; {_load()}):", flush=True)  # fmt: skip
    print(report, flush=True)
    again = [estimate_step(plan_input.spec, c["cand"], cluster, refitted).step_seconds for c in chosen]
    refit_rows = [{**r, "refit": t} for r, t in zip(rows, again)]
    pick = _planned(plan_input, cluster, refitted, {}, top=1)[0]
    print(f"re-planned with the refitted costs, the top pick: {pick['split']} {pick['schedule']} mbs "
          f"{pick['micro_batch_size']} ({pick['predicted']:.3f} s predicted)", flush=True)  # fmt: skip
    return {"rows": refit_rows, "timeline_run_seconds": statistics.median(times),
            **_table(refit_rows, "refit", REFIT_WITHIN)}  # fmt: skip


def _split(c: dict) -> str:
    parts = [("TP", c["tp"]), ("CP", c["cp"]), ("PP", c["pp"]), ("VPP", c["vpp"])]
    return "x".join([f"{n}{s}" for n, s in parts if s > 1] + [f"DP{c['dp']}"])


def check_rebalance(rounds: int, iterations: int) -> dict:
    from planner.cli import main as plan

    base = UNBALANCED.split() + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4"]
    with tempfile.TemporaryDirectory() as tmp:
        timeline = os.path.join(tmp, "timeline")
        run_steps(base, iterations, ["--timeline-dir", timeline, "--timeline-iters", str(iterations - 1),
                                     str(iterations)])  # fmt: skip
        out = os.path.join(tmp, "plan.out")
        with open(out, "w") as f, contextlib.redirect_stdout(f):
            plan([*UNBALANCED.split(), "--num-gpus", "4", "--profile-local", "--from-timeline", timeline])
        with open(out) as f:
            report = f.read()
    print(report, flush=True)
    proposed = re.search(r"--pipeline-model-parallel-layout '([^']+)'", report).group(1)
    gain = float(re.search(r"predicted gain: ([\d.]+)x", report).group(1))
    layouts = {"even": [], "proposed": []}
    for round_ in range(rounds):
        for name, taken in layouts.items():
            extra = [] if name == "even" else ["--pipeline-model-parallel-layout", proposed]
            times = run_steps(base + extra, iterations)
            taken.append(statistics.median(times))
            print(f"  round {round_ + 1} {name}: {statistics.median(times):.3f} s ({_load()})", flush=True)
    even, new = statistics.median(layouts["even"]), statistics.median(layouts["proposed"])
    result = {"proposed_layout": proposed, "predicted_gain": gain, "even_seconds": even, "proposed_seconds": new,
              "measured_ratio": new / even, "rounds": layouts, "load": _load()}  # fmt: skip
    print(f"measured: proposed {new:.3f} s / even {even:.3f} s = {new / even:.3f} "
          f"(predicted {1 / gain:.3f}); {result['load']}")  # fmt: skip
    return result


def check_cp_share(models: dict[str, str], micro_batch_sizes: tuple[int, ...] = (1, 2)) -> dict:
    """A context-parallel rank's decoder layer, as ``--profile-local`` measures it (its share of the
    sequence, ring attention in a fake group), over ``1 / cp`` of the whole-sequence layer: why the
    profile measures each CP size rather than dividing. ``models``: name -> model flags."""
    from planner.inputs import read_input
    from planner.profile import measure_shape

    rows = []
    print(f"{'model':10s} {'mbs':>3s} {'cp':>3s} {'whole F/B ms':>14s} {'rank F/B ms':>13s} "
          f"{'F ratio':>7s} {'B ratio':>7s}")  # fmt: skip
    for name, flags in models.items():
        plan_input = read_input(flags.split())
        args, spec = plan_input.args, plan_input.spec
        for mbs in micro_batch_sizes:
            whole = measure_shape(args, spec, 1, mbs, "none", cp=1, repeats=5)[0]
            for cp in (2, 4):
                share = measure_shape(args, spec, 1, mbs, "none", cp=cp, repeats=5)[0]
                forward, backward = cp * share[0] / whole[0], cp * sum(share[1:]) / sum(whole[1:])
                rows.append({"model": name, "micro_batch_size": mbs, "cp": cp, "whole": whole, "rank": share,
                             "forward_ratio": forward, "backward_ratio": backward})  # fmt: skip
                print(f"{name:10s} {mbs:3d} {cp:3d} {1e3 * whole[0]:6.2f}/{1e3 * sum(whole[1:]):6.2f} "
                      f"{1e3 * share[0]:5.2f}/{1e3 * sum(share[1:]):6.2f} {forward:7.2f} {backward:7.2f}",
                      flush=True)  # fmt: skip
    return {"rows": rows, "load": _load()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["layouts", "cp-share", "rebalance"])
    parser.add_argument("--count", type=int, default=8, help="layouts to run (layouts)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=6, help="per run; the first two are not timed")
    parser.add_argument("--refit", action="store_true",
                        help="layouts: then run the top pick once with --timeline-dir, refit, and print the "
                        "same candidates re-predicted against the same measured steps (within 10%%)")  # fmt: skip
    parser.add_argument("--calibrations", type=int, default=1,
                        help="layouts: then predict the same candidates with this many calibrations in all "
                        "(each fresh, in a fresh process as a plan's), against the same measured steps")  # fmt: skip
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                        help="layouts, cp-share: the models to check, each in turn (all: GPT and LLaMA, three "
                        "sizes, and gpt-256-s128, the planner issue's example; default gpt-256 unless "
                        "--model-flags is given)")  # fmt: skip
    parser.add_argument("--model-flags", action="append", default=[], metavar="FLAGS",
                        help="layouts, cp-share: also check this model, given as pretrain_gpt.py's model flags in "
                        "one string (with --global-batch-size; repeat for more models: custom-1, custom-2, ...)")  # fmt: skip
    args = parser.parse_args()
    models = {name: MODELS[name] for name in args.models or ([] if args.model_flags else ["gpt-256"])}
    models |= {f"custom-{i + 1}": flags for i, flags in enumerate(args.model_flags)}
    if args.what == "layouts":
        result = {}
        for name, flags in models.items():
            print(f"== {name}: {flags}", flush=True)
            result[name] = check_layouts(
                args.count, args.rounds, args.iterations, flags, args.refit, args.calibrations
            )
    elif args.what == "cp-share":
        result = check_cp_share(models)
    else:
        result = check_rebalance(args.rounds, args.iterations)
    print(json.dumps({"check": args.what, **result}, default=lambda o: o.item()))  # numpy scalars


if __name__ == "__main__":
    main()
