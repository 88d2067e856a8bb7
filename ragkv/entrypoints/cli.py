"""Command line: `ragkv serve | generate | bench | eval | calibrate | demo | precompute`."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import (
    CHUNK_ATTENTIONS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SINK_TOKENS,
    POSITION_STRATEGIES,
    RECOMPUTE_METHODS,
    EngineConfig,
)
from .config_file import apply_config_file


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got "
                                         f"{text!r}") from None


_MODEL_HELP = ("local HF directory, GGUF file, a Hugging Face id in the local HF cache "
               "(Org/Name), smollm2-135m-instruct, gemma3-270m, or builtin:tiny / builtin:small")


def add_model_arg(parser: argparse.ArgumentParser, default: str | None,
                  required: bool = True) -> None:
    """The model, as `ragkv CMD MODEL` or `ragkv CMD --model MODEL` (vLLM takes both);
    `default` when neither is given (None and `required`: one must be). Resolved by
    `_resolve_model`."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help=f"the model: {_MODEL_HELP}"
                             + (f" (default: {default})" if default else ""))
    parser.add_argument("--model", default=None, help="the model, as a flag (same as MODEL)")
    parser.set_defaults(default_model=default, model_required=required)


def _resolve_model(args: argparse.Namespace) -> None:
    """args.model from the positional MODEL or --model (the same model if both are given)."""
    if not hasattr(args, "model_arg"):
        return
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model!r}")
    args.model = args.model_arg or args.model or args.default_model
    if args.model is None and args.model_required:
        raise ValueError(f"no model given: ragkv {args.command} MODEL (or --model MODEL)")


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object given on the command line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_engine_args(parser: argparse.ArgumentParser,
                    default_model: str | None = "builtin:small") -> None:
    """Engine flags, named as in vLLM, shared by every subcommand that loads a model."""
    add_model_arg(parser, default_model)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the model's own)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (float32 on CPU, checkpoint dtype on GPU), float32, bfloat16, "
                             "float16")
    parser.add_argument("--quantization", "-q", default=None, choices=["gguf", "none"],
                        help="gguf: keep a GGUF file's quantized weights (Q4_0/1, Q4_K, Q5_0/1, "
                             "Q5_K, Q8_0) packed: int4 kernels on CPU, int8 groups and Triton "
                             "kernels on CUDA; none: dequantize every weight at load (default: "
                             "gguf for such a file on CPU unless --dtype float32, else none)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model's heads and MLP across this many processes "
                             "(one GPU each on CUDA, from --device's; gloo on CPU)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the engine's sampling (requests may give their own)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (prompt + output) in tokens (default: the "
                             "model's limit, lowered to what the KV cache holds)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache size in tokens, chunk region included (default: 85%% "
                             "of free GPU memory, or 2 GiB on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of the GPU's memory the engine may hold (weights, "
                             "activations, KV cache), as in vLLM; the KV cache takes what the "
                             "loaded model leaves of it (GPU only: on CPU give "
                             "--kv-cache-tokens or --kv-cache-memory-bytes)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="most sequences in one engine step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="most tokens in one engine step (longer prompts are chunked)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the KV of a shared prompt prefix")
    parser.add_argument("--enable-chunk-cache", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="reuse each document's KV in any request, at any place")
    parser.add_argument("--chunk-separator", default=None, type=lambda v: v or None,
                        help="split text prompts (and a chat's last user message) at this "
                             "text into system, documents and question, e.g. '##'; unset: "
                             "never (a request may still name its own chunk_separator)")
    parser.add_argument("--chunk-cache-tokens", type=int, default=None,
                        help="tokens of the KV cache kept for documents (default: "
                             "--chunk-cache-fraction of it)")
    parser.add_argument("--chunk-cache-fraction", type=float, default=0.3,
                        help="share of the KV cache kept for documents")
    parser.add_argument("--max-chunk-tokens", type=int, default=4096,
                        help="longest document in tokens (see --oversize-chunk)")
    parser.add_argument("--oversize-chunk", choices=["error", "split"], default="error",
                        help="a longer document is an error, or split into pieces cached on "
                             "their own")
    parser.add_argument("--chunk-hash-algo", choices=["sha256", "xxh3_128"], default="sha256",
                        help="hash of chunk-cache keys")
    parser.add_argument("--tokenizer-cache-mb", type=int, default=64,
                        help="token ids of system prompts and documents sent as text, kept by "
                             "their text so each is tokenized once (MiB; 0: off)")
    parser.add_argument("--chunk-store", default=None,
                        help="tiers behind the chunk cache, in order, comma-separated: "
                             "host:SIZE, disk:PATH:SIZE, redis://HOST:PORT/DB (e.g. "
                             "host:8GiB,disk:/var/cache/ragkv:50GiB,redis://127.0.0.1:6379/0)")
    parser.add_argument("--position-strategy", choices=list(POSITION_STRATEGIES),
                        default=None,
                        help="default RAG layout: chunks follow one another (sequential) or "
                             "share the positions after the system prompt (shared: exact "
                             "chunk reuse, no recompute); unset: sequential with the model's "
                             "calibrated recompute, the quality mode")
    parser.add_argument("--chunk-attention", choices=list(CHUNK_ATTENTIONS),
                        default="isolated",
                        help="what a chunk attends to: the system prompt and itself "
                             "(isolated) or itself only, reusable under any system prompt "
                             "(standalone)")
    parser.add_argument("--recompute", choices=list(RECOMPUTE_METHODS), default=None,
                        help="selective recompute of chunk tokens (sequential positions): by "
                             "K/V deviation (blend), each chunk's first tokens (sink), the "
                             "question's attention (query), or sinks then a scorer (unset: "
                             "the model's calibrated profile, else query 0.1 to 0.5 holding "
                             "0.9 of the scores; none with shared positions)")
    parser.add_argument("--recompute-ratio", type=float, default=None,
                        help="fraction of chunk tokens recomputed (0: none, 1: a full "
                             "prefill; unset: the profile's, else 0.5 in the quality mode, "
                             "0.15 with --recompute given)")
    parser.add_argument("--recompute-score-mass", type=float, default=None,
                        help="adaptive budget: recompute the fewest top-scored chunk tokens "
                             "that hold this share of the probe's scores, between "
                             "--recompute-min-ratio and --recompute-ratio (unset: the "
                             "profile's, else 0.9 in the quality mode; a fixed "
                             "--recompute-ratio with --recompute or --recompute-ratio given)")
    parser.add_argument("--recompute-min-ratio", type=float, default=None,
                        help="the least an adaptive budget recomputes (unset: the profile's, "
                             "else 0.1 in the quality mode, 0 otherwise)")
    parser.add_argument("--recompute-damping", type=float, default=None,
                        help="the question's and answer's attention logit offset on stale "
                             "chunk tokens (unset: the profile's, else 0)")
    parser.add_argument("--chunk-primer", default=None,
                        help="documents after the first computed after S and this passage: "
                             "default (the built-in one), none, or the text (unset: RAG default's)")
    parser.add_argument("--recompute-profile", default="auto",
                        help="calibrated recompute settings (ragkv calibrate): auto (the "
                             "model's, from the cache or the package), a file, or none")
    parser.add_argument("--recompute-sink-tokens", type=int, default=None,
                        help="sink tokens per chunk (unset: the ratio of each chunk for sink "
                             f"alone, {DEFAULT_SINK_TOKENS} in sink+blend and sink+query)")
    parser.add_argument("--recompute-check-layers", type=_layer_list, default=None,
                        help="layers whose K/V deviation (blend) or question attention "
                             "(query) scores tokens (unset: 1 for blend, 13,27,40%% deep)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size in bytes (instead of --kv-cache-tokens)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most log-probabilities a request may ask for per token")
    parser.add_argument("--max-n", type=int, default=128,
                        help="largest n (completions per prompt) a request may ask for")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                        default="auto",
                        help="attention kernels: auto = triton on CUDA when it imports, else torch")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: run every decode and short extend step eagerly")
    parser.add_argument("--enable-torch-compile", action="store_true",
                        help="CPU: decode steps through torch.compile (needs a C++ compiler)")
    parser.add_argument("--debug-checks", action="store_true",
                        help="check the scheduler's invariants after every step")
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        metavar="JSON",
                        help="speculative decoding from the request's own tokens, vLLM's "
                             "form: '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                             "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; off when "
                             "not given")


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = set(EngineConfig.field_names()) - {"model"}
    return {k: v for k, v in vars(args).items() if k in names}


