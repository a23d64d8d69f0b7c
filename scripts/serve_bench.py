#!/usr/bin/env python3
"""A serving benchmark for `mtp serve` that checks the server's promise on every response
it measures: each one's token ids are bitwise those of the same request sent alone.

    # against a running server
    python scripts/serve_bench.py --url http://127.0.0.1:8000 --workload shared-prefix \\
        --requests 32 --concurrency 16 --prefix-tokens 600 --own-tokens 64 --max-tokens 32
    # starting one (from the repository root; stopped at the end, its startup timed apart;
    # `--serve=ARGS` with the `=`, as ARGS starts with a dash; `--port` comes from --url)
    python scripts/serve_bench.py --binary target/release/mtp \\
        --serve="--max-batch 16 --prefix-cache-mib 0" --workload chat --arrival poisson --rate 4
    # the checker's negative control: one alone run perturbed must be reported
    python scripts/serve_bench.py --serve="--max-batch 16" --self-test-negative

Contract:
- Workloads (prompts cut from examples/heldout-prompts.jsonl, repeated as needed, sized
  in characters from a chars-per-token ratio measured with one calibration request, so
  sizes are approximate; the mean prompt tokens actually sent is read off each response's
  `usage.prompt_tokens`): `shared-prefix` sends one shared block of about
  `--prefix-tokens` tokens of code then a distinct part of about `--own-tokens` tokens
  through /v1/completions; `chat` sends distinct prompts of about `--own-tokens` tokens as
  one user message through /v1/chat/completions (the template adds its own tokens).
- Arrivals: `burst` (all `--requests` at time 0) or `poisson --rate R` (exponential gaps,
  seeded by `--seed`); at most `--concurrency` requests in flight either way. Latencies
  are timed from when a request is sent, not from its arrival.
- Every request is streamed with `return_token_ids`; greedy (temperature 0) unless picked
  by `--sampled-fraction F`: temperature 0.8 with a per-request seed (reproducible).
- Report (a table on stdout, `--json PATH`): wall time, requests ok / failed, output and
  prompt tokens/s, TTFT, inter-token latency (gaps between chunks that carry tokens) and
  end-to-end latency p50/p90/p99, prompt tokens from the prefix cache, and the peak of
  /metrics' `mtp_kv_bytes` and `mtp_prefix_cache_bytes` (polled every 100 ms) with their
  idle values before and after the load; `mtp_kv_bytes` not back at idle is a K/V leak.
- `--check-alone N|all` (default: all up to 64 requests, else 32 of them): after the load
  the chosen requests are sent again one at a time, same parameters, and their token ids
  and finish reasons compared with the load's. `--self-test-negative` perturbs one alone
  run (max_tokens one less than the tokens it produced) and passes only if exactly that
  request is reported different.
- Exit status: 0 all good; 1 a failed request, a difference, or a K/V leak (with
  `--self-test-negative`: the checker missed the perturbation); 2 bad setup (server not
  reachable, /health failing, bad flags).
"""

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx
import openai

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "examples", "heldout-prompts.jsonl")


class SetupError(Exception):
    """The benchmark could not start: nothing was measured (exit status 2)."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def pct(xs, p):
    """The p-th percentile by nearest rank (nan for no samples)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


# ---- the server: started here or already running ---------------------------------------

