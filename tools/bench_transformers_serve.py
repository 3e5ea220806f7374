"""pagedserve's HTTP server against ``transformers serve --continuous-batching``: output
tokens/s of each, on the same model, dtype, trace and client, in one run.

Starts both servers on 127.0.0.1 (pagedserve as tools/bench_server.py starts it; the peer as
``transformers serve MODEL_DIR --continuous-batching --dtype DTYPE --device cpu`` with the
``--cb-*`` settings below, on a free port, ready once ``GET /health`` answers 200), then per
repeat replays one trace (tools/traces.py, greedy, ``--request-rate`` Poisson arrivals) over
streamed ``POST /v1/completions`` on each with bench_server.py's aiohttp client, the first
of the two alternating between repeats. Both are stopped at the end, also on a failure,
Ctrl-C or SIGTERM (SIGTERM, then SIGKILL to what is left of each one's process group).

What transformers serve 5.25 takes, and what this tool does about it:

- Prompts: text only (token ids get HTTP 400). So both servers get text: the trace's random
  token ids decoded with the model's tokenizer, and the trace's request is that text's
  encoding (a few percent more tokens than drawn; outputs cut to keep within ``--max-len``).
  Every call's ``usage.prompt_tokens`` must equal it, on both servers.
- ``ignore_eos``, ``min_tokens``, ``cache_salt``: refused (HTTP 422, unknown fields). Its
  ``generation_config`` field (JSON) takes ``{"eos_token_id": -1}``, which its continuous
  batching reads as no EOS: pagedserve gets ``ignore_eos``, the peer that, so both generate
  exactly the trace's output lengths and every call is held to it (finish reason "length",
  ``usage.completion_tokens``). Without ``cache_salt`` the peer's prefix cache (on, and not
  settable from its command line) would serve a repeated prompt, so each repeat draws a
  trace of its own (seed ``--seed`` + repeat; the warm-up's ``--seed`` + ``--repeats``):
  both servers get the same requests within a repeat, and no prompt is ever sent twice.
- Usage in a stream: yes, with ``stream_options.include_usage`` (a last chunk, no choices).
  The peer's stream ends without ``data: [DONE]``: only for it, the end of the body ends it.
- Its ``--cb-*`` flags: ``--cb-block-size`` pagedserve's ``--block-size``;
  ``--cb-num-blocks`` the same KV capacity in tokens as pagedserve's server got (from
  ``--kv-cache-bytes``; its default would take 80-90 % of the machine's free RAM);
  ``--cb-max-batch-tokens`` pagedserve's ``--max-num-batched-tokens`` (default 2048). Its
  batch holds at most min(1024, max batch tokens) requests, which its command line cannot
  set: give pagedserve a ``--max-num-seqs`` of at least the requests in flight so that
  neither is held below the other's batch. Torch threads: each server's own default.

Output tokens/s = every call's usage.completion_tokens over first send to last chunk; the
ratio is pagedserve's median over the peer's. "At saturation": a rate well above both
servers' capacity, or every request at once (``--request-rate inf``); the record's
``last_arrival_s`` against each run's seconds shows how long requests were still arriving.
Greedy outputs of the two in bfloat16 differ where kernels round differently: their text
equality is a sanity figure, not a check. CPU only (the peer runs with ``--device cpu``).

The measurement of issue 36 (the embedded SmolLM2, bfloat16, Alpaca lengths, 64 requests
arriving within about 4 s, all in one batch: ``--max-num-seqs`` 64 is the default). On 2
cores, at most about 9 minutes: in smoke runs the peer made 17-28 tok/s with up to 8
requests in flight, pagedserve about 100; 3,700 output tokens a run:

    .venv/bin/python tools/bench_transformers_serve.py --num-requests 64 --request-rate 16 \\
        --repeats 2 --json /tmp/vs_transformers.json

Needs transformers' serving extra (FastAPI, uvicorn): ``.venv/bin/pip install -e '.[bench]'``.
Exit status: 0 when every check held, 1 otherwise (the summary and the JSON say which).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shlex
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_server import (
    FIRST_ORDINARY_TOKEN_ID,
    EngineSettings,
    Ports,
    ServerProcess,
    ServerRun,
    _api_figures,
    _equal_outputs,
    _log,
    _on_sigterm,
    _ratio,
    _run_failures,
    _settings_record,
    add_engine_arguments,
    add_run_arguments,
    completion_body,
    machine_info,
    model_info,
    poisson_arrivals_s,
    run_async,
    run_server,
    run_target,
    serve_argv,
    target_model_card,
)
from traces import Request, make_trace, trace_stats

from pagedserve.frontend.model_resolver import resolve_model
from pagedserve.frontend.tokenizer import Tokenizer

# pagedserve's max_num_batched_tokens when none is given (with chunked prefill, its default).
PAGEDSERVE_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# What the peer gets for ignore_eos: its continuous batching takes a negative EOS id as none.
NO_EOS_GENERATION_CONFIG = json.dumps({"eos_token_id": -1})
HEALTH_POLL_S = 0.5
# The two sides, in the order of the even repeats, and their keys' prefixes in the record.
SIDES = ("pagedserve", "transformers_serve")
# Each side's exit status after a graceful stop: uvicorn, once its shutdown has ended,
# raises again the SIGTERM it caught.
CLEAN_EXIT_CODES = {"pagedserve": (0,), "transformers_serve": (0, -signal.SIGTERM)}


class PeerServerProcess(ServerProcess):
    """``transformers serve`` in a subprocess: serving once ``GET /health`` answers 200. Its
    model runs in a process it spawns, in its process group, which ``stop`` kills if the
    server left it behind."""

    def wait_healthy(self, base_url: str, startup_timeout_s: float) -> None:
        deadline_s = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline_s:
            self.check_alive()
            # OSError: refused, not answering yet, or an HTTP error status.
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{base_url}/health", timeout=HEALTH_POLL_S) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(
            f"transformers serve was not healthy within --startup-timeout-s="
            f"{startup_timeout_s:g}\n{self.log_tail()}"
        )

    def stop(self) -> int | None:
        exit_code = super().stop()
        if self.process is not None:
            # The group is the server's own session (start_new_session): nothing else is in it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        return exit_code


def free_port() -> int:
    """A port free on 127.0.0.1 now (the peer takes no port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def peer_argv(
    model_dir: Path, dtype: str, port: int, block_size: int, num_blocks: int, max_batch_tokens: int
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--dtype",
        dtype,
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--cb-block-size",
        str(block_size),
        "--cb-num-blocks",
        str(num_blocks),
        "--cb-max-batch-tokens",
        str(max_batch_tokens),
    ]


def text_trace(
    requests: list[Request], tokenizer: Tokenizer, max_len: int
) -> tuple[list[Request], list[str]]:
    """Each request's prompt as text (its ids decoded), and the request as that text
    encodes: what both servers see. Outputs are cut so that prompt + output <= max_len."""
    encoded_requests, texts = [], []
    for request in requests:
        token_ids = request.prompt_token_ids
        while True:
            text = tokenizer.decode(token_ids, skip_special_tokens=False)
            encoded = tokenizer.encode(text)
            if len(encoded) < max_len or len(token_ids) <= 1:
                break
            token_ids = token_ids[: len(token_ids) - (len(encoded) - max_len + 1)]
        if not encoded or len(encoded) >= max_len:
            raise ValueError(
                f"prompt ids {request.prompt_token_ids[:8]}... decode to text that encodes to "
                f"{len(encoded)} tokens; it must be 1 to max_len - 1 = {max_len - 1}"
            )
        output_len = min(request.output_len, max_len - len(encoded))
        encoded_requests.append(Request(prompt_token_ids=encoded, output_len=output_len))
        texts.append(text)
    return encoded_requests, texts


def draw_trace(
    args: argparse.Namespace,
    num_requests: int,
    seed: int,
    max_len: int,
    vocab_size: int,
    tokenizer: Tokenizer,
) -> tuple[list[Request], list[str]]:
    requests = make_trace(
        args.trace,
        num_requests,
        seed,
        max_len,
        vocab_size,
        FIRST_ORDINARY_TOKEN_ID,
        length_scale=args.length_scale,
    )
    return text_trace(requests, tokenizer, max_len)


def pagedserve_body(request: Request, text: str, namespace: str) -> dict[str, Any]:
    return completion_body(request, namespace, None) | {"prompt": text}


def peer_body(request: Request, text: str, model: str) -> dict[str, Any]:
    body = completion_body(request, "", model) | {"prompt": text}
    del body["ignore_eos"], body["cache_salt"]  # unknown fields there: HTTP 422
    return body | {"generation_config": NO_EOS_GENERATION_CONFIG}


class Sides:
    """Both servers, started; ``run`` replays one trace on one of them, checked."""

    def __init__(self, args: argparse.Namespace, ports: Ports, peer_url: str, model: str) -> None:
        self.args = args
        self.ports = ports
        self.peer_url = peer_url
        self.model = model

    def run(
        self,
        side: str,
        requests: list[Request],
        texts: list[str],
        arrivals_s: list[float],
        namespace: str,
    ) -> ServerRun:
        if side == "pagedserve":
            return run_async(
                run_server(
                    "http",
                    self.ports,
                    requests,
                    arrivals_s,
                    namespace,
                    namespace,
                    self.args.timeout_s,
                    make_body=lambda i: pagedserve_body(requests[i], texts[i], namespace),
                )
            )
        return run_async(
            run_target(
                self.peer_url,
                self.model,
                requests,
                arrivals_s,
                namespace,
                namespace,
                self.args.timeout_s,
                make_body=lambda i: peer_body(requests[i], texts[i], self.model),
                require_done=False,
            )
        )


def bench(args: argparse.Namespace, load_before: float) -> dict[str, Any]:
    engine = EngineSettings.from_args(args)
    record: dict[str, Any] = {
        "command": shlex.join(sys.orig_argv),
        "settings": _settings_record(args),
        "engine": asdict(engine),
    }
    runs: dict[str, list[ServerRun]] = {side: [] for side in SIDES}
    repeats: list[dict[str, Any]] = []
    warmup_problems: list[str] = []
    error: str | None = None
    servers: list[ServerProcess] = []
    with tempfile.TemporaryDirectory(prefix="bench-transformers-serve-") as directory:
        log_dir = args.log_dir or Path(directory)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            model_dir = resolve_model(args.model).path
            tokenizer = Tokenizer(model_dir)
            port_file = Path(directory) / "port.json"
            argv = serve_argv(
                engine, port_file, args.startup_timeout_s, args.num_requests, 1, http=True
            )
            record["pagedserve_argv"] = argv
            pagedserve = ServerProcess(argv, log_dir / f"{SIDES[0]}.log")
            servers.append(pagedserve)
            _log(f"starting pagedserve: {shlex.join(argv)}")
            ports = pagedserve.start(port_file, args.startup_timeout_s)
            info = run_async(model_info(ports.grpc))
            record["pagedserve_model_info"] = {
                "model": info.model,
                "dtype": info.dtype,
                "block_size": info.block_size,
                "num_blocks": info.num_blocks,
                "max_num_seqs": info.max_num_seqs,
                "max_model_len": info.max_model_len,
            }
            # The same KV capacity in tokens, in blocks of the same size.
            num_blocks = math.ceil(info.num_blocks * info.block_size / engine.block_size)
            max_batch_tokens = (
                engine.max_num_batched_tokens or PAGEDSERVE_DEFAULT_MAX_NUM_BATCHED_TOKENS
            )
            port = free_port()
            peer_url = f"http://127.0.0.1:{port}"
            argv = peer_argv(
                model_dir, engine.dtype, port, engine.block_size, num_blocks, max_batch_tokens
            )
            record["transformers_serve_argv"] = argv
            peer = PeerServerProcess(argv, log_dir / f"{SIDES[1]}.log")
            servers.append(peer)
            _log(f"starting transformers serve: {shlex.join(argv)}")
            peer.launch()
            peer.wait_healthy(peer_url, args.startup_timeout_s)
            card = run_async(target_model_card(peer_url, None))
            sides = Sides(args, ports, peer_url, card["id"])
            max_len = min(args.max_len, info.max_model_len)

            if args.warmup_requests:
                seed = args.seed + args.repeats  # no repeat's
                warm, warm_texts = draw_trace(
                    args, args.warmup_requests, seed, max_len, info.vocab_size, tokenizer
                )
                _log(f"warm-up: {len(warm)} requests on each")
                for side in SIDES:
                    run = sides.run(side, warm, warm_texts, [0.0] * len(warm), "warmup")
                    warmup_problems += [
                        f"{side} warm-up: {k} x{n}" for k, n in run.problems.items()
                    ]
                    warmup_problems += [f"{side} warm-up: {p}" for p in run.stats_problems]
                if warmup_problems:
                    raise RuntimeError("the warm-up failed: " + "; ".join(warmup_problems))

            for repeat in range(args.repeats):
                seed = args.seed + repeat
                requests, texts = draw_trace(
                    args, args.num_requests, seed, max_len, info.vocab_size, tokenizer
                )
                arrivals_s = poisson_arrivals_s(len(requests), args.request_rate, seed)
                repeats.append(
                    {
                        "seed": seed,
                        "trace_stats": asdict(trace_stats(requests)),
                        "last_arrival_s": arrivals_s[-1],
                    }
                )
                # Each side first in every other repeat: the machine's drift weighs on both.
                ran = []
                for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                    run = sides.run(side, requests, texts, arrivals_s, f"repeat-{repeat}")
                    runs[side].append(run)
                    ran.append(run)
                    _log(
                        f"{side} run {repeat}: {run.output_tokens} tokens, "
                        f"{run.tokens_per_s:.1f} tok/s, {run.seconds:.2f} s"
                        + ("" if run.ok else f"; problems {run.problems} {run.stats_problems}")
                    )
                    if not run.ok:
                        break
                if len(ran) < len(SIDES) or not all(run.ok for run in ran):
                    break
                repeats[-1]["outputs_equal"] = _equal_outputs(
                    *(runs[side][-1].output_texts for side in SIDES)
                )
        except (Exception, KeyboardInterrupt) as caught:
            error = f"{type(caught).__name__}: {caught}"
            _log(f"stopped early: {error}")
        finally:
            for side, server in reversed(list(zip(SIDES, servers))):
                _log(f"stopping {side} (SIGTERM)")
                server.stop()
                if server.exit_code not in CLEAN_EXIT_CODES[side] or error is not None:
                    print(server.log_tail(), file=sys.stderr)
    failures = [] if error is None else [error]
    failures += warmup_problems
    for side in SIDES:
        failures += _run_failures(side, runs[side])
    for side, server in zip(SIDES, servers):
        if server.exit_code not in CLEAN_EXIT_CODES[side] or server.stop_note:
            failures.append(f"{side} exit code {server.exit_code} {server.stop_note}".rstrip())
        record[f"{side}_exit_code"] = server.exit_code
    for side in SIDES:
        record.update(_api_figures(side, runs[side], None, over_offline=False))
    record["pagedserve_over_transformers_serve"] = _ratio(
        record["pagedserve_tok_s_median"], record["transformers_serve_tok_s_median"]
    )
    record["repeats"] = repeats
    record["failures"] = failures
    record["ok"] = not failures
    record["machine"] = {**machine_info(), "load_average_1m_before": load_before}
    return record


def format_summary(record: dict[str, Any]) -> str:
    settings = record["settings"]
    lines = [
        f"{settings['num_requests']} requests a repeat ({settings['trace']} "
        f"x{settings['length_scale']:g}), rate {settings['request_rate']} req/s, "
        f"{settings['dtype']}, {len(record['repeats'])} repeats"
    ]
    for repeat in record["repeats"]:
        stats = repeat["trace_stats"]
        lines.append(
            f"  seed {repeat['seed']}: mean {stats['mean_input_len']:.1f} in / "
            f"{stats['mean_output_len']:.1f} out, {stats['total_output_tokens']} output tokens, "
            f"last arrival {repeat['last_arrival_s']:.1f} s, outputs equal "
            f"{repeat.get('outputs_equal')}"
        )
    lines.append(f"  {'':20}{'tok/s':>10}{'req/s':>8}   runs (tok/s; output tokens; s)")
    for side in SIDES:
        tok_s, req_s = record[f"{side}_tok_s_median"], record[f"{side}_req_s_median"]
        if tok_s is None:
            continue
        runs = "; ".join(
            f"{run['tok_s']:.1f} {run['output_tokens']} {run['seconds']:.1f}"
            for run in record[f"{side}_runs"]
        )
        lines.append(f"  {side:20}{tok_s:10.1f}{req_s:8.2f}   {runs}")
        latency = record[f"{side}_latency_ms"]
        lines.append(
            f"  {'':20}TTFT p50 {latency['ttft_ms']['p50'] or 0:.0f} ms, TPOT p50 "
            f"{latency['tpot_ms']['p50'] or 0:.0f} ms (medians over runs)"
        )
    ratio = record["pagedserve_over_transformers_serve"]
    if ratio is not None:
        lines.append(f"  pagedserve / transformers serve: {ratio:.2f}x output tokens/s")
    if record["failures"]:
        lines.append("FAILED:")
        lines += [f"  {failure}" for failure in record["failures"]]
    else:
        lines.append("every request complete and exact on both, every pagedserve block free: ok")
    machine = record["machine"]
    lines.append(
        f"{machine['cpu_model']}, {machine['cpu_count']} CPUs, 1-minute load "
        f"{machine['load_average_1m_before']:.1f} before, {machine['load_average_1m']:.1f} after"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="local HF directory or .gguf (default: the embedded model)"
    )
    add_run_arguments(
        parser,
        trace="alpaca",
        length_scale=1.0,
        repeats=2,
        repeats_help="runs on each server",
        warmup_help="requests of a trace of their own, untimed",
    )
    add_engine_arguments(parser)
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep both servers' logs here")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    for name in ("num_requests", "repeats", "max_len", "max_num_seqs", "kv_cache_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    for name in ("request_rate", "length_scale", "timeout_s", "startup_timeout_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(
            f"transformers serve needs {', '.join(missing)}: "
            "pip install 'transformers[serving]' (keeping this transformers' version)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    record = bench(args, os.getloadavg()[0])
    print(format_summary(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
