"""``pagedserve``: the command line. ``chat`` answers a message, ``generate`` continues
a prompt, ``serve`` runs the server (gRPC, and OpenAI-compatible HTTP with
``--http-port``), ``run-batch`` runs a file of OpenAI batch requests; all on the embedded
model unless ``--model`` names another."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from pagedserve.frontend.api_key import ENVIRONMENT_VARIABLE as API_KEY_ENVIRONMENT_VARIABLE
from pagedserve.frontend.cors import parse_origins
from pagedserve.frontend.engine_args import add_engine_arguments, engine_options_from_cli
from pagedserve.frontend.liveness import DEFAULT_STALL_EXIT_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S
from pagedserve.frontend.responses_store import (
    DEFAULT_RESPONSES_STORE_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
)
from pagedserve.frontend.server import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HTTP_READ_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    ServerConfig,
    serve,
)
from pagedserve.frontend.tool_calls import TOOL_CALL_PARSERS
from pagedserve.scheduler.logs import ENVIRONMENT_VARIABLE as LOG_FORMAT_ENVIRONMENT_VARIABLE
from pagedserve.scheduler.logs import LOG_FORMATS, configure_logging
from pagedserve.scheduler.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
)

# run-batch: no limit of the server's own on requests in flight (see _run_batch).
UNBOUNDED_REQUESTS = 1 << 40


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    request = argparse.ArgumentParser(add_help=False)
    request.add_argument("--max-tokens", type=int, default=128)
    request.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    request.add_argument("--seed", type=int, default=None)
    request.add_argument(
        "--lora", default=None, metavar="NAME", help="run through this --lora-modules adapter"
    )
    request.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the output where TEXT first appears (left out of it); repeatable",
    )
    constraint = request.add_argument_group(
        "structured output", "constrain the output (at most one; TEXT or @FILE)"
    )
    constraint.add_argument(
        "--json-schema", metavar="SCHEMA", help="a JSON schema the output must follow"
    )
    constraint.add_argument(
        "--json-object", action="store_true", help="the output is any JSON object"
    )
    constraint.add_argument("--regex", help="a regular expression the output must match")
    constraint.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these; repeatable"
    )
    constraint.add_argument("--grammar", help="a Lark or GBNF grammar the output must follow")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser(
        "chat", parents=[_engine_parser("chat"), request], help="answer one user message"
    )
    chat.add_argument("message", nargs="+", help="one or more user messages, answered in a batch")
    generate = commands.add_parser(
        "generate", parents=[_engine_parser("generate"), request], help="continue raw prompts"
    )
    generate.add_argument("prompt", nargs="+", help="one or more prompts, run as one batch")
    # What the OpenAI API's calls need, served (serve) or read from a file (run-batch).
    api = argparse.ArgumentParser(add_help=False)
    api.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (serve: the APIs and metrics; run-batch: metrics)",
    )
    api.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide to call tools (tool_choice 'auto', the default when a chat "
        "request gives tools); needs --tool-call-parser",
    )
    api.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a chat request bring its own template (chat_template, vLLM's): a template "
        "is code the server runs, so allow it only for trusted clients",
    )
    api.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call format: hermes (Hermes, Qwen2.5, Qwen3: <tool_call> "
        "blocks), llama3_json (Llama 3.1+ JSON calls), pythonic (Llama 3.2 / 4: a Python "
        "list of calls), mistral ([TOOL_CALLS]: Mistral, Mixtral, Devstral), qwen3_coder "
        "(Qwen3-Coder's XML calls), seed_oss (Seed-OSS: that XML in <seed:tool_call> blocks), "
        "deepseek_v3 (DeepSeek V3, R1 and its Qwen / Llama "
        "distills), deepseek_v31 (DeepSeek V3.1), glm45 (GLM-4.5 / 4.6: <tool_call> blocks of "
        "<arg_key> / <arg_value> pairs), kimi_k2 (Kimi K2: a <|tool_calls_section_begin|> "
        "section of functions.NAME:INDEX calls), minimax_m2 (MiniMax-M2: <minimax:tool_call> "
        "blocks of <invoke> calls), granite (IBM Granite 3.x: a JSON array "
        "after <|tool_call|>), phi4_mini_json (Phi-4-mini: functools[...]) or openai "
        "(gpt-oss: harmony messages to=functions.NAME)",
    )
    api.add_argument(
        "--served-model-name",
        default=None,
        nargs="+",
        metavar="NAME",
        help="the model's name in the OpenAI API (a request's model, the answers'; default: "
        "the model as --model names it); more names are aliases requests may use, answers "
        "give the first (vLLM's)",
    )
    api.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        metavar="N",
        help="the Responses API keeps the most recent N responses made with store=true, in "
        "memory, for previous_response_id and GET /v1/responses/{id} (0: none)",
    )
    api.add_argument(
        "--responses-store-bytes",
        type=int,
        default=DEFAULT_RESPONSES_STORE_BYTES,
        metavar="BYTES",
        help="... and within this many bytes of memory in all (their inputs, outputs and a "
        "background stream's events; the oldest ended ones go first; default 512 MiB)",
    )
    api.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
        "default: off)",
    )
    api.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="also expose the metrics vLLM has under its names (vllm:num_requests_running, "
        "vllm:e2e_request_latency_seconds, vllm:kv_cache_usage_perc, ...; label model_name), "
        "so vLLM's Grafana dashboards and alerts read this server",
    )
    api.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info (default) logs start-up, each finished call (serve) and the drain",
    )
    api.add_argument(
        "--log-format",
        default=os.environ.get(LOG_FORMAT_ENVIRONMENT_VARIABLE) or "text",
        choices=LOG_FORMATS,
        help="text (default), or json: one JSON object per line (time, level, logger, pid, "
        "message, and each call's ids, token counts and times), for a log shipper; the "
        f"engine's processes follow it; default ${LOG_FORMAT_ENVIRONMENT_VARIABLE}",
    )
    serve = commands.add_parser(
        "serve",
        parents=[_engine_parser("serve"), api],
        help="serve the gRPC API (protos/pagedserve/v1/generation.proto) and, with "
        "--http-port, the OpenAI-compatible HTTP API",
        description="Serve pagedserve.v1.GenerationService, grpc.health.v1.Health and reflection "
        "(and with --http-port the OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/score, /v1/rerank, "
        "/v1/classify, /v1/models, /health, /metrics). "
        "SIGTERM drains: new calls are refused, calls in flight finish (up to "
        "--drain-timeout-s), then the process exits 0; it exits 1 if the engine dies.",
    )
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; implies "
        "--enable-lora): clients then name adapter directories this server reads, so allow "
        "it only for trusted clients",
    )
    serve.add_argument(
        "--allowed-origins",
        default=None,
        help="origins whose browser pages may call the HTTP API (CORS): comma-separated "
        "or a JSON list, * for any; default none (vLLM allows any: name them here)",
    )
    serve.add_argument(
        "--allow-credentials",
        action="store_true",
        help="with --allowed-origins: browsers may send credentials (cookies, HTTP auth) "
        "cross-origin",
    )
    serve.add_argument("--port", type=int, default=50051, help="gRPC port; 0: any free port")
    serve.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port too (0: any free port; "
        "default: off)",
    )
    serve.add_argument(
        "--port-file",
        default=None,
        help='once serving, write {"port": ..., "http_port": ..., "pid": ...} here (for port 0)',
    )
    serve.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="generation calls in flight, at most; more get RESOURCE_EXHAUSTED",
    )
    serve.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, how long calls in flight may run on before they are ended",
    )
    serve.add_argument(
        "--http-read-timeout-s",
        type=float,
        default=DEFAULT_HTTP_READ_TIMEOUT_S,
        help="an HTTP client has this long to send a request's headers, then its body; past "
        "it the connection closes (default 30)",
    )
    serve.add_argument(
        "--stall-timeout-s",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="with requests pending and no engine step completed for this long (a worker "
        "stopped, deadlocked or on a hung device), health turns NOT_SERVING / 503 and the "
        "systemd watchdog is no longer pinged (default 30)",
    )
    serve.add_argument(
        "--stall-exit-timeout-s",
        type=float,
        default=DEFAULT_STALL_EXIT_TIMEOUT_S,
        help="still stalled this long after that, every call in flight ends UNAVAILABLE "
        "naming the stalled process and the server exits 1 (default 30)",
    )
    serve.add_argument(
        "--no-request-log",
        action="store_true",
        help="do not log a line per finished call (busy servers; metrics still count them)",
    )
    serve.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed completion and chat completion ends with a usage chunk, asked "
        "for or not (vLLM's; for gateways that bill by the stream)",
    )
    serve.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="GenerateStream: send once this many new tokens are there (the first token and "
        "the end at once); more cut the server's cost per token (default 1: every step)",
    )
    serve.add_argument("--tls-cert-file", default=None, help="serve TLS: certificate chain (PEM)")
    serve.add_argument("--tls-key-file", default=None, help="serve TLS: private key (PEM)")
    serve.add_argument(
        "--tls-client-ca-file",
        default=None,
        help="mutual TLS: accept only clients whose certificate this CA (PEM) signed",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENVIRONMENT_VARIABLE) or None,
        help="generation calls of both APIs must send 'Authorization: Bearer KEY' (gRPC: "
        f"metadata); default ${API_KEY_ENVIRONMENT_VARIABLE}, which keeps it out of `ps`; "
        "health, metrics and version stay open",
    )
    run_batch = commands.add_parser(
        "run-batch",
        parents=[_engine_parser("run-batch"), api],
        help="run a file of OpenAI batch requests (JSON Lines) and write their answers",
        description="Run OpenAI batch requests (vLLM's run-batch): each input line is "
        '{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" (or '
        "/v1/completions, /v1/responses, /v1/embeddings, /v1/score, /v1/rerank, /v1/classify), "
        '"body": {...}}; each output line, in the input\'s '
        'order, is {"id", "custom_id", "response": {"status_code", "request_id", "body"}, '
        '"error"}. Exits 0 once every line is answered (whatever their statuses), 1 if the '
        "engine fails or a signal stops the batch, 2 for bad arguments or unreadable files.",
    )
    run_batch.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="the requests, one JSON object per line: a file, - for standard input, or an "
        "http(s) URL to GET",
    )
    run_batch.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where the answers go (written as they come, in the input's order): a file, - "
        "for standard output, or an http(s) URL to PUT them to once the batch ends",
    )
    run_batch.add_argument(
        "--output-tmp-dir",
        default=None,
        metavar="DIR",
        help="with an output URL: where the answers are written before the upload (kept "
        "there if it fails; default: the system's temporary directory)",
    )
    run_batch.add_argument(
        "--max-lines-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="lines running at once, at most (default: twice --max-num-seqs)",
    )
    run_batch.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log a line per finished request (its custom_id as the client id)",
    )
    return parser


def _engine_parser(command: str) -> argparse.ArgumentParser:
    """The flags of the engine's options ``command`` takes (``engine_args.py``)."""
    engine = argparse.ArgumentParser(add_help=False)
    options = engine.add_argument_group("engine options (docs/engine_options.md)")
    add_engine_arguments(options, command)
    engine.add_argument("--verbose", action="store_true", help="log engine events to stderr")
    return engine