class Server:
    """`mtp serve ARGS` as a child process: started, waited on until /health answers, stopped."""

    def __init__(self, binary, args, url):
        self.binary, self.args, self.url = binary, shlex.split(args), url
        if not any(a == "--port" or a.startswith("--port=") for a in self.args):
            self.args += ["--port", str(urlparse(url).port or 80)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mtp-serve-", suffix=".log", delete=False)
        self.proc, self.startup_s = None, None

    def start(self, timeout=300):
        if not os.access(self.binary, os.X_OK):
            raise SetupError(f"--binary {self.binary}: not an executable file (build it, or pass --binary)")
        if health(self.url, quiet=True):
            raise SetupError(f"something already answers {self.url}/health: stop it or pick another --url port")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([self.binary, "serve", *self.args], stdout=self.log, stderr=subprocess.STDOUT)
        log(f"started {self.binary} serve {' '.join(self.args)} (pid {self.proc.pid}, log {self.log.name})")
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SetupError(f"mtp serve exited with status {self.proc.returncode}:\n{self.tail()}")
            if health(self.url, quiet=True):
                self.startup_s = time.perf_counter() - t0
                return
            time.sleep(0.05)
        raise SetupError(f"mtp serve did not answer {self.url}/health within {timeout} s:\n{self.tail()}")

    def tail(self, lines=20):
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def health(url, quiet=False):
    """Whether GET /health answers 200; with quiet=False a failure is a SetupError."""
    try:
        r = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError as e:
        if quiet:
            return False
        raise SetupError(f"server not reachable at {url}: {e!r} (start it, or use --serve)")
    if r.status_code != 200:
        if quiet:
            return False
        raise SetupError(f"{url}/health answered {r.status_code}: {r.text[:200]}")
    return True


# ---- /metrics ---------------------------------------------------------------------------

GAUGES = ("mtp_kv_bytes", "mtp_prefix_cache_bytes", "mtp_prompt_tokens_cached_total", "mtp_preemptions_total")


async def read_metrics(http):
    r = await http.get("/metrics")
    r.raise_for_status()
    found = {}
    for line in r.text.splitlines():
        m = re.match(r"^(\w+) (\S+)$", line)
        if m and m.group(1) in GAUGES:
            found[m.group(1)] = float(m.group(2))
    return found


class MetricsPoller:
    """Polls /metrics every `period` s while the load runs, keeping each gauge's peak."""

    def __init__(self, http, period=0.1):
        self.http, self.period, self.peak, self.polls, self.task = http, period, {}, 0, None

    async def _run(self):
        while True:
            try:
                for k, v in (await read_metrics(self.http)).items():
                    self.peak[k] = max(v, self.peak.get(k, v))
                self.polls += 1
            except httpx.HTTPError:
                pass  # a missed poll only lowers the sampling rate
            await asyncio.sleep(self.period)

    def start(self):
        self.task = asyncio.create_task(self._run())

    async def stop(self):
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


# ---- the workload -----------------------------------------------------------------------

def corpus():
    with open(CORPUS) as f:
        return "\n".join(json.loads(line)["prompt"] for line in f if line.strip())


def cut(text, start, chars):
    """`chars` characters of `text` read from `start`, wrapping around as often as needed."""
    start %= len(text)
    out = ""
    while len(out) < chars:
        out += text[start:start + chars - len(out)]
        start = 0
    return out


async def chars_per_token(client, model, text):
    """The corpus' characters per token, from one request's usage (its first line differs
    from every benchmark prompt, so it warms no prefix the load will use)."""
    sample = "// calibration\n" + cut(text, 0, 1500)
    r = await client.completions.create(model=model, prompt=sample, max_tokens=1, temperature=0)
    return len(sample) / r.usage.prompt_tokens


def build_requests(args, text, cpt):
    """The benchmark's requests: what to send, and how, for each index."""
    rng = random.Random(args.seed)
    sampled = set(rng.sample(range(args.requests), round(args.sampled_fraction * args.requests)))
    prefix = cut(text, 0, round(args.prefix_tokens * cpt)) + "\n" if args.workload == "shared-prefix" else ""
    own_chars = round(args.own_tokens * cpt)
    reqs = []
    for i in range(args.requests):
        # A distinct first line, then the corpus from a per-request offset.
        own = f"// request {i}\n" + cut(text, 997 * i + 131, own_chars)
        reqs.append({
            "index": i,
            "prompt": prefix + own,
            "max_tokens": args.max_tokens,
            "temperature": 0.8 if i in sampled else 0.0,
            "seed": args.seed * 100_003 + i,
        })
    return reqs


async def send(client, model, workload, req, ignore_eos):
    """Streams one request; returns its token ids, usage and timings (or its error)."""
    common = dict(model=model, max_tokens=req["max_tokens"], temperature=req["temperature"], seed=req["seed"],
                  stream=True, stream_options={"include_usage": True},
                  extra_body={"return_token_ids": True, "ignore_eos": ignore_eos})
    out = {"index": req["index"], "ids": [], "gaps": [], "ttft": None, "finish": None, "prompt_tokens": None}
    t0 = time.perf_counter()
    last = None
    try:
        if workload == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": req["prompt"]}], **common)
        else:
            stream = await client.completions.create(prompt=req["prompt"], **common)
        async for chunk in stream:
            if chunk.usage:
                out["prompt_tokens"] = chunk.usage.prompt_tokens
            for c in chunk.choices:
                ids = (c.model_extra or {}).get("token_ids") or []
                if ids:
                    now = time.perf_counter()
                    if last is None:
                        out["ttft"] = now - t0
                    else:
                        out["gaps"].append(now - last)
                    last = now
                    out["ids"] += ids
                out["finish"] = c.finish_reason or out["finish"]
        if out["finish"] not in ("stop", "length"):
            raise RuntimeError(f"stream ended without a finish reason (finish {out['finish']!r})")
        out["e2e"] = time.perf_counter() - t0
    except Exception as e:  # counted and reported: a benchmark must show every failure
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def run_load(args, client, model, reqs):
    """Sends `reqs` on their arrival schedule, at most --concurrency in flight."""
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        if args.arrival == "poisson":
            t += rng.expovariate(args.rate)
    gate = asyncio.Semaphore(args.concurrency)
    state = {"done": 0, "failed": 0, "in_flight": 0}
    t0 = time.perf_counter()

    async def one(req, at):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with gate:
            state["in_flight"] += 1
            r = await send(client, model, args.workload, req, args.ignore_eos)
            state["in_flight"] -= 1
        state["done"] += 1
        state["failed"] += "error" in r
        return r

    async def progress():
        while True:
            await asyncio.sleep(3)
            log(f"  {time.perf_counter() - t0:6.1f} s: done {state['done']}/{len(reqs)}, "
                f"in flight {state['in_flight']}, failed {state['failed']}")

    ticker = asyncio.create_task(progress())
    results = await asyncio.gather(*(one(r, a) for r, a in zip(reqs, arrivals)))
    ticker.cancel()
    return results, time.perf_counter() - t0


def first_difference(a, b):
    """The first token index where two id lists differ (None when equal)."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


async def check_alone(args, client, model, reqs, results, chosen, perturb):
    """Sends each chosen request again alone; compares ids and finish reasons with the load's."""
    differ = []
    for n, i in enumerate(chosen):
        req = dict(reqs[i])
        if i == perturb:
            req["max_tokens"] = len(results[i]["ids"]) - 1
        alone = await send(client, model, args.workload, req, args.ignore_eos)
        if "error" in alone:
            differ.append({"index": i, "token": None, "why": f"alone run failed: {alone['error']}"})
            continue
        j = first_difference(results[i]["ids"], alone["ids"])
        if j is not None or alone["finish"] != results[i]["finish"]:
            differ.append({"index": i, "token": j, "load": results[i]["ids"][j:j + 4] if j is not None else [],
                           "alone": alone["ids"][j:j + 4] if j is not None else [],
                           "why": "token ids differ" if j is not None
                           else f"finish {results[i]['finish']} vs {alone['finish']}"})
        if (n + 1) % 8 == 0:
            log(f"  alone {n + 1}/{len(chosen)}, differing {len(differ)}")
    return differ


# ---- the report -------------------------------------------------------------------------

def summarize(args, results, wall):
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(len(r["ids"]) for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    ms = lambda xs: {f"p{p}": pct(xs, p) * 1e3 for p in (50, 90, 99)}
    return {
        "wall_s": wall,
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else float("nan"),
        "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens_per_s": prompt_tokens / wall,
        "ttft_ms": ms([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_ms": ms([g for r in ok for g in r["gaps"]]),
        "e2e_ms": ms([r["e2e"] for r in ok]),
    }


def print_table(report):
    s, m = report["load"], report["metrics"]
    rows = [
        ("workload", f"{report['config']['workload']}, {report['config']['arrival']} arrivals, "
                     f"{report['config']['requests']} requests, concurrency {report['config']['concurrency']}, "
                     f"max_tokens {report['config']['max_tokens']}"),
        ("server startup", f"{report['startup_s']:.2f} s" if report["startup_s"] is not None else "(already running)"),
        ("wall time", f"{s['wall_s']:.2f} s"),
        ("requests ok / failed", f"{s['requests_ok']} / {s['requests_failed']}"),
        ("mean prompt tokens", f"{s['mean_prompt_tokens']:.1f} (from usage.prompt_tokens)"),
        ("output tokens/s", f"{s['output_tokens_per_s']:.1f} ({s['output_tokens']} tokens)"),
        ("prompt tokens/s", f"{s['prompt_tokens_per_s']:.1f} ({s['prompt_tokens']} tokens, "
                            f"{m['prompt_tokens_cached']:.0f} from the prefix cache)"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "inter-token latency"), ("e2e_ms", "end-to-end latency")):
        rows.append((f"{name} p50/p90/p99", " / ".join(f"{s[key][p]:.1f}" for p in ("p50", "p90", "p99")) + " ms"))
    for g in ("mtp_kv_bytes", "mtp_prefix_cache_bytes"):
        v = m[g]
        rows.append((f"{g} peak", f"{v['peak'] / 2**20:.2f} MiB (idle {v['idle_before'] / 2**20:.2f} before, "
                                  f"{v['idle_after'] / 2**20:.2f} after)"))
    rows.append(("K/V leak", "YES: mtp_kv_bytes did not return to idle" if m["kv_leak"] else "no"))
    rows.append(("preemptions", f"{m['preemptions']:.0f} (rows that gave their K/V up and resumed)"))
    a = report["alone"]
    if a is not None:
        line = f"{a['equal']} of {a['checked']} equal"
        if a["differ"]:
            d = a["differ"][0]
            line += f"; first difference: request {d['index']} at token {d['token']} ({d['why']})"
        rows.append(("bitwise vs alone", line))
        if a.get("negative") is not None:
            rows.append(("negative self-test", "passed" if a["negative"] else "FAILED: perturbation not caught"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


# ---- main -------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server address (no /v1)")
    ap.add_argument("--serve", metavar="ARGS", help="start `BINARY serve ARGS` and stop it at the end (write --serve=ARGS)")
    ap.add_argument("--binary", default="target/release/mtp")
    ap.add_argument("--api-key", default=os.environ.get("MTP_API_KEY", "unused"))
    ap.add_argument("--workload", choices=("shared-prefix", "chat"), default="shared-prefix")
    ap.add_argument("--prefix-tokens", type=int, default=600)
    ap.add_argument("--own-tokens", type=int, default=64)
    ap.add_argument("--arrival", choices=("burst", "poisson"), default="burst")
    ap.add_argument("--rate", type=float, help="poisson arrivals: requests per second")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true", help="every response runs to --max-tokens")
    ap.add_argument("--sampled-fraction", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-alone", default=None, metavar="N|all")
    ap.add_argument("--self-test-negative", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if args.arrival == "poisson" and not (args.rate and args.rate > 0):
        ap.error("--arrival poisson needs --rate R > 0")
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 2 or args.own_tokens < 1:
        ap.error("--requests, --concurrency, --own-tokens must be at least 1 and --max-tokens at least 2")
    if args.workload == "shared-prefix" and args.prefix_tokens < 1:
        ap.error("--workload shared-prefix needs --prefix-tokens of at least 1")
    if not 0.0 <= args.sampled_fraction <= 1.0:
        ap.error("--sampled-fraction must be between 0 and 1")
    default = "all" if args.requests <= 64 else "32"
    args.check_alone = args.check_alone or default
    if args.check_alone != "all" and not (args.check_alone.isdigit()):
        ap.error("--check-alone takes a count or `all`")
    if args.self_test_negative and args.check_alone == "0":
        ap.error("--self-test-negative needs --check-alone of at least 1")
    args.url = args.url.rstrip("/").removesuffix("/v1")
    return args


async def bench(args, startup_s):
    http = httpx.AsyncClient(base_url=args.url, timeout=600, headers={"Authorization": f"Bearer {args.api_key}"},
                             limits=httpx.Limits(max_connections=args.concurrency + 4))
    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=600,
                                http_client=http)
    try:
        model = (await client.models.list()).data[0].id
        await read_metrics(http)
    except (openai.APIError, httpx.HTTPError) as e:
        raise SetupError(f"{args.url}: /v1/models or /metrics failed: {e!r}")
    cpt = await chars_per_token(client, model, text := corpus())
    reqs = build_requests(args, text, cpt)
    idle = await read_metrics(http)  # after the calibration request
    log(f"model {model}; {cpt:.2f} characters per token; {len(reqs)} requests")

    poller = MetricsPoller(http)
    poller.start()
    results, wall = await run_load(args, client, model, reqs)
    await poller.stop()
    # A finished row's K/V is freed at the engine's next round: give it a moment.
    for _ in range(50):
        after = await read_metrics(http)
        if after["mtp_kv_bytes"] <= idle["mtp_kv_bytes"]:
            break
        await asyncio.sleep(0.1)
    metrics = {g: {"idle_before": idle[g], "peak": max(poller.peak.get(g, 0.0), after[g]), "idle_after": after[g]}
               for g in ("mtp_kv_bytes", "mtp_prefix_cache_bytes")}
    metrics["kv_leak"] = after["mtp_kv_bytes"] != idle["mtp_kv_bytes"]
    metrics["prompt_tokens_cached"] = after["mtp_prompt_tokens_cached_total"] - idle["mtp_prompt_tokens_cached_total"]
    metrics["preemptions"] = after.get("mtp_preemptions_total", 0.0) - idle.get("mtp_preemptions_total", 0.0)
    metrics["polls"] = poller.polls

    ok = [r["index"] for r in results if "error" not in r]
    alone = None
    if args.check_alone != "0" and ok:
        want = len(ok) if args.check_alone == "all" else min(len(ok), int(args.check_alone))
        chosen = sorted(random.Random(args.seed + 1).sample(ok, want))
        perturb = None
        if args.self_test_negative:
            perturb = next((i for i in chosen if len(results[i]["ids"]) >= 2), None)
            if perturb is None:
                raise SetupError("--self-test-negative: no checked response has 2 tokens to cut")
        log(f"checking {len(chosen)} requests alone, one at a time"
            + (f" (request {perturb} perturbed: max_tokens cut by one)" if perturb is not None else ""))
        differ = await check_alone(args, client, model, reqs, results, chosen, perturb)
        alone = {"checked": len(chosen), "equal": len(chosen) - len(differ), "differ": differ}
        if perturb is not None:
            alone["negative"] = [d["index"] for d in differ] == [perturb]
    await http.aclose()

    report = {"config": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
              "model": model, "chars_per_token": cpt, "startup_s": startup_s,
              "load": summarize(args, results, wall), "metrics": metrics, "alone": alone,
              "errors": [f"request {r['index']}: {r['error']}" for r in results if "error" in r]}
    print_table(report)
    for e in report["errors"][:10]:
        log(e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    failed = report["load"]["requests_failed"] > 0 or metrics["kv_leak"]
    if alone is None:
        return 1 if failed else 0
    if args.self_test_negative:
        return 1 if failed or not alone["negative"] else 0
    return 1 if failed or alone["differ"] else 0


def main():
    args = parse_args()
    server = Server(args.binary, args.serve, args.url) if args.serve is not None else None
    try:
        if server:
            server.start()
            log(f"server up in {server.startup_s:.2f} s")
        else:
            health(args.url)
        code = asyncio.run(bench(args, server.startup_s if server else None))
    except SetupError as e:
        log(f"serve_bench: {e}")
        code = 2
    finally:
        if server:
            server.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
