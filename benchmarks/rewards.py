"""Reward library benchmark: throughput per verifier, the inline-vs-pool choice, adversarial latency, and a
10,000-item mixed batch scored with per-item deadlines.

    python benchmarks/rewards.py              # everything (a few minutes on 2 busy cores)
    python benchmarks/rewards.py --items 2000 # a smaller mixed batch

Prints four tables:
1. items/s of each verifier called directly in one process (one core), on honest responses;
2. the RL loop's case — 128 short ``number`` responses — scored inline vs through the worker pool;
3. the hack probes (``vlrl.rewards.probes``) through the executor: worst unit time per verifier vs its
   deadline (worker-side time, or the deadline when the unit was killed);
4. a mixed batch (honest items of every verifier plus ~5 % hostile ones) with the default deadlines:
   total time, items/s, failures, and the worst unit time per verifier vs its deadline.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

from vlrl.rewards import RewardExecutor, RewardItem, RewardSpec, get_reward, spec_of
from vlrl.rewards.probes import CODE_TESTS, OPTIONS, PLAN, REF_HTML, REF_SVG, probes

KILL_SLACK = 0.5  # the pool notices a deadline within ~0.1-0.5 s; a unit counts as late beyond this


def honest_items(rng: random.Random) -> dict[str, list[RewardItem]]:
    """Representative responses per verifier: right and wrong, short, as a policy writes them."""
    items: dict[str, list[RewardItem]] = {}

    def add(reward, response, answer, meta=None):
        name = reward if isinstance(reward, str) else "+".join(reward)
        items.setdefault(name, []).append(RewardItem(response, answer, reward, meta or {}, f"{name}-{len(items.get(name, []))}", name))

    for _ in range(50):
        n = rng.randint(0, 20)
        add("number", f"<think>count them</think><answer>{n + rng.choice([0, 0, 1])}</answer>", str(n))
        letter = rng.choice("ABCD")
        add("multiple_choice", f"<answer>{rng.choice([letter, 'A'])}</answer>", letter, {"options": OPTIONS})
        add("bool", f"<answer>{rng.choice(['Yes', 'no'])}</answer>", "yes")
        add("string_match", f"<answer>{rng.choice(['Paris', 'the city of Paris', 'Rome'])}</answer>", "paris",
            {"mode": "contains"})
        add("ocr", f"<answer>{rng.choice(['hello world', 'helo world', 'goodbye'])}</answer>", "hello world")
        x = rng.randint(0, 50)
        add("bbox_iou", f"<answer>[{x}, {x}, {x + 40}, {x + 40}]</answer>", [10, 10, 50, 50])
        add("format", rng.choice(["<think>a</think><answer>b</answer>", "<answer>b</answer>"]), None)
        add("cot_format", "<think>" + "step " * 20 + "</think>\\boxed{3}", None)
        add("overlong", "x", None, {"max_length": 4096, "cache_length": 512, "response_length": rng.randint(1, 5000)})
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        add("math", rng.choice([f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"<answer>{a / b:.6f}</answer>", "\\boxed{0}"]),
            f"{a}/{b}")
        dets = [{"bbox_2d": [x, x, x + 30, x + 30], "label": "cat"}, {"bbox_2d": [60, 60, 90, 90], "label": "dog"}]
        add("ovd_map", json.dumps(dets[: rng.randint(1, 2)]), dets)
        add("json_plan", json.dumps({"visual_state_description": "", "reasoning_and_reflection": "",
                                     "language_plan": "", **PLAN}), None)
        add("plan_prefix", json.dumps({"executable_plan": PLAN["executable_plan"][: rng.randint(0, 3)]}), PLAN)
        add("html", REF_HTML.replace("Hello", rng.choice(["Hello", "Bye"])), REF_HTML)
        add("svg", REF_SVG.replace("red", rng.choice(["red", "blue"])), REF_SVG)
        add("code", "```python\na, b = map(int, input().split())\nprint(a + b" + rng.choice(["", "", " + 1"]) + ")\n```",
            CODE_TESTS)
    return items


def table_direct(items: dict[str, list[RewardItem]]) -> None:
    print("\n1. items/s per verifier, called directly in one process (one core)")
    print(f"   {'verifier':16s} {'mode':7s} {'items/s':>10s} {'ms/item':>9s}")
    for name, batch in items.items():
        fn = get_reward(name)
        fn(batch[0].response, batch[0].answer, **batch[0].meta)  # warm: imports, caches
        reps = 1 if spec_of(name).mode == "pool" else 20
        start = time.perf_counter()
        for _ in range(reps):
            for item in batch:
                fn(item.response, item.answer, **item.meta)
        seconds = (time.perf_counter() - start) / (reps * len(batch))
        print(f"   {name:16s} {spec_of(name).mode:7s} {1 / seconds:10.0f} {seconds * 1e3:9.3f}")


def number_in_pool(response, answer, **meta):
    """The ``number`` verifier forced through the worker pool (for the inline-vs-pool comparison)."""
    return get_reward("number")(response, answer, **meta)


number_in_pool.reward_spec = RewardSpec(mode="pool", deadline=1.0)


def table_inline_vs_pool() -> None:
    print("\n2. the RL loop's batch: 128 short 'number' responses (median of 20 batches)")
    rng = random.Random(1)
    batch = [RewardItem(f"<answer>{rng.randint(0, 9)}</answer>", "3", "number", {}, str(i), "t") for i in range(128)]
    pooled = [RewardItem(i.response, i.answer, "__main__:number_in_pool", {}, i.id, i.task) for i in batch]
    for label, items, workers in (("inline", batch, 1), ("pool, 1 worker", pooled, 1), ("pool, 2 workers", pooled, 2)):
        with RewardExecutor(workers=workers) as ex:
            ex.start()
            times = []
            for _ in range(20):
                start = time.perf_counter()
                ex.score(items)
                times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        print(f"   {label:16s} {median * 1e3:8.2f} ms per batch  ({median / 128 * 1e6:7.1f} µs/item)")


def table_probes(workers: int) -> None:
    ps = probes()
    print(f"\n3. {len(ps)} hack probes through the executor ({workers} workers, default deadlines)")
    items = [RewardItem(p.response, p.answer, p.reward, p.meta, p.name, p.name.split("/")[0]) for p in ps]
    with RewardExecutor(workers=workers) as ex:
        ex.start()
        start = time.perf_counter()
        outputs, report = ex.score(items)
        wall = time.perf_counter() - start
    over_bound = [p.name for p, o in zip(ps, outputs, strict=True) if o.overall > p.bound + 1e-9]
    print(f"   wall {wall:.2f} s; over their reward bound: {over_bound or 'none'}; "
          f"failures: {len(report.details)} ({dict((d.id, d.kind) for d in report.details)})")
    _latency_table(report)


def _latency_table(report) -> None:
    late = []
    print(f"   {'verifier':16s} {'worst s':>8s} {'deadline':>9s}")
    for name, worst in sorted(report.max_seconds.items(), key=lambda kv: -kv[1]):
        deadline = spec_of(name).deadline
        late += [name] if worst > deadline + KILL_SLACK else []
        print(f"   {name:16s} {worst:8.3f} {deadline:9.1f}")
    print(f"   units over their deadline: {late or 'none'}")


def table_mixed(n_items: int, workers: int, rng: random.Random) -> None:
    print(f"\n4. mixed batch of {n_items} items ({workers} workers, default deadlines)")
    pools = honest_items(rng)
    weights = {"number": 25, "multiple_choice": 15, "bool": 5, "string_match": 5, "ocr": 5, "bbox_iou": 10,
               "format": 3, "cot_format": 2, "overlong": 2, "math": 15, "ovd_map": 2, "json_plan": 1,
               "plan_prefix": 1, "html": 2, "svg": 1.5, "code": 1.5}
    names = list(weights)
    hostile = probes()
    items = []
    for i in range(n_items):
        if rng.random() < 0.05:
            p = hostile[i % len(hostile)]
            items.append(RewardItem(p.response, p.answer, p.reward, p.meta, f"h{i}-{p.name}", "hostile"))
        else:
            name = rng.choices(names, weights=[weights[n] for n in names])[0]
            src = rng.choice(pools[name])
            items.append(RewardItem(src.response, src.answer, src.reward, src.meta, f"m{i}", name))
    with RewardExecutor(workers=workers) as ex:
        ex.start()
        start = time.perf_counter()
        outputs, report = ex.score(items)
        wall = time.perf_counter() - start
    kinds = Counter(d.kind for d in report.details)
    print(f"   total {wall:.1f} s = {n_items / wall:.0f} items/s; units: inline {report.counts['inline_units']}, "
          f"pool {report.counts['pool_units']}; too long {report.counts['too_long']}; failures {dict(kinds)}")
    _latency_table(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000, help="size of the mixed batch")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    table_direct(honest_items(rng))
    table_inline_vs_pool()
    table_probes(args.workers)
    table_mixed(args.items, args.workers, rng)


if __name__ == "__main__":
    main()