def _embedded_name() -> str:
    """The embedded model's name in the HTTP API: its GGUF's, without the quantization."""
    from pagedserve.frontend.model_resolver import EMBEDDED_GGUF_NAME

    return EMBEDDED_GGUF_NAME.split(".")[0]


def _auto_tool_choice_error(args: argparse.Namespace) -> int | None:
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        print(
            "pagedserve: error: --enable-auto-tool-choice and --tool-call-parser go together "
            "(the parser reads the calls the model decides to make)",
            file=sys.stderr,
        )
        return 2
    return None


def _api_config(args: argparse.Namespace, **kwargs) -> dict:
    """The ``ServerConfig`` settings of the ``api`` flags, which serve and run-batch share."""
    return dict(
        host=args.host,
        served_model_name=(args.served_model_name or [args.model or _embedded_name()])[0],
        served_model_aliases=tuple((args.served_model_name or [])[1:]),
        responses_store_size=args.responses_store_size,
        responses_store_bytes=args.responses_store_bytes,
        vllm_metric_names=args.vllm_metric_names,
        metrics_port=args.metrics_port,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        **kwargs,
    )


def _server_llm(args: argparse.Namespace):
    """How serve and run-batch build their engine (in the server's engine thread)."""
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.tokenizer import preload as preload_tokenizer

    options = engine_options_from_cli(args, args.command)
    # Adapters loaded at run time need an engine that serves them.
    options["enable_lora"] = options["enable_lora"] or getattr(
        args, "allow_runtime_lora_updating", False
    )
    preload_tokenizer()
    # The server is the frontend process: the scheduler and workers always run apart.
    return lambda: LLM(**options, multiprocess=True)