def _structured_outputs(args: argparse.Namespace):
    from ..structured.params import StructuredOutputsParams

    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{"):  # a file
            try:
                with open(schema, encoding="utf-8") as f:
                    schema = f.read()
            except OSError as e:
                raise ValueError(f"--json-schema: cannot read {schema!r}: {e.strerror}") from None
        return StructuredOutputsParams(json=schema)
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    return None


def _generate(args: argparse.Namespace) -> int:
    from ..llm import LLM
    from ..sampling.params import SamplingParams

    # Before the model loads: a bad sampling value is reported at once.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty,
                            min_tokens=args.min_tokens,
                            structured_outputs=_structured_outputs(args))
    llm = LLM(args.model, **engine_kwargs(args))
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({
                "prompt": out.prompt, "text": completion.text,
                "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                "num_prompt_tokens": len(out.prompt_token_ids),
                "num_cached_tokens": out.num_cached_tokens, "ttft_s": out.metrics.ttft,
            }))
        else:
            print(f"prompt: {out.prompt!r}")
            print(f"output: {completion.text!r}")
            print(f"        ({len(completion.token_ids)} tokens, finish_reason="
                  f"{completion.finish_reason}, ttft {out.metrics.ttft * 1000:.1f} ms)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from ..server.serve import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ..server.app import ServerConfig

    config = EngineConfig(model=args.model, **engine_kwargs(args))
    names = args.served_model_name or [""]
    server = ServerConfig(model_name=names[0], aliases=tuple(names[1:]), api_key=args.api_key,
                          vllm_metric_names=args.vllm_metric_names,
                          trust_request_chat_template=args.trust_request_chat_template,
                          max_body_bytes=args.max_body_bytes,
                          body_timeout_s=args.body_timeout)
    serve(config, server, host=args.host, port=args.port, log_level=args.log_level,
          header_timeout_s=args.header_timeout, timeout_keep_alive_s=args.timeout_keep_alive,
          limit_concurrency=args.limit_concurrency or None)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..bench.workload import WorkloadConfig

    workload = WorkloadConfig(
        num_docs=args.num_docs, doc_tokens=args.doc_tokens,
        docs_per_request=args.docs_per_request, zipf=args.zipf,
        system_tokens=args.system_tokens, question_tokens=args.question_tokens,
        output_tokens=args.output_tokens, num_requests=args.num_requests, seed=args.seed)
    progress = not args.no_progress
    if args.url:
        from ..bench.serving import format_serving, run_serving
        from ..model.loader import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(args.tokenizer or args.model))
        results = run_serving(args.url, workload, tokenizer, args.concurrency,
                              args.request_rate, args.api_key, progress)
        print(format_serving(results))
    else:
        from ..bench.offline import format_table, plot_ttft, run_offline

        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        results = run_offline(args.model, modes, workload, engine_kwargs(args),
                              args.compare_hf, progress)
        print(format_table(results))
        if args.plot:
            plot_ttft(results, args.plot)
            print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"figures written to {args.json}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from ..eval import evaluate as ev
    from ..eval.modes import engine_primer
    from ..eval.suite import build_suite
    from ..llm import LLM

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    items = ev.pick_items(build_suite(args.num_per_task, seed=args.suite_seed), args.limit)
    llm = LLM(args.model, **{**engine_kwargs(args),
                             "chunk_primer": engine_primer(modes, args.chunk_primer)})
    results = ev.evaluate(llm, items, modes, max_tokens=args.max_tokens,
                          progress=not args.no_progress, batch_size=args.batch_size)
    summary = ev.summarize(results)
    print(f"model {args.model}: {len(items)} questions, suite seed {args.suite_seed}")
    print(ev.format_summary(summary))
    if args.json:
        meta = {"model": args.model, "suite_seed": args.suite_seed,
                "num_per_task": args.num_per_task, "limit": args.limit,
                "num_items": len(items), "modes": list(summary), "max_tokens": args.max_tokens,
                "batch_size": args.batch_size}
        with open(args.json, "w") as f:
            json.dump(ev.report_json(results, summary, meta), f, indent=2)
        print(f"results written to {args.json}")
    if args.plot:
        ev.plot_summary(summary, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from ..eval.calibrate import calibrate, format_curve
    from ..eval.modes import engine_primer
    from ..llm import LLM
    from ..recompute.profile import profile_dir, profile_name, write_profile

    candidates = [m.strip() for m in args.candidates.split(",") if m.strip()] or None
    # The candidates carry their own settings; no profile may shape the measurement.
    kwargs = {**engine_kwargs(args), "recompute_profile": None,
              "chunk_primer": engine_primer(candidates or (), args.chunk_primer)}
    llm = LLM(args.model, **kwargs)
    profile = calibrate(llm, args.model, target=args.target, quick=args.quick,
                        candidates=candidates, num_questions=args.questions,
                        suite_seed=args.suite_seed, max_tokens=args.max_tokens,
                        batch_size=args.batch_size, progress=not args.no_progress)
    print(format_curve(profile))
    out = args.output or profile_dir() / profile_name(profile["model_fingerprint"])
    print(f"profile written to {write_profile(profile, out)}: {profile['chosen']}")
    return 0


def _precompute(args: argparse.Namespace) -> int:
    import logging

    from ..llm import LLM
    from .precompute import precompute, read_documents

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.chunk_store:
        raise ValueError("precompute needs --store (a disk:PATH:SIZE or redis:// tier)")
    documents = read_documents(args.documents)
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        summary = precompute(llm, documents, args.system, args.prompt_format, args.cache_salt,
                             args.batch_size, progress=not args.no_progress)
    finally:
        llm.engine.close()
    print(summary.format())
    return 1 if summary.failed or summary.store_errors else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.model, num_requests=args.num_requests, max_tokens=args.max_tokens,
                    quantization=args.quantization,
                    tensor_parallel_size=args.tensor_parallel_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragkv", description="RAG-native LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(srv, default_model=None)
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1, /tokenize, "
                          "/detokenize and /debug (or set RAGKV_API_KEY)")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="the model names clients may send; responses carry the first "
                          "(default: MODEL as given)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="render a chat request's own chat_template (Jinja runs on the "
                          "server: only for clients you trust); else such a request is a 400")
    # vLLM's tool-calling flags, so its command lines run unchanged: ragkv parses tool calls
    # in the Hermes format whenever a request has tools (tool_choice "auto" by default).
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM command lines: tool_choice 'auto' is always "
                          "available when a request has tools")
    srv.add_argument("--tool-call-parser", choices=["hermes"], default="hermes",
                     help="the format tool calls are parsed from: 'hermes' (<tool_call> JSON, "
                          "as Qwen2.5/Qwen3 write it; ragkv's preamble teaches it to models "
                          "whose template has no tools)")
    srv.add_argument("--vllm-metric-names", action="store_true",
                     help="/metrics also publishes the series vLLM has under vLLM's names "
                          "(vllm:num_requests_running, vllm:time_to_first_token_seconds, ...), "
                          "so dashboards built for vLLM work")
    srv.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="largest request body accepted (else 413)")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection may take to send a request's headers "
                          "(idle and slow clients are closed)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request body may take to arrive (else 408)")
    srv.add_argument("--timeout-keep-alive", type=int, default=5,
                     help="seconds an idle keep-alive connection stays open after a response")
    srv.add_argument("--limit-concurrency", type=int, default=1024,
                     help="connections/requests at once before 503s (0: no limit)")
    srv.add_argument("--log-level", default="info",
                     help="uvicorn's log level: critical, error, warning, info, debug")
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="RAG benchmark: offline modes, or a running server",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(bench)
    bench.add_argument("--modes", default="none,prefix,chunk",
                       help="offline: comma-separated none, prefix, chunk")
    bench.add_argument("--num-docs", type=int, default=16, help="documents in the corpus")
    bench.add_argument("--doc-tokens", type=int, default=512, help="tokens per document")
    bench.add_argument("--docs-per-request", type=int, default=4,
                       help="documents in each request")
    bench.add_argument("--zipf", type=float, default=1.1, help="document popularity exponent")
    bench.add_argument("--system-tokens", type=int, default=64, help="system prompt tokens")
    bench.add_argument("--question-tokens", type=int, default=32, help="question tokens")
    bench.add_argument("--output-tokens", type=int, default=8, help="tokens generated each")
    bench.add_argument("--num-requests", type=int, default=40, help="requests in the run")
    bench.add_argument("--compare-hf", action="store_true",
                       help="offline: also time HF transformers prefilling the same prompts")
    bench.add_argument("--json", default=None, help="write every figure to this file")
    bench.add_argument("--plot", default=None, help="offline: TTFT per mode as a PNG")
    bench.add_argument("--url", default=None,
                       help="serving mode: base URL of a running server, e.g. "
                            "http://127.0.0.1:8000")
    bench.add_argument("--concurrency", type=int, default=8,
                       help="serving mode: requests in flight at most")
    bench.add_argument("--request-rate", type=float, default=float("inf"),
                       help="serving mode: requests per second (default: all at once)")
    bench.add_argument("--api-key", default=None, help="serving mode: the server's API key")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser("demo", help="RAG workload: cold vs warm TTFT, checked for exactness",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Unset: smollm2-135m-instruct when installed, else builtin:small.
    add_model_arg(demo, None, required=False)
    demo.add_argument("--num-requests", type=int, default=None,
                      help="default: every question twice, in different document orders")
    demo.add_argument("--max-tokens", type=int, default=24, help="answer length limit")
    demo.add_argument("--quantization", "-q", default=None, choices=["gguf", "none"],
                      help="a GGUF file's quantized weights packed (gguf) or dequantized "
                           "(none); default: the engine's (packed on CPU)")
    demo.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="processes the model is split across (see ragkv serve)")
    demo.set_defaults(func=_demo)

    ev = sub.add_parser("eval", help="RAG answer quality of each mode against full prefill",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(ev)
    ev.set_defaults(default_model="smollm2-135m-instruct")
    ev.add_argument("--modes", default="full,chunk,sequential,standalone",
                    help="comma-separated eval modes (full always runs: it is the reference)")
    ev.add_argument("--num-per-task", type=int, default=80,
                    help="questions generated per task type")
    ev.add_argument("--suite-seed", type=int, default=0, help="seed of the question suite")
    ev.add_argument("--limit", type=int, default=None,
                    help="run at most this many questions (round-robin over the tasks)")
    ev.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    ev.add_argument("--batch-size", type=int, default=8,
                    help="questions in flight at once, each in every mode (1: one request at "
                         "a time, so TTFTs hold no queueing)")
    ev.add_argument("--json", default=None, help="write the summary and every answer here")
    ev.add_argument("--plot", default=None, help="accuracy and gold likelihood as a PNG")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=_eval)

    cal = sub.add_parser("calibrate", help="the cheapest selective recompute that keeps a "
                                           "model's answers: a per-model profile",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(cal)
    cal.add_argument("--target", type=float, default=0.9,
                     help="share of the gold-answer likelihood gap between sequential and "
                          "full prefill to close (accuracy must also be within noise of full)")
    cal.add_argument("--quick", action="store_true",
                     help="fewer questions and candidates: a first profile in minutes")
    cal.add_argument("--questions", type=int, default=None,
                     help="calibration questions (default: 60 with --quick, else 250)")
    cal.add_argument("--candidates", default="",
                     help="comma-separated recompute modes to try (METHOD@RATIO or METHOD@"
                          "LOW:HIGH:MASS, +primer: primed; default: the built-in sweep)")
    cal.add_argument("--suite-seed", type=int, default=1009,
                     help="seed of the calibration split (ragkv eval reports seed 0)")
    cal.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    cal.add_argument("--batch-size", type=int, default=8, help="questions in flight at once")
    cal.add_argument("--output", default=None,
                     help="profile path (default: the ragkv cache directory, where engines "
                          "of this model find it)")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar")
    cal.set_defaults(func=_calibrate, default_model="smollm2-135m-instruct")

    pre = sub.add_parser("precompute", help="compute a corpus's chunk KV into the chunk store",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(pre)
    pre.add_argument("--documents", required=True,
                     help="corpus file: one JSON object {\"id\", \"text\"} per line")
    pre.add_argument("--system", default="",
                     help="the system prompt the served requests will have")
    pre.add_argument("--store", dest="chunk_store", default=None,
                     help="the chunk store to fill (same syntax as --chunk-store)")
    pre.add_argument("--prompt-format", choices=["chat", "text"], default="chat",
                     help="chat: documents as /v1/chat/completions places them (the model's "
                          "chat template around the system message); text: the separator / "
                          "RAGPrompt form (system text, then the document)")
    pre.add_argument("--cache-salt", default=None,
                     help="the cache_salt the served requests will carry")
    pre.add_argument("--batch-size", type=int, default=16, help="documents per engine batch")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(func=_precompute)

    gen = sub.add_parser("generate", help="generate completions for prompts offline",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt (repeat the flag for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens below this share of the best one's probability")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed of this run's sampling (default: the engine's --seed)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="OpenAI's presence penalty")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="OpenAI's frequency penalty")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="HF's repetition penalty (1: none)")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="tokens generated before a stop may end the output")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past the end-of-sequence token")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output is JSON following this JSON schema (its text, or a "
                            "file holding it)")
    shape.add_argument("--json-object", action="store_true",
                       help="the output is one JSON object or array")
    shape.add_argument("--choice", action="append", default=None,
                       help="the output is one of these strings (repeat the flag)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_generate)
    for command in sub.choices.values():  # read by `apply_config_file` before parsing
        command.add_argument("--config", metavar="FILE",
                             help="a YAML (or JSON) file of flags, vLLM's format: keys are flag "
                                  "names; the command line's flags win")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        argv = apply_config_file(argv, parser)
    except ValueError as e:
        print(f"ragkv: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:  # an abbreviation argparse matched
        print("ragkv: error: spell out --config, once", file=sys.stderr)
        return 2
    try:
        _resolve_model(args)
        return args.func(args)
    except ValueError as e:
        print(f"ragkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