def _serve(args: argparse.Namespace) -> int:
    if (code := _auto_tool_choice_error(args)) is not None:
        return code
    try:
        config = ServerConfig(
            **_api_config(
                args,
                port=args.port,
                http_port=args.http_port,
                max_concurrent_requests=args.max_concurrent_requests,
                drain_timeout_s=args.drain_timeout_s,
                stall_timeout_s=args.stall_timeout_s,
                stall_exit_timeout_s=args.stall_exit_timeout_s,
                http_read_timeout_s=args.http_read_timeout_s,
                port_file=args.port_file,
                stream_interval_tokens=args.stream_interval,
                force_include_usage=args.enable_force_include_usage,
                log_requests=not args.no_request_log,
                tls_cert_file=args.tls_cert_file,
                tls_key_file=args.tls_key_file,
                tls_client_ca_file=args.tls_client_ca_file,
                api_key=args.api_key,
                allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                allowed_origins=parse_origins(args.allowed_origins or ""),
                allow_credentials=args.allow_credentials,
            )
        )
    except ValueError as error:
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2
    return serve(_server_llm(args), config)


def _run_batch(args: argparse.Namespace) -> int:
    from pagedserve.frontend.batch_runner import BatchConfig, run_batch

    if (code := _auto_tool_choice_error(args)) is not None:
        return code
    try:
        config = ServerConfig(
            # The lines in flight are bounded (max_lines_in_flight), not the requests:
            # a line of many prompts waits its turn in the scheduler, never a 429.
            **_api_config(args, max_concurrent_requests=UNBOUNDED_REQUESTS),
            log_requests=args.enable_log_requests,
        )
        batch = BatchConfig(
            args.input_file,
            args.output_file,
            args.max_lines_in_flight,
            output_tmp_dir=args.output_tmp_dir,
        )
    except ValueError as error:
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2
    return run_batch(_server_llm(args), config, batch)


def _structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The constraint the flags ask for (None: none); ``@path`` reads a file."""

    def text(value: str | None) -> str | None:
        if value is None or not value.startswith("@"):
            return value
        try:
            return Path(value[1:]).read_text()
        except OSError as error:
            raise ValueError(f"cannot read {value[1:]!r}: {error.strerror}") from None

    fields = {
        "json": text(args.json_schema),
        "regex": text(args.regex),
        "choice": args.choice,
        "grammar": text(args.grammar),
        "json_object": args.json_object,
    }
    flags = {
        "json": "--json-schema",
        "regex": "--regex",
        "choice": "--choice",
        "grammar": "--grammar",
        "json_object": "--json-object",
    }
    given = [flags[name] for name, value in fields.items() if value]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(
            f"give at most one of the structured output flags, got {' and '.join(given)}"
        )
    return StructuredOutputsParams(**fields)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    served = args.command in ("serve", "run-batch")
    if served:
        # A server logs each finished call (an operator's access log) unless told not to.
        level = logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper())
    else:  # the one-shot commands: only what went wrong
        level = logging.INFO if args.verbose else logging.WARNING
    log_format = args.log_format if served else "text"
    # The engine's processes read it from the environment they inherit.
    os.environ[LOG_FORMAT_ENVIRONMENT_VARIABLE] = log_format
    configure_logging(level, "%(asctime)s %(name)s %(levelname)s %(message)s", log_format)
    if args.command == "serve":
        return _serve(args)
    if args.command == "run-batch":
        return _run_batch(args)
    from pagedserve.frontend.llm import LLM

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop=args.stop,
            structured_outputs=_structured_outputs(args),
        )
        started = time.monotonic()
        llm = LLM(**engine_options_from_cli(args, args.command))
        ranks = (
            f" on each of {llm.tensor_parallel_size} ranks" if llm.tensor_parallel_size > 1 else ""
        )
        try:
            print(
                f"pagedserve: engine ready in {time.monotonic() - started:.1f} s; KV cache "
                f"{llm.num_blocks} blocks x {args.block_size} tokens "
                f"({llm.bytes_per_block} bytes each{ranks}, at most "
                f"{llm.num_blocks * args.block_size} cached tokens), "
                f"{llm.num_host_blocks} host swap blocks",
                file=sys.stderr,
            )
            if args.command == "chat":
                conversations = [[{"role": "user", "content": text}] for text in args.message]
                outputs = llm.chat(conversations, params, lora_request=args.lora)
            else:
                outputs = llm.generate(args.prompt, params, lora_request=args.lora)
        finally:
            llm.shutdown()
    except (ValueError, TypeError) as error:
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 2
    for output in outputs:
        if len(outputs) > 1:
            print(f"--- {output.request_id} ({output.outputs[0].finish_reason})")
        print(output.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
